"""Emit: render a plan through the Jinja templates into a black-formatted module.

Only validated identifiers and numbers from the spec reach the output: names come
from the checked model (or the NameTable), the docstring's spec is re-printed from
the model rather than copied from the file, and the source path appears only as an
escaped comment.
"""

from __future__ import annotations

import functools

import jinja2

from .describe import describe
from .formatting import format_module
from .dtypes import DType
from .expr import Const, Expr, Var, flat, render
from .plan import BlockPlan, FactorRead, Plan
from .resources import resource_dir



@functools.cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resource_dir("templates"))),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["py"] = lambda e: render(e, "py")
    env.filters["host"] = lambda e: render(e, "host")
    env.filters["pytuple"] = _tuple
    env.filters["quote"] = lambda text: f'"{text}"'
    return env


def _tuple(items) -> str:
    items = list(items)
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def spec_text(kernel, name: str | None = None, tiles: dict[str, int] | None = None) -> str:
    """A kernel's spec, re-printed from the checked model (identifiers and numbers only),
    optionally renamed and retiled (how `variants` derives its specs)."""
    k = kernel
    tiles = {i.name: i.tile for i in k.indices} | (tiles or {})
    lines = [f"kernel {name or k.name} {{"]
    for op in k.operands:
        lines.append(f"    {'in ' if op.direction == 'in' else 'out'} {op.decl}")

    def term(t):
        return f"{t.offset.operand}[{t.offset.position}] + {t.index}" if t.offset else t.index

    out = k.output
    order = list(k.contraction or ()) + list(k.end_factors)
    factors = sorted(k.data_inputs, key=lambda op: order.index(op.name) if op.name in order else len(order))
    rhs = " * ".join(f"{op.name}[{', '.join(term(t) for t in op.terms)}]" for op in factors)
    lines.append(f"    {out.name}[{', '.join(t.index for t in out.terms)}] = {rhs}")
    lines.append("    tile " + ", ".join(f"{i.name} = {tiles[i.name]}" for i in k.indices))
    lines.append(f"    accumulate {k.accumulate.name}")
    lines.append("}")
    return "\n".join(lines) + "\n"


