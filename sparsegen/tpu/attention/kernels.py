"""The row walk's kernel bodies, as lines of Python: the forward (flash: running max and
sum, rescaled accumulators), the stored outputs' dense walk, and the backward: fused (dk,
dv and dq in one key-side walk on key x row blocks, dq summed per group in VMEM) where
`lower.backward_walk` says so, else dq (row walk) and dk/dv (key-side walk). Mixed into the
emitter, whose names, tiles and sizes they use.
"""

from __future__ import annotations

import math
import re
import dataclasses
from dataclasses import dataclass, field

from ...ir import Read, Term
from ...pytext import py_tuple
from ...expr import Const
from ...schedule.attention import read_key
from ...schedule.row import Direction
from ...terms import ScoreTerms, render_term
from .lower import LANES, SUBLANES, Operand, gradient_dtype


@dataclass
class Arr:
    """One array of a pallas_call: its ref, block, index map and the host expression passed."""

    ref: str
    block: tuple  # None: squeezed
    coords: tuple  # per dimension, the block coordinate: an expr over the walk (`RowWalk.coord`)
    fn: str
    host: str
    about: str
    itemsize: int = field(default=4, kw_only=True)  # bytes an element of the array passed (f32 unless said)


@dataclass
class OutArr(Arr):
    shape: tuple[str, ...] = ()  # the array's shape (host expressions)
    view: tuple[str, ...] = ()  # the shape the call writes (a unit dimension for row vectors)
    dtype: str = ""
    var: str = ""


@dataclass
class CallSpec:
    """One pallas_call over a walk: the kernel's text and everything its call needs."""

    kernel_fn: str
    kernel_lines: list[str]
    scratch: list[str]
    ins: list[Arr]
    outs: list[OutArr]
    statics: list[str]
    tables: Direction  # the walk's direction: which table holds each step's row, query and key block
    flops: str
    transcendentals: str
    about: str
    refs: list[str] = field(default_factory=list)
    suffix: str = ""  # the index maps' names: the key-side walk reads its tables the other way
    post: list[str] = field(default_factory=list)  # lines after the call (placing per-step blocks)



LOG2E, LN2 = math.log2(math.e), math.log(2.0)


def lanes(x: str, width: int) -> str:
    """A (rows, 128) value whose lanes all hold the row's value, as a (rows, width) block:
    tiled, sliced, or (another width) one lane broadcast."""
    if width == LANES:
        return x
    if width % LANES == 0:
        return f"jnp.tile({x}, (1, {width // LANES}))"
    if width < LANES:
        return f"({x})[:, :{width}]"
    return f"({x})[:, 0:1]"


def zero_outside(inside: str, var: str, dtype, lhs: bool) -> list[str]:
    """Lines zeroing `var` (a block of `dtype`) where `inside` is false. `lhs`: the block is a
    product's left operand; a 16-bit float one is then selected as f32 and packed back
    (exact). Mosaic selects a packed bf16 block as int16, and libtpu's static profiler rejects
    that as a vmatmul's left operand ("Expected vector-bf16packed, got vector-int16"),
    aborting `verify --cycles` on every backward pass; as a right operand it passes."""
    if lhs and dtype.is_float and dtype.bits == 16:
        return ["        # Via f32: a bf16 select here aborts libtpu's cycle profiler.",
                f"        {var} = jnp.where({inside}, {var}.astype(jnp.float32), 0.0).astype({var}.dtype)"]
    return [f"        {var} = jnp.where({inside}, {var}, jnp.zeros_like({var}))"]


