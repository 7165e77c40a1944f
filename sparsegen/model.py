"""The checked kernel: what the checker proves about a spec and hands to the planner.

Everything here is validated: names are identifiers, sizes bind consistently, tiles
divide, the statement has a supported shape. Spans are kept so that later stages
(the resource check) can still point back at the spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from .dtypes import DType
from .source import Span


@dataclass(frozen=True)
class Size:
    """A dimension size: a literal, or a symbol bound at call time (or fixed by a literal)."""

    symbol: str | None
    literal: int | None

    @property
    def text(self) -> str:
        return self.symbol if self.symbol is not None else str(self.literal)

    def describe(self) -> str:
        if self.symbol is not None and self.literal is not None:
            return f"{self.symbol} = {self.literal}"
        return self.text


@dataclass(frozen=True)
class OffsetRef:
    """`start[0]`: a scalar of an `index` operand, added to an index (block-aligned)."""

    operand: str
    position: int


@dataclass(frozen=True)
class Term:
    """One subscript of an operand access: an index, maybe shifted by an offset."""

    index: str
    offset: OffsetRef | None = None


@dataclass(frozen=True)
class Operand:
    name: str
    direction: str  # "in" | "out"
    dtype: DType
    dims: tuple[Size, ...]
    sparsity: str  # "dense" | "coo" | "mask" | "index"
    terms: tuple[Term, ...]  # how the statement accesses it; () for index operands
    span: Span
    dtype_span: Span

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def indices(self) -> tuple[str, ...]:
        return tuple(t.index for t in self.terms)

    @property
    def decl(self) -> str:
        sparsity = "" if self.sparsity in ("dense", "index") else f" {self.sparsity}"
        return f"{self.name}: {self.dtype.name}[{', '.join(d.text for d in self.dims)}]{sparsity}"


@dataclass(frozen=True)
class Index:
    name: str
    size: Size
    tile: int
    summed: bool
    tile_span: Span

    @property
    def blocks(self) -> str:
        """The number of blocks along this index, as text."""
        if self.size.literal is not None:
            return str(self.size.literal // self.tile)
        return f"{self.size.symbol} / {self.tile}"


@dataclass(frozen=True)
class Kernel:
    name: str
    source_name: str
    digest: str
    text: str
    operands: tuple[Operand, ...]  # declaration order, the output included
    indices: tuple[Index, ...]  # output indices in output order, then the summed index
    contraction: tuple[str, str] | None  # (lhs, rhs) operands of the matmul, if any
    end_factors: tuple[str, ...]  # factors with no summed index, applied at the end
    accumulate: DType
    name_span: Span
    tile_span: Span
    symbols: tuple[tuple[str, int | None], ...]  # every size symbol, with its fixed value

    @property
    def inputs(self) -> tuple[Operand, ...]:
        return tuple(o for o in self.operands if o.direction == "in")

    @property
    def output(self) -> Operand:
        return next(o for o in self.operands if o.direction == "out")

    @property
    def data_inputs(self) -> tuple[Operand, ...]:
        return tuple(o for o in self.inputs if o.sparsity != "index")

    @property
    def sparse_input(self) -> Operand | None:
        return next((o for o in self.inputs if o.sparsity in ("coo", "mask")), None)

    @property
    def summed(self) -> Index | None:
        return next((i for i in self.indices if i.summed), None)

    @property
    def output_indices(self) -> tuple[Index, ...]:
        return tuple(i for i in self.indices if not i.summed)

    def operand(self, name: str) -> Operand:
        return next(o for o in self.operands if o.name == name)

    def index(self, name: str) -> Index:
        return next(i for i in self.indices if i.name == name)

    @property
    def strategy(self) -> str:
        """How the planner drives the grid: dense, coo_input, mask or coo_output."""
        if self.output.sparsity == "coo":
            return "coo_output"
        sparse = self.sparse_input
        if sparse is None:
            return "dense"
        return "coo_input" if sparse.sparsity == "coo" else "mask"
