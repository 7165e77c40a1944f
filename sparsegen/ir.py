"""The IR: what the checker proves about a spec, and what every later stage reads.

A kernel holds operands, indices (one size and one tile each, kernel-wide) and
statements in dependency order. Everything is validated: names are identifiers, sizes
bind consistently, literal tiles divide literal sizes. No strategy lives here: how a
statement is walked is the schedule's business, how it runs on a chip the target's.
Spans are kept so that later stages can still point back at the spec.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from .dtypes import DType
from .source import Span


@dataclass(frozen=True)
class Size:
    """A dimension size: a literal, or a symbol bound at call time (or fixed by a literal).

    Language v2, section 2: an index read as `j // T` on a dimension of size NP and `j % T`
    ranges over the product `NP * T`: `product` holds its factors (symbols or literals),
    `symbol` is then None and `literal` the product where every factor is known."""

    symbol: str | None
    literal: int | None
    product: tuple[str | int, ...] = ()

    @property
    def text(self) -> str:
        if self.product:
            return " * ".join(str(f) for f in self.product)
        return self.symbol if self.symbol is not None else str(self.literal)

    def describe(self) -> str:
        if (self.symbol is not None or self.product) and self.literal is not None:
            return f"{self.text} = {self.literal}"
        return self.text


@dataclass(frozen=True)
class OffsetRef:
    """`start[0]`: a scalar of an `index` operand, added to an index (block-aligned)."""

    operand: str
    position: int


@dataclass(frozen=True)
class Sub:
    """One subscript of an access: an index, maybe shifted by an offset or divided (`h // 4`).

    Language v2, section 2 adds forms that only the front end handles so far (`lowered`
    is False for them, and `backends.lower_kernel` refuses a kernel using one):
    a size as divisor (`j // T`: `divisor` is the symbol), a modulus (`j % T`, `j % 8`),
    a read through a table (`pages[b, j // T]`: `table` is that read of an `index`
    operand and `index` is ""), and inside a table only an integer literal
    (`pages[b, 0]`: `literal`, `index` ""). `indices` lists the indices a subscript uses.
    """

    index: str
    offset: OffsetRef | None = None
    divisor: int | str = 1
    shift: int = 0  # `g + 1` (a condition's read only)
    modulus: int | str | None = None  # `j % T` (language v2, section 2)
    table: "Read | None" = None  # `pages[b, j // T]` (language v2, section 2)
    literal: int | None = None  # `0` in `pages[b, 0]` (inside a table only)
    span: Span | None = field(default=None, compare=False, repr=False)  # where it is written (v2 forms)

    @property
    def lowered(self) -> bool:
        """Is it a form the schedules and targets handle (language v1 and `g + 1`)?"""
        return self.table is None and self.literal is None and self.modulus is None and isinstance(self.divisor, int)

    @property
    def indices(self) -> tuple[str, ...]:
        if self.table is not None:
            return self.table.indices
        if self.literal is not None:
            return ()
        return (self.index,)

    @property
    def text(self) -> str:
        if self.table is not None:
            return self.table.text
        if self.literal is not None:
            return str(self.literal)
        if self.modulus is not None:
            return f"{self.index} % {self.modulus}"
        if self.offset is not None:
            return f"{self.offset.operand}[{self.offset.position}] + {self.index}"
        if self.shift:
            return f"{self.index} {'+' if self.shift > 0 else '-'} {abs(self.shift)}"
        return f"{self.index} // {self.divisor}" if self.divisor != 1 else self.index


@dataclass(frozen=True)
class Operand:
    name: str
    direction: str  # "in" | "out"
    dtype: DType
    dims: tuple[Size, ...]
    sparsity: str  # "dense" | "coo" | "mask" | "index"
    span: Span
    dtype_span: Span

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def decl(self) -> str:
        sparsity = "" if self.sparsity in ("dense", "index") else f" {self.sparsity}"
        return f"{self.name}: {self.dtype.name}[{', '.join(d.text for d in self.dims)}]{sparsity}"


@dataclass(frozen=True)
class Read:
    """An access of an operand in a statement (its target, or one factor)."""

    operand: str
    subs: tuple[Sub, ...]
    span: Span

    @property
    def indices(self) -> tuple[str, ...]:
        """The indices it uses, each once, in order (one per subscript in language v1, where
        an access uses an index once; v2's `kc[h // 8, pages[b, j // T], j % T, d]` uses
        h, b, j, d)."""
        return tuple(dict.fromkeys(i for s in self.subs for i in s.indices))

    @property
    def lowered(self) -> bool:
        """Does every subscript have a form the schedules and targets handle?"""
        return all(s.lowered for s in self.subs)

    @property
    def text(self) -> str:
        return f"{self.operand}[{', '.join(s.text for s in self.subs)}]"


@dataclass(frozen=True)
class Group:
    """Factors multiplied elementwise before the sum: `main` and the factors it covers."""

    main: int  # position of the factor in Einsum.factors
    extras: tuple[int, ...]

    @property
    def members(self) -> tuple[int, ...]:
        return (self.main, *self.extras)


def summed_indices(target: Read, factors) -> tuple[str, ...]:
    """The indices a statement sums over: those of its factors the left side lacks, in order
    of first appearance."""
    out = set(target.indices)
    summed: list[str] = []
    for r in factors:
        for i in r.indices:
            if i not in out and i not in summed:
                summed.append(i)
    return tuple(summed)


def group_factors(reads, summed: set[str], masks: set[str] = frozenset()) -> tuple[tuple[Group, ...], tuple[Group, ...]]:
    """(summed groups, end groups): a factor with a summed index whose indices another such
    factor has is multiplied into it before the sum. The widest factor covers; among equals
    a data factor before a mask, then the first written. The language allows two groups."""
    with_sum = [n for n, r in enumerate(reads) if summed & set(r.indices)]
    order = sorted(with_sum, key=lambda n: (-len(reads[n].indices), reads[n].operand in masks, n))
    mains: list[int] = []
    extras: dict[int, list[int]] = {}
    for n in order:
        cover = next((m for m in mains if set(reads[n].indices) <= set(reads[m].indices)), None)
        if cover is None:
            mains.append(n)
            extras[n] = []
        else:
            extras[cover].append(n)
    summed_groups = tuple(Group(m, tuple(sorted(extras[m]))) for m in sorted(mains))
    end_groups = tuple(Group(n, ()) for n in range(len(reads)) if n not in with_sum)
    return summed_groups, end_groups


@dataclass(frozen=True)
class Number:
    """A numeric literal factor, as validated text (re-printed, never copied from the file)."""

    value: int | float

    @property
    def text(self) -> str:
        return repr(self.value)


@dataclass(frozen=True)
class Einsum:
    """`target[...] = f1[...] * f2[...] * ... * literals`: indices on the right only are summed.

    `summed_groups` hold the factors with a summed index (at most two, after covered
    factors are multiplied into the factor covering them); `end_groups` the factors with
    none, applied once after the sum. Without a summed index every factor is an end
    group and the statement is an elementwise product.
    """

    target: Read
    factors: tuple[Read, ...]
    numbers: tuple[Number, ...]
    summed: tuple[str, ...]  # in order of first appearance
    summed_groups: tuple[Group, ...]
    end_groups: tuple[Group, ...]
    span: Span
    condition: "Term | None" = None  # `where ...` (language v1, section 4)

    @property
    def out_indices(self) -> tuple[str, ...]:
        return self.target.indices

    @property
    def reads(self) -> tuple[Read, ...]:
        """Every operand read: the factors, then the condition's."""
        return self.factors + (self.condition.reads if self.condition is not None else ())

    @property
    def indices(self) -> tuple[str, ...]:
        return self.out_indices + self.summed

    def kind(self, index: str) -> str:
        """"summed", "batch" (on the left and in two or more factors) or "free"."""
        if index in self.summed:
            return "summed"
        uses = sum(index in f.indices for f in self.factors)
        return "batch" if uses >= 2 else "free"

    @property
    def scale(self) -> int | float | None:
        """The product of the literal factors (None without any)."""
        if not self.numbers:
            return None
        return functools.reduce(lambda a, b: a * b, (n.value for n in self.numbers))

    @property
    def text(self) -> str:
        rhs = [f.text for f in self.factors] + [n.text for n in self.numbers]
        cond = f" where {self.condition.text}" if self.condition is not None else ""
        return f"{self.target.text} = {' * '.join(rhs)}{cond}"


