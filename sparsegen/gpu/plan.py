"""What the GPU lowering decides, per statement: the GPU's plan, read by the emitter,
`plan` and `verify`.

A statement with a sum is a `ProductPass`: a block-sparse matrix product, A (rows x k)
times B (k x columns), each operand seen as a 2-D `Matrix`; one without a sum is an
`ElementwisePass`. A `GpuModule` holds a kernel's passes and those of its backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import DType
from ..expr import Call, Expr, lift
from ..ir import Einsum
from ..lowered import LoweredModule
from ..names import ModuleNames
from ..source import Diagnostic
from .targets import GpuTarget


def ds(index: Expr, tile: int) -> Expr:
    """The slice of tile `index` (counted in tiles of `tile`) of a dimension: `pl.ds(index * tile, tile)`."""
    return Call("pl.ds", (lift(index) * tile, lift(tile)))


class GpuError(Exception):
    def __init__(self, diagnostics: list[Diagnostic]):
        self.diagnostics = diagnostics
        super().__init__("; ".join(d.message for d in diagnostics))


@dataclass(frozen=True)
class Tiles:
    """The spec's blocks (bm, bn, bk) and the CTA's tiles inside them (tm, tn, tk)."""

    bm: int
    bn: int
    bk: int
    tm: int
    tn: int
    tk: int
    stages: int  # pipeline buffers (TMA copies in flight)
    # Warp-specialized (FlashAttention-3's and CUTLASS's cooperative shape): `wgs` consumer
    # warpgroups side by side along n, each a tm x tn tile, and a producer warpgroup issuing
    # the copies; 1: one warpgroup copies and computes.
    wgs: int = 1
    epi: int = 0  # warp-specialized: the columns of a tile each store moves (the epilogue's tile)

    @property
    def ksub(self) -> int:
        return self.bk // self.tk

    @property
    def cta_n(self) -> int:
        """The columns of a CTA's tile: its consumers' side by side."""
        return self.tn * self.wgs


@dataclass(frozen=True)
class Coord:
    """A grid coordinate in an operand's dimension `dim`: the output index, maybe divided (`h // 4`)."""

    index: str
    divisor: int
    extent: Expr  # the dimension's size
    dim: int


@dataclass(frozen=True)
class Matrix:
    """An operand as the kernel sees it: a 2-D array of (coords.., row) x col, or its transpose;
    with `lead`, its coordinates kept as leading dimensions (coords.., row, col), read by TMA
    copies with those dimensions squeezed, so a ragged row clips per coordinate."""

    operand: str
    array: str  # the wrapper's variable
    coords: tuple[Coord, ...]  # grid coordinates, in the operand's order (leading, flattened into the rows)
    row: str
    col: str
    transposed: bool  # stored (coords.., col) x row: WGMMA reads the shared-memory tile MN-major
    stored: bool  # a coo operand's blocks: stored block s is rows s*tile.. of the matrix
    copied: bool = False  # the wrapper copies it transposed (tf32 WGMMA reads K-major tiles only)
    lead: bool = False  # coordinates as leading dimensions, not flattened into the rows


@dataclass(frozen=True)
class EndVector:
    """A factor after the sum with the output's rows but not its columns (`r[m]`, `r[b, m]`) or
    its columns but not its rows (`c[n]`): read per CTA tile as a vector of `length` elements
    (the tile's rows, or its columns), broadcast over the accumulator and multiplied in before
    the cast and store, as the factor after the sum is; the wrapper never forms its product."""

    operand: str
    array: str  # the wrapper's variable: the vector, padded to whole blocks, its coordinates flattened in front
    axis: str  # "rows" | "cols": the accumulator's dimension it runs along
    coords: tuple[Coord, ...]  # its grid coordinates, in the output's order
    dtype: DType
    index: Expr | None = None  # the tile (of `length` elements) a CTA reads
    length: int = 0


@dataclass
class Selection:
    """A partial step's tile rewritten in shared memory before its WGMMA (`on` "a" or "b"): a
    condition walk's absent terms selected out (the schedule's condition walk, `where`: zeroed
    where the condition is false), or a covered mask's partial block multiplied in. Or, for a
    condition on the output's indices alone, the accumulator masked before it is stored (`on`
    "out")."""

    on: str  # "a" | "b" | "out"
    kind: str  # kernel code: the step's kind (on "a"/"b"; a step let names the step), _PARTIAL where evaluated
    lines: list[str]  # kernel code: the condition evaluated (`present`) and the tile or accumulator masked
    step_lets: list[tuple[str, str]]  # the step's values the lines read (a subset of the index maps')
    held: list[tuple]  # (gmem ref, wrapper array, scoped names, their allocation): condition operand tiles copied at partial steps
    held_bytes: int = 0
    held_barriers: int = 0
    about: str = ""  # what a partial step does, for its comment (a condition's: the emitter says)


