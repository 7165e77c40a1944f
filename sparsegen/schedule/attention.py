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

from ..callconv import reads_through_tables
from ..ir import Einsum, Elementwise, Kernel, Read, Reduction, SoftmaxProduct, Term
from ..source import Diagnostic
from .build import ScheduleError
from .classify import EMPTY, FULL, PARTIAL

__all__ = ["EMPTY", "PARTIAL", "FULL", "RowPlan", "row_plan", "is_row_kernel"]


def read_key(r: Read) -> tuple:
    """A read as the block it loads (two reads of `x[i, j]` at different places are one)."""
    return (r.operand, r.subs)


def _dedupe(reads) -> list[Read]:
    out, seen = [], set()
    for r in reads:
        if read_key(r) not in seen:
            seen.add(read_key(r))
            out.append(r)
    return out


@dataclass(frozen=True)
class Consumer:
    """An output fed by the rows of scores."""

    kind: str  # "softmax_product" | "logsumexp" | "max" | "sum" | "softmax_out" | "scores_out"
    output: str
    value: Read | None = None  # the softmax product's other factor
    scale: float | int | None = None
    term: Term | None = None  # scores_out: the elementwise expression of the last score local
    point: int = 0  # which of the plan's points (the local or operand it reads) it consumes

    @property
    def stored(self) -> bool:
        """Written whole, block by block (a second walk over every block), not row by row."""
        return self.kind in ("softmax_out", "scores_out")


@dataclass(frozen=True)
class Point:
    """What consumers read: a local of the chain (or the product's score), or a stored
    operand read directly (`max(x[i, j], j)`), with the conditions of everything it
    derives from, and-ed (None: every element present)."""

    local: str | None
    read: Read | None
    condition: Term | None

    @property
    def name(self) -> str:
        return self.local if self.local is not None else self.read.operand


@dataclass(frozen=True)
class RowPlan:
    kernel: Kernel
    lead: tuple[str, ...]  # row indices walked one at a time (batch, heads): grid axes
    query: str  # the row index walked in blocks
    key: str  # the index each row reduces over
    summed: str | None  # the score product's summed index (None: a stored score)
    q: Read | None  # the score factor holding the query index (None: a stored score)
    k: Read | None  # the score factor holding the key index
    scale: float | int | None
    chain: tuple[tuple[str, Term], ...]  # elementwise locals (after the product's score), in order
    score: str  # the product's local, or the first point's name for a stored score
    points: tuple[Point, ...]
    consumers: tuple[Consumer, ...]
    inner: tuple[str, ...]  # indices a block spans whole (the summed one, a value's free one)

    @property
    def stored_score(self) -> bool:
        """The scores are read from stored operands (elementwise locals of inputs), not a product."""
        return self.q is None

    @property
    def condition(self) -> Term | None:
        """The condition of a single point (the walk's, for a plan with one)."""
        return self.points[0].condition if len(self.points) == 1 else None

    @property
    def conditions(self) -> tuple[Term, ...]:
        return tuple(pt.condition for pt in self.points if pt.condition is not None)

    def _valued_reads(self) -> list[Read]:
        """Operand reads whose values the scores are made of: the chain's and the points'."""
        return [r for _, term in self.chain for r in term.reads] + [pt.read for pt in self.points if pt.read is not None]

    @property
    def reads(self) -> tuple[Read, ...]:
        """Operand reads of the chain, the points and the conditions (besides q, k and the values)."""
        return tuple(_dedupe(self._valued_reads() + [r for cond in self.conditions for r in cond.reads]))

    def float_reads(self) -> tuple[Read, ...]:
        """Float operands the elementwise chain reads (biases, slopes, a stored score): they get gradients."""
        ops = self.kernel.operand
        return tuple(_dedupe(r for r in self._valued_reads() if ops(r.operand).dtype.is_float and ops(r.operand).sparsity != "mask"))

    def score_operands(self) -> list[str]:
        """The operands the scores are computed from (the product's factors, then the chain's
        float reads), whose gradients flow through every output the scores reach."""
        return ([] if self.stored_score else [self.q.operand, self.k.operand]) + [r.operand for r in self.float_reads()]

    @property
    def data_dependent(self) -> bool:
        """Does the classification read operands (segment ids, masks)?"""
        return any(cond.reads for cond in self.conditions)

    @property
    def class_axes(self) -> tuple[str, ...]:
        """The axes of the block-kind array: lead indices the conditions read, query, key."""
        used = set()
        for cond in self.conditions:
            for t in cond.walk():
                if t.op == "index":
                    used.add(t.name)
                if t.read is not None:
                    used |= set(t.read.indices)
        return tuple(i for i in self.lead if i in used) + (self.query, self.key)


def is_row_kernel(kernel: Kernel) -> bool:
    return not kernel.einsums_only