# ----------------------------------------------------------- language v1, sections 3-5


@dataclass(frozen=True)
class Term:
    """A node of an elementwise expression or a condition, checked.

    op: "num" (value), "index" (name: an index's value), "size" (name: a size symbol),
    "read" (read: an operand), "local" (read: a local tensor), "+ - * / // %", "neg",
    a function ("exp", "log", "sqrt", "tanh", "abs", "maximum", "minimum"),
    "cmp" (args compared by `ops`, a chain), "and", "or", "not", "truth" (a mask read).
    """

    op: str
    args: tuple["Term", ...] = ()
    name: str | None = None
    read: Read | None = None
    value: int | float | None = None
    ops: tuple[str, ...] = ()

    def walk(self):
        """Every node, in preorder (a loop, not nested generators: a long chain's terms are
        walked many times)."""
        stack = [self]
        while stack:
            t = stack.pop()
            yield t
            stack.extend(reversed(t.args))

    # Kept once found (a term never changes): the checks, the schedule and the mesh rules
    # ask a statement's term for them again and again.
    @functools.cached_property
    def reads(self) -> tuple[Read, ...]:
        return tuple(t.read for t in self.walk() if t.read is not None and t.op in ("read", "truth"))

    @functools.cached_property
    def locals(self) -> tuple[Read, ...]:
        return tuple(t.read for t in self.walk() if t.op == "local")

    @property
    def text(self) -> str:
        return term_text(self)