class KernelWriter:
    """The kernels' lines (a mixin of AttentionEmitter)."""

    # -------------------------------------------------------- kernel pieces
    def head(self, n, tables: Direction) -> tuple[list[str], dict, str, str, str]:
        """Grid coordinates, the step's table slot, its kind and flags."""
        p = self.p
        lines = []
        lead_vars = {i: n.local(i) for i in p.lead}
        for d, i in enumerate(p.lead):
            lines.append(f"{lead_vars[i]} = pl.program_id({d})")
        t, at = n.local("t"), n.local("at")
        lines.append(f"{t} = pl.program_id({len(p.lead)})")
        lines.append(f"{at} = {self.slot(lead_vars, t)}")
        kind, flag = n.local("kind"), n.local("flag")
        lines.append(f"{kind} = {self.w.kinds}[{at}]")
        lines.append(f"{flag} = {self.w.flags}[{at}]")
        return lines, lead_vars, at, kind, flag

    def scores(self, n, lead_vars, at, tables, with_raw: bool, transposed: bool = False, base2: bool = False) -> list[str]:
        """`_scores(masked)`: the score block (MXU), the elementwise chain, and on a partial
        block the condition (absent: minus infinity). With `with_raw`, also the product
        before the chain, for the chain's derivative. `transposed`: key x row blocks (the
        key-side walk), so per-row statistics are rows and the gradients plain products."""
        p, acc = self.p, self.acc
        n = n.scope()  # _scores' own locals: they avoid the kernel's names, not its other functions'
        ti, tj = self.tile[p.query], self.tile[p.key]
        out = ["", "def _scores(masked):"]
        operands = self.operands(transposed)
        floats = {read_key(r) for r in p.float_reads()}
        for o in operands:
            if o.role == "value":
                continue
            if with_raw and (o.role in ("q", "k") or read_key(o.read) in floats):
                # Past the ends memory holds anything: zeros keep the scores finite there
                # (the derivatives the chain sums for a bias too); the gradient products
                # reuse these blocks.
                # The score product's left operand: q's block, k's on key x row blocks.
                lhs = o.role == ("k" if transposed else "q")
                out += self.load_block(n, o, at, tables, "masked", (p.query, p.key), transposed, lhs)
            else:
                out.append(f"    {o.var} = {self.block_value(o, transposed)}")
        raw = None
        if not p.stored_score:
            qo, ko = operands[0], operands[1]
            qd, kd = self.live(qo.read).index(p.summed), self.live(ko.read).index(p.summed)
            raw = n.local("raw_scores")
            (qv, kv), prec = self.score_factors(qo, ko)
            a, b, da, db = (kv, qv, kd, qd) if transposed else (qv, kv, qd, kd)
            out.append(f"    {raw} = lax.dot_general({a}, {b}, ((({da},), ({db},)), ((), ())), preferred_element_type={acc.jnp}{prec})")
            if base2:
                out.append("    # In base 2 (softmax is the same): log2(e) joins the scale, so exp2 needs no multiply of its own.")
                out.append(f"    {raw} = {raw} * {(1.0 if p.scale is None else p.scale) * LOG2E!r}")
            elif p.scale is not None:
                out.append(f"    {raw} = {raw} * {p.scale!r}")
        qpos, kpos = n.local(f"{p.query}_pos"), n.local(f"{p.key}_pos")
        # Positions as whole blocks: a (rows, 1) column against a score block is a lane
        # broadcast on the XLU at every use; a 2-d iota is one VPU op a vreg.
        qshape = kshape = (tj, ti) if transposed else (ti, tj)
        starts = [f"{tables.query}[{at}] * {ti}", f"{tables.key}[{at}] * {tj}"]
        gpos = {p.query: qpos, p.key: kpos}  # the positions a condition or the chain compares
        ends = {p.query: self.size_of(p.query), p.key: self.size_of(p.key)}  # where each ends, as `gpos` counts
        if self.positions:
            # Positions are global: a shard's first element sits at `origins` (a ring on a
            # mesh); added to the block's first (a scalar), not to every element.
            for d, index in enumerate((p.query, p.key)):
                gpos[index] = n.local(f"{index}_at")
                starts[d] = f"({starts[d]} + {self.origins}[{d}])"
                ends[index] = f"{ends[index]} + {self.origins}[{d}]"
        pos_lines = [
            f"    {gpos[p.query]} = {starts[0]} + lax.broadcasted_iota(jnp.int32, {qshape}, {int(transposed)})",
            f"    {gpos[p.key]} = {starts[1]} + lax.broadcasted_iota(jnp.int32, {kshape}, {int(not transposed)})",
        ]
        chain_pos = self.chain_uses_positions()
        if chain_pos:
            out += pos_lines
        block_of = {read_key(o.read): o.var for o in operands}
        terms = ScoreTerms(gpos, lead_vars, str, lambda r: block_of[read_key(r)], acc.jnp, self.m.conv.size_var,
                           {} if raw is None else {p.score: raw})
        leaf = terms.leaf

        fvars = [block_of[read_key(r)] for r in p.float_reads()]
        args = ([raw] if raw is not None else []) + fvars
        if self.has_chain():
            # The elementwise steps (after the product), one function: its derivative is jax.vjp's.
            out += ["", f"    def _chain({', '.join(args)}):"]
            out += terms.chain(p.chain, n.local, "        ")
            out.append(f"        return {', '.join(terms.point(pt) for pt in p.points)}")
            out.append("")
            ss = [n.local("s") for _ in p.points]
            out.append(f"    {', '.join(ss)} = _chain({', '.join(args)})")
        else:
            ss = [n.local("s")]
            out.append(f"    {ss[0]} = {raw}")
        # A ragged index's end: a literal size's is known; a size symbol's is static in the
        # kernel, so at a multiple of the tile its test is dropped while tracing.
        past = [(f"({gpos[index]} < {ends[index]})", self.may_pass_end(index).removeprefix(" and "))
                for index in (p.query, p.key) if self.ragged(index)]
        known = [test for test, guard in past if not guard]
        guarded = [(test, guard) for test, guard in past if guard]
        # `&` binds tighter than the comparisons in a condition: bracket it when anything joins it.
        spliced: dict[str, str] = {}  # `_ranges`' tests: name -> code

        def cond_leaf(x: Term) -> str:
            return spliced[x.name] if x.op == "index" and x.name in spliced else leaf(x, False)

        split = self.split_parts(lead_vars, spliced, cond_leaf)
        conds = [([] if pt.condition is None or split else [render_term(self._ranges(pt.condition, lead_vars, spliced, cond_leaf), cond_leaf)])
                 for pt in p.points]
        conds = [[f"({c[0]})"] + known if c and (known or guarded) else c + known for c in conds]
        if split or any(conds) or guarded:
            out.append("    if masked:")
            if not chain_pos:
                # Positions where a part evaluated here compares them (or a ragged end is tested).
                kinds = sorted({k for ks, test, pos in split if pos for k in ks})
                guard = " or ".join(dict.fromkeys(g for _, g in guarded))
                if known or not split or all(pos for _, _, pos in split):
                    out += ["    " + x for x in pos_lines]
                elif kinds or guarded:
                    tests = ([self.evaluates(kinds)] if kinds else []) + ([guard] if guarded else [])
                    out += [f"        if {' or '.join(tests)}:"] + ["        " + x for x in pos_lines]
            guard = " or ".join(dict.fromkeys(g for _, g in guarded))
            for s, cond in zip(ss, conds):
                present = n.local("present")
                if split:
                    # A step of kind _PARTIAL + 2 * (part + 1) evaluates that part of the
                    # condition alone: the others hold over its whole block.
                    out.append(f"        {present} = None")
                    for ks, test, _ in split:
                        part = n.local("part")
                        out += [f"        if {self.evaluates(ks)}:", f"            {part} = {test}",
                                f"            {present} = {part} if {present} is None else {present} & {part}"]
                    if known:
                        out.append(f"        {present} = {present} & " + " & ".join(known))
                    cond = [present]
                if cond:
                    if not split:
                        out.append(f"        {present} = " + " & ".join(cond))
                    if guarded:
                        out += [f"        if {guard}:", "            # Past the end: absent.",
                                f"            {present} = {present} & " + " & ".join(t for t, _ in guarded)]
                    out.append(f"        {s} = jnp.where({present}, {s}, -jnp.inf)")
                else:
                    out += [f"        if {guard}:", "            # Past the end: absent.",
                            f"            {present} = " + " & ".join(t for t, _ in guarded),
                            f"            {s} = jnp.where({present}, {s}, -jnp.inf)"]
        if with_raw:  # one point (the gradients are derived for one)
            got = ([raw] if raw is not None else []) + [ss[0]] + (["_chain"] if self.has_chain() else [])
            if fvars:
                got.append(f"({', '.join(fvars)}{',' if len(fvars) == 1 else ''})")
            out.append(f"    return {', '.join(got)}")
        else:
            out.append(f"    return {', '.join(ss)}")
        return out

    def split_kinds(self) -> list[int]:
        """The kinds of partial step that evaluate one part of the condition alone
        (`Classification.parts`): _PARTIAL + 2 * (part + 1); none unless the kinds are split."""
        return [1 + 2 * (g + 1) for g in range(max(self.conjunct_parts) + 1)] if self.conjunct_parts else []

    def evaluates(self, kinds) -> str:
        """The test, on `masked` (True: every part; else the step's kind), for code that
        steps of `kinds` and plain partial ones run."""
        return f"masked is True or masked == {kinds[0]}" if len(kinds) == 1 else f"masked is True or masked in {py_tuple(map(str, kinds))}"

    def split_parts(self, lead_vars: dict, spliced: dict, leaf) -> list[tuple[list[int], str, bool]]:
        """A split condition (`split_kinds`) as the tests the kernel evaluates: per test, the
        kinds of step that evaluate it (those of the parts it joins: `_ranges` may make two
        conjuncts one test), its code, and whether it compares query or key positions."""
        from ...schedule.classify import conjuncts

        p = self.p
        if not self.conjunct_parts or len(p.points) != 1:
            return []
        flat = conjuncts(p.points[0].condition)
        held: list[tuple[int, ...]] = []
        ranged = self._ranges(Term("and", args=tuple(flat)), lead_vars, spliced, leaf, held)
        tests = list(ranged.args) if ranged.op == "and" and len(held) > 1 else [ranged]
        out = []
        for conj, test in zip(held, tests):
            kinds = sorted({1 + 2 * (self.conjunct_parts[c] + 1) for c in conj})
            pos = any(x.op == "index" and (x.name in (p.query, p.key) or x.name in spliced) for x in test.walk())
            out.append((kinds, render_term(test, leaf), pos))
        return out

    def _ranges(self, t: Term, lead_vars: dict, spliced: dict, leaf, held: list | None = None) -> Term:
        """A condition whose `and` bounds one affine term in the positions from below and
        above by integers (`i >= j and i - j < W`: 0 <= i - j <= W - 1) with the pair as one
        unsigned comparison, `uint32(E - lo) <= hi - lo`: a compare per score vreg instead of
        two and their `&` (two's complement: E below lo wraps past hi - lo). Other terms as
        they are; the pair's test is spliced in as an atom (`spliced`)."""
        if t.op in ("or", "not"):
            return dataclasses.replace(t, args=tuple(self._ranges(a, lead_vars, spliced, leaf) for a in t.args))
        if t.op != "and":
            return t
        args = [self._ranges(a, lead_vars, spliced, leaf) for a in t.args]
        bounds = {}  # the affine part (its first coefficient positive) -> [(lower, upper, arg index, term, sign, constant)]
        for n, a in enumerate(args):
            got = self._bound(a, lead_vars)
            if got is not None:
                bounds.setdefault(got[0], []).append((n,) + got[1:])
        used, out, pairs = set(), [], []
        for key, found in bounds.items():
            lows = [f for f in found if f[1] == "lo"]
            highs = [f for f in found if f[1] == "hi"]
            if not lows or not highs:
                continue
            (n_lo, _, lo, term, sign, k), (n_hi, _, hi, *_) = lows[0], highs[0]
            if hi < lo:
                continue
            # E - lo from the lower bound's own sides: (lhs - rhs) is sign * E + k.
            shift = k + sign * lo
            expr = Term("-", args=term.args)
            expr = expr if sign == 1 else Term("neg", args=(expr,))
            diff = render_term(Term("-", args=(expr, Term("num", value=sign * shift))) if shift else expr, leaf)
            name = f"__range{len(spliced)}"
            spliced[name] = f"(lax.bitcast_convert_type({diff}, jnp.uint32) <= {hi - lo})"
            used |= {n_lo, n_hi}
            pairs.append((n_lo, n_hi))
            out.append(Term("index", name=name))
        rest = [a for n, a in enumerate(args) if n not in used]
        if held is not None:  # per term of the result, the places in `t.args` it holds
            held += [(n,) for n in range(len(args)) if n not in used] + pairs
        if not used:
            return dataclasses.replace(t, args=tuple(args))
        kept = rest + out
        return kept[0] if len(kept) == 1 else Term("and", args=tuple(kept))

    def _bound(self, t: Term, lead_vars: dict):
        """A comparison as an integer bound on an affine term in the positions: (the term's
        coefficients, "lo" or "hi", the bound (inclusive), the comparison, the sign and
        constant with which lhs - rhs is sign * E + constant); None for any other term."""
        p = self.p
        if t.op != "cmp" or len(t.ops) != 1 or t.ops[0] not in (">=", ">", "<=", "<"):
            return None

        def affine(x: Term) -> dict | None:
            if x.op == "num" and isinstance(x.value, int) and not isinstance(x.value, bool):
                return {"": x.value}
            if x.op == "index":
                return {x.name: 1} if x.name in (p.query, p.key) or x.name in lead_vars else None
            if x.op == "size":
                return {f"size {x.name}": 1}
            if x.op in ("+", "-", "neg"):
                parts = [affine(a) for a in x.args]
                if any(q is None for q in parts):
                    return None
                out: dict = {}
                for sign, q in zip((-1,) if x.op == "neg" else (1, 1 if x.op == "+" else -1), parts):
                    for key, c in q.items():
                        out[key] = out.get(key, 0) + sign * c
                return out
            if x.op == "*":
                a, b = affine(x.args[0]), affine(x.args[1])
                for u, v in ((a, b), (b, a)):
                    if u is not None and v is not None and set(u) == {""}:
                        return {key: u[""] * c for key, c in v.items()}
            return None

        lhs, rhs = affine(t.args[0]), affine(t.args[1])
        if lhs is None or rhs is None:
            return None
        d = dict(lhs)
        for key, c in rhs.items():
            d[key] = d.get(key, 0) - c
        k = d.pop("", 0)
        part = tuple(sorted((key, c) for key, c in d.items() if c))
        if not any(key in (p.query, p.key) for key, _ in part):
            return None
        sign = 1 if part[0][1] > 0 else -1
        part = tuple((key, sign * c) for key, c in part)
        # sign * E + k op 0, as a bound on E.
        op = t.ops[0] if sign == 1 else {">=": "<=", ">": "<", "<=": ">=", "<": ">"}[t.ops[0]]
        b = -k * sign
        kind, bound = {">=": ("lo", b), ">": ("lo", b + 1), "<=": ("hi", b), "<": ("hi", b - 1)}[op]
        return part, kind, bound, t, sign, k

    def base2(self) -> bool:
        """exp(x) is exp2(x * log2(e)) on the EUP: where the scores feed only softmax and
        logsumexp, every pass keeps them in base 2 with log2(e) in the score's scale (one
        multiply a score, not two); the logsumexp the forward writes stays in base e."""
        p = self.p
        return p.scale is not None and not self.has_chain() and all(c.kind in ("softmax_product", "logsumexp") for c in p.consumers)

    def has_chain(self) -> bool:
        """Is there a `_chain` function (elementwise steps, several points, stored scores)?"""
        p = self.p
        return bool(p.chain) or p.stored_score or any(pt.local != p.score for pt in p.points)

    def may_pass_end(self, index: str) -> str:
        """What joins `masked` in the test guarding a ragged index's zeroing: a size symbol's
        value is static in the kernel (a Python int), so at a multiple of the tile the test is
        false while tracing and the selects are never emitted (a diagonal block of causal
        attention then pays only its condition). Empty for a literal size (ragged or not, known)."""
        if self.k.index(index).size.literal is not None:
            return ""
        return f" and {self.size_of(index)} % {self.tile[index]} != 0"

    def load_block(self, n, o: Operand, at, tables, masked: str, along: tuple[str, ...], transposed: bool = False,
                   lhs: bool = False) -> list[str]:
        """An operand's block; on a partial step its rows (or columns) past the end of a
        ragged index in `along` are zeroed: memory there holds anything, and 0 x NaN is NaN.
        `lhs`: the block is a product's left operand (`zero_outside`)."""
        lines = [f"    {o.var} = {self.block_value(o, transposed)}"]
        live = self.live(o.read)
        if o.layout == "natural":
            axes = {i: a for a, i in enumerate(live)}
            if o.role == "extra" and transposed == (live == [self.p.query, self.p.key]):
                axes = {i: 1 - a for i, a in axes.items()}  # the block was transposed
        elif o.layout == "rows":
            axes = {live[0]: 0}
        elif o.layout == "cols":
            axes = {live[0]: 1}
        else:
            axes = {}
        for index in along:
            if index not in axes or not self.ragged(index):
                continue
            t, axis = self.tile[index], axes[index]
            shape = f"({t}, 1)" if axis == 0 else f"(1, {t})"
            table = tables.query if index == self.p.query else tables.key
            inside = n.local("inside")
            lines += [f"    if {masked}{self.may_pass_end(index)}:", f"        # Past the end of {index} memory holds anything: zero it.",
                      f"        {inside} = {table}[{at}] * {t} + lax.broadcasted_iota(jnp.int32, {shape}, {axis}) < {self.size_of(index)}"]
            lines += zero_outside(inside, o.var, self.dtype_of(o), lhs)
        return lines

    def operands(self, transposed: bool) -> list[Operand]:
        return [self.transposed(o) for o in self.m.operands] if transposed else list(self.m.operands)

    def values(self) -> list[Operand]:
        return [o for o in self.m.operands if o.role == "value"]

    def operand_of(self, r: Read) -> Operand:
        return next(o for o in self.m.operands if read_key(o.read) == read_key(r))

    def consumer_value(self, c) -> Operand:
        return self.operand_of(c.value)

    def phases(self, kind: str, step: str) -> list[str]:
        lines = ["", f"@pl.when({kind} == _PARTIAL)", "def _partial():", "    # Some elements absent: evaluate the condition.", f"    {step}(True)"]
        for g, k in enumerate(self.split_kinds()):
            lines += ["", f"@pl.when({kind} == {k})", f"def _partial_{g}():",
                      f"    # Only part {g} of the condition may fail here: the others are not evaluated.", f"    {step}({k})"]
        return lines + ["", f"@pl.when({kind} == _FULL)", "def _full():", "    # Every element present: the condition is not evaluated.", f"    {step}(False)"]

    # -------------------------------------------------------------- forward
    def forward_call(self) -> CallSpec:
        p, k, acc = self.p, self.k, self.acc
        consumers = [c for c in p.consumers if not c.stored]
        n = self.n.scope()
        tables = self.row_tables()
        lines, lead_vars, at, kind, flag = self.head(n, tables)
        ti = self.tile[p.query]
        pts = range(len(p.points))
        # Per point (what consumers read): a running max and sum.
        stat_names = [(n.local("m_scratch"), n.local("l_scratch")) for _ in pts]
        accs = {}
        for c in consumers:
            if c.kind == "softmax_product":
                accs[c.output] = n.local(f"{c.output}_acc")
            elif c.kind == "sum":
                accs[c.output] = n.local(f"{c.output}_sum")
        out_refs = {c.output: n.local(f"{c.output}_ref") for c in consumers}
        stats_refs = [n.local("row_lse_ref") for _ in pts]
        lines += ["", f"@pl.when({flag} & 1 != 0)", "def _init():", "    # The row's first step: nothing seen yet."]
        for m_scr, l_scr in stat_names:
            # The running max starts at the lowest finite value, not minus infinity: an absent
            # score (minus infinity) then gives exp(-inf - m) = 0 with no guard on m, and a row
            # with nothing present yet keeps a sum of 0 (its max is not written as such: the
            # flush tests the sum).
            lines += [f"    {m_scr}[...] = jnp.full_like({m_scr}, jnp.finfo({acc.jnp}).min)", f"    {l_scr}[...] = jnp.zeros_like({l_scr})"]
        lines += [f"    {a}[...] = jnp.zeros_like({a})" for a in accs.values()]
        base2 = self.base2()
        exp, log = ("jnp.exp2", "jnp.log2") if base2 else ("jnp.exp", "jnp.log")
        lines += self.scores(n, lead_vars, at, tables, with_raw=False, base2=base2)
        nms = [{x: n.local(x) for x in ["m_prev", "m_new", "alpha", "probs", "total", "nothing", "scores"]} for _ in pts]
        lines += ["", "def _step(masked):", f"    {', '.join(nm['scores'] for nm in nms)} = _scores(masked)"]
        tj = self.tile[p.key]
        for nm, (m_scr, l_scr) in zip(nms, stat_names):
            sv = nm["scores"]
            lines += [f"    {nm['m_prev']} = {m_scr}[...]",
                      f"    {nm['m_new']} = jnp.maximum({nm['m_prev']}, jnp.max({sv}, axis=1, keepdims=True))",
                      f"    {nm['alpha']} = {exp}({nm['m_prev']} - {nm['m_new']})",
                      f"    {nm['probs']} = {exp}({sv} - {lanes(nm['m_new'], tj)})",
                      f"    {l_scr}[...] = {nm['alpha']} * {l_scr}[...] + jnp.sum({nm['probs']}, axis=1, keepdims=True)",
                      f"    {m_scr}[...] = {nm['m_new']}"]
        for c in consumers:
            nm, sv = nms[c.point], nms[c.point]["scores"]
            if c.kind == "softmax_product":
                vo = self.consumer_value(c)
                vd = self.live(vo.read).index(p.key)
                lines += self.load_block(n, vo, at, tables, "masked", (p.key,))
                a = accs[c.output]
                pv, vv, prec = self.mxu(nm["probs"], vo.var, self.dtype_of(vo), in_mxu=True)
                dot = f"lax.dot_general({{}}, {{}}, (((1,), ({vd},)), ((), ())), preferred_element_type={acc.jnp}{prec})"
                x = n.local("x")
                rescaled_by = lanes(nm['alpha'], self.tile[self.e_of(c)])
                # Full steps too: a score of minus infinity from the data (an additive mask)
                # is absent where no condition is evaluated.
                lines += ["    # An absent element's weight (0) meets its value: a NaN or Inf there must not",
                          "    # reach the row (the running sum rescaled, then the product added).",
                          f"    _present_add({a}, {dot.format(pv, vv)}, lambda: _present_dot(lambda {x}, y: {dot.format(x, 'y')}, "
                          f"{pv}, {nm['probs']}, jnp.logical_not(jnp.isneginf({sv})), {vv}), {rescaled_by})"]
            elif c.kind == "sum":
                lines.append(f"    {accs[c.output]}[...] += jnp.sum(jnp.where(jnp.isneginf({sv}), 0.0, {sv}), axis=1, keepdims=True)")
        lines += self.phases(kind, "_step")
        # A row with nothing present (its sum 0): 1 / 0 and log(0) are
        # replaced by the selects, as tokamax's and Splash's are (no guarded divisor to build).
        lses = [f"{m_scr}[...] + {log}({nm['total']})" for nm, (m_scr, _) in zip(nms, stat_names)]
        lses = [f"jnp.where({nm['nothing']}, -jnp.inf, " + (f"({lse}) * {LN2!r})" if base2 else f"{lse})") for nm, lse in zip(nms, lses)]
        lines += ["", f"@pl.when({flag} & 2 != 0)", "def _flush():", "    # The row's last step: normalise and write."]
        for nm, (_, l_scr) in zip(nms, stat_names):
            lines += [f"    {nm['total']} = {l_scr}[...]", f"    {nm['nothing']} = {nm['total']} == 0.0"]
        lse_rows = {}  # a point's logsumexp as a row vector, where an output is it
        for c in consumers:
            ref, nm, lse, m_scr = out_refs[c.output], nms[c.point], lses[c.point], stat_names[c.point][0]
            if c.kind == "softmax_product":
                scale = f" * {c.scale!r}" if c.scale is not None else ""
                norm = lanes(f"jnp.where({nm['nothing']}, 0.0, 1.0 / {nm['total']})", self.tile[self.e_of(c)])
                lines.append(f"    {ref}[...] = ({accs[c.output]}[...] * {norm}{scale}).astype({ref}.dtype)")
            elif c.kind == "logsumexp":
                if c.point not in lse_rows:  # computed once: the gradients keep it too
                    lse_rows[c.point] = n.local("lse_row")
                    lines.append(f"    {lse_rows[c.point]} = _row_vector({lse})")
                lines.append(f"    {ref}[...] = {lse_rows[c.point]}.astype({ref}.dtype)")
            elif c.kind == "max":
                lines.append(f"    {ref}[...] = _row_vector(jnp.where({nm['nothing']}, -jnp.inf, {m_scr}[...])).astype({ref}.dtype)")
            else:
                lines.append(f"    {ref}[...] = _row_vector({accs[c.output]}[...]).astype({ref}.dtype)")
        for pt, (stats_ref, lse) in enumerate(zip(stats_refs, lses)):
            # None in the call not differentiated (`primal_call`): nothing kept, nothing computed.
            lines += [f"    if {stats_ref} is not None:", f"        {stats_ref}[...] = {lse_rows.get(pt, f'_row_vector({lse})')}  # kept for the gradients"]
        ins = [self.arr(o, tables) for o in self.m.operands]
        outs = []
        for c in consumers:
            st = k.statement_of(c.output)
            outs.append(self.out_arr(out_refs[c.output], st.target.indices, k.operand(c.output).dtype.jnp, self.n.local(c.output),
                                     f"{st.target.text}: the row block of the step", vector=c.kind != "softmax_product"))
        for stats_ref, pt in zip(stats_refs, p.points):
            about = "each row's logsumexp (for the gradients)" if len(p.points) == 1 else f"each row's logsumexp of {pt.name}"
            outs.append(self.out_arr(stats_ref, p.lead + (p.query,), "jnp.float32", self.n.local("row_lse"), about, vector=True))
        # The running max and sum hold each row's value in every lane (as Splash keeps them):
        # their uses against score and accumulator blocks need no lane broadcast.
        scratch = [f"pltpu.VMEM(({ti}, {LANES}), {acc.jnp})" for _ in range(2 * len(p.points))]
        for c in consumers:
            if c.kind == "softmax_product":
                scratch.append(f"pltpu.VMEM(({ti}, {self.tile[self.e_of(c)]}), {acc.jnp})")
            elif c.kind == "sum":
                scratch.append(f"pltpu.VMEM(({ti}, 1), {acc.jnp})")
        refs = [a.ref for a in ins] + [o.ref for o in outs] + [x for pair in stat_names for x in pair] + list(accs.values())
        dims = self.block_elements()
        e_total = sum(self.tile[self.e_of(c)] for c in consumers if c.kind == "softmax_product")
        return CallSpec(self.n.function("_attention_kernel"), lines, scratch, ins, outs, self.statics(lines), tables,
                        f"{2 * dims * (self.score_depth() + e_total)}", f"{dims}", "the outputs", refs)

    def primal_call(self, forward: CallSpec) -> CallSpec:
        """The forward of a call not differentiated (`_run`, `_impl(..., residuals=False)`):
        the outputs alone. Its kernel is the forward's with no logsumexp refs (None): the
        flush neither computes nor writes what only the gradients read."""
        n_stats = len(self.p.points)
        outs = forward.outs[: len(forward.outs) - n_stats]
        stats = {o.ref for o in forward.outs[len(outs):]}
        refs = [r for r in forward.refs if r not in stats]
        passed = ", ".join(self.tables + ["None" if r in stats else r for r in forward.refs] + [f"{v}={v}" for v in forward.statics])
        lines = [f"{forward.kernel_fn}({passed})"]
        return dataclasses.replace(forward, kernel_fn=self.n.function("_attention_primal_kernel"), kernel_lines=lines, outs=outs, refs=refs,
                                   about="the outputs alone (a call not differentiated): the forward's kernel, no logsumexp kept")

    def score_depth(self) -> int:
        """Multiply-adds per score element: the product's summed tile (a stored score: one,
        its running max and sum; no product)."""
        return self.tile[self.p.summed] if self.p.summed is not None else 1

    def stored_call(self) -> CallSpec:
        """Stored softmax or score outputs: every block written (zeros where empty), from a
        dense walk over (row block, key block); a softmax reads each row's logsumexp."""
        p, k = self.p, self.k
        stored = [c for c in p.consumers if c.stored]
        n = self.n.scope()
        tables = self.row_tables()
        lines, lead_vars, at, kind, flag = self.head(n, tables)
        out_refs = {c.output: n.local(f"{c.output}_ref") for c in stored}
        ins = [self.arr(o, tables) for o in self.m.operands if o.role != "value"]
        lse_refs = {}
        for pt in sorted({c.point for c in stored if c.kind == "softmax_out"}):
            lse_refs[pt] = n.local("row_lse_ref")
            block = tuple([None] * len(p.lead) + [self.tile[p.query], LANES])
            coords = tuple(self.w.lead_coords() + [self.w.coord(p.query), Const(0)])
            ins.append(Arr(lse_refs[pt], block, coords, self.fn("_row_lse_rows_map"), self.stored_lse_hosts[pt],
                           "the forward's logsumexp per row, broadcast along lanes"))
        lines += ["", f"@pl.when({kind} == _EMPTY)", "def _empty():", "    # Nothing present in this block: zeros."]
        lines += [f"    {r}[...] = jnp.zeros_like({r})" for r in out_refs.values()]
        lines += self.scores(n, lead_vars, at, tables, with_raw=False)
        svs = [n.local("scores") for _ in p.points]
        lines += ["", "def _write(masked):", f"    {', '.join(svs)} = _scores(masked)"]
        for c in stored:
            ref, sv = out_refs[c.output], svs[c.point]
            if c.kind == "softmax_out":
                lse = n.local("lse")
                lines += [f"    {lse} = {lse_refs[c.point]}[:, 0:1]", f"    {lse} = jnp.where(jnp.isneginf({lse}), 0.0, {lse})",
                          f"    {ref}[...] = jnp.where(jnp.isneginf({sv}), 0.0, jnp.exp({sv} - {lse})).astype({ref}.dtype)"]
            else:
                value = render_term(c.term, lambda t: sv if t.op == "local" else self.scalar_leaf(t))
                lines.append(f"    {ref}[...] = jnp.where(jnp.isneginf({sv}), 0.0, {value}).astype({ref}.dtype)")
        lines += self.phases(kind, "_write")
        outs = []
        for c in stored:
            st = k.statement_of(c.output)
            block = tuple(None if i in p.lead else self.tile[i] for i in st.target.indices)
            coords = tuple(self.w.coord(i) for i in st.target.indices)
            shape = tuple(self.size_of(i) for i in st.target.indices)
            outs.append(OutArr(out_refs[c.output], block, coords, self.fn(f"_{c.output}_map", key=("stored", c.output)), "", f"{st.target.text}: the step's block",
                               shape, shape, k.operand(c.output).dtype.jnp, self.n.local(c.output)))
        refs = [a.ref for a in ins] + [o.ref for o in outs]
        dims = self.block_elements()
        return CallSpec(self.n.function("_attention_stored_kernel"), lines, [], ins, outs, self.statics(lines), tables,
                        f"{2 * dims * self.score_depth()}", f"{dims}", "the stored softmax and score outputs", refs)

    def scalar_leaf(self, t: Term) -> str:
        if t.op == "size":
            return f"float({self.m.conv.size_var(t.name)})"
        raise NotImplementedError(f"a stored score reads {t.op}")  # checked in row_plan

    def statics(self, lines) -> list[str]:
        text = "\n".join(lines)
        return list(dict.fromkeys([self.steps] + [v for v in self.sizes if re.search(rf"\b{re.escape(v)}\b", text)]))

    # ------------------------------------------------------------- backward
    def backward_inputs(self, n, tables, transposed: bool = False) -> tuple[list[Arr], dict]:
        """The arrays both backward kernels read: the forward's operands, each softmax
        product's cotangent, and per row the forward's logsumexp and the softmax-gradient
        correction (and the cotangent of a sum reduction)."""
        p, k = self.p, self.k
        ins = [self.arr(o, tables) for o in self.operands(transposed)]
        extra = {}
        for c in p.consumers:
            if c.kind == "softmax_product":
                st = k.statement_of(c.output)
                ref = n.local(f"d{c.output}_ref")
                block = tuple(None if i in p.lead else self.tile[i] for i in st.target.indices)
                coords = tuple(self.w.coord(i) for i in st.target.indices)  # the rows and a value's own index (whole)
                ins.append(Arr(ref, block, coords, self.fn(f"_d{c.output}_map", key=("cotangent", c.output)), self.cot(c.output), f"the cotangent of {c.output}",
                               itemsize=k.operand(c.output).dtype.itemsize))
                extra["cotangent", c.output] = ref  # apart from the row statistics: an output may be named row_lse
        about = {"row_lse": "the forward's logsumexp per row", "delta": "per row: sum(do * o) minus the logsumexp's cotangent",
                 "dsum": "per row: the cotangent of the sum"}
        for key, host in (self.col_hosts if transposed else self.row_hosts).items():
            ref = n.local(f"{key}_ref")
            if transposed:  # the key-side walk wants each row's statistic along lanes: a row vector
                block = tuple([None] * len(p.lead) + [SUBLANES, self.tile[p.query]])
                coords = tuple(self.w.lead_coords() + [Const(0), self.w.coord(p.query)])
                fn, how = self.fn(f"_{key}_cols_map"), ", broadcast along sublanes"
            else:
                block = tuple([None] * len(p.lead) + [self.tile[p.query], LANES])
                coords = tuple(self.w.lead_coords() + [self.w.coord(p.query), Const(0)])
                fn, how = self.fn(f"_{key}_rows_map"), ", broadcast along lanes"
            ins.append(Arr(ref, block, coords, fn, host, about[key] + how))
            extra[key] = ref
        return ins, extra

    def cot(self, output: str) -> str:
        return self.cotangents[output]

    def backward_step(self, n, at, tables, extra, masked, transposed: bool = False) -> tuple[list[str], str, str, dict]:
        """Lines computing, for one block: probs, the score gradient `ds`, and the product's
        gradient `dr` (through the chain); returns (lines, probs, draw, s)."""
        p, acc = self.p, self.acc
        nm = {x: n.local(x) for x in ["raw", "s", "probs", "dprobs", "ds", "draw", "lse", "pull"]}
        chain = n.local("chain")
        # A row's statistics: one sublane of the key-side walk's (8, rows) blocks; on the row
        # walk the (rows, 128) blocks whole, widened to the key tile by copying whole vregs
        # (a (rows, 1) column would be broadcast across lanes on the XLU at every use).
        row = "[0:1, :]" if transposed else "[...]"
        widen = (lambda x: x) if transposed else (lambda x: lanes(x, self.tile[p.key]))
        fes = n.local("float_blocks")
        dfe = [n.local(f"d{r.operand}") for r in p.float_reads()]
        got = ", ".join(([] if p.stored_score else [nm["raw"]]) + [nm["s"]] + ([chain] if self.has_chain() else []))
        if dfe:
            got += f", {fes}"
        delta = n.local("delta")
        lines = [f"    {got} = _scores({masked})",
                 f"    {nm['lse']} = {extra['row_lse']}{row}",
                 f"    {delta} = {extra['delta']}{row}"]
        if self.ragged(p.query):
            # Row statistics past the end are garbage: zeros make the block's absent rows give
            # exp(-inf) = 0 and a finite correction (small vectors, not the whole block).
            ti = self.tile[p.query]
            shape, axis = (f"(1, {ti})", 1) if transposed else (f"({ti}, 1)", 0)
            inside = n.local("rows_inside")
            lines += [f"    if {masked}{self.may_pass_end(p.query)}:",
                      f"        {inside} = {tables.query}[{at}] * {ti} + lax.broadcasted_iota(jnp.int32, {shape}, {axis}) < {self.size_of(p.query)}",
                      f"        {nm['lse']} = jnp.where({inside}, {nm['lse']}, 0.0)",
                      f"        {delta} = jnp.where({inside}, {delta}, 0.0)"]
        lines.append(f"    {nm['lse']} = jnp.where(jnp.isneginf({nm['lse']}), 0.0, {nm['lse']})  # a row with nothing present")
        if self.base2():
            lines += [f"    {nm['lse']} = {nm['lse']} * {LOG2E!r}  # in base 2, as the scores",
                      f"    {nm['probs']} = jnp.exp2({nm['s']} - {widen(nm['lse'])})  # absent elements: exp2(-inf) = 0"]
        else:
            lines.append(f"    {nm['probs']} = jnp.exp({nm['s']} - {widen(nm['lse'])})  # absent elements: exp(-inf) = 0")
        terms, dos = [], {}
        for c in p.consumers:
            if c.kind == "softmax_product":
                vo = self.consumer_value(c)
                # The values are the left operand of dprobs on key x row blocks, do on row blocks.
                lines += self.load_block(n, vo, at, tables, masked, (p.key, p.query), lhs=transposed)
                ve = self.live(vo.read).index(self.e_of(c))
                do = dos[c.output] = n.local(f"d{c.output}")
                lines.append(f"    {do} = {extra['cotangent', c.output]}[...]")
                if self.ragged(p.query):
                    ti = self.tile[p.query]
                    inside = n.local("inside")
                    lines += [f"    if {masked}{self.may_pass_end(p.query)}:", f"        # Past the end of {p.query} memory holds anything: zero it.",
                              f"        {inside} = {tables.query}[{at}] * {ti} + lax.broadcasted_iota(jnp.int32, ({ti}, 1), 0) < {self.size_of(p.query)}"]
                    lines += zero_outside(inside, do, self.k.operand(c.output).dtype, not transposed)
                dov, vv, prec = self.mxu(do, vo.var, self.dtype_of(vo))
                if transposed:
                    term = f"lax.dot_general({vv}, {dov}, ((({ve},), (1,)), ((), ())), preferred_element_type={acc.jnp}{prec})"
                else:
                    term = f"lax.dot_general({dov}, {vv}, (((1,), ({ve},)), ((), ())), preferred_element_type={acc.jnp}{prec})"
                terms.append(term + (f" * {c.scale!r}" if c.scale is not None else ""))
        if terms:
            lines.append(f"    {nm['dprobs']} = " + " + ".join(terms))
            lines.append(f"    {nm['ds']} = {nm['probs']} * ({nm['dprobs']} - {widen(delta)})")
        else:
            lines.append(f"    {nm['ds']} = -{nm['probs']} * {widen(delta)}")
        if "dsum" in extra:
            lines.append(f"    {nm['ds']} = {nm['ds']} + jnp.where(jnp.isneginf({nm['s']}), 0.0, {widen(extra['dsum'] + row)})")
        if dfe:
            # The chain's gradient at an absent element is 0 (by the condition or by a score of
            # minus infinity), not its weight 0 times a NaN of the row's statistics.
            lines.append(f"    {nm['ds']} = jnp.where(jnp.isneginf({nm['s']}), 0.0, {nm['ds']})")
        if p.stored_score:  # the chain's operands are all there is to differentiate
            lines.append(f"    _, {nm['pull']} = jax.vjp({chain}, *{fes})")
            lines.append(f"    {', '.join(dfe)}{',' if len(dfe) == 1 else ''} = {nm['pull']}({nm['ds']})")
        elif self.has_chain():
            lines.append(f"    _, {nm['pull']} = jax.vjp({chain}, {nm['raw']}" + (f", *{fes})" if dfe else ")"))
            lines.append(f"    {', '.join([nm['draw']] + dfe)}{',' if not dfe else ''} = {nm['pull']}({nm['ds']})")
            # An absent element's raw gradient is 0, or not finite (0 x a NaN of the row's
            # statistics): not selected here, `present_add` (its only use) keeps it out.
        else:
            lines.append(f"    {nm['draw']} = {nm['ds']}")
        dos["floats"] = dict(zip(p.float_reads(), dfe))
        dos["keep"] = f"jnp.logical_not(jnp.isneginf({nm['s']}))"  # the present elements (`present_add`)
        return lines, nm["probs"], nm["draw"], dos

    def dq_call(self) -> CallSpec:
        """The row-side gradients: dq over the forward's walk, and the gradients of the float
        operands the chain reads per block (placed by the wrapper), per row, or per walk."""
        p, acc = self.p, self.acc
        n = self.n.scope()
        tables = self.row_tables()
        head, lead_vars, at, kind, flag = self.head(n, tables)
        ins, extra = self.backward_inputs(n, tables)
        dq_acc, dq_ref = n.local("dq_acc"), n.local("dq_ref")
        # Kernel-level names first: _step's locals (a scope of their own) avoid them.
        float_names = {r: (n.local(f"d{r.operand}_ref"), n.local(f"d{r.operand}_acc")) for r in p.float_reads()}
        sn = n.scope()
        step, probs, draw, dos = self.backward_step(sn, at, tables, extra, "masked")
        outs, scratch = [], []
        if not p.stored_score:
            ko = self.m.operands[1]
            kj = self.live(ko.read).index(p.key)
            step += self.load_block(sn, ko, at, tables, "masked", (p.key,))
            # The product's scale multiplies the (rows x d) result, not the (rows x keys) block.
            scale = f" * {p.scale!r}" if p.scale is not None else ""
            step += self.present_add(sn, dq_acc, draw, ko.var, self.dtype_of(ko), dos["keep"], f"((1,), ({kj},))", scale)
            outs = [self.out_arr(dq_ref, p.lead + (p.query, p.summed), self.grad_dtype(p.q), self.grad_var("dq_full"),
                                 "the row block's gradient of the score's row factor", vector=False)]
            scratch = [f"pltpu.VMEM(({self.tile[p.query]}, {self.tile[p.summed]}), {acc.jnp})"]
        row_accs, walk_accs, init, flush, finish, post = [], [], [], [], [], []
        ti, tj = self.tile[p.query], self.tile[p.key]
        lead_shape = [self.size_of(i) for i in p.lead]
        for r, d in dos["floats"].items():
            o = self.operand_of(r)
            ref, a = float_names[r]
            var = self.n.local(f"d{r.operand}_{''.join(r.indices)}")
            if o.layout == "natural":
                # One block per step, placed by the wrapper: each non-empty block once.
                step.append(f"    {ref}[...] = {d}")
                block = tuple([None] * len(p.lead) + [None, ti, tj])
                coords = tuple(self.w.lead_coords() + [self.w.step_coord(), Const(0), Const(0)])
                shape = tuple(lead_shape + [self.steps, str(ti), str(tj)])
                outs.append(OutArr(ref, block, coords, self.fn(f"_d{r.operand}_steps_map", key=("steps", r)), "", f"the gradient of {r.text}, one block per step",
                                   shape, shape, "jnp.float32", var))
                groups = f"_lead_groups({py_tuple(lead_shape)}, {py_tuple(str(i in p.class_axes) for i in p.lead)})"
                post.append(f"{var} = _scatter_blocks({var}, {self.tables[0]}, {self.tables[1]}, {self.w.kinds}, {groups}, "
                            f"({self.size_of(p.query)}, {self.size_of(p.key)}))")
                self.float_grads.append((r, var, p.lead + (p.query, p.key)))
            elif o.layout == "rows":
                row_accs.append(a)
                step.append(f"    {a}[...] += {d}")
                init.append(f"    {a}[...] = jnp.zeros_like({a})")
                flush.append(f"    {ref}[...] = jnp.broadcast_to({a}[...], {ref}.shape)")
                block = tuple([None] * len(p.lead) + [ti, LANES])
                coords = tuple(self.w.lead_coords() + [self.w.row(), Const(0)])
                shape = tuple(lead_shape + [self.size_of(p.query), str(LANES)])
                outs.append(OutArr(ref, block, coords, self.fn(f"_d{r.operand}_rows_map", key=("rows", r)), "", f"the gradient of {r.text}, per row",
                                   shape, shape, "jnp.float32", var))
                post.append(f"{var} = {var}[..., 0]")
                self.float_grads.append((r, var, p.lead + (p.query,)))
            elif o.layout == "scalar":
                walk_accs.append(a)
                step.append(f"    {a}[...] += {d}")
                finish.append(f"    {ref}[...] = jnp.broadcast_to({a}[...], {ref}.shape)")
                block = tuple([None] * len(p.lead) + [SUBLANES, LANES])
                coords = tuple(self.w.lead_coords() + [Const(0), Const(0)])
                shape = tuple(lead_shape + [str(SUBLANES), str(LANES)])
                outs.append(OutArr(ref, block, coords, self.fn(f"_d{r.operand}_scalar_map", key=("scalar", r)), "", f"the gradient of {r.text}, summed over the walk",
                                   shape, shape, "jnp.float32", var))
                post.append(f"{var} = {var}[..., 0, 0]")
                self.float_grads.append((r, var, p.lead))
        # Scratch in the order of the kernel's refs: the row sums, then the walk's.
        scratch += [f"pltpu.VMEM(({ti}, 1), {acc.jnp})" for _ in row_accs] + [f"pltpu.VMEM((1, 1), {acc.jnp})" for _ in walk_accs]
        lines = list(head)
        if walk_accs:
            lines += ["", f"@pl.when(pl.program_id({len(p.lead)}) == 0)", "def _start():", "    # Sums over the whole walk (a slope, a per-head bias) start once."]
            lines += [f"    {a}[...] = jnp.zeros_like({a})" for a in walk_accs]
        if not p.stored_score:
            init.insert(0, f"    {dq_acc}[...] = jnp.zeros_like({dq_acc})")
            flush.insert(0, f"    {dq_ref}[...] = {dq_acc}[...].astype({dq_ref}.dtype)")
        if init:
            lines += ["", f"@pl.when({flag} & 1 != 0)", "def _init():"] + init
        lines += self.scores(n, lead_vars, at, tables, with_raw=True, base2=self.base2())
        lines += ["", "def _step(masked):"] + step
        lines += self.phases(kind, "_step")
        if flush:
            lines += ["", f"@pl.when({flag} & 2 != 0)", "def _flush():"] + flush
        if walk_accs:
            # The last step the grid runs (a traced extent where the walk is classified under jit).
            lines += ["", f"@pl.when(pl.program_id({len(p.lead)}) == pl.num_programs({len(p.lead)}) - 1)", "def _finish():"] + finish
        refs = [a.ref for a in ins] + [o.ref for o in outs] + ([] if p.stored_score else [dq_acc]) + row_accs + walk_accs
        dims = self.block_elements()
        e_total = sum(self.tile[self.e_of(c)] for c in p.consumers if c.kind == "softmax_product")
        about = f"the gradient of {p.q.operand}" if not p.stored_score else "the gradients of the stored scores' operands"
        return CallSpec(self.n.function("_attention_dq_kernel"), lines, scratch, ins, outs, self.statics(lines), tables,
                        f"{2 * dims * (2 * self.score_depth() + e_total)}", f"{dims}", about, refs, post=post)

    def dkv_call(self, fused: bool = False) -> CallSpec:
        """The key-side gradients: a walk over key blocks (the transposed classification),
        visiting each key block's non-empty row blocks. `fused` (lower.backward_walk): dq in
        the same walk, from the same probabilities (`fused_dq`)."""
        p, acc = self.p, self.acc
        n = self.n.scope()
        tables = self.key_tables()
        head, lead_vars, at, kind, flag = self.head(n, tables)
        ins, extra = self.backward_inputs(n, tables, transposed=True)
        dk_acc, dk_ref = n.local("dk_acc"), n.local("dk_ref")
        dv = {c.output: (n.local(f"dv_{c.output}_acc"), n.local(f"dv_{c.output}_ref")) for c in p.consumers if c.kind == "softmax_product"}
        float_names = {r: (n.local(f"d{r.operand}_ref"), n.local(f"d{r.operand}_acc")) for r in p.float_reads()}
        sn = n.scope()  # _step's own locals avoid the kernel-level names above
        step, probs, draw, dos = self.backward_step(sn, at, tables, extra, "masked", transposed=True)
        if not p.stored_score:
            qo = self.m.operands[0]
            qi = self.live(qo.read).index(p.query)
            step += self.load_block(sn, qo, at, tables, "masked", (p.query,))
        for c in p.consumers:
            if c.kind == "softmax_product":
                scale = f" * {c.scale!r}" if c.scale is not None else ""
                do = dos[c.output]
                step += self.present_add(sn, dv[c.output][0], probs, do, self.k.operand(c.output).dtype, dos["keep"], "((1,), (0,))", scale)
        outs, scratch = [], []
        if not p.stored_score:
            scale = f" * {p.scale!r}" if p.scale is not None else ""
            step += self.present_add(sn, dk_acc, draw, qo.var, self.dtype_of(qo), dos["keep"], f"((1,), ({qi},))", scale)
            outs = [self.out_arr(dk_ref, p.lead + (p.key, p.summed), self.grad_dtype(p.k), self.grad_var("dk_full"),
                                 "the key block's gradient of the score's key factor", vector=False)]
            scratch = [f"pltpu.VMEM(({self.tile[p.key]}, {self.tile[p.summed]}), {acc.jnp})"]
        for c in p.consumers:
            if c.kind == "softmax_product":
                e = self.e_of(c)
                outs.append(self.out_arr(dv[c.output][1], p.lead + (p.key, e), self.grad_dtype(c.value), self.grad_var(f"dv_{c.output}_full"),
                                         f"the key block's gradient of {c.value.operand}", vector=False))
                scratch.append(f"pltpu.VMEM(({self.tile[p.key]}, {self.tile[e]}), {acc.jnp})")
        # Float operands the chain reads per key (a key-padding bias): summed per key block here.
        key_accs, key_flush, post = [], [], []
        lead_shape = [self.size_of(i) for i in p.lead]
        for r, d in dos["floats"].items():
            if self.operand_of(r).layout != "cols":
                continue
            ref, a = float_names[r]
            var = self.grad_var(f"d{r.operand}_{''.join(r.indices)}")
            key_accs.append(a)
            step.append(f"    {a}[...] += {d}")
            key_flush.append(f"    {ref}[...] = jnp.broadcast_to({a}[...], {ref}.shape)")
            shape = tuple(lead_shape + [self.size_of(p.key), str(LANES)])
            outs.append(OutArr(ref, tuple([None] * len(p.lead) + [self.tile[p.key], LANES]), tuple(self.w.lead_coords() + [self.w.row(), Const(0)]),
                               self.fn(f"_d{r.operand}_keys_map", key=("keys", r)), "", f"the gradient of {r.text}, per key", shape, shape, "jnp.float32", var))
            scratch.append(f"pltpu.VMEM(({self.tile[p.key]}, 1), {acc.jnp})")
            post.append(f"{var} = {var}[..., 0]")
            if (r, var, p.lead + (p.key,)) not in self.float_grads:  # the fused walk and the key walk return the same variable
                self.float_grads.append((r, var, p.lead + (p.key,)))
        accs = ([] if p.stored_score else [dk_acc]) + [a for a, _ in dv.values()] + key_accs
        start, finish, group_accs = [], [], []
        if fused:
            start, finish, group_accs = self.fused_dq(n, sn, step, at, tables, draw, dos["keep"], outs, scratch, post)
        lines = list(head) + start + ["", f"@pl.when({flag} & 1 != 0)", "def _init():"] + [f"    {a}[...] = jnp.zeros_like({a})" for a in accs]
        lines += ["", "# Blocks are key x row here: each row's statistics are row vectors, and both",
                  "# gradients are plain products with the row blocks."]
        lines += self.scores(n, lead_vars, at, tables, with_raw=True, transposed=True, base2=self.base2())
        lines += ["", "def _step(masked):"] + step + self.phases(kind, "_step")
        lines += ["", f"@pl.when({flag} & 2 != 0)", "def _flush():"] + ([] if p.stored_score else [f"    {dk_ref}[...] = {dk_acc}[...].astype({dk_ref}.dtype)"])
        lines += [f"    {r}[...] = {a}[...].astype({r}.dtype)" for a, r in dv.values()] + key_flush + finish
        refs = [a.ref for a in ins] + [o.ref for o in outs] + accs + group_accs
        e_total = sum(self.tile[self.e_of(c)] for c in p.consumers if c.kind == "softmax_product")
        about = f"the gradients of {p.k.operand} and the values" if not p.stored_score else "the gradients of the values and per-key operands"
        depth = 2 * self.score_depth()
        if fused:
            about, depth = f"the gradients of {p.k.operand}, the values and {p.q.operand} in one walk over key blocks", 3 * self.score_depth()
        return CallSpec(self.n.function("_attention_fused_backward_kernel" if fused else "_attention_dkv_kernel"), lines, scratch, ins, outs,
                        self.statics(lines), tables, f"{2 * self.block_elements() * (depth + 2 * e_total)}", f"{self.block_elements()}",
                        about, refs, suffix="_by_key", post=post)

    def fused_dq(self, n, sn, step, at, tables, draw, keep, outs, scratch, post) -> tuple[list[str], list[str], list[str]]:
        """dq in the key-side walk (lower.backward_walk says when): each step's row block
        of dq, draw^T k (draw is key x row here), is added into an f32 sum of the whole
        group's rows in VMEM at the step's row block, zeroed at the group's first step and
        written at its last as one output block that no other step maps to. (A dq block per
        row in HBM would be revisited out of turn: the walk meets a row block once per key
        block.) Appends to the step, outputs, scratch and post lines; returns the group's
        start and finish regions and the sum's scratch ref."""
        p, acc = self.p, self.acc
        ti, d = self.tile[p.query], self.tile[p.summed]
        ko = self.m.operands[1]
        kj = self.live(ko.read).index(p.key)
        step += self.load_block(sn, ko, at, tables, "masked", (p.key,), transposed=True)
        scale = f" * {p.scale!r}" if p.scale is not None else ""
        dq_acc, dq_ref, row = n.local("dq_acc"), n.local("dq_ref"), sn.local("row")
        step.append(f"    {row} = pl.multiple_of({tables.query}[{at}] * {ti}, {ti})")
        step += self.present_add(sn, f"{dq_acc}.at[pl.ds({row}, {ti}), :]", draw, ko.var, self.dtype_of(ko), keep, f"((0,), ({kj},))", scale)
        rows = self.padded_rows()
        lead_shape = [self.size_of(i) for i in p.lead]
        var = self.grad_var("dq_full")
        shape = tuple(lead_shape + [rows, self.size_of(p.summed)])
        outs.append(OutArr(dq_ref, tuple([None] * len(p.lead) + [rows, d]), tuple(self.w.lead_coords() + [Const(0), Const(0)]),
                           self.fn("_dq_group_map", key=("group", "dq")), "", f"the gradient of {p.q.operand}: the group's rows, written at its last step",
                           shape, shape, self.grad_dtype(p.q), var))
        scratch.append(f"pltpu.VMEM(({rows}, {d}), {acc.jnp})")
        post.append(f"{var} = {var}[..., :{self.size_of(p.query)}, :]  # the rows past the end dropped")
        axis = len(p.lead)
        start = ["", f"@pl.when(pl.program_id({axis}) == 0)", "def _start():", "    # The group's first step: no row of dq summed yet.",
                 f"    {dq_acc}[...] = jnp.zeros_like({dq_acc})"]
        finish = ["", f"@pl.when(pl.program_id({axis}) == pl.num_programs({axis}) - 1)", "def _finish():", "    # The group's last step: every row of dq is whole.",
                  f"    {dq_ref}[...] = {dq_acc}[...].astype({dq_ref}.dtype)"]
        return start, finish, [dq_acc]

    def present_add(self, n, ref: str, computed: str, block: str, dtype, keep: str, dims: str, scale: str = "") -> list[str]:
        """Lines adding a backward product, `computed` (a block the step computed: 0 at its
        absent elements, unless a NaN of the row's own statistics or of the other product's
        block met it there) by `block`, into `ref` (a ref or a view of one). An absent
        element must not carry a NaN or Inf of either block into the sum, on a partial step
        or where a score is minus infinity on a full one: `_present_add` adds the finite
        elements of the product as they are and takes the others again over the present
        elements alone. `dims`: the product's contracting dimensions; `scale`: text
        multiplying it (" * 0.125")."""
        cx, by, prec = self.mxu(computed, block, dtype)
        dot = "lax.dot_general({}, {}, " + f"({dims}, ((), ())), preferred_element_type={self.acc.jnp}{prec})"
        x = n.local("x")
        kept = f"jnp.where({keep}, {computed}, 0.0)"
        present = f"_present_dot(lambda {x}, y: {dot.format(x, 'y')}, {self.mxu(kept, block, dtype)[0]}, {kept}, {keep}, {by})"
        return [f"    _present_add({ref}, {dot.format(cx, by)}{scale}, lambda: {present}{scale})"]

    def padded_rows(self) -> str:
        """The query index's size rounded up to its tile (a host expression): dq's rows in VMEM."""
        ti = self.tile[self.p.query]
        size = self.k.index(self.p.query).size
        if size.literal is not None:
            return str(-(-size.literal // ti) * ti)
        return f"-(-{self.size_of(self.p.query)} // {ti}) * {ti}"

    def grad_var(self, preferred: str) -> str:
        """A gradient's variable in `_backward`: one name whichever walk computes it."""
        if preferred not in self.grad_vars:
            self.grad_vars[preferred] = self.n.local(preferred)
        return self.grad_vars[preferred]

    def needs_key_walk(self) -> bool:
        """The key-side backward walk: for the key factor, the values, per-key operands."""
        p = self.p
        return not p.stored_score or any(c.kind == "softmax_product" for c in p.consumers) or any(
            self.operand_of(r).layout == "cols" for r in p.float_reads())

    def row_tables(self) -> Direction:
        """The row-major walk's tables (the forward, stored outputs, dq)."""
        return self.w.rows

    def key_tables(self) -> Direction:
        """The key-side walk: its rows are key blocks, its columns row blocks."""
        return self.w.keys

    def block_elements(self) -> int:
        return self.tile[self.p.query] * self.tile[self.p.key]

    def grad_dtype(self, read: Read) -> str:
        """A gradient block's dtype (`lower.gradient_dtype`), as jnp names it."""
        return gradient_dtype(self.k, self.p, read).jnp