class _Emitter:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.k = plan.kernel
        self.acc: DType = self.k.accumulate
        self.n = plan.names
        self.in_blocks = [b for b in plan.blocks if not b.is_output]
        self.out_block = next(b for b in plan.blocks if b.is_output)
        self.out_rank = self.k.output.rank

    # ---------------------------------------------------------------- reads
    def read(self, f: FactorRead, source: str, cast: bool = True) -> str:
        """A factor's block (or array) in the output's index order, in the accumulate dtype."""
        value = source
        if cast and f.dtype != self.acc:
            value = f"{value}.astype({self.acc.jnp})"
        if f.perm is not None:
            value = f"{value}.T" if f.perm == (1, 0) else f"jnp.transpose({value}, {_tuple(map(str, f.perm))})"
        if f.expand:
            idx = ["None" if d in f.expand else ":" for d in range(self.out_rank)]
            value = f"{value}[{', '.join(idx)}]"
        return value

    def ref(self, f: FactorRead) -> str:
        return f"{f.ref}[...]"

    def dot(self, lhs: str, rhs: str, lhs_dim: int, rhs_dim: int, same_dtype: bool, f32: bool = False) -> str:
        pref = f"preferred_element_type={self.acc.jnp}"
        if f32:
            # The MXU rounds f32 operands to bf16 unless asked for full precision.
            pref += ", precision=lax.Precision.HIGHEST"
        if not same_dtype:
            lhs, rhs = f"{lhs}.astype({self.acc.jnp})", f"{rhs}.astype({self.acc.jnp})"
        if (lhs_dim, rhs_dim) == (1, 0):
            return f"jnp.dot({lhs}, {rhs}, {pref})"
        return f"lax.dot_general({lhs}, {rhs}, ((({lhs_dim},), ({rhs_dim},)), ((), ())), {pref})"

    def compute_value(self) -> str:
        body = self.plan.body
        if body.contraction is not None:
            c = body.contraction
            f32 = "f32" in (c.lhs.dtype.name, c.rhs.dtype.name)
            return self.dot(self.ref(c.lhs), self.ref(c.rhs), c.lhs_dim, c.rhs_dim, c.lhs.dtype == c.rhs.dtype, f32)
        parts = [self.read(f, self.ref(f)) for f in body.compute_factors]
        return " * ".join(parts) if parts else f"jnp.ones({self.n['acc_ref']}.shape, {self.acc.jnp})"

    def flush_cases(self) -> list[dict]:
        body = self.plan.body
        out_ref = self.out_block.ref
        acc = self.n["acc_ref"]
        cases = []
        for case in body.flush_cases:
            whens = [render(e, "py") for e in (body.flush_when, case.when) if e is not None]
            when = " & ".join(f"({w})" if len(whens) > 1 else w for w in whens) if whens else None
            if case.factors is None:
                value = f"jnp.zeros_like({out_ref})"
            else:
                parts = ([f"{acc}[...]"] if body.scratch else []) + [self.read(f, self.ref(f)) for f in case.factors]
                if not parts:
                    parts = [f"jnp.ones({out_ref}.shape, {self.acc.jnp})"]
                product = " * ".join(parts)
                value = f"({product}).astype({out_ref}.dtype)" if len(parts) > 1 else f"{product}.astype({out_ref}.dtype)"
            cases.append({"when": when, "value": value, "name": case.name, "about": case.about})
        return cases

    # -------------------------------------------------------------- blocks
    def block_texts(self, b: BlockPlan) -> dict:
        shape = _tuple("None" if s is None else str(s) for s in b.shape)
        if b.statics:
            kw = ", ".join(f"{name}={render(value, 'host')}" for name, value in b.statics)
            map_text = f"functools.partial({b.fn}, {kw})"
        else:
            map_text = b.fn
        return {"shape_text": shape, "map_text": map_text}

    # ------------------------------------------------------------- prepare
    def prepare_lines(self) -> list[str]:
        plan, k, n = self.plan, self.k, self.n
        size = n["size"]
        lines = []
        keywords = ", ".join(f'"{s.symbol}": {s.internal}' for s in plan.sizes)
        fixed = ", ".join(f'"{s.symbol}": {s.literal}' for s in plan.sizes if s.literal is not None)
        if plan.sizes:
            lines.append(f"{size} = _sizes({{{keywords}}}, {{{fixed}}})")
        nb_bound = False
        for p in plan.params:
            op = k.operand(p.operand)
            name = p.internal
            if p.kind in ("dense", "mask"):
                lines.append(f'{name} = _as_array("{p.public}", {name}, {op.rank}, {op.dtype.jnp})')
                for d, dim in enumerate(op.dims):
                    what = f"{p.public} dim {d}"
                    if dim.symbol is not None:
                        lines.append(f'_bind({size}, "{dim.symbol}", {name}.shape[{d}], "{what}")')
                    else:
                        lines.append(f'_check_dim({name}.shape[{d}], {dim.literal}, "{what}")')
            elif p.kind == "blocks":
                lines.append(f'{name} = _as_array("{p.public}", {name}, {op.rank + 1}, {op.dtype.jnp})')
                for d, idx in enumerate(op.indices):
                    tile = self.plan_tile(idx)
                    lines.append(f'_check_dim({name}.shape[{d + 1}], {tile}, "{p.public} dim {d + 1} (the tile of {idx})")')
                lines.append(f"{n['nb']} = {name}.shape[0]")
                nb_bound = True
            elif p.kind in ("coords", "out_coords"):
                lines.append(f'{name} = _as_array("{p.public}", {name}, 1, None)')
                if p.kind == "out_coords" and not nb_bound:
                    lines.append(f"{n['nb']} = {name}.shape[0]")
                    nb_bound = True
                else:
                    first = next(q for q in plan.params if q.operand == p.operand and q.kind in ("blocks", "out_coords"))
                    lines.append(f'_check_dim({name}.shape[0], {n["nb"]}, "{p.public} length (one per block of {first.public})")')
            elif p.kind == "index":
                length = op.dims[0].literal
                lines.append(f'{name} = _as_array("{p.public}", {name}, 1, None)')
                lines.append(f'_check_dim({name}.shape[0], {length}, "{p.public} length")')
        for s in plan.sizes:
            if s.keyword_only:
                lines.append(f'_need({size}, "{s.symbol}", "{s.carriers}")')
        if plan.sizes:
            targets = ", ".join(s.internal for s in plan.sizes)
            values = ", ".join(f'{size}["{s.symbol}"][0]' for s in plan.sizes)
            lines.append(f"{targets}{',' if len(plan.sizes) == 1 else ''} = {values}")
        # Tiles divide the symbolic sizes (literal ones were checked at build time).
        for idx in k.indices:
            if idx.size.literal is None:
                var = plan.size_var(idx.size.symbol)
                lines.append(f'_check_multiple({var}, {idx.tile}, "{idx.size.symbol} (the size of index {idx.name})")')
        for op in k.data_inputs:
            for d, t in enumerate(op.terms):
                if t.offset is not None and op.dims[d].literal is None:
                    var = plan.size_var(op.dims[d].symbol)
                    lines.append(f'_check_multiple({var}, {self.plan_tile(t.index)}, "{op.name} dim {d}, read in blocks of {t.index}")')
        for p in plan.params:
            if p.kind in ("coords", "out_coords"):
                op = k.operand(p.operand)
                idx = op.indices[p.dim]
                limit = render(plan_blocks(plan, idx), "host")
                padding = ", padding=True" if p.kind == "coords" else ""
                lines.append(f'{p.internal} = _check_coords("{p.public}", {p.internal}, {limit}, "{op.name} dim {p.dim}"{padding})')
        if plan.coo is not None:
            coo = plan.coo
            names = [p.public for p in plan.params if p.kind == "coords"]
            quoted = _tuple(f'"{n}"' for n in names)
            lines.append(f"{coo.pad} = _check_padding({quoted}, {_tuple(coo.coords)})")
        if plan.offsets:
            by_param: dict[str, list] = {}
            for use in plan.offsets:
                by_param.setdefault(use.param, []).append(use)
            parts = []
            for param, uses in by_param.items():
                public = next(p.public for p in plan.params if p.internal == param)
                spec = ", ".join(f'({u.position}, {u.tile}, {render(u.max_start, "host")}, "{u.target}")' for u in uses)
                parts.append(f'*_check_offsets("{public}", {param}, ({spec},))')
            lines.append(f"{plan.offsets_var} = jnp.stack([{', '.join(parts)}])")
        if plan.prefetch:
            # Group equal lengths: 4 * (nb + M // 512) reads better than a long sum.
            counts: dict[str, int] = {}
            for pf in plan.prefetch:
                text = render(pf.length, "host")
                counts[text] = counts.get(text, 0) + 1
            terms = [text if c == 1 else f"{c} * ({text})" if " " in text else f"{c} * {text}" for text, c in counts.items()]
            lines.append(f'_check_smem({" + ".join(terms)}, "the scalar-prefetch tables of this call")')
        ret = [a for a in self.impl_args()]
        sizes = _tuple(s.internal for s in plan.sizes)
        lines.append(f"return {', '.join(ret + [sizes])}")
        return lines

    def plan_tile(self, index: str) -> int:
        return self.k.index(index).tile

    def impl_args(self) -> list[str]:
        args = [p.internal for p in self.plan.params if p.kind != "index"]
        if self.plan.coo is not None:
            args.append(self.plan.coo.pad)
        if self.plan.offsets_var:
            args.append(self.plan.offsets_var)
        return args

    # ---------------------------------------------------------------- impl
    def guard_lines(self) -> list[str]:
        """The start of _impl: sizes of this call, and calls with nothing to compute."""
        plan, n = self.plan, self.n
        lines = []
        out_shape = _tuple(render(e, "host") for e in plan.out_shape)
        if plan.strategy == "coo_input":
            coo = plan.coo
            lines.append(f"{coo.nb} = {coo.blocks}.shape[0]")
            lines.append(f"if {coo.nb} == 0:")
            lines.append("    # Nothing is stored: the result is all zeros.")
            lines.append(f"    return jnp.zeros({out_shape}, {plan.out_dtype.jnp})")
        elif plan.strategy == "coo_output":
            lines.append(f"{n['nb']} = {plan.coo_out.coords[0]}.shape[0]")
            lines.append(f"if {n['nb']} == 0:")
            lines.append("    # No block requested.")
            lines.append(f"    return jnp.zeros({out_shape}, {plan.out_dtype.jnp})")
        return lines

    def prefetch_lines(self) -> list[str]:
        """The body of _prefetch: block kinds, step tables and maps, computed with jnp."""
        plan = self.plan
        lines = []
        if plan.strategy == "coo_input":
            coo = plan.coo
            rows = flat([Var(c) for c, _ in coo.row_coords], [e for _, e in coo.row_coords])
            kind, block, row = (p.var for p in plan.prefetch[:3])
            lines.append("# Sort the stored blocks by the output block they feed; a flush step closes each output block.")
            lines.append(f"{kind}, {block}, {row} = _coo_steps({render(rows, 'host')}, {render(coo.rows, 'host')}, {coo.pad})")
            for var, coords in coo.held:
                lines.append(f"{var} = jnp.maximum({coords}[{block}], 0)  # 0 if every entry is padding")
        if plan.mask is not None:
            m = plan.mask
            lines.append(f"# Classify the blocks of {m.operand}; skipped steps follow a map to the next step that computes.")
            lines.append(f"{m.kind_var} = _block_kinds({m.array}, {_tuple(map(str, m.tiles))}, {m.ones})")
            if m.gather is not None:
                lines.append(f"{m.kind_var} = {m.kind_var}[{', '.join(m.gather)}]  # at the requested output blocks")
            if m.to_grid is not None:
                lines.append(f"{m.kind_var} = {m.kind_var}.transpose({_tuple(map(str, m.to_grid))})")
            full = [render(e, "host") for e, _ in m.prefix]
            ones = [render(e, "host") if walks else "1" for e, walks in m.prefix]

            def over_prefix(cond: str) -> str:
                if full == ones:
                    return f"({cond}).reshape(-1)"
                return f"jnp.broadcast_to(({cond}).reshape({_tuple(ones)}), {_tuple(full)}).reshape(-1)"

            lines.append(f"{m.next_var} = _next_live({over_prefix(f'{m.kind_var} != _EMPTY')})")
            if m.partial_var:
                lines.append(f"{m.partial_var} = _next_live({over_prefix(f'{m.kind_var} == _PARTIAL')})")
            lines.append(f"{m.kind_var} = {m.kind_var}.reshape(-1)")
        return lines

    def out_bytes(self) -> Expr:
        size = Const(self.plan.out_dtype.itemsize)
        for e in self.plan.out_shape:
            size = size * e
        return size

    def call_args(self) -> list[str]:
        return [b.array for b in self.in_blocks]

    # ----------------------------------------------------------- reference
    def reference_lines(self) -> list[str]:
        plan, k, n = self.plan, self.k, self.n
        acc = self.acc
        lines = []
        views: dict[str, str] = {}
        for op in k.data_inputs:
            if op.sparsity == "coo":
                coo = plan.coo
                view = n[f"view:{op.name}"]
                shape = _tuple(render(plan_dim(plan, d), "host") for d in op.dims)
                lines.append(f"{view} = _densify({coo.blocks}, {_tuple(coo.coords)}, {coo.pad}, {shape}, {acc.jnp})")
                views[op.name] = view
            elif any(t.offset for t in op.terms):
                view = n[f"view:{op.name}"]
                param = next(p.internal for p in plan.params if p.operand == op.name)
                starts, sizes = [], []
                for d, t in enumerate(op.terms):
                    if t.offset is None:
                        starts.append("0")
                        sizes.append(render(plan_dim(plan, op.dims[d]), "host"))
                    else:
                        slot = next(i for i, u in enumerate(plan.offsets) if u.target == f"{op.name} dim {d}")
                        starts.append(f"{plan.offsets_var}[{slot}] * {self.plan_tile(t.index)}")
                        sizes.append(render(plan_dim(plan, k.index(t.index).size), "host"))
                lines.append(f"{view} = lax.dynamic_slice({param}, {_tuple(starts)}, {_tuple(sizes)})")
                views[op.name] = view
            else:
                views[op.name] = next(p.internal for p in plan.params if p.operand == op.name)
        letters = {i.name: chr(ord("a") + n_) for n_, i in enumerate(k.indices)}
        out = n["out"]
        reads = {f.operand: f for f in plan.reads}
        if k.contraction:
            lhs, rhs = (k.operand(x) for x in k.contraction)
            spec = f"{''.join(letters[i] for i in lhs.indices)},{''.join(letters[i] for i in rhs.indices)}->" + "".join(
                letters[i] for i in k.output.indices
            )
            precision = ", precision=lax.Precision.HIGHEST" if acc.is_float else ""
            lines.append(f'{out} = jnp.einsum("{spec}", {views[lhs.name]}, {views[rhs.name]}, preferred_element_type={acc.jnp}{precision})')
            for name in k.end_factors:
                lines.append(f"{out} = {out} * {self.read(reads[name], views[name])}")
        else:
            parts = [self.read(reads[op.name], views[op.name]) for op in k.data_inputs]
            lines.append(f"{out} = {' * '.join(parts)}")
        result = f"{out}.astype({plan.out_dtype.jnp})"
        if plan.strategy == "coo_output":
            tiles = _tuple(str(self.plan_tile(i)) for i in k.output.indices)
            result = f"_gather_blocks({result}, {_tuple(plan.coo_out.coords)}, {tiles})"
        lines.append(f"return {result}")
        return lines

    # ------------------------------------------------------------ docstring
    def signature(self) -> tuple[str, str]:
        """Parameter lists of the kernel function and of `reference`."""
        public = [p.public for p in self.plan.params]
        keywords = [f"{s.symbol}=None" for s in self.plan.sizes]
        kernel = ", ".join(public + ["*"] + keywords + ["interpret=False"])
        reference = ", ".join(public + (["*"] + keywords if keywords else []))
        return kernel, reference

    def docstring(self) -> tuple[str, str]:
        plan, k = self.plan, self.k
        out = k.output
        call = f"{k.name}({self.signature()[0]})"
        if out.sparsity == "coo":
            tiles = ", ".join(str(self.plan_tile(i)) for i in out.indices)
            returns = f"{out.name}: {out.dtype.name}[nb, {tiles}], one block per requested coordinate, in the order given"
        else:
            returns = f"{out.name}: {out.dtype.name}[{', '.join(d.text for d in out.dims)}]"
        args = []
        for p in plan.params:
            shape = f"{p.dtype}[{', '.join(p.shape)}]"
            args.append(f"    {p.public}: {shape}" + (f"  {p.about}" if p.about else ""))
        for s in plan.sizes:
            if s.literal is not None:
                args.append(f"    {s.symbol}: int, keyword, optional  (fixed to {s.literal} by the spec)")
            elif s.keyword_only:
                args.append(f"    {s.symbol}: int, keyword, required  (carried only by {s.carriers})")
            else:
                args.append(f"    {s.symbol}: int, keyword, optional  (taken from the arguments; must agree if given)")
        args.append("    interpret: False compiles for the TPU; True runs the CPU interpreter;")
        args.append("        pltpu.InterpretParams() runs the TPU simulator.")
        spec = "\n".join("    " + line for line in spec_text(plan.kernel).splitlines())
        plan_lines = "\n".join("    " + line for line in describe(plan))
        doc = (
            f"{k.name}: a Pallas TPU kernel generated by sparsegen.\n\n"
            f"Spec:\n\n{spec}\n\n"
            f"Call:\n\n    {call}\n\n"
            f"Arguments:\n\n" + "\n".join(args) + "\n\n"
            f"Returns:\n\n    {returns}\n\n"
            "Bad shapes, dtypes, and concrete coordinates or offsets out of range raise a\n"
            "ValueError naming the argument and dimension; under jax.jit, traced\n"
            "coordinates are clamped and offsets rounded down to their tile, so no copy\n"
            "ever leaves its array.\n\n"
            f"Plan (target {plan.target.name}):\n\n{plan_lines}\n"
        )
        call_doc = (
            f"Run the kernel: {returns}.\n\n"
            "    Arguments are the inputs in declaration order (see the module docstring).\n    "
        )
        return doc, call_doc

    # --------------------------------------------------------------- module
    def module(self, source_name: str) -> str:
        plan = self.plan
        uses = {
            "need": any(s.keyword_only for s in plan.sizes),
            "coords": any(p.kind in ("coords", "out_coords") for p in plan.params),
            "offsets": bool(plan.offsets),
            "smem": bool(plan.prefetch),
            "next_live": plan.strategy == "coo_input" or plan.mask is not None,
            "coo_steps": plan.strategy == "coo_input",
            "block_kinds": plan.mask is not None,
            "densify": plan.strategy == "coo_input",
            "padding": plan.strategy == "coo_input",
            "gather": plan.strategy == "coo_output",
        }
        env = _environment()
        helpers = env.get_template("helpers.py.j2").render(uses=uses).strip()
        doc, call_doc = self.docstring()
        kernel_sig, reference_sig = self.signature()
        forward = [p.public for p in plan.params] + [s.symbol for s in plan.sizes]
        map_params = [a.var for a in plan.axes] + [p.var for p in plan.prefetch]
        kernel_params = [p.var for p in plan.prefetch] + [b.ref for b in self.in_blocks] + [self.out_block.ref]
        if plan.body.scratch:
            kernel_params.append(self.n["acc_ref"])
        blocks = [dict(fn=b.fn, statics=b.statics, about=b.about, lets=b.lets, index=b.index) for b in plan.blocks]
        acc_shape = _tuple(str(self.plan_tile(i)) for i in self.k.output.indices)
        source = source_name.encode("unicode_escape").decode("ascii")
        text = env.get_template("module.py.j2").render(
            plan=plan,
            k=self.k,
            source=source,
            digest=self.k.digest,
            doc=doc,
            call_doc=call_doc,
            helpers=helpers,
            body=plan.body,
            body_notes=plan.body.notes,
            acc=self.n["acc_ref"],
            compute_value=self.compute_value() if plan.body.scratch else "",
            flush_cases=self.flush_cases(),
            out_ref=self.out_block.ref,
            blocks=blocks,
            map_params=map_params,
            kernel_params=kernel_params,
            public_params=[p.internal for p in plan.params] + [s.internal for s in plan.sizes],
            prepare_lines=self.prepare_lines(),
            impl_args=self.impl_args(),
            size_vars=[s.internal for s in plan.sizes],
            guard_lines=self.guard_lines(),
            prefetch_lines=self.prefetch_lines(),
            in_blocks=[self.block_texts(b) for b in self.in_blocks],
            out_block=self.block_texts(self.out_block),
            acc_shape=acc_shape,
            vmem_limit=plan.vmem_limit,
            cost_flops=render(plan.block_products * plan.flops_per_product, "host"),
            cost_bytes=render(plan.block_products * plan.bytes_per_product + self.out_bytes(), "host"),
            call_args=self.call_args(),
            reference_lines=self.reference_lines(),
            kernel_signature=kernel_sig,
            reference_signature=reference_sig,
            forward=forward,
        )
        return text


def plan_dim(plan: Plan, size) -> Expr:
    return Const(size.literal) if size.literal is not None else Var(plan.size_var(size.symbol))


def plan_blocks(plan: Plan, index: str) -> Expr:
    idx = plan.kernel.index(index)
    return plan_dim(plan, idx.size).div(idx.tile)


def emit(plan: Plan, source_name: str) -> str:
    """The generated module's source, formatted by black."""
    return format_module(_Emitter(plan).module(source_name), names=(plan.name,))