def term_text(t: Term) -> str:
    """A term re-printed from checked parts (identifiers and numbers only)."""
    if t.op == "num":
        return repr(t.value)
    if t.op in ("index", "size"):
        return t.name
    if t.op in ("read", "local", "truth"):
        return t.read.text
    if t.op == "neg":
        return f"-{_paren(t.args[0])}"
    if t.op == "not":
        return f"not {_paren(t.args[0])}"
    if t.op in ("and", "or"):
        return f" {t.op} ".join(_paren(a) for a in t.args)
    if t.op == "cmp":
        parts = [_paren(t.args[0])]
        for op, a in zip(t.ops, t.args[1:]):
            parts += [op, _paren(a)]
        return " ".join(parts)
    if t.op in ("+", "-", "*", "/", "//", "%"):
        return f"{_paren(t.args[0])} {t.op} {_paren(t.args[1])}"
    return f"{t.op}({', '.join(term_text(a) for a in t.args)})"


def _paren(t: Term) -> str:
    text = term_text(t)
    return text if t.op in ("num", "index", "size", "read", "local", "truth") or t.op not in ("+", "-", "*", "/", "//", "%", "and", "or", "cmp", "not", "neg") else f"({text})"


@dataclass(frozen=True)
class Elementwise:
    """`t[...] = expression [where condition]`: no sum; every index of the right side is on the left."""

    target: Read
    value: Term
    condition: Term | None
    span: Span

    @property
    def factors(self) -> tuple[Read, ...]:
        """The operands it reads (not locals): what the calling convention looks at."""
        return tuple(dict.fromkeys(self.value.reads + (self.condition.reads if self.condition else ())))

    reads = factors

    @property
    def out_indices(self) -> tuple[str, ...]:
        return self.target.indices

    @property
    def text(self) -> str:
        return f"{self.target.text} = {self.value.text}" + (f" where {self.condition.text}" if self.condition else "")


