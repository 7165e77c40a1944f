"""Emission of the row walk's module: classification, the walk's tables, the calls, the
custom_vjp glue, `reference`, `block_kinds`; Jinja (templates/tpu/attention.py.j2) and black."""

from __future__ import annotations

import dataclasses
import math

from ...dtypes import DTYPES
from ...expr import Const, Var, render
from ...schedule.row import SLOT, STEP
from ...ir import Read
from ...mesh import mesh_plan
from ...pytext import live_lines, parameters, py_tuple, words
from ...wrapper import Glue
from .describe import describe_attention
from .kernels import Arr, CallSpec, KernelWriter, OutArr, lanes
from .lower import LANES, SUBLANES, AttentionModule, Operand, layout_block
from ...walks.flash_gradients import derived_outputs
from ...walks.row import RowHost


class AttentionEmitter(RowHost, KernelWriter):
    split_conjuncts = True  # a partial step evaluates only the part of the condition that may fail

    def live(self, read: Read) -> list[str]:
        return [s.index for s in read.subs if s.index not in self.p.lead]

    # ------------------------------------------------------------- arrays
    def arr(self, o: Operand, tables) -> Arr:
        # Other layouts pass the operand broadcast as int32 or float32.
        itemsize = self.k.operand(o.read.operand).dtype.itemsize if o.layout == "natural" else 4
        return Arr(o.ref, o.block, o.coords, o.fn, self.array(o), f"{o.read.text}: {self.about(o)}", itemsize=itemsize)

    def out_arr(self, ref, indices, dtype, var, about, vector: bool) -> OutArr:
        p, w = self.p, self.w
        block, coords = [], []
        for i in indices:
            if i in p.lead:
                block.append(None)
                coords.append(w.coord(i))
            elif i in (p.query, p.key) and i == indices[len(p.lead)]:
                if vector:
                    block.append(1)
                    coords.append(Const(0))
                block.append(self.tile[i])
                coords.append(w.row())
            else:
                block.append(self.tile[i])
                coords.append(Const(0))
        shape = tuple(self.size_of(i) for i in indices)
        view = shape[:-1] + ("1",) + shape[-1:] if vector else shape
        return OutArr(ref, tuple(block), tuple(coords), self.fn(f"_{ref.removesuffix('_ref')}_map", key=("output", ref)), "", about, shape, view, dtype, var)

    def map_names(self, lead_vars: dict[str, str], t: str) -> dict[str, str]:
        """The walk's variables (lead indices, the step) as a kernel or index map names them."""
        return {**lead_vars, STEP: t}

    def map_dict(self, a: Arr, call: CallSpec) -> dict:
        names = self.map_names(dict(zip(self.p.lead, self.grid_vars)), self.t)
        coords = [render(self.w.resolve(c, call.tables, names), "py") for c in a.coords]
        # Pallas passes every coordinate and table; the map names only those it reads.
        used = set().union(*(words(c) for c in coords))
        statics = [v for v in [self.steps] + self.sizes if v in used]  # the group's slot reads the lead sizes
        signature, deleted = parameters(self.grid_vars + [self.t] + self.tables, used, statics)
        partial = ", ".join(f"{v}={v}" for v in statics)
        # The key-side walk's maps read the tables the other way: a name of their own, drawn
        # like every function's (a spec name may be the map's name plus the suffix).
        fn = self.fn(a.fn + call.suffix, key=("suffixed", a.fn, call.suffix)) if call.suffix else a.fn
        return {"fn": fn, "coords": coords, "about": a.about, "signature": signature, "deleted": deleted,
                "spec_map": f"functools.partial({fn}, {partial})" if statics else fn}

    def call_dict(self, call: CallSpec, walk_kinds: str, walk: str = "_walk_tables") -> dict:
        grid = [render(a.extent, "host") for a in self.w.lead] + [self.n_run]  # the walk's axes: lead values, then steps
        # The kernel's head binds every coordinate, slot and kind; those nothing reads are
        # dropped, and the kernel `del`s the tables it does not read.
        lines = live_lines(call.kernel_lines)
        used = set().union(*(words(line) for line in lines))
        signature, deleted = parameters(self.tables + call.refs, used | set(call.refs), call.statics, collapse=False)
        return {
            "kernel_fn": call.kernel_fn,
            "kernel_signature": signature,
            "kernel_deleted": deleted,
            "kernel_lines": lines,
            "maps": [self.map_dict(a, call) for a in call.ins + call.outs],
            "in_specs": [(py_tuple("None" if b is None else str(b) for b in a.block), self.map_dict(a, call)["spec_map"]) for a in call.ins],
            "outs": [{"block": py_tuple("None" if b is None else str(b) for b in o.block), "map": self.map_dict(o, call)["spec_map"], "view": py_tuple(o.view), "shape": py_tuple(o.shape),
                      "dtype": o.dtype, "var": o.var, "reshape": o.view != o.shape} for o in call.outs],
            "arrays": [a.host for a in call.ins],
            "scratch": call.scratch,
            "grid": py_tuple(grid),
            "semantics": py_tuple(['"parallel"' if a.parallel else '"arbitrary"' for a in self.w.axes]),
            "flops": f"{self.w.kinds}.size * {call.flops}",
            "bytes": self.bytes_accessed(call),
            "transcendentals": f"{self.w.kinds}.size * {call.transcendentals}",
            "statics_kw": ", ".join(f"{v}={v}" for v in call.statics),
            "walk_kinds": walk_kinds,
            "walk_fn": walk,
            "post": call.post,
            "about": call.about,
            "vmem_limit": None,  # the module's (a call of its own sets it)
        }

    def bytes_accessed(self, call: CallSpec) -> str:
        """The call's HBM traffic for its cost estimate, as the einsum modules count it: every
        step of the walk reads one block of each input, and each output is written once."""
        itemsize = {d.jnp: d.itemsize for d in DTYPES.values()}
        per_step = sum(math.prod(b for b in a.block if b is not None) * a.itemsize for a in call.ins)
        outs = [" * ".join([*o.shape, str(itemsize[o.dtype])]) for o in call.outs]
        return " + ".join([f"{self.w.kinds}.size * {per_step}"] + outs)

    # ------------------------------------------------------------------ module
    def module(self, source_name: str, formatted: bool = True) -> str:
        from ...formatting import format_module

        m, k, p, conv = self.m, self.k, self.p, self.m.conv
        classify_fn, classify_reads, classify_lines = self.classify()
        self.classify_fn, self.classify_reads = classify_fn, classify_reads  # `reference` visits as the walk does
        data = p.data_dependent
        xp = "jnp" if data else "np"
        kinds_var = self.n.local("block_kinds")
        n_class = len(p.class_axes)
        # Traced first positions (a shard's, on a mesh) classify under jit.
        kinds_lines = self.kinds_call(kinds_var, classify_fn, classify_reads, xp, data)
        kinds_lines.append(f"{kinds_var} = {kinds_var}.reshape((-1,) + {kinds_var}.shape[{n_class - 2}:])")
        forward = self.forward_call()
        row_consumers = [c for c in p.consumers if not c.stored]
        self.out_var = {c.output: forward.outs[n].var for n, c in enumerate(row_consumers)}
        self.row_lses = [o.var for o in forward.outs[len(row_consumers):]]  # one per point
        self.row_lse = self.row_lses[0]
        stored = None
        stored_lines = []
        if any(c.stored for c in p.consumers):
            self.stored_lse_hosts = {}
            row_shape = py_tuple([self.size_of(i) for i in p.lead] + [self.size_of(p.query), str(LANES)])
            for pt in sorted({c.point for c in p.consumers if c.kind == "softmax_out"}):
                host = self.stored_lse_hosts[pt] = self.row_hosts["row_lse"] if pt == 0 else self.n.local("row_lse_rows")
                stored_lines.append(f"{host} = jnp.broadcast_to({self.row_lses[pt]}[..., None], {row_shape})")
            stored = self.stored_call()
            self.out_var.update({c.output: o.var for c, o in zip([c for c in p.consumers if c.stored], stored.outs)})
        error = m.backward_error
        backward = {}
        outputs = [c.output for c in p.consumers]
        derived = derived_outputs(p) if error is None else []
        fused_dict, fused_rows, fused_vmem, calls_b = None, None, None, []
        dq = dkv = fused = None
        if derived:
            self.cotangents = {o.name: self.n.local(f"g_{o.name}") for o in k.outputs}
            bw = m.backward_walk
            # lower.backward_walk: two walks (over rows, over key blocks), or one over key
            # blocks, or (the query size known only at trace time) one, and past max_rows two.
            if not bw.fused or bw.max_rows is not None:
                dq, dkv = self.dq_call(), self.dkv_call() if self.needs_key_walk() else None
                backward = self.backward_glue(dq.outs, dkv.outs if dkv else [], outputs)
                calls_b = [self.call_dict(dq, kinds_var)] + ([self.call_dict(dkv, f"{kinds_var}.transpose(0, 2, 1)")] if dkv else [])
            if bw.fused:
                fused = self.dkv_call(fused=True)
                if dq is None:  # the gradients of the one walk: dq's, then the key side's
                    dq_var = self.grad_vars["dq_full"]
                    backward = self.backward_glue([o for o in fused.outs if o.var == dq_var], [o for o in fused.outs if o.var != dq_var], outputs)
                fused_dict = self.call_dict(fused, f"{kinds_var}.transpose(0, 2, 1)")
                if bw.max_rows is None:
                    limits = [x for x in (bw.limit, m.vmem_limit()) if x is not None]
                    fused_dict["vmem_limit"] = max(limits) if limits else None
                else:  # the size is known at trace time: so is the limit (`_fused_vmem_limit`)
                    fused_rows = (self.padded_rows(), bw.max_rows)
                    fused_dict["vmem_limit"] = f"_fused_vmem_limit({self.padded_rows()})"
                    fused_vmem = {"static": bw.static_bytes, "row": bw.row_bytes, "floor": m.vmem_limit() or m.target.scoped_vmem_bytes,
                                  "vmem": m.target.vmem_bytes}
        doc, call_doc = self.docstring()
        forward_dict = self.call_dict(forward, kinds_var)
        # `_run` (no gradients) calls the forward without the logsumexp the gradients read;
        # stored outputs read it in a second walk, so they keep the one call.
        primal = None if stored else self.primal_call(forward)
        primal_dict = self.call_dict(primal, kinds_var) if primal else None
        stored_dict = self.call_dict(stored, kinds_var, walk="_dense_tables") if stored else None
        maps = self.all_maps([forward] + ([stored] if stored else []) + [c for c in (dq, dkv, fused) if c])
        prepare_lines = self.prepare_lines()
        reference_lines = self.reference_lines()
        outputs = [self.out_var[c.output] for c in p.consumers]
        declared = [self.out_var[o.name] for o in k.outputs]
        glue = Glue(
            args=list(conv.impl_args),
            statics=["sizes", "bound", "interpret"],
            tables=self.gradient_tables(backward, derived),
            n_outputs=len(k.outputs),
            cotangents=backward.get("cotangents", []),
            residuals_about=["The residuals: the arguments, the outputs and each row's logsumexp, with which",
                             "arguments are differentiated."],
            residuals=list(conv.impl_args) + outputs + self.row_lses,
            derived=bool(backward),
            bargs=backward.get("args", []),
            partials=backward.get("results", []),
            returns=backward.get("returns", []),
            prelude=backward.get("lines", []),
            wanted=False,
            kept=outputs + self.row_lses,
            declared=declared,
            zeros=True,
            keywords=self.shard_keywords,
            primal="residuals=False" if primal else "",
        )
        # `sharded`'s plan, a ring where mesh.py allows one (the kernels take first positions);
        # the TPU simulator runs each kernel call on every device together: no device skips a pair.
        mesh = mesh_plan(k, conv, self.wrapper.spans, ring=len(conv.impl_args) == len(conv.params))
        text = self.wrapper.module(
            "tpu/attention.py.j2", source_name, m.target.name, doc, call_doc, glue, prepare_lines, reference_lines,
            keywords=("max_steps",) if data else (),
            mesh=mesh,
            ring_tables=self.ring_tables(glue, mesh.ring, "chunk, None, interpret",
                                         lockstep=("not isinstance(interpret, bool)", "the TPU simulator")),
            smem=m.target.smem_bytes,
            classify_fn=classify_fn,
            classify_params=classify_reads,
            classify_lines=classify_lines,
            forward=forward_dict,
            primal=primal_dict,
            stored=stored_dict,
            stored_lines=stored_lines,
            backward_calls=calls_b,
            fused=fused_dict,
            fused_rows=fused_rows,
            fused_vmem=fused_vmem,
            maps=maps,
            kinds_lines=kinds_lines,
            xp=xp,
            tables=self.walk_tables,
            prefetch=self.tables,
            positions=self.positions,
            shard_keywords=self.shard_keywords,
            steps=self.steps,
            n_run=self.n_run,
            dynamic=self.dynamic,
            vmem_limit=self.m.vmem_limit(),
            class_axes=list(p.class_axes),
            split=bool(self.conjunct_parts),
            data=data,
        )
        return format_module(text, names=(m.name,)) if formatted else text

    def all_maps(self, calls) -> list[dict]:
        """Every index map of the module, once each (the forward and dq walks share theirs)."""
        out: dict[str, dict] = {}
        for call in calls:
            for a in call.ins + call.outs:
                d = self.map_dict(a, call)
                assert out.get(d["fn"], d)["coords"] == d["coords"], d["fn"]
                out[d["fn"]] = d
        return list(out.values())

    def backward_glue(self, row_outs: list[OutArr], key_outs: list[OutArr], outputs) -> dict:
        """`_run_backward`'s lines: the per-row inputs, the backward's results (`row_outs`: dq
        and the row walk's gradients; `key_outs`: the key walk's, dk's first), and each
        gradient reduced to its operand (`h // n` reads sum their group, a lead index the
        operand lacks sums away)."""
        p, k, conv = self.p, self.k, self.m.conv
        lines = []
        f32 = "jnp.float32"
        row_shape = py_tuple([self.size_of(i) for i in p.lead] + [self.size_of(p.query), str(LANES)])
        lse_var = self.row_lse
        delta = self.n.local("delta")
        parts = []
        for c in p.consumers:
            if c.kind == "softmax_product":
                o = self.out_var[c.output]
                parts.append(f"jnp.sum({self.cotangents[c.output]}.astype({f32}) * {o}.astype({f32}), axis=-1)")
        for c in p.consumers:
            if c.kind == "logsumexp":
                parts.append(f"-{self.cotangents[c.output]}.astype({f32})")
        lines.append(f"{delta} = " + (" + ".join(parts) if parts else f"jnp.zeros({lse_var}.shape, {f32})"))
        lines.append(f"{self.row_hosts['row_lse']} = jnp.broadcast_to({lse_var}[..., None], {row_shape})")
        lines.append(f"{self.row_hosts['delta']} = jnp.broadcast_to({delta}[..., None], {row_shape})")
        col_shape = py_tuple([self.size_of(i) for i in p.lead] + [str(SUBLANES), self.size_of(p.query)])
        lines.append(f"{self.col_hosts['row_lse']} = jnp.broadcast_to({lse_var}[..., None, :], {col_shape})")
        lines.append(f"{self.col_hosts['delta']} = jnp.broadcast_to({delta}[..., None, :], {col_shape})")
        for c in p.consumers:
            if c.kind == "sum":
                lines.append(f"{self.row_hosts['dsum']} = jnp.broadcast_to({self.cotangents[c.output]}.astype({f32})[..., None], {row_shape})")
                lines.append(f"{self.col_hosts['dsum']} = jnp.broadcast_to({self.cotangents[c.output]}.astype({f32})[..., None, :], {col_shape})")
        results = [o.var for o in row_outs + key_outs]
        # Per operand: the gradients its reads get, laid out as the operand.
        grads: dict[str, list[str]] = {}
        std = {}
        if not p.stored_score:
            std = {row_outs[0].var: (p.q, p.lead + (p.query, p.summed)), key_outs[0].var: (p.k, p.lead + (p.key, p.summed))}
        vals = [c for c in p.consumers if c.kind == "softmax_product"]
        for c, o in zip(vals, key_outs[0 if p.stored_score else 1:]):
            std[o.var] = (c.value, p.lead + (p.key, self.e_of(c)))
        letters = {i: chr(97 + n) for n, i in enumerate(x.name for x in k.indices)}
        for var, (read, order) in std.items():
            src = "".join(letters[i] for i in order)
            dst = "".join(letters[s.index] for s in read.subs)
            divided = py_tuple(f'("{letters[s.index]}", {s.divisor})' for s in read.subs if s.divisor != 1)
            grads.setdefault(read.operand, []).append(f'_to_operand({var}, "{src}", "{dst}", {divided})')
        for r, var, order in self.float_grads:
            src = "".join(letters[i] for i in order)
            dst = "".join(letters[s.index] for s in r.subs)
            divided = py_tuple(f'("{letters[s.index]}", {s.divisor})' for s in r.subs if s.divisor != 1)
            grads.setdefault(r.operand, []).append(f'_to_operand({var}, "{src}", "{dst}", {divided})')  # `var` is a call's output: in `results`
        returns = []
        for a in conv.impl_args:
            param = next((q for q in conv.params if q.internal == a), None)
            op = k.operand(param.operand) if param is not None else None
            if op is not None and op.name in grads and op.dtype.is_float:
                returns.append(f"({' + '.join(grads[op.name])}).astype({op.dtype.jnp})")
            else:
                returns.append("None")
        do_args = [self.cot(c.output) for c in p.consumers if c.kind == "softmax_product"]
        floats = [op for op in grads if k.operand(op).dtype.is_float]
        return {"lines": lines, "results": results, "returns": returns, "cotangents": [self.cotangents[o.name] for o in k.outputs], "grads": floats,
                "args": list(conv.impl_args) + do_args + list(self.row_hosts.values()) + list(self.col_hosts.values())}

    def about(self, o: Operand) -> str:
        return {"q": "the row block the step reads", "k": "the key block the step reads", "value": "the key block the step reads",
                "extra": {"natural": "the step's block", "rows": "per row, broadcast along lanes", "cols": "per key, broadcast along sublanes",
                          "scalar": "one value, broadcast to a tile"}[o.layout]}[o.role]

    def array(self, o: Operand) -> str:
        """The array the call receives for an operand (broadcast layouts for small reads)."""
        param = self.keyed(o.read) or self.m.conv.param(o.read.operand).internal
        if o.layout == "natural":
            return param
        op = self.k.operand(o.read.operand)
        dtype = "jnp.int32" if not op.dtype.is_float else "jnp.float32"
        x = f"{param}.astype({dtype})"
        shape = [self.dim_size(o.read, d) for d in range(len(o.read.subs))]
        if o.layout == "rows":
            return f"jnp.broadcast_to({x}[..., None], {py_tuple(shape + [str(LANES)])})"
        if o.layout == "cols":
            return f"jnp.broadcast_to({x}[..., None, :], {py_tuple(shape[:-1] + [str(SUBLANES), shape[-1]])})"
        return f"jnp.broadcast_to({x}[..., None, None], {py_tuple(shape + [str(SUBLANES), str(LANES)])})"

    def precision(self, *dtypes) -> str:
        """A product's precision, from the dtypes its operands enter it with: the MXU rounds
        f32 operands to bf16 unless asked for full precision."""
        return ", precision=lax.Precision.HIGHEST" if any(d.name == "f32" for d in dtypes) else ""

    def mxu(self, computed: str, block: str, dtype, in_mxu: bool = False) -> tuple[str, str, str]:
        """A product of a block computed in the accumulate dtype (probabilities, a gradient)
        by a block of a spec array of `dtype`: (computed, block, precision) as the MXU takes
        them. A float block sets the dtype (bf16 products, as flash attention does them); an
        integer block is widened instead (probabilities cast to an integer would be 0 or 1).
        `in_mxu`: f32 probabilities times a bf16 block go to the MXU as they are: at default
        precision it takes them to bf16 itself, one pass as the cast's product, with no pack on
        the VPU (a slot use per two score vregs; tokamax's and Splash's forward do the same)."""
        if in_mxu and dtype.name == "bf16" and self.acc.name == "f32":
            return computed, block, ""
        if dtype.is_float:
            return f"{computed}.astype({block}.dtype)", block, self.precision(dtype)
        return computed, f"{block}.astype({self.acc.jnp})", self.precision(self.acc)

    def score_factors(self, qo: Operand, ko: Operand) -> tuple[tuple[str, str], str]:
        """The score's two blocks as the MXU takes them, and the product's precision. Mosaic
        multiplies no integer block into a float sum: integer factors are widened, as
        `reference` widens them, to bf16 when both hold 8 bits (exact there), else to f32."""
        qt, kt = self.dtype_of(qo), self.dtype_of(ko)
        if qt.is_float and kt.is_float:
            return (qo.var, ko.var), self.precision(qt, kt)
        to = DTYPES["bf16" if qt.bits == kt.bits == 8 and not qt.is_float and not kt.is_float else "f32"]
        blocks = tuple(o.var if t == to else f"{o.var}.astype({to.jnp})" for o, t in ((qo, qt), (ko, kt)))
        return blocks, self.precision(to)

    def dtype_of(self, o: Operand):
        return self.k.operand(o.read.operand).dtype

    def block_value(self, o: Operand, transposed: bool = False) -> str:
        ref = o.ref
        if o.layout == "rows":
            if not self.dtype_of(o).is_float:
                # Integers (segment ids) meet the score block whole: lane-wide, as the block
                # holds them, not a column each use would broadcast across lanes (XLU).
                return lanes(f"{ref}[...]", self.tile[self.p.query if transposed else self.p.key])
            return f"{ref}[:, 0:1]"
        if o.layout == "cols":
            return f"{ref}[0:1, :]"
        if o.layout == "scalar":
            return f"{ref}[0:1, 0:1]"
        live = [s.index for s in o.read.subs if s.index not in self.p.lead]
        if o.role == "extra" and live == ([self.p.query, self.p.key] if transposed else [self.p.key, self.p.query]):
            return f"{ref}[...].T"
        return f"{ref}[...]"

    def transposed(self, o: Operand) -> Operand:
        """An extra operand as the key-side walk reads it (scores there are key x row)."""
        if o.role != "extra" or o.layout not in ("rows", "cols"):
            return o
        layout = "cols" if o.layout == "rows" else "rows"
        block, coords = layout_block(o.read, layout, self.w, self.tile)
        return dataclasses.replace(o, layout=layout, block=block, coords=coords, fn=self.fn(f"{o.fn}_t"))

    def slot(self, lead_vars, t: str) -> str:
        """A step's entry in the walk's tables (`RowWalk.slot`), in a kernel's variables."""
        return render(self.w.resolve(Var(SLOT), self.w.rows, self.map_names(lead_vars, t)), "py")

    # ------------------------------------------------------------- docstring
    def docstring(self) -> tuple[str, str]:
        signature = self.wrapper.signature()[0]
        args = []
        if self.p.data_dependent:
            signature = signature.replace("interpret=False", "max_steps=None, interpret=False")
            args.append("    max_steps: int, keyword, optional  (the tables' steps per group, in scalar memory; default:")
            args.append("        every block; the grid runs the steps the data needs either way; checked on concrete")
            args.append("        arguments, NaN outputs under jit when too few)")
        args.append("    interpret: False compiles for the TPU; True runs the CPU interpreter;")
        args.append("        pltpu.InterpretParams() runs the TPU simulator.")
        return self.wrapper.docstrings("a Pallas TPU kernel", args, "Bad shapes and dtypes raise a ValueError naming the argument and dimension.",
                                       describe_attention(self.m), self.m.target.name, signature)




def emit_attention(m: AttentionModule, source_name: str, formatted: bool = True) -> str:
    return AttentionEmitter(m).module(source_name, formatted)