def _as_term(st: Einsum) -> Term:
    """A local assigned a product without a sum (`x[i, j] * 0.5`) as an elementwise term."""
    parts = [Term("read", read=r) for r in st.factors] + [Term("num", value=n.value) for n in st.numbers]
    out = parts[0]
    for t in parts[1:]:
        out = Term("*", (out, t))
    return out


def _and(conds: list[Term]) -> Term | None:
    if not conds:
        return None
    return conds[0] if len(conds) == 1 else Term("and", tuple(conds))


def row_plan(kernel: Kernel, packed_rows: bool = False) -> RowPlan:
    """Recognise the family; a ScheduleError at the statement it cannot walk.

    The scores are either a product (a local `s[..., i, j] = q[..., i, d] * k[..., j, d]`)
    or stored: elementwise locals of inputs read with the rows and the key index (a masked
    softmax of logits the caller has). Consumers reduce any local, or an input directly;
    each thing they read is a point of the walk, with its own condition."""
    sts = kernel.statements
    locals_ = {loc.name for loc in kernel.locals}

    def fail_at(span, message):
        raise ScheduleError(Diagnostic(span, message))

    def fail(st, message):
        fail_at(st.span, message)

    score_st = next((s for s in sts if isinstance(s, Einsum) and s.target.operand in locals_ and s.summed), None)
    if score_st is not None and (len(score_st.summed) != 1 or len(score_st.factors) != 2
                                 or not all(score_st.summed[0] in f.indices for f in score_st.factors)):
        fail(score_st, "not supported yet: the score is a product of two operands (and numbers) summed over one index")
    chain: list[tuple[str, Term]] = []
    parents: dict[str, tuple[str, ...]] = {}  # local -> the locals it reads
    own: dict[str, Term | None] = {}  # local -> its own condition
    indices: dict[str, tuple[str, ...]] = {}
    if score_st is not None:
        parents[score_st.target.operand], own[score_st.target.operand] = (), score_st.condition
        indices[score_st.target.operand] = score_st.target.indices
    consumers: list[Consumer] = []
    points: list[Point] = []
    point_sts = []

    def point_of(arg: Read, st) -> int:
        if arg.operand in locals_:
            pt = Point(arg.operand, None, None)
        else:
            pt = Point(None, arg, None)
            indices.setdefault(arg.operand, arg.indices)
        for n, x in enumerate(points):
            if x.local == pt.local and x.read == pt.read:
                return n
        points.append(pt)
        point_sts.append(st)
        return len(points) - 1

    if not locals_ and not any(isinstance(st, (Reduction, SoftmaxProduct)) for st in sts):
        fail(sts[0], "not supported yet: a kernel with conditions, expressions or reductions needs scores reduced along an "
                     "index: a local `s[..., i, j]` (a product `q[..., i, d] * k[..., j, d]` or elementwise of stored inputs), "
                     "or an input, under softmax, logsumexp, max or sum")
    for st in sts:
        if st is score_st:
            continue
        target = st.target.operand
        if target in locals_:
            if isinstance(st, Einsum) and not st.summed:
                term = _as_term(st)
            elif isinstance(st, Elementwise):
                term = st.value
            else:
                fail(st, "not supported yet: more than one score product (one product, then elementwise locals)")
            reads = tuple(dict.fromkeys(r.operand for r in term.locals))
            if any(r.indices != st.target.indices for r in term.locals):
                fail(st, "not supported yet: an elementwise local reads earlier locals with its own indices")
            chain.append((target, term))
            parents[target], own[target], indices[target] = reads, st.condition, st.target.indices
        elif isinstance(st, SoftmaxProduct):
            if st.condition is not None:
                fail(st, "not supported yet: a softmax product has no condition of its own (put it on the score or an elementwise local)")
            scale = None
            for n in st.numbers:
                scale = n.value if scale is None else scale * n.value
            consumers.append(Consumer("softmax_product", target, st.value, scale, point=point_of(st.scores, st)))
        elif isinstance(st, Reduction):
            if st.condition is not None:
                fail(st, "not supported yet: a reduction has no condition of its own (put it on the score or an elementwise local)")
            kind = "softmax_out" if st.fn == "softmax" else st.fn
            consumers.append(Consumer(kind, target, point=point_of(st.arg, st)))
        elif isinstance(st, Elementwise) and st.condition is None and len({r.operand for r in st.value.locals}) == 1:
            if any(t.op in ("index", "read") for t in st.value.walk()):
                fail(st, "not supported yet: a stored score's expression reads only the score local, numbers and sizes")
            consumers.append(Consumer("scores_out", target, term=st.value, point=point_of(st.value.locals[0], st)))
        else:
            fail(st, "not supported yet in an attention-like kernel: statements other than a score, elementwise locals, "
                     "softmax products, reductions (logsumexp, max, sum, softmax) and elementwise outputs of a score local")
    if not consumers:
        fail(sts[-1], "nothing reads the scores into an output")

    def ancestry(name: str) -> list[str]:
        """The locals a local derives from, itself included, in statement order."""
        seen, todo = set(), [name]
        while todo:
            x = todo.pop()
            if x not in seen:
                seen.add(x)
                todo += list(parents.get(x, ()))
        return [s.target.operand for s in sts if s.target.operand in seen]

    points = [Point(pt.local, pt.read, _and([own[x] for x in ancestry(pt.local) if own.get(x) is not None]) if pt.local else None)
              for pt in points]
    score = score_st.target.operand if score_st is not None else chain[0][0] if chain else points[0].name
    score_idx = indices[score]
    for st in sts:
        if st.target.operand in locals_ and indices[st.target.operand] != score_idx:
            fail(st, f"not supported yet: every local of an attention-like kernel has the indices of '{score}', in order")
    for pt, st in zip(points, point_sts):
        if indices[pt.name] != score_idx:
            fail(st, f"not supported yet: every score a reduction reads has the indices of '{score}', in order")
    key = _key_of(sts, consumers) or score_idx[-1]
    reducing = [st for st in sts if isinstance(st, (SoftmaxProduct, Reduction))]
    for st in reducing:
        if st.index != key:
            fail_at(st.index_span or st.span, f"not supported yet: every reduction of the scores runs over one index ('{key}')")
    if key not in score_idx or score_idx[-1] != key or len(score_idx) < 2:
        # Reported where the reduction names its index: that is what to change, more often than the score.
        at = next((st.index_span for st in reducing if st.index == key and st.index_span is not None), (score_st or point_sts[0]).span)
        fail_at(at, f"not supported yet: the scores are reduced over their last index ('{score_idx[-1]}'), not '{key}'"
                if key != score_idx[-1] else f"not supported yet: the score's last index is the one its rows reduce over ('{key}'), after the row index")
    rows = score_idx[:-1]
    query = rows[-1]
    lead = rows[:-1]
    q = k = summed = None
    inner = set()
    if score_st is not None:
        # Both factors hold the summed index (a key read through a table holds the lead
        # indices too, so one may cover the other: the product is still q . k).
        g0, g1 = score_st.factors
        q, k = (g1, g0) if key in g0.indices else (g0, g1)
        if query not in q.indices or key not in k.indices or key in q.indices or query in _plain_indices(k):
            fail(score_st, "not supported yet: the score multiplies a factor with the row index by one with the key index")
        summed = score_st.summed[0]
        inner.add(summed)
        if score_st.condition is not None and any(t.op == "index" and t.name == summed or t.read is not None and summed in t.read.indices
                                                  for t in score_st.condition.walk()):
            fail(score_st, f"not supported yet: a condition on the score's summed index '{summed}' (the walk classifies row and key blocks)")
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
                if sub.divisor != 1 and sub.index not in lead and not (sub.index == query and r in (k,) + tuple(c.value for c in consumers)):
                    raise ScheduleError(Diagnostic(r.span, f"not supported yet: '{r.operand}' read through {sub.text}; "
                                                           "in an attention-like kernel only a batch or head index may be divided"))
    for i in lead:
        if kernel.index(i).tile != 1 and not packed_rows:  # the paged walk packs them into its rows
            raise ScheduleError(Diagnostic(kernel.index(i).tile_span, f"an attention kernel walks '{i}' one at a time: tile {i} = 1"))
    for i in inner:
        idx = kernel.index(i)
        if idx.size.literal is not None and idx.size.literal != idx.tile:
            fail_at(idx.tile_span, f"tile {i} = {idx.tile} must span its size {idx.size.literal}: a score block sums (or a value block holds) all of '{i}'")
    return RowPlan(kernel, tuple(lead), query, key, summed, q, k, score_st.scale if score_st is not None else None, tuple(chain), score,
                   tuple(points), tuple(consumers), tuple(sorted(inner)))


def _plain_indices(r: Read) -> set[str]:
    """The indices a read subscripts with directly, not through `// n` (a key-side read of
    grouped-query heads holds the row index that way)."""
    return {s.index for s in r.subs if s.index and s.divisor == 1 and s.table is None}


def whole_sizes(kernel: Kernel) -> dict[str, int]:
    """Size symbols a row kernel's blocks span whole (the score's summed index, a value's
    free index): each must equal its tile. Empty for other kernels."""
    if not is_row_kernel(kernel):
        return {}
    try:
        plan = row_plan(kernel, packed_rows=reads_through_tables(kernel))  # a paged walk packs heads into its rows
    except ScheduleError:
        return {}
    return {kernel.index(i).size.symbol: kernel.index(i).tile for i in plan.inner if kernel.index(i).size.literal is None}


def _key_of(sts, consumers) -> str | None:
    for st in sts:
        if isinstance(st, (SoftmaxProduct, Reduction)) and st.target.operand in {c.output for c in consumers}:
            return st.index
    return None