@dataclass(frozen=True)
class Reduction:
    """`t[...] = fn(arg[...], j)`: fn is sum, max or logsumexp (the result drops j) or softmax (keeps it)."""

    target: Read
    fn: str
    arg: Read  # a local or an operand
    index: str
    condition: Term | None
    span: Span
    index_span: Span | None = None  # the reduced index's token, for messages

    @property
    def factors(self) -> tuple[Read, ...]:
        return (self.condition.reads if self.condition else ())

    reads = factors

    @property
    def out_indices(self) -> tuple[str, ...]:
        return self.target.indices

    @property
    def text(self) -> str:
        return f"{self.target.text} = {self.fn}({self.arg.text}, {self.index})" + (f" where {self.condition.text}" if self.condition else "")


@dataclass(frozen=True)
class SoftmaxProduct:
    """`o[..., e] = softmax(s[..., j], j) * v[..., j, e]`: summed over j the flash-attention way."""

    target: Read
    scores: Read  # the local (or operand) the softmax normalises
    index: str
    value: Read  # the factor it multiplies
    numbers: tuple[Number, ...]
    span: Span
    condition: Term | None = None
    index_span: Span | None = None  # the summed index's token in `softmax(s[...], j)`, for messages

    @property
    def factors(self) -> tuple[Read, ...]:
        return (self.value,) + (self.condition.reads if self.condition else ())

    reads = factors

    @property
    def out_indices(self) -> tuple[str, ...]:
        return self.target.indices

    @property
    def text(self) -> str:
        rest = "".join(f" * {n.text}" for n in self.numbers)
        cond = f" where {self.condition.text}" if self.condition else ""
        return f"{self.target.text} = softmax({self.scores.text}, {self.index}) * {self.value.text}{rest}{cond}"


@dataclass(frozen=True)
class Local:
    """A tensor assigned but not declared: computed one block at a time, never stored whole."""

    name: str
    indices: tuple[str, ...]
    span: Span


@dataclass(frozen=True)
class Index:
    name: str
    size: Size
    tile: int
    tile_span: Span

    @property
    def blocks(self) -> str:
        """The number of blocks along this index, as text."""
        if self.size.literal is not None:
            return str(self.size.literal // self.tile)
        return f"ceil({self.size.text} / {self.tile})"


@dataclass(frozen=True)
class Relation:
    """A dimension read through `h // n`: its size is size(h) / n (checked at call time when symbolic)."""

    dim: Size
    index: str
    divisor: int | str  # a size symbol in language v2 (`j // T`)
    what: str  # "k dim 1", for messages


@dataclass(frozen=True)
class Kernel:
    name: str
    source_name: str
    digest: str
    operands: tuple[Operand, ...]  # declaration order
    indices: tuple[Index, ...]  # in order of first appearance
    statements: tuple[Einsum, ...]  # in dependency order
    accumulate: DType
    name_span: Span
    tile_span: Span
    symbols: tuple[tuple[str, int | None], ...]  # every size symbol, with its fixed value
    relations: tuple[Relation, ...] = ()
    accumulate_span: Span | None = None  # where `accumulate` is written, if it is
    locals: tuple[Local, ...] = ()

    @property
    def einsums_only(self) -> bool:
        """Products of operands only, with or without conditions (the einsum walks run them)."""
        return not self.locals and all(isinstance(s, Einsum) for s in self.statements)

    @property
    def inputs(self) -> tuple[Operand, ...]:
        return tuple(o for o in self.operands if o.direction == "in")

    @property
    def outputs(self) -> tuple[Operand, ...]:
        return tuple(o for o in self.operands if o.direction == "out")

    @property
    def data_inputs(self) -> tuple[Operand, ...]:
        return tuple(o for o in self.inputs if o.sparsity != "index")

    @property
    def sparse_input(self) -> Operand | None:
        return next((o for o in self.inputs if o.sparsity in ("coo", "mask")), None)

    def operand(self, name: str) -> Operand:
        return next(o for o in self.operands if o.name == name)

    def index(self, name: str) -> Index:
        return next(i for i in self.indices if i.name == name)

    def statement_of(self, output: str) -> Einsum:
        return next(s for s in self.statements if s.target.operand == output)