@dataclass
class ProductPass:
    """A statement with a sum: a block-sparse matrix product, A (m x k) times B (k x n)."""

    statement: Einsum
    output: str  # the output operand
    walk: str  # "dense" | "rows" | "cols" | "coo output" | "output mask" | "condition" | "condition output":
    # the schedule's walk (schedule.choose_walk) in GPU terms
    sparse: str | None  # the operand whose blocks decide the walk
    a: Matrix
    b: Matrix
    end: Matrix | None  # a factor applied after the sum (mask or dense), read per output tile
    end_mask: bool
    tiles: Tiles
    in_dtype: DType
    acc_dtype: DType  # WGMMA's accumulator (the kernel's `accumulate`): f32, or i32 for i8 factors
    after_dtype: DType  # the sum times the factors after it (`after_sum_dtype`): pieces and stores of that value
    out_dtype: DType
    scale: float | int | None
    cell_coords: tuple[tuple[str, Expr], ...]  # the output's block coordinates, per cell, in grid order
    cells: Expr  # the number of output blocks the grid covers
    host: list[str]  # wrapper lines: matrices and tables
    guard: list[str]  # wrapper lines returning zeros early (nothing stored or requested)
    tables: list[tuple[str, str]]  # (name, about): int32 vectors the kernel reads from GMEM
    kernel_lets: list[tuple[str, str]]  # per-CTA values in the kernel: cell coordinates, start, count
    a_index: tuple[Expr, ...]  # the tile each step reads (its coordinates first, where leading dimensions)
    b_index: tuple[Expr, ...]
    out_index: tuple[Expr, ...]
    end_index: tuple[Expr, ...] | None
    step_lets: list[tuple[str, str]]  # per-step values the index maps read
    steps: str  # an output block's steps (kernel code over `cell` and the kernel lets): what the work list deals
    kind_table: str | None  # output mask: the kind of each cell's block
    finish: list[str]  # wrapper lines turning the kernel's 2-D output into the operand
    out_var: str
    raw: str  # the kernel's 2-D result, in the wrapper
    raw_shape: tuple[str, ...] | None  # its shape (wrapper code: coords.., rows, columns); None: a coo output's, (cells * bm, bn)
    statics: tuple[str, ...]  # size variables the kernel reads
    names: ModuleNames
    fn: str
    call_fn: str
    block_products: Expr  # block products the walk computes at most (dense: all of them)
    flops_per_product: int
    smem: int
    selection: Selection | None = None  # a condition walk's partial steps (or blocks)
    vectors: tuple[EndVector, ...] = ()  # factors after the sum along the rows or the columns alone
    covered: tuple[str, ...] = ()  # the dtype each integer factor's covered product is formed in, and why (`covered_dtype`)
    # The condition's absent terms are selected out of one factor's tiles; the other lacks an index
    # they span (`k <= m`: y[k, n]), so a NaN or Inf there meets them: the wrapper checks the result.
    exposed: bool = False

    @property
    def classifies(self) -> bool:
        """Does the wrapper classify blocks (a mask's `_block_kinds`, a condition's) for this walk?"""
        side = self.a if self.walk == "rows" else self.b
        return self.walk in ("output mask", "condition", "condition output") or (self.walk in ("rows", "cols") and not side.stored)


@dataclass
class ElementwisePass:
    """A statement without a sum: factors of the output's shape multiplied tile by tile."""

    statement: Einsum
    output: str
    out_dtype: DType
    tm: int
    tn: int
    bm: int
    bn: int
    cells: Expr
    lets: list[tuple[str, str]]  # per CTA: the statement's block coordinates
    factors: list[dict]
    out_index: tuple[Expr, Expr]
    inside: str | None  # a window written at offsets: tiles outside it are zeros
    scale: float | int | None
    host: list[str]
    tables: list[tuple[str, str]]
    finish: list[str]
    out_var: str
    raw: str
    raw_shape: tuple[Expr, Expr]
    statics: tuple[str, ...]
    names: ModuleNames
    fn: str
    call_fn: str
    smem: int
    walk: str = "elementwise"
    classifies: bool = False


@dataclass(frozen=True)
class GpuModule(LoweredModule):
    target: GpuTarget
    passes: tuple["ProductPass | ElementwisePass", ...]
    outputs: tuple[tuple[str, str], ...]
    backward: object | None = None  # autodiff.Backward: how the gradients are derived
    backward_module: "GpuModule | None" = None  # its passes, lowered like any kernel's

    @property
    def smem_bytes(self) -> int:
        return max(p.smem for p in self.passes)


GpuPass = ProductPass | ElementwisePass
