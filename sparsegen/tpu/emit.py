"""Emit: render a lowered kernel through the Jinja templates into a black-formatted module.

Only validated identifiers and numbers from the spec reach the output: names come from
the IR or the module's name tables, the docstring's spec is re-printed from the IR, and
the source path appears only as an escaped comment.
"""

from __future__ import annotations

import math

from ..expr import Call, Const, Var, lift, names as expr_names, render, substitute
from ..formatting import format_module
from ..pytext import needed, parameters, py_tuple
from ..wrapper import Glue, Wrapper, einsum_glue
from .body import BodyWriter
from .describe import describe_einsum
from .lower import TpuModule, TpuPass


class _Emitter:
    def __init__(self, m: TpuModule):
        self.m = m
        self.k = m.kernel
        self.wrapper = Wrapper(m.kernel, m.conv, m.spans, m.names.local("size"), m.names)
        self.outputs = dict(m.schedule.outputs)

    # ------------------------------------------------------------ kernels
    def kernel_text(self, tp: TpuPass, mod: TpuModule) -> dict:
        p, body = tp.p, tp.p.body
        w = BodyWriter(mod.kernel, tp)
        w._locals = set()
        refs = [s.ref for s in tp.in_specs] + [tp.out_spec.ref] + ([tp.acc_ref] if body.accumulator else [])
        phase_exprs = [e for e in (body.init_when, body.compute_when, body.flush_when) if e is not None]
        phase_exprs += [c.when for c in body.flush_cases if c.when is not None] + [v for _, v in body.lets]
        phase_exprs += [t.coord for t in (*body.tails, *body.out_tails)]
        if body.select is not None:
            phase_exprs += [body.select.when, *(e for _, e in body.select.coords), *(e for _, e in body.select.scalars)]
        used = set()
        for e in phase_exprs:
            used |= expr_names(e)
        # The kernel receives every table; those no condition, let or tail reads are `del`-ed.
        sig, deleted = parameters([t.var for t in p.tables] + refs, used | set(refs), tp.sizes, collapse=False)
        lets = [(a.var, render(Call("pl.program_id", (Const(d),)), "py")) for d, a in enumerate(p.axes) if a.var in used]
        lets += [(a.static, render(Call("pl.num_programs", (Const(d),)), "py")) for d, a in enumerate(p.axes) if a.static in used]
        axis_statics = {a.static for a in p.axes}
        # Extents a block coordinate decodes with (a flattened row of several indices).
        lets += [(name, render(value, "py")) for name, value in p.statics if name in used and name not in axis_statics]
        lets += [(name, render(value, "py")) for name, value in body.lets]
        compute_lines, compute_value = ([], "")
        computes = []
        if body.accumulator:
            compute_lines, compute_value = w.compute_lines()
            if body.select is not None and body.select.target != "flush":
                # A partial step selects the absent terms out; a full one needs no condition.
                partial = render(body.select.when, "py")
                lines, value = w.compute_lines(partial=True)
                computes = [{"name": "compute_partial", "when": partial, "lines": lines, "value": value,
                             "about": "Some terms absent: the condition selects them out."},
                            {"name": "compute_full", "when": render(body.select.full, "py"),
                             "lines": compute_lines, "value": compute_value, "about": "Every term present: no condition to evaluate."}]
            elif body.split is not None:
                # A mask inside the sum: a partial block multiplies it in, an all-ones one is not read.
                used, w._locals = w._locals, set()  # each region's locals are its own: the full one reuses the names
                lines, value = w.compute_lines(groups=body.split.summed)
                w._locals |= used
                computes = [{"name": "compute_partial", "when": render(body.split.partial, "py"), "lines": compute_lines,
                             "value": compute_value, "about": f"{body.split.mask} block partial: multiply it in."},
                            {"name": "compute_full", "when": render(body.split.full, "py"), "lines": lines, "value": value,
                             "about": f"{body.split.mask} is all ones here: no need to read it."}]
        cases = []
        for case in body.flush_cases:
            whens = [render(e, "py") for e in (body.flush_when, case.when) if e is not None]
            when = " & ".join(f"({x})" if len(whens) > 1 else x for x in whens) if whens else None
            if case.select and body.select is not None and body.select.target == "flush":
                partial = render(body.select.when, "py")
                lines, value = w.flush_value(case.products, select=True)
                cases.append({"when": f"({when}) & ({partial})" if when else partial, "lines": lines, "value": value,
                              "name": f"{case.name}_partial", "about": case.about + " Some elements absent: zeros there."})
                lines, value = w.flush_value(case.products)
                full = render(body.select.not_partial, "py")
                cases.append({"when": f"({when}) & ({full})" if when else full, "lines": lines, "value": value,
                              "name": case.name, "about": case.about})
                continue
            lines, value = w.flush_value(case.products)
            cases.append({"when": when, "lines": lines, "value": value, "name": case.name, "about": case.about})
        return {
            "fn": tp.kernel_fn,
            "signature": sig,
            "deleted": deleted,
            "lets": lets,
            "notes": body.notes,
            "accumulator": body.accumulator,
            "init_when": render(body.init_when, "py") if body.init_when is not None else None,
            "compute_when": render(body.compute_when, "py") if body.compute_when is not None else None,
            "compute_lines": compute_lines,
            "compute_value": compute_value,
            "computes": computes,
            "cases": cases,
            "acc": tp.acc_ref,
            "out_ref": tp.out_spec.ref,
        }

    def maps(self, tp: TpuPass) -> list[dict]:
        params = [a.var for a in tp.p.axes] + [t.var for t in tp.p.tables]
        out = []
        for s in tp.specs:
            # The lets the index reads (directly or through later lets): a walk's shared lets
            # (the next live step) are not all read by every operand's map.
            used, lets = set().union(*(expr_names(e) for e in s.index)), []
            for name, value in reversed(s.block.lets):
                if name in used:
                    lets.insert(0, (name, value))
                    used |= expr_names(value)
            # Pallas passes every coordinate and table; the map names only those it reads.
            signature, deleted = parameters(params, used, [name for name, _ in s.statics])
            out.append({"fn": s.fn, "signature": signature, "deleted": deleted, "about": s.block.about, "lets": lets, "index": s.index})
        return out

    def spec_text(self, s) -> dict:
        shape = py_tuple("None" if x is None else str(x) for x in s.shape)
        if s.statics:
            kw = ", ".join(f"{name}={render(value, 'host')}" for name, value in s.statics)
            map_text = f"functools.partial({s.fn}, {kw})"
        else:
            map_text = s.fn
        return {"shape": shape, "map": map_text}

    def call(self, tp: TpuPass, mod: TpuModule) -> dict:
        """The lines that run one pass's pallas_call, for `_impl` (or its own function)."""
        p = tp.p
        conv = mod.conv
        outputs = dict(mod.schedule.outputs)
        arrays = []
        for s in tp.in_specs:
            a = s.block.array
            if s.view.reshapes:
                shape = self.view_shape(s)
                a = f"{a}.reshape({shape})"
            arrays.append(a)
        out = tp.out_spec
        out_shape = py_tuple(render(e, "host") for e in p.out_shape)
        view_shape = self.view_shape(out) if out.view.reshapes else out_shape
        kernel = tp.kernel_fn
        if tp.sizes:
            kernel = f"functools.partial({kernel}, " + ", ".join(f"{v}={v}" for v in tp.sizes) + ")"
        products = p.block_products
        per = sum(math.prod(s.view.ref_shape or (1,)) * mod.kernel.operand(s.block.operand).dtype.itemsize for s in tp.in_specs)
        reads = [outputs[self.kernel_of(mod).operand(b.operand).name] for b in p.inputs
                 if self.kernel_of(mod).operand(b.operand).direction == "out"]
        out_bytes = Const(p.out_dtype.itemsize)
        for e in p.out_shape:
            out_bytes = out_bytes * e
        guard = list(p.guard)
        if p.guard:
            guard.append(f"    return jnp.zeros({out_shape}, {p.out_dtype.jnp})")
        out = {
            "fn": tp.call_fn,
            "args": list(conv.impl_args),
            "reads": list(dict.fromkeys(reads)),
            "pre": list(p.pre),
            "guard": guard,
            "prefetch": f"*{tp.prefetch_fn}({', '.join(conv.impl_args)}, sizes{', ' + p.fallback.count + ', piece' if p.fallback and p.fallback.bound else ''}), "
                        if p.tables else "",
            "fallback": p.fallback,
            "tables": len(p.tables),
            "grid": py_tuple(render(a.extent, "host") for a in p.axes),
            "in_specs": [self.spec_text(s) for s in tp.in_specs],
            "out_spec": self.spec_text(out),
            "scratch": f"pltpu.VMEM({py_tuple(map(str, p.body.acc_shape or (1, 1)))}, {p.accumulate.jnp})" if p.body.accumulator else "",
            "kernel": kernel,
            "out_struct": f"jax.ShapeDtypeStruct({view_shape}, {p.out_dtype.jnp})",
            # A dense walk in pieces writes into an output padded to whole blocks (`_pieces`).
            "out_view": view_shape,
            "out_padded": f"jax.ShapeDtypeStruct({self.padded_shape(tp)}, {p.out_dtype.jnp})",
            "reshape_out": out_shape if out.view.reshapes else None,
            "lead": f"{outputs[p.output]} = " if out.view.reshapes else "return ",
            "semantics": py_tuple(f'"{x}"' for x in tp.dimension_semantics),
            "vmem_limit": tp.vmem_limit(self.m.target),
            "flops": render(products * p.flops_per_product, "host"),
            "bytes": render(products * per + out_bytes, "host"),
            "arrays": arrays,
        }
        # The block counts this call reads. With a fallback, the pallas_call lies inside
        # `_walk`, whose parameter is the fallback's count: that count is read outside only.
        fb = p.fallback
        # Without a bound, the grid's extent min(needed, count) is computed outside, from the count.
        outside = guard + ([fb.needed_value, fb.bound, fb.dense] if fb and fb.bound else [fb.needed_value, fb.count] if fb else [])
        inside = [str(v) for key, v in out.items() if key not in ("guard", "fallback")]
        unshadowed = [(var, value) for var, value in p.counts if fb is None or fb.bound is None or var != fb.count]
        kept = needed(p.counts, *outside, *(var for var, _ in needed(unshadowed, *inside)))
        out["guard"] = [f"{var} = {value}" for var, value in kept] + guard
        return out

    def padded_shape(self, tp: TpuPass) -> str:
        """The output's view shape with each blocked dimension padded to whole blocks."""
        from .layout import view_shape

        out = tp.out_spec
        dims = view_shape(tuple(tp.p.out_shape), out.view.inserted)
        return py_tuple(render(lift(d).cdiv(b) * b if b not in (None, 1) else lift(d), "host") for d, b in zip(dims, out.view.block))

    def kernel_of(self, mod: TpuModule):
        return mod.kernel

    def view_shape(self, s) -> str:
        """The array's shape with the view's unit dimensions, as host code."""
        from .layout import view_shape

        tp, mod = self.pass_of(s)
        op = mod.kernel.operand(s.block.operand)
        if s.block.stored:
            lead = render(tp.p.out_shape[0], "host") if s.block.is_output else f"{s.block.array}.shape[0]"
            dims = [lead] + [str(d.extent) for d in s.block.dims[1:]]
        else:
            dims = [render(mod.conv.size(d), "host") for d in op.dims]
        return py_tuple(map(str, view_shape(tuple(dims), s.view.inserted)))

    def pass_of(self, spec):
        mods = [self.m] + ([self.m.backward_module] if self.m.backward_module else [])
        return next((tp, mod) for mod in mods for tp in mod.passes if spec in tp.specs)

    def prefetch(self, tp: TpuPass, mod: TpuModule) -> dict:
        fb = tp.p.fallback
        # The block counts the tables are computed from (the others: read by the call only).
        counts = [f"{var} = {value}" if fb is None or fb.bound is None or var != fb.count else f"{var} = {value} if {var} is None else {var}"
                  for var, value in needed(tp.p.counts, *tp.p.host)]
        return {"fn": tp.prefetch_fn, "lines": counts + list(tp.p.host), "tables": [t.var for t in tp.p.tables], "args": list(mod.conv.impl_args)}

    def pass_dicts(self, mod: TpuModule) -> list[dict]:
        outputs = dict(mod.schedule.outputs)
        return [{"kernel": self.kernel_text(tp, mod), "maps": self.maps(tp), "prefetch": self.prefetch(tp, mod), "call": self.call(tp, mod),
                 "output": outputs[tp.p.output], "functions": tp.p.functions} for tp in mod.passes]

    def gradient(self) -> tuple[Glue, list[dict]]:
        """The custom_vjp glue, and the backward's passes."""
        m = self.m
        bm = m.backward_module
        pass_outputs = {} if bm is None else {tp.p.output: dict(bm.schedule.outputs)[tp.p.output] for tp in bm.passes}
        if bm is None:
            return einsum_glue(self.k, m.conv, m.names, m.backward, m.refused, pass_outputs), []
        passes = self.pass_dicts(bm)
        # Coo inputs a backward pass reads densely (they meet another coo operand there).
        prelude = []
        for var, (operand, tiles) in m.backward.prelude:
            op = self.k.operand(operand)
            coords = py_tuple(p.internal for p in m.conv.params if p.operand == operand and p.kind == "coords")
            shape = py_tuple(render(m.conv.size(d), "host") for d in op.dims)
            blocks = m.conv.param(operand, "blocks").internal
            prelude.append(f"{var} = _densify({blocks}, {coords}, {m.conv.pad(operand)}, {shape}, {py_tuple(map(str, tiles))}, {op.dtype.jnp})")
        return einsum_glue(self.k, m.conv, m.names, m.backward, m.refused, pass_outputs, bm.conv.impl_args, prelude), passes

    # ------------------------------------------------------------ module
    def smem_checks(self) -> list[str]:
        lines = []
        for tp in self.m.passes:
            if not tp.p.tables:
                continue
            # Block counts are the pass's own locals: read them from the arrays here.
            stored = {var: Var(value) for var, value in tp.p.counts}
            counts: dict[str, int] = {}
            for t in tp.p.tables:
                text = render(substitute(t.length, stored), "host")
                counts[text] = counts.get(text, 0) + 1
            terms = [text if c == 1 else f"{c} * ({text})" if " " in text else f"{c} * {text}" for text, c in counts.items()]
            what = "the scalar-prefetch tables of this call" + (f" ({tp.p.output})" if len(self.m.passes) > 1 else "")
            lines.append(f'_check_smem({" + ".join(terms)}, "{what}")')
        return lines

    def docstring(self) -> tuple[str, str]:
        return self.wrapper.docstrings(
            "a Pallas TPU kernel",
            ["    interpret: False compiles for the TPU; True runs the CPU interpreter;",
             "        pltpu.InterpretParams() runs the TPU simulator."],
            "Bad shapes, dtypes, and concrete coordinates or offsets out of range raise a\n"
            "ValueError naming the argument and dimension; under jax.jit, traced\n"
            "coordinates are clamped and offsets rounded down to their tile, so no copy\n"
            "ever leaves its array.",
            describe_einsum(self.m), self.m.target.name,
        )

    def module(self, source_name: str) -> str:
        m, k = self.m, self.k
        doc, call_doc = self.docstring()
        passes = self.pass_dicts(m)
        glue, backward_passes = self.gradient()
        kinds = []
        for tp in (*m.passes, *(m.backward_module.passes if m.backward_module else ())):
            for name in tp.p.kinds:
                if name not in kinds:
                    kinds.append(name)
        return self.wrapper.module(
            "tpu/module.py.j2", source_name, m.target.name, doc, call_doc, glue,
            prepare_lines=self.wrapper.prepare_lines(self.smem_checks()),
            reference_lines=self.wrapper.reference_lines(self.outputs),
            smem=m.target.smem_bytes if any(tp.p.tables for tp in m.passes) or any(ps["prefetch"]["tables"] for ps in backward_passes) else None,
            kinds=kinds,
            passes=passes,
            backward_passes=backward_passes,
            single=len(passes) == 1,
            results=[self.outputs[o.name] for o in k.outputs],
        )


def emit_einsum(m: TpuModule, source_name: str, formatted: bool = True) -> str:
    """The generated module's source, formatted by black (`formatted=False`: the same code as
    the templates write it, for tests that build hundreds of modules)."""
    text = _Emitter(m).module(source_name)
    return format_module(text, names=(m.name,)) if formatted else text
