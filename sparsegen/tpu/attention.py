"""TPU lowering and emission of the row walk (schedule/attention.py): flash attention and
its relatives as one pallas_call.

Grid: the lead indices (batch, heads; parallel), then one flat axis over the walk's
steps (arbitrary: a row's steps revisit its output blocks consecutively). Five int32
scalar-prefetch tables drive the index maps and the phases. Per step the kernel
computes the score block (an MXU product), the elementwise chain, and — on a partial
block only — the condition from iota and the operand blocks; full blocks never evaluate
it. The softmax rows are consumed online: running max and sum in VMEM scratch, one
rescaled accumulator per softmax product.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..callconv import Convention, convention
from ..dtypes import DType
from ..ir import Kernel, Read, Term
from ..names import ModuleNames
from ..schedule.attention import EMPTY, FULL, PARTIAL, Classifier, RowPlan
from .layout import padded_bytes
from .targets import Target

LANES, SUBLANES = 128, 8
_FUNCTIONS = {"exp": "jnp.exp", "log": "jnp.log", "sqrt": "jnp.sqrt", "tanh": "jnp.tanh", "abs": "jnp.abs",
              "maximum": "jnp.maximum", "minimum": "jnp.minimum"}  # fmt: skip


@dataclass(frozen=True)
class Operand:
    """One array the pallas_call reads: a read of the spec, laid out for its block."""

    read: Read
    role: str  # "q" | "k" | "value" | "extra"
    ref: str  # the kernel's ref
    var: str  # the kernel's local for its block value
    fn: str  # index map
    layout: str  # "natural" | "rows" (lane-broadcast column) | "cols" (sublane-broadcast row) | "scalar"
    block: tuple  # block shape (None: squeezed)
    coords: tuple[str, ...]  # index map's coordinates


@dataclass(frozen=True)
class AttentionModule:
    kernel: Kernel
    target: Target
    conv: Convention
    names: ModuleNames
    plan: RowPlan
    operands: tuple[Operand, ...]
    vmem: tuple[tuple[str, int], ...]  # (what, bytes)
    backward_error: str = "gradients of attention-like kernels (the flash-attention backward) are not derived yet"
    vmem_limit_override: int | None = None  # verify's probe

    @property
    def name(self) -> str:
        return self.kernel.name

    @property
    def vmem_bytes(self) -> int:
        return sum(b for _, b in self.vmem)

    passes = ()
    backward_module = None
    spans = ()


def lower_attention(kernel: Kernel, plan: RowPlan, target: Target) -> AttentionModule:
    names = ModuleNames(kernel)
    conv = convention(kernel, names)
    p = plan
    ops: list[Operand] = []
    tile = {i.name: i.tile for i in kernel.indices}

    def add(read: Read, role: str):
        if any(o.read == read for o in ops):
            return
        has_q, has_k = p.query in read.indices, p.key in read.indices
        layout = "natural" if role != "extra" or (has_q and has_k) else ("rows" if has_q else "cols" if has_k else "scalar")
        block, coords = [], []
        for s in read.subs:
            if s.index in p.lead:
                block.append(None)
                coords.append(s.index if s.divisor == 1 else f"{s.index} // {s.divisor}")
            elif s.index == p.query:
                block.append(tile[p.query])
                coords.append("QROW")
            elif s.index == p.key:
                block.append(tile[p.key])
                coords.append("COL")
            else:
                block.append(tile[s.index])
                coords.append("0")
        if layout == "rows":
            block, coords = block + [LANES], coords + ["0"]
        elif layout == "cols":
            block, coords = block[:-1] + [SUBLANES, block[-1]], coords[:-1] + ["0", coords[-1]]
        elif layout == "scalar":
            block, coords = block + [SUBLANES, LANES], coords + ["0", "0"]
        n = len(ops)
        ops.append(Operand(read, role, names.local(f"{read.operand}_ref"), names.local(f"{read.operand}_blk" if n else f"{read.operand}_blk"),
                           names.function(f"_{read.operand}_map" if role != "extra" else f"_{read.operand}_{''.join(read.indices)}_map"),
                           layout, tuple(block), tuple(coords)))

    add(p.q, "q")
    add(p.k, "k")
    for c in p.consumers:
        if c.value is not None:
            add(c.value, "value")
    for r in p.reads:
        add(r, "extra")
    vmem = []
    acc = kernel.accumulate
    for o in ops:
        shape = tuple(b for b in o.block if b is not None)
        vmem.append((f"{o.read.operand} block x2", 2 * padded_bytes(shape, kernel.operand(o.read.operand).dtype)))
    ti, tj = tile[p.query], tile[p.key]
    for c in p.consumers:
        out = kernel.operand(c.output)
        if c.kind == "softmax_product":
            e = [i for i in kernel.statement_of(c.output).target.indices if i not in p.lead and i != p.query][0]
            vmem.append((f"{c.output} block x2", 2 * padded_bytes((ti, tile[e]), out.dtype)))
            vmem.append((f"{c.output} accumulator", padded_bytes((ti, tile[e]), acc)))
        else:
            vmem.append((f"{c.output} block x2", 2 * padded_bytes((1, ti), out.dtype)))
    vmem.append(("running max and sum", 3 * padded_bytes((ti, 1), acc)))
    vmem.append(("score block and its softmax (f32 temporaries)", 3 * padded_bytes((ti, tj), acc)))
    return AttentionModule(kernel, target, conv, names, plan, tuple(ops), tuple(vmem))


# ------------------------------------------------------------------- terms


def render_term(t: Term, leaf) -> str:
    """A checked term as jax.numpy code; `leaf` renders indices, sizes and reads."""
    if t.op == "num":
        return repr(t.value)
    if t.op in ("index", "size", "read", "local", "truth"):
        return leaf(t)
    a = [render_term(x, leaf) for x in t.args]
    if t.op in ("+", "-", "*", "/"):
        return f"({a[0]} {t.op} {a[1]})"
    if t.op == "//":
        return f"_floordiv({a[0]}, {a[1]})"
    if t.op == "%":
        return f"_mod({a[0]}, {a[1]})"
    if t.op == "neg":
        return f"(-{a[0]})"
    if t.op == "not":
        return f"~({a[0]})"
    if t.op in ("and", "or"):
        return "(" + (" & " if t.op == "and" else " | ").join(f"({x})" for x in a) + ")"
    if t.op == "cmp":
        return "(" + " & ".join(f"({a[n]} {op} {a[n + 1]})" for n, op in enumerate(t.ops)) + ")"
    return f"{_FUNCTIONS[t.op]}({', '.join(a)})"


# ------------------------------------------------------------------ emission


class AttentionEmitter:
    def __init__(self, m: AttentionModule):
        from ..wrapper import Wrapper

        self.m = m
        self.k = m.kernel
        self.p = m.plan
        self.n = m.names
        self.tile = {i.name: i.tile for i in self.k.indices}
        self.wrapper = Wrapper(m.kernel, m.conv, (), m.names.local("size"), m.names)
        self.sizes = [s.internal for s in m.conv.sizes]

    def size_of(self, index: str) -> str:
        size = self.k.index(index).size
        return str(size.literal) if size.literal is not None else self.m.conv.size_var(size.symbol)

    def ragged(self, index: str) -> bool:
        idx = self.k.index(index)
        return idx.size.literal is None or idx.size.literal % idx.tile != 0

    # -------------------------------------------------------- classification
    def classify(self) -> tuple[str, list[str], list[str]]:
        """The block-kind function: its parameters and lines."""
        p = self.p
        scope = self.n.scope()
        cl = Classifier(p, self.m.conv, scope.local, lambda i: self.tile[i], self.size_of)
        tails = [p.key] if self.ragged(p.key) else []
        lines = cl.kinds(tails)
        reads = []
        for r in (p.condition.reads if p.condition is not None else ()):
            param = self.m.conv.param(r.operand).internal
            if param not in reads:
                reads.append(param)
        return self.n.function("_classify_blocks"), reads, lines

    # ---------------------------------------------------------------- kernel
    def kernel_lines(self, kinds_vars, steps: str) -> tuple[list[str], list[str]]:
        p, k, n = self.p, self.k, self.n.scope()
        acc = k.accumulate
        ti, tj = self.tile[p.query], self.tile[p.key]
        lines: list[str] = []
        rows, cols, qrows, kinds, flags = kinds_vars
        lead_vars = {i: n.local(i) for i in p.lead}
        for d, i in enumerate(p.lead):
            lines.append(f"{lead_vars[i]} = pl.program_id({d})")
        t = n.local("t")
        at = n.local("at")
        lines.append(f"{t} = pl.program_id({len(p.lead)})")
        group = self.group_expr(lead_vars)
        lines.append(f"{at} = {t}" if group == "0" else f"{at} = {group} * {steps} + {t}")
        kind, flag = n.local("kind"), n.local("flag")
        lines.append(f"{kind} = {kinds}[{at}]")
        lines.append(f"{flag} = {flags}[{at}]")
        m_scr, l_scr = n.local("m_scratch"), n.local("l_scratch")
        accs = {}
        for c in p.consumers:
            if c.kind == "softmax_product":
                accs[c.output] = n.local(f"{c.output}_acc")
            elif c.kind == "sum":
                accs[c.output] = n.local(f"{c.output}_sum")
        out_refs = {c.output: n.local(f"{c.output}_ref") for c in p.consumers}
        lines += ["", f"@pl.when({flag} & 1 != 0)", "def _init():", "    # The row's first step: nothing seen yet."]
        lines.append(f"    {m_scr}[...] = jnp.full_like({m_scr}, -jnp.inf)")
        lines.append(f"    {l_scr}[...] = jnp.zeros_like({l_scr})")
        for a in accs.values():
            lines.append(f"    {a}[...] = jnp.zeros_like({a})")
        # The score block.
        score = ["", "def _scores(masked):"]
        for o in self.m.operands:
            if o.role in ("q", "k") or o.role == "extra":
                score.append(f"    {o.var} = {self.block_value(o)}")
        qo, ko = self.m.operands[0], self.m.operands[1]
        qd = [s.index for s in qo.read.subs if s.index not in p.lead].index(p.summed)
        kd = [s.index for s in ko.read.subs if s.index not in p.lead].index(p.summed)
        s = n.local("s")
        score.append(f"    {s} = lax.dot_general({qo.var}, {ko.var}, ((({qd},), ({kd},)), ((), ())), preferred_element_type={acc.jnp}{self.precision()})")
        if p.scale is not None:
            score.append(f"    {s} = {s} * {p.scale!r}")
        # Index values: positions along the query (a column) and the key (a row).
        qpos, kpos = n.local(f"{p.query}_pos"), n.local(f"{p.key}_pos")
        uses_pos = self.chain_uses_positions()
        pos_lines = [
            f"    {qpos} = {qrows}[{at}] * {ti} + lax.broadcasted_iota(jnp.int32, ({ti}, 1), 0)",
            f"    {kpos} = {cols}[{at}] * {tj} + lax.broadcasted_iota(jnp.int32, (1, {tj}), 1)",
        ]
        if uses_pos:
            score += pos_lines
        block_of = {o.read: o.var for o in self.m.operands}

        def leaf(term: Term, float_ctx: bool) -> str:
            if term.op == "index":
                if term.name == p.query:
                    v = qpos
                elif term.name == p.key:
                    v = kpos
                else:
                    v = lead_vars[term.name]
                return f"{v}.astype({acc.jnp})" if float_ctx else v
            if term.op == "size":
                v = self.m.conv.size_var(term.name)
                return f"float({v})" if float_ctx else v
            if term.op == "local":
                return current[0]
            if term.op == "truth":
                return f"({block_of[term.read]} != 0)"
            v = block_of[term.read]
            return f"{v}.astype({acc.jnp})" if float_ctx else v

        current = [s]
        for name, term in p.chain:
            var = n.local(name)
            score.append(f"    {var} = {render_term(term, lambda x: leaf(x, True))}")
            current[0] = var
        final = current[0]
        score.append("    if masked:")
        cond = [] if p.condition is None else [render_term(p.condition, lambda x: leaf(x, False))]
        if self.ragged(p.key):
            cond.append(f"({kpos} < {self.size_of(p.key)})")
        if not uses_pos and (cond and (self.ragged(p.key) or self.cond_uses_positions())):
            score += ["    " + x for x in pos_lines]
        present = n.local("present")
        if cond:
            score.append(f"        {present} = " + " & ".join(cond))
            score.append(f"        {final} = jnp.where({present}, {final}, -jnp.inf)")
        else:
            score.append("        pass")
        score.append(f"    return {final}")
        lines += score
        nm = {x: n.local(x) for x in ['m_prev', 'm_new', 'm_safe', 'alpha', 'probs', 'total', 'nothing', 'safe', 'inside']}
        # Consuming a block of scores.
        sv, masked = n.local("scores"), "masked"
        cons = ["", f"def _consume({sv}, {masked}):", f"    {nm["m_prev"]} = {m_scr}[...]",
                f"    {nm["m_new"]} = jnp.maximum({nm["m_prev"]}, jnp.max({sv}, axis=1, keepdims=True))",
                "    # A row with nothing present yet keeps minus infinity; exp then gives zeros.",
                f"    {nm["m_safe"]} = jnp.where(jnp.isneginf({nm["m_new"]}), 0.0, {nm["m_new"]})",
                f"    {nm["alpha"]} = jnp.exp({nm["m_prev"]} - {nm["m_safe"]})",
                f"    {nm["probs"]} = jnp.exp({sv} - {nm["m_safe"]})",
                f"    {l_scr}[...] = {nm["alpha"]} * {l_scr}[...] + jnp.sum({nm["probs"]}, axis=1, keepdims=True)",
                f"    {m_scr}[...] = {nm["m_new"]}"]
        for c in p.consumers:
            if c.kind == "softmax_product":
                vo = next(o for o in self.m.operands if o.read == c.value)
                vd = [s.index for s in vo.read.subs if s.index not in p.lead].index(p.key)
                cons.append(f"    {vo.var} = {vo.ref}[...]")
                if self.ragged(p.key):
                    cons.append(f"    if {masked}:")
                    cons.append("        # Past the end of the keys memory holds anything: zero it.")
                    axis = 0 if vd == 0 else 1
                    shape = f"({tj}, 1)" if vd == 0 else f"(1, {tj})"
                    cons.append(f"        {nm["inside"]} = {cols}[{at}] * {tj} + lax.broadcasted_iota(jnp.int32, {shape}, {axis}) < {self.size_of(p.key)}")
                    cons.append(f"        {vo.var} = jnp.where({nm["inside"]}, {vo.var}, jnp.zeros_like({vo.var}))")
                a = accs[c.output]
                cons.append(f"    {a}[...] = {nm["alpha"]} * {a}[...] + lax.dot_general({nm["probs"]}.astype({vo.var}.dtype), {vo.var}, (((1,), ({vd},)), ((), ())), "
                            f"preferred_element_type={acc.jnp}{self.precision()})")
            elif c.kind == "sum":
                a = accs[c.output]
                cons.append(f"    {a}[...] += jnp.sum(jnp.where(jnp.isneginf({sv}), 0.0, {sv}), axis=1, keepdims=True)")
        lines += cons
        lines += ["", f"@pl.when({kind} == _PARTIAL)", "def _partial():", "    # Some elements absent: evaluate the condition.", "    _consume(_scores(True), True)"]
        lines += ["", f"@pl.when({kind} == _FULL)", "def _full():", "    # Every element present: the condition is not evaluated.", "    _consume(_scores(False), False)"]
        lines += ["", f"@pl.when({flag} & 2 != 0)", "def _flush():", "    # The row's last step: normalise and write.",
                  f"    {nm["total"]} = {l_scr}[...]", f"    {nm["nothing"]} = {nm["total"]} == 0.0", f"    {nm["safe"]} = jnp.where({nm["nothing"]}, 1.0, {nm["total"]})"]
        for c in p.consumers:
            ref = out_refs[c.output]
            if c.kind == "softmax_product":
                scale = f" * {c.scale!r}" if c.scale is not None else ""
                lines.append(f"    {ref}[...] = ({accs[c.output]}[...] * jnp.where({nm["nothing"]}, 0.0, 1.0 / {nm["safe"]}){scale}).astype({ref}.dtype)")
            elif c.kind == "logsumexp":
                lines.append(f"    {ref}[...] = _row_vector(jnp.where({nm["nothing"]}, -jnp.inf, {m_scr}[...] + jnp.log({nm["safe"]}))).astype({ref}.dtype)")
            elif c.kind == "max":
                lines.append(f"    {ref}[...] = _row_vector({m_scr}[...]).astype({ref}.dtype)")
            else:
                lines.append(f"    {ref}[...] = _row_vector({accs[c.output]}[...]).astype({ref}.dtype)")
        refs = [o.ref for o in self.m.operands] + [out_refs[c.output] for c in p.consumers] + [m_scr, l_scr] + list(accs.values())
        return lines, refs

    def chain_uses_positions(self) -> bool:
        return any(t.op == "index" and t.name in (self.p.query, self.p.key) for _, term in self.p.chain for t in term.walk())

    def cond_uses_positions(self) -> bool:
        c = self.p.condition
        return c is not None and any(t.op == "index" and t.name in (self.p.query, self.p.key) for t in c.walk())

    def precision(self) -> str:
        return ", precision=lax.Precision.HIGHEST" if self.k.accumulate.name == "f32" and any(
            self.k.operand(o.read.operand).dtype.name == "f32" for o in self.m.operands[:2]) else ""

    def block_value(self, o: Operand) -> str:
        ref = o.ref
        if o.layout == "rows":
            return f"{ref}[:, 0:1]"
        if o.layout == "cols":
            return f"{ref}[0:1, :]"
        if o.layout == "scalar":
            return f"{ref}[0:1, 0:1]"
        live = [s.index for s in o.read.subs if s.index not in self.p.lead]
        if o.role == "extra" and live == [self.p.key, self.p.query]:
            return f"{ref}[...].T"
        return f"{ref}[...]"

    def group_expr(self, lead_vars) -> str:
        """The walk's table group of a step: a flat index over the lead axes the condition reads."""
        axes = [a for a in self.p.class_axes[:-2]]
        if not axes:
            return "0"
        expr = lead_vars[axes[0]]
        for a in axes[1:]:
            expr = f"({expr}) * {self.size_of(a)} + {lead_vars[a]}"
        return expr

    # ------------------------------------------------------------------ module
    def module(self, source_name: str) -> str:
        from ..formatting import format_module
        from .emit import _OPTIONAL, _environment

        m, k, p, conv = self.m, self.k, self.p, self.m.conv
        env = _environment()
        classify_fn, classify_reads, classify_lines = self.classify()
        tables = [self.n.local(x) for x in ("rows", "cols", "read_rows", "kinds", "flags")]
        steps = self.n.local("steps")
        kernel_lines, refs = self.kernel_lines(tables, steps)
        kernel_fn = self.n.function("_attention_kernel")
        statics = list(dict.fromkeys([steps] + [v for v in self.sizes if any(v in line for line in kernel_lines)]))
        # Index maps.
        params = [self.n.local(f"{i}_") if False else i for i in p.lead]
        lead_vars = {i: i for i in p.lead}
        grid_vars = [self.n.local(i) for i in p.lead]
        at_t = self.n.local("t")
        maps = []
        group = self.group_expr(dict(zip(p.lead, grid_vars)))
        for o in m.operands:
            coords = []
            for c in o.coords:
                coords.append(self.coord(c, grid_vars, tables, group, steps, at_t))
            maps.append({"fn": o.fn, "coords": coords, "about": f"{o.read.text}: {self.about(o)}"})
        outs = []
        for c in p.consumers:
            st = k.statement_of(c.output)
            out = k.operand(c.output)
            fn = self.n.function(f"_{c.output}_map")
            coords, block = [], []
            for s in st.target.subs:
                if s.index in p.lead:
                    coords.append(grid_vars[p.lead.index(s.index)])
                    block.append("None")
                elif s.index == p.query:
                    if c.kind != "softmax_product":
                        coords.append("0")
                        block.append("1")
                    coords.append(f"{tables[0]}[{at_t if group == '0' else f'{group} * {steps} + {at_t}'}]")
                    block.append(str(self.tile[p.query]))
                else:
                    coords.append("0")
                    block.append(str(self.tile[s.index]))
            shape = [self.size_of(i) for i in st.target.indices]
            view = list(shape)
            if c.kind != "softmax_product":
                view = shape[:-1] + ["1"] + shape[-1:]
            maps.append({"fn": fn, "coords": coords, "about": f"{st.target.text}: the row block of the step"})
            outs.append({"name": c.output, "map": fn, "block": _tuple(block), "shape": _tuple(shape), "view": _tuple(view),
                         "dtype": out.dtype.jnp, "reshape": view != shape, "var": self.n.local(c.output)})
        acc = k.accumulate.jnp
        ti = self.tile[p.query]
        scratch = [f"pltpu.VMEM(({ti}, 1), {acc})", f"pltpu.VMEM(({ti}, 1), {acc})"]
        for c in p.consumers:
            if c.kind == "softmax_product":
                e = [i for i in k.statement_of(c.output).target.indices if i not in p.lead and i != p.query][0]
                scratch.append(f"pltpu.VMEM(({ti}, {self.tile[e]}), {acc})")
            elif c.kind == "sum":
                scratch.append(f"pltpu.VMEM(({ti}, 1), {acc})")
        arrays = [self.array(o) for o in m.operands]
        data = p.data_dependent
        kinds_var = self.n.local("block_kinds")
        walk = [f"{kinds_var} = {classify_fn}({'jnp' if data else 'np'}, {', '.join(classify_reads + ['sizes'])})"]
        n_class = len(p.class_axes)
        walk.append(f"{kinds_var} = {kinds_var}.reshape((-1,) + {kinds_var}.shape[{n_class - 2}:])")
        walk.append(f"{_tuple(tables)}, {steps} = _row_walk({'jnp' if data else 'np'}, {kinds_var})")
        if not data:
            walk.append(f"{', '.join(tables)} = ({', '.join(f'jnp.asarray({x})' for x in tables)})")
        grid = [self.size_of(i) if self.tile[i] == 1 else f"-(-{self.size_of(i)} // {self.tile[i]})" for i in p.lead] + [steps]
        sem = ['"parallel"'] * len(p.lead) + ['"arbitrary"']
        products = f"{tables[3]}.size"  # upper bound on computing steps
        dims = self.tile[p.query] * self.tile[p.key]
        e_total = sum(self.tile[[i for i in k.statement_of(c.output).target.indices if i not in p.lead and i != p.query][0]]
                      for c in p.consumers if c.kind == "softmax_product")
        flops = f"{products} * {2 * dims * (self.tile[p.summed] + e_total)}"
        transcendentals = f"{products} * {dims}"
        vmem_limit = self.vmem_limit()
        main = env.get_template("tpu/attention.py.j2").render(
            k=k,
            source=source_name.encode("unicode_escape").decode("ascii"),
            digest=k.digest,
            doc=self.docstring(),
            call_doc=f"Run the kernel: {self.wrapper.returns()}.\n\n    Arguments are the inputs in declaration order (see the module docstring).\n    ",
            helpers="{helpers}",
            smem=m.target.smem_bytes,
            target=m.target.name,
            classify_fn=classify_fn,
            classify_params=classify_reads,
            classify_lines=classify_lines,
            size_vars=self.sizes,
            kernel_fn=kernel_fn,
            kernel_params=tables + refs,
            kernel_statics=statics,
            kernel_lines=kernel_lines,
            maps=maps,
            map_params=grid_vars + [at_t] + tables,
            public_params=[p_.internal for p_ in conv.params] + self.sizes,
            prepare_lines=self.prepare_lines(),
            impl_args=list(conv.impl_args),
            walk=walk,
            tables=tables,
            steps=steps,
            grid=_tuple(grid),
            in_specs=[(_tuple("None" if b is None else str(b) for b in o.block), o.fn) for o in m.operands],
            outs=outs,
            scratch=scratch,
            arrays=arrays,
            semantics=_tuple(sem),
            vmem_limit=vmem_limit,
            flops=flops,
            transcendentals=transcendentals,
            reference_lines=self.reference_lines(),
            kernel_signature=self.wrapper.signature()[0],
            reference_signature=self.wrapper.signature()[1],
            forward=[p_.public for p_ in conv.params] + [s.symbol for s in conv.sizes],
            n_args=len(conv.impl_args),
            backward_error=repr(m.backward_error),
            statics_kw=", ".join(f"{v}={v}" for v in statics),
            class_axes=list(p.class_axes),
            data=data,
        )
        uses = {key: False for key in _OPTIONAL}
        text = main
        for _ in range(3):
            called = set(__import__("re").findall(r"\b(_\w+)\(", text))
            for key, fn in _OPTIONAL.items():
                uses[key] = uses[key] or fn in called
            helpers = env.get_template("helpers.py.j2").render(uses=uses).strip()
            text = main + helpers
        helpers = env.get_template("helpers.py.j2").render(uses=uses).strip()
        return format_module(main.replace("{helpers}", helpers, 1), names=(m.name,))

    def prepare_lines(self) -> list[str]:
        lines = self.wrapper.prepare_lines([])
        checks = []
        for o in self.m.operands:
            op = self.k.operand(o.read.operand)
            for d, s in enumerate(o.read.subs):
                dim = op.dims[d]
                if s.index in self.p.inner and dim.symbol is not None:
                    var, t = self.m.conv.size_var(dim.symbol), self.tile[s.index]
                    line = f'_check_whole({var}, {t}, "{op.name} dim {d} ({dim.symbol})")'
                    if line not in checks:
                        checks.append(line)
        return lines[:-1] + checks + lines[-1:]

    def coord(self, c: str, grid_vars, tables, group, steps, t) -> str:
        at = t if group == "0" else f"{group} * {steps} + {t}"
        if c == "QROW":
            return f"{tables[2]}[{at}]"
        if c == "COL":
            return f"{tables[1]}[{at}]"
        if c == "0":
            return "0"
        name, _, div = c.partition(" // ")
        v = grid_vars[self.p.lead.index(name)]
        return f"lax.div({v}, {div})" if div else v

    def about(self, o: Operand) -> str:
        return {"q": "the row block the step reads", "k": "the key block the step reads", "value": "the key block the step reads",
                "extra": {"natural": "the step's block", "rows": "per row, broadcast along lanes", "cols": "per key, broadcast along sublanes",
                          "scalar": "one value, broadcast to a tile"}[o.layout]}[o.role]

    def array(self, o: Operand) -> str:
        """The array the call receives for an operand (broadcast layouts for small reads)."""
        param = self.m.conv.param(o.read.operand).internal
        if o.layout == "natural":
            return param
        op = self.k.operand(o.read.operand)
        dtype = "jnp.int32" if not op.dtype.is_float else "jnp.float32"
        x = f"{param}.astype({dtype})"
        shape = [self.size_of(s.index) if s.divisor == 1 else f"{self.size_of(s.index)} // {s.divisor}" for s in o.read.subs]
        shape = [self.dim_size(o.read, d) for d in range(len(o.read.subs))]
        if o.layout == "rows":
            return f"jnp.broadcast_to({x}[..., None], {_tuple(shape + [str(LANES)])})"
        if o.layout == "cols":
            return f"jnp.broadcast_to({x}[..., None, :], {_tuple(shape[:-1] + [str(SUBLANES), shape[-1]])})"
        return f"jnp.broadcast_to({x}[..., None, None], {_tuple(shape + [str(SUBLANES), str(LANES)])})"

    def dim_size(self, read: Read, d: int) -> str:
        dim = self.k.operand(read.operand).dims[d]
        return str(dim.literal) if dim.literal is not None else self.m.conv.size_var(dim.symbol)

    def vmem_limit(self) -> int | None:
        if self.m.vmem_limit_override is not None:
            return self.m.vmem_limit_override
        need = self.m.vmem_bytes + 128 * 1024
        t = self.m.target
        if need <= t.scoped_vmem_bytes * 3 // 4:
            return None
        limit = -(-(need * 5 // 4 + 2 * (1 << 20)) // (1 << 20)) * (1 << 20)
        return min(max(limit, t.scoped_vmem_bytes), t.vmem_bytes)

    # ------------------------------------------------------------- reference
    def reference_lines(self) -> list[str]:
        """The kernel in plain jax.numpy over whole arrays (O(rows x keys) memory: for tests)."""
        p, k, conv = self.p, self.k, self.m.conv
        scope = self.n.scope()
        acc = k.accumulate
        rows = p.lead + (p.query, p.key)
        letters = {i: chr(97 + n) for n, i in enumerate([*rows, *sorted(set(x.name for x in k.indices) - set(rows))])}
        lines = []

        def view(r: Read) -> str:
            v = conv.param(r.operand).internal
            for d, s in enumerate(r.subs):
                if s.divisor != 1:
                    v = f"jnp.repeat({v}, {s.divisor}, axis={d})"
            return v

        def spec(r: Read) -> str:
            return "".join(letters[i] for i in r.indices)

        dst = "".join(letters[i] for i in rows)
        s = scope.local("s")
        widen = lambda r: f"{view(r)}.astype({acc.jnp})"
        prec = ", precision=lax.Precision.HIGHEST" if acc.is_float else ""
        lines.append(f'{s} = jnp.einsum("{spec(p.q)},{spec(p.k)}->{dst}", {widen(p.q)}, {widen(p.k)}, preferred_element_type={acc.jnp}{prec})')
        if p.scale is not None:
            lines.append(f"{s} = {s} * {p.scale!r}")

        def leaf(t: Term, float_ctx: bool) -> str:
            if t.op == "index":
                shape = _tuple("-1" if i == t.name else "1" for i in rows)
                v = f"jnp.arange({self.size_of(t.name)}).reshape({shape})"
                return f"{v}.astype({acc.jnp})" if float_ctx else v
            if t.op == "size":
                v = conv.size_var(t.name)
                return f"float({v})" if float_ctx else v
            if t.op == "local":
                return current[0]
            v = f'_expand({view(t.read)}, "{spec(t.read)}", "{dst}")'
            if t.op == "truth":
                return f"({v} != 0)"
            return f"{v}.astype({acc.jnp})" if float_ctx else v

        current = [s]
        for name, term in p.chain:
            var = scope.local(name)
            lines.append(f"{var} = {render_term(term, lambda x: leaf(x, True))}")
            current[0] = var
        final = current[0]
        if p.condition is not None:
            lines.append(f"{final} = jnp.where({render_term(p.condition, lambda x: leaf(x, False))}, {final}, -jnp.inf)")
        probs, lse = scope.local("probs"), scope.local("lse")
        results = {}
        needs_softmax = any(c.kind in ("softmax_product", "logsumexp") for c in p.consumers)
        if needs_softmax:
            lines.append(f"{probs}, {lse} = _softmax_rows({final})")
        for c in p.consumers:
            out = k.operand(c.output)
            var = scope.local(c.output)
            st = k.statement_of(c.output)
            if c.kind == "softmax_product":
                e_letters = "".join(letters[i] for i in st.target.indices)
                lines.append(f'{var} = jnp.einsum("{dst},{spec(c.value)}->{e_letters}", {probs}, {widen(c.value)}, preferred_element_type={acc.jnp}{prec})')
                if c.scale is not None:
                    lines.append(f"{var} = {var} * {c.scale!r}")
            elif c.kind == "logsumexp":
                lines.append(f"{var} = {lse}")
            elif c.kind == "max":
                lines.append(f"{var} = jnp.max({final}, axis=-1)")
            else:
                lines.append(f"{var} = jnp.sum(jnp.where(jnp.isneginf({final}), 0.0, {final}), axis=-1)")
            lines.append(f"{var} = {var}.astype({out.dtype.jnp})")
            results[c.output] = var
        out = [results[o.name] for o in k.outputs]
        lines.append(f"return {', '.join(out)}")
        return lines

    # ------------------------------------------------------------- docstring
    def docstring(self) -> str:
        from ..wrapper import spec_text
        from .describe_attention import describe_attention

        k, w = self.k, self.wrapper
        call = f"{k.name}({w.signature()[0]})"
        args = w.argument_lines()
        args.append("    interpret: False compiles for the TPU; True runs the CPU interpreter;")
        args.append("        pltpu.InterpretParams() runs the TPU simulator.")
        spec = "\n".join("    " + line for line in spec_text(k).splitlines())
        plan = "\n".join("    " + line for line in describe_attention(self.m))
        return (
            f"{k.name}: a Pallas TPU kernel generated by sparsegen.\n\n"
            f"Spec:\n\n{spec}\n\n"
            f"Call:\n\n    {call}\n\n"
            "Arguments:\n\n" + "\n".join(args) + "\n\n"
            f"Returns:\n\n    {w.returns()}\n\n"
            "Bad shapes and dtypes raise a ValueError naming the argument and dimension.\n\n"
            f"Plan (target {self.m.target.name}):\n\n{plan}\n"
        )


def _tuple(items) -> str:
    items = list(items)
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def emit_attention(m: AttentionModule, source_name: str) -> str:
    return AttentionEmitter(m).module(source_name)
