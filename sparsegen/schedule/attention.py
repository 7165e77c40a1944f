"""The row walk: attention-like kernels (language v1, sections 3-5), backend-neutral.

A kernel of this family computes a *score* block per (row block, key block) — a product
of two operands summed over one index, then elementwise steps — under a `where`
condition, and consumes each row of scores without storing it: a softmax product (flash
attention: running max, running sum, rescaled accumulator), logsumexp, max or sum.

Which blocks are visited is decided by classifying every (row block, key block) of the
condition as empty, partial or full (`classify_lines`), exactly for affine comparisons
(and their `and`), sorted integer ids and mask operands, conservatively (partial) for
the rest. The walk then visits, per row, only the non-empty key blocks: one flat grid
axis over (row block, key block) pairs, so the grid has exactly the non-empty blocks
when the classification depends on sizes only (computed with numpy at trace time), and
the dense count with the empty steps trailing (no compute, no copy) when it depends on
traced data.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Einsum, Elementwise, Kernel, Read, Reduction, SoftmaxProduct, Term
from ..source import Diagnostic
from .build import ScheduleError

# Step kinds of the walk (the same numbering as the einsum walks' block kinds).
EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class Consumer:
    """An output fed by the rows of scores."""

    kind: str  # "softmax_product" | "logsumexp" | "max" | "sum" | "softmax_out" | "scores_out"
    output: str
    value: Read | None = None  # the softmax product's other factor
    scale: float | int | None = None
    term: Term | None = None  # scores_out: the elementwise expression of the last score local

    @property
    def stored(self) -> bool:
        """Written whole, block by block (a second walk over every block), not row by row."""
        return self.kind in ("softmax_out", "scores_out")


@dataclass(frozen=True)
class RowPlan:
    kernel: Kernel
    lead: tuple[str, ...]  # row indices walked one at a time (batch, heads): grid axes
    query: str  # the row index walked in blocks
    key: str  # the index each row reduces over
    summed: str  # the score product's summed index
    q: Read  # the score factor holding the query index
    k: Read  # the score factor holding the key index
    scale: float | int | None
    chain: tuple[tuple[str, Term], ...]  # elementwise locals after the score, in order
    score: str  # the local the score product assigns
    condition: Term | None  # every statement's condition, and-ed
    consumers: tuple[Consumer, ...]
    inner: tuple[str, ...]  # indices a block spans whole (the summed one, a value's free one)

    @property
    def reads(self) -> tuple[Read, ...]:
        """Operand reads of the chain and the condition (besides q, k and the values)."""
        out: list[Read] = []
        for _, term in self.chain:
            out += [r for r in term.reads if r not in out]
        if self.condition is not None:
            out += [r for r in self.condition.reads if r not in out]
        return tuple(out)

    def float_reads(self) -> tuple[Read, ...]:
        """Float operands the elementwise chain reads (biases, slopes): they get gradients."""
        out: list[Read] = []
        for _, term in self.chain:
            out += [r for r in term.reads if r not in out and self.kernel.operand(r.operand).dtype.is_float
                    and self.kernel.operand(r.operand).sparsity != "mask"]
        return tuple(out)

    @property
    def data_dependent(self) -> bool:
        """Does the classification read operands (segment ids, masks)?"""
        return self.condition is not None and bool(self.condition.reads)

    @property
    def class_axes(self) -> tuple[str, ...]:
        """The axes of the block-kind array: lead indices the condition reads, query, key."""
        used = set()
        if self.condition is not None:
            for t in self.condition.walk():
                if t.op == "index":
                    used.add(t.name)
                if t.read is not None:
                    used |= set(t.read.indices)
        return tuple(i for i in self.lead if i in used) + (self.query, self.key)


def is_row_kernel(kernel: Kernel) -> bool:
    return not kernel.einsums_only


def row_plan(kernel: Kernel) -> RowPlan:
    """Recognise the family; a ScheduleError at the statement it cannot walk."""
    sts = kernel.statements
    locals_ = {loc.name for loc in kernel.locals}

    def fail(st, message):
        raise ScheduleError(Diagnostic(st.span, message))

    score_st = next((s for s in sts if isinstance(s, Einsum) and s.target.operand in locals_), None)
    if score_st is None:
        fail(sts[0], "not supported yet: a kernel with conditions, expressions or reductions needs a local score `s[..., i, j] = q[..., i, d] * k[..., j, d]`")
    if len(score_st.summed) != 1 or len(score_st.factors) != 2 or len(score_st.summed_groups) != 2:
        fail(score_st, "not supported yet: the score is a product of two operands (and numbers) summed over one index")
    conditions = [score_st.condition] if score_st.condition is not None else []
    chain: list[tuple[str, Term]] = []
    current = score_st.target.operand
    consumers: list[Consumer] = []
    for st in sts:
        if st is score_st:
            continue
        if isinstance(st, Elementwise) and st.target.operand in locals_:
            if [r.operand for r in st.value.locals] != [current] or st.target.indices != score_st.target.indices:
                fail(st, "not supported yet: an elementwise local reads the previous score local once, with the same indices")
            chain.append((st.target.operand, st.value))
            current = st.target.operand
            if st.condition is not None:
                conditions.append(st.condition)
        elif isinstance(st, SoftmaxProduct) and st.target.operand not in locals_:
            if st.scores.operand != current or st.condition is not None:
                fail(st, f"not supported yet: the softmax reads the last score local ('{current}') with no condition of its own")
            scale = None
            for n in st.numbers:
                scale = n.value if scale is None else scale * n.value
            consumers.append(Consumer("softmax_product", st.target.operand, st.value, scale))
        elif isinstance(st, Reduction) and st.target.operand not in locals_:
            if st.arg.operand != current or st.condition is not None:
                fail(st, f"not supported yet: a reduction reads the last score local ('{current}') with no condition of its own")
            kind = "softmax_out" if st.fn == "softmax" else st.fn
            consumers.append(Consumer(kind, st.target.operand))
        elif isinstance(st, Elementwise) and st.target.operand not in locals_ and st.condition is None \
                and [r.operand for r in st.value.locals] == [current]:
            if any(t.op in ("index", "read") for t in st.value.walk()):
                fail(st, "not supported yet: a stored score's expression reads only the score local, numbers and sizes")
            consumers.append(Consumer("scores_out", st.target.operand, term=st.value))
        else:
            fail(st, "not supported yet in an attention-like kernel: statements other than a score, elementwise locals, "
                     "softmax products, reductions (logsumexp, max, sum, softmax) and elementwise outputs of the last score local")
    if not consumers:
        fail(sts[-1], "nothing reads the scores into an output")
    score_idx = score_st.target.indices
    key = _key_of(sts, consumers) or score_idx[-1]
    reducing = [st for st in sts if isinstance(st, (SoftmaxProduct, Reduction))]
    for st in reducing:
        if st.index != key:
            raise ScheduleError(Diagnostic(st.index_span or st.span, f"not supported yet: every reduction of the scores runs over one index ('{key}')"))
    if key not in score_idx or score_idx[-1] != key:
        # Reported where the reduction names its index: that is what to change, more often than the score.
        at = next((st.index_span for st in reducing if st.index == key and st.index_span is not None), score_st.span)
        raise ScheduleError(Diagnostic(at, f"not supported yet: the scores are reduced over their last index ('{score_idx[-1]}'), not '{key}'"))
    rows = score_idx[:-1]
    query = rows[-1]
    lead = rows[:-1]
    g0, g1 = (score_st.factors[g.main] for g in score_st.summed_groups)
    q, k = (g0, g1) if query in g0.indices else (g1, g0)
    if query not in q.indices or key not in k.indices or key in q.indices or query in k.indices:
        fail(score_st, "not supported yet: the score multiplies a factor with the row index by one with the key index")
    inner = {score_st.summed[0]}
    for c in consumers:
        target = kernel.statement_of(c.output).target.indices
        if c.kind == "softmax_product":
            extra = [i for i in target if i not in rows]
            if list(target[: len(rows)]) != list(rows) or len(extra) != 1:
                fail(kernel.statement_of(c.output), "not supported yet: a softmax product's output is the score's rows and one more index, in that order")
            inner.add(extra[0])
        elif c.stored:
            if tuple(target) != score_idx:
                fail(kernel.statement_of(c.output), "not supported yet: a stored softmax or score has the score's indices, in their order")
        elif tuple(target) != rows:
            fail(kernel.statement_of(c.output), "not supported yet: a reduction's output keeps the score's other indices in their order")
    for st in sts:
        for r in (st.reads if not isinstance(st, Einsum) else st.factors):
            for sub in r.subs:
                if sub.divisor != 1 and sub.index not in lead:
                    raise ScheduleError(Diagnostic(r.span, f"not supported yet: '{r.operand}' read through {sub.text}; "
                                                           "in an attention-like kernel only a batch or head index may be divided"))
    for i in lead:
        if kernel.index(i).tile != 1:
            raise ScheduleError(Diagnostic(kernel.index(i).tile_span, f"an attention kernel walks '{i}' one at a time: tile {i} = 1"))
    for i in inner:
        idx = kernel.index(i)
        if idx.size.literal is not None and idx.size.literal != idx.tile:
            raise ScheduleError(Diagnostic(idx.tile_span, f"tile {i} = {idx.tile} must span its size {idx.size.literal}: a score block sums (or a value block holds) all of '{i}'"))
    condition = None
    if conditions:
        condition = conditions[0] if len(conditions) == 1 else Term("and", tuple(conditions))
    return RowPlan(kernel, tuple(lead), query, key, score_st.summed[0], q, k, score_st.scale, tuple(chain), score_st.target.operand,
                   condition, tuple(consumers), tuple(sorted(inner)))


def whole_sizes(kernel: Kernel) -> dict[str, int]:
    """Size symbols a row kernel's blocks span whole (the score's summed index, a value's
    free index): each must equal its tile. Empty for other kernels."""
    if not is_row_kernel(kernel):
        return {}
    try:
        plan = row_plan(kernel)
    except ScheduleError:
        return {}
    return {kernel.index(i).size.symbol: kernel.index(i).tile for i in plan.inner if kernel.index(i).size.literal is None}


def _key_of(sts, consumers) -> str | None:
    for st in sts:
        if isinstance(st, (SoftmaxProduct, Reduction)) and st.target.operand in {c.output for c in consumers}:
            return st.index
    return None


# ------------------------------------------------------------- classification
# A condition is classified per block as two truth arrays over the class axes: `can`
# (some element may be present) and `must` (every element is). Integer terms become
# ranges [lo, hi] over a block; a comparison of two terms is one of their difference, an
# affine form over independent atoms (index values; other terms are atoms with their own
# ranges), so a single comparison is exact; an `and` of comparisons of the same affine form
# is intersected first (a window: i >= j and i - j < 1024), so it is exact too.


class Classifier:
    """Host code (over `xp`: numpy at trace time, or jax.numpy for traced operands) that
    computes the block kinds of a row plan's condition."""

    def __init__(self, plan: RowPlan, conv, local, tile_of, size_of):
        self.p = plan
        self.conv = conv
        self.local = local  # a fresh local name
        self.tile_of = tile_of
        self.size_of = size_of  # index -> host expression of its size
        self.lines: list[str] = []
        self.axes = plan.class_axes
        self.ranges: dict[str, tuple[str, str]] = {}
        self.read_ranges: dict[Read, tuple[str, str]] = {}

    def shape_for(self, indices) -> str:
        """A reshape target putting `indices` on their class axes (1 elsewhere)."""
        return "(" + ", ".join("-1" if a in indices else "1" for a in self.axes) + ("," if len(self.axes) == 1 else "") + ")"

    def index_range(self, i: str) -> tuple[str, str]:
        if i not in self.ranges:
            t = self.tile_of(i)
            blocks = self.local(f"{i}_block")
            lo, hi = self.local(f"{i}_lo"), self.local(f"{i}_hi")
            size = self.size_of(i)
            self.lines.append(f"{blocks} = xp.arange(-(-{size} // {t})).reshape({self.shape_for([i])})")
            self.lines.append(f"{lo} = {blocks} * {t}")
            self.lines.append(f"{hi} = xp.minimum({lo} + {t}, {size}) - 1")
            self.ranges[i] = (lo, hi)
        return self.ranges[i]

    def read_range(self, r: Read) -> tuple[str, str]:
        """Per block, the least and greatest value an integer operand holds there."""
        if r not in self.read_ranges:
            self.read_ranges[r] = self.block_pair(r, "_block_min_max", "{}", ("min", "max"))
        return self.read_ranges[r]

    def block_pair(self, r: Read, helper: str, of: str, what: tuple[str, str]) -> tuple[str, str]:
        """Two per-block statistics of an operand (`helper` over `of` its array, and its
        tiles), laid out over the class axes."""
        a, b = (self.local(f"{r.operand}_{w}") for w in what)
        param = self.conv.param(r.operand).internal
        tiles = "(" + ", ".join(str(self.tile_of(i)) for i in r.indices) + ",)"
        order = "".join(chr(97 + n) for n in range(len(r.indices)))
        dst = "".join(order[r.indices.index(x)] if x in r.indices else "z" for x in self.axes)
        self.lines.append(f"{a}, {b} = {helper}({of.format(param)}, {tiles})")
        self.lines.append(f'{a}, {b} = _expand({a}, "{order}", "{dst}"), _expand({b}, "{order}", "{dst}")')
        return a, b

    # Integer terms as ranges; None: unknown.
    def affine(self, t: Term) -> dict | None:
        """t as {atom: coefficient} with the constant under key 1; atoms are index names or
        Terms; None when t is not a sum of atoms times integer constants."""
        if t.op == "num":
            return {1: t.value}
        if t.op == "size":
            return {1: self.conv.size_var(t.name)}
        if t.op == "index":
            return {t.name: 1}
        if t.op in ("+", "-"):
            a, b = self.affine(t.args[0]), self.affine(t.args[1])
            if a is None or b is None:
                return None
            sign = 1 if t.op == "+" else -1
            out = dict(a)
            for key, c in b.items():
                out[key] = _add(out.get(key, 0), _mul(sign, c))
            return out
        if t.op == "neg":
            a = self.affine(t.args[0])
            return None if a is None else {k: _mul(-1, c) for k, c in a.items()}
        if t.op == "*":
            a, b = self.affine(t.args[0]), self.affine(t.args[1])
            if a is None or b is None:
                return {t: 1}
            for x, y in ((a, b), (b, a)):
                if set(x) == {1} and isinstance(x[1], int):
                    return {k: _mul(x[1], c) for k, c in y.items()}
            return {t: 1}
        return {t: 1}  # // % reads: atoms with their own ranges

    def atom_range(self, atom) -> tuple[str, str] | None:
        if isinstance(atom, str):
            return self.index_range(atom)
        t: Term = atom
        if t.op == "read":
            return self.read_range(t.read)
        if t.op in ("//", "%") and t.args[1].op == "num" and t.args[1].value > 0:
            inner = self.range(t.args[0])
            if inner is None:
                return None
            lo, hi = inner
            c = t.args[1].value
            if t.op == "//":
                return f"({lo}) // {c}", f"({hi}) // {c}"
            same = f"(({lo}) // {c} == ({hi}) // {c})"
            return f"xp.where({same}, ({lo}) % {c}, 0)", f"xp.where({same}, ({hi}) % {c}, {c - 1})"
        if t.op == "*":
            a, b = self.range(t.args[0]), self.range(t.args[1])
            if a is None or b is None:
                return None
            corners = [f"({x}) * ({y})" for x in a for y in b]
            return f"_min_of(xp, {', '.join(corners)})", f"_max_of(xp, {', '.join(corners)})"
        return None

    def range(self, t: Term) -> tuple[str, str] | None:
        form = self.affine(t)
        if form is None:
            return None
        return self.form_range(form)

    def form_range(self, form: dict) -> tuple[str, str] | None:
        const = form.get(1, 0)
        lo, hi = ([str(const)], [str(const)]) if const != 0 else ([], [])
        for atom, c in form.items():
            if atom == 1 or c == 0:
                continue
            r = self.atom_range(atom)
            if r is None or not isinstance(c, int):
                return None
            a, b = r if c > 0 else r[::-1]
            lo.append(_term(c, a))
            hi.append(_term(c, b))
        return _sum(lo), _sum(hi)

    # Truth values: (can, must) code.
    def truth(self, t: Term) -> tuple[str, str]:
        if t.op == "truth":
            return self.block_pair(t.read, "_block_any_all", "{} != 0", ("any", "all"))
        if t.op == "not":
            can, must = self.truth(t.args[0])
            return f"~({must})", f"~({can})"
        if t.op == "or":
            parts = [self.truth(a) for a in t.args]
            return " | ".join(f"({c})" for c, _ in parts), " | ".join(f"({m})" for _, m in parts)
        if t.op == "and":
            return self.conjunction(list(t.args))
        if t.op == "cmp":  # a chain a < b < c is split by conjunction
            return self.conjunction([t])
        raise AssertionError(t.op)

    def conjunction(self, terms: list[Term]) -> tuple[str, str]:
        """and: comparisons of one affine form intersect their bounds (exact); the rest and-ed."""
        flat: list[Term] = []
        for t in terms:
            if t.op == "and":
                flat += list(t.args)
            elif t.op == "cmp" and len(t.ops) > 1:
                flat += [Term("cmp", (t.args[n], t.args[n + 1]), ops=(op,)) for n, op in enumerate(t.ops)]
            else:
                flat.append(t)
        groups: dict[tuple, list[tuple[str, object]]] = {}
        rest: list[Term] = []
        for t in flat:
            bound = self.bound(t) if t.op == "cmp" else None
            if bound is None:
                rest.append(t)
                continue
            key, lo, hi = bound
            groups.setdefault(key, []).append((lo, hi))
        cans, musts = [], []
        for key, bounds in groups.items():
            form = dict(key)
            r = self.form_range(form)
            if r is None:
                cans.append("True")
                musts.append("False")
                continue
            lo, hi = (f"({x})" for x in r)
            los = [b for b, _ in bounds if b is not None]
            his = [b for _, b in bounds if b is not None]
            low = f"_max_of(xp, {', '.join(map(str, los))})" if len(los) > 1 else (str(los[0]) if los else None)
            high = f"_min_of(xp, {', '.join(map(str, his))})" if len(his) > 1 else (str(his[0]) if his else None)
            # Some value of the form in [low, high] lies in [lo, hi]; every value does.
            can = [f"({hi} >= {low})" if low else None, f"({lo} <= {high})" if high else None]
            must = [f"({lo} >= {low})" if low else None, f"({hi} <= {high})" if high else None]
            if low and high:
                can.append(f"({low} <= {high})")
            cans.append(" & ".join(c for c in can if c) or "True")
            musts.append(" & ".join(m for m in must if m) or "True")
        for t in rest:
            c, m = self.truth(t) if t.op != "cmp" else self.compare(t)
            cans.append(f"({c})")
            musts.append(f"({m})")
        return " & ".join(cans), " & ".join(musts)

    def bound(self, t: Term):
        """A comparison as `low <= form <= high` over an affine form without constant."""
        a, b = self.affine(t.args[0]), self.affine(t.args[1])
        if a is None or b is None:
            return None
        form = dict(a)
        for k, c in b.items():
            form[k] = _add(form.get(k, 0), _mul(-1, c))
        const = form.pop(1, 0)
        form = {k: c for k, c in form.items() if c != 0}
        if not form or not all(isinstance(c, int) for c in form.values()):
            return None
        key = tuple(sorted(form.items(), key=lambda kv: repr(kv[0])))
        neg = f"-({const})" if const != 0 else "0"
        op = t.ops[0]
        # form + const op 0
        if op == ">=":
            return key, neg, None
        if op == ">":
            return key, f"{neg} + 1", None
        if op == "<=":
            return key, None, neg
        if op == "<":
            return key, None, f"{neg} - 1"
        if op == "==":
            return key, neg, neg
        return None  # != is no interval

    def compare(self, t: Term) -> tuple[str, str]:
        r = self.range(Term("-", (t.args[0], t.args[1])))
        if r is None:
            return "True", "False"
        lo, hi = (f"({x})" for x in r)
        op = t.ops[0]
        return {
            ">=": (f"{hi} >= 0", f"{lo} >= 0"),
            ">": (f"{hi} > 0", f"{lo} > 0"),
            "<=": (f"{lo} <= 0", f"{hi} <= 0"),
            "<": (f"{lo} < 0", f"{hi} < 0"),
            "==": (f"({lo} <= 0) & ({hi} >= 0)", f"({lo} == 0) & ({hi} == 0)"),
            "!=": (f"~(({lo} == 0) & ({hi} == 0))", f"({lo} > 0) | ({hi} < 0)"),
        }[op]

    def kinds(self, ragged: list[str]) -> list[str]:
        """Lines computing `kinds` (EMPTY/PARTIAL/FULL per block over the class axes)."""
        for i in self.axes:
            self.index_range(i)
        if self.p.condition is None:
            can, must = "True", "True"
        else:
            can, must = self.truth(self.p.condition)
        shape = "(" + ", ".join(f"{self.ranges[a][0]}.size" for a in self.axes) + ",)"
        tails = [f"({self.ranges[i][0]} + {self.tile_of(i)} > {self.size_of(i)})" for i in ragged]
        if tails:
            must = f"({must}) & ~({' | '.join(tails)})"
        return self.lines + [
            f"can = xp.broadcast_to({can}, {shape})",
            f"must = xp.broadcast_to({must}, {shape})",
            f"return xp.where(can, xp.where(must, {FULL}, {PARTIAL}), {EMPTY}).astype(xp.int32)",
        ]


def _term(c: int, x: str) -> str:
    if c == 1:
        return x
    if c == -1:
        return f"-{x}" if x.isidentifier() else f"-({x})"
    return f"{c} * ({x})"


def _sum(parts: list[str]) -> str:
    if not parts:
        return "0"
    out = parts[0]
    for x in parts[1:]:
        out += f" - {x[1:]}" if x.startswith("-") else f" + {x}"
    return out


def _add(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    return f"({a}) + ({b})"


def _mul(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    return f"({a}) * ({b})"
