"""The schedule's vocabulary: a backend-neutral description of the kernel to generate.

A module runs one *pass* per statement. A pass walks a grid of axes; before it runs, the
wrapper computes per-step integer *tables* (which stored block a step reads, the next step
that computes, ...); at every step each operand's *block* is given by coordinates over the
axes and tables; the *body* says what a step computes into the accumulator and when it is
initialised and flushed. A target lowers this (TPU: scalar prefetch, BlockSpecs, pl.when
phases) without deciding any of it again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..dtypes import DType
from ..expr import Expr
from ..ir import Einsum, Number, Term


@dataclass(frozen=True)
class Axis:
    var: str  # the grid coordinate's name in kernels and index maps
    role: str  # "blocks" (an index's blocks) | "steps" | "out_blocks" | "reduce"
    index: str | None  # the spec index it walks, if any
    extent: Expr  # number of steps, over the wrapper's size variables
    static: str  # the name under which index maps and kernels receive the extent
    parallel: bool
    about: str  # what the axis walks, for people


@dataclass(frozen=True)
class Table:
    """An int32 array computed before the pass runs, read by index maps and the body."""

    var: str
    length: Expr
    about: str


@dataclass(frozen=True)
class BlockDim:
    index: str | None  # the index walked along this array dimension; None: the stored-block dim
    extent: int  # elements per block along it; 1 is a squeezed dimension
    divisor: int = 1  # read through `index // divisor`

    @property
    def live(self) -> bool:
        """Does the kernel see this dimension (an index it computes along)?"""
        return self.index is not None and self.extent > 1


@dataclass(frozen=True)
class Block:
    """Which block of an array each step touches."""

    key: str  # "f0", "f1", ... for factors (statement order), "out" for the output
    operand: str
    array: str  # the array the call receives
    stored: bool  # a coo blocks array: dim 0 is the stored block
    dims: tuple[BlockDim, ...]
    coords: tuple[Expr, ...]  # block coordinates per array dimension
    lets: tuple[tuple[str, Expr], ...]
    about: str
    is_output: bool = False
    layout: str = "natural"  # a condition's 1-index read: "rows" (lane-broadcast: a column) | "cols" (sublane-broadcast: a row)

    @property
    def live(self) -> tuple[str, ...]:
        return tuple(d.index for d in self.dims if d.live)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(d.extent for d in self.dims if d.live)


@dataclass(frozen=True)
class Factor:
    """A factor's block as the body computes with it."""

    block: str  # Block.key
    operand: str
    live: tuple[str, ...]
    dtype: DType


@dataclass(frozen=True)
class Product:
    """Factors multiplied elementwise; the first sets the dtype (the language's covering factor)."""

    factors: tuple[Factor, ...]

    @property
    def live(self) -> tuple[str, ...]:
        return self.factors[0].live

    @property
    def indices(self) -> set[str]:
        return set().union(*(f.live for f in self.factors))


@dataclass(frozen=True)
class Tail:
    """A symbolic size that need not be a multiple of its tile: elements at or past it are absent."""

    index: str
    coord: Expr  # the block coordinate along the index at a computing step
    size: str  # the size variable
    tile: int


@dataclass(frozen=True)
class Select:
    """A condition on a statement's terms (language v2, section 1): in a partial step the
    absent terms are selected out (`jnp.where`, not multiplied), so nothing any of their
    factors holds reaches a result (language v3, section 0; the rule: `condition.Selection`).

    `target`: "flush" (the value written: a condition on the output's indices only),
    "product" (each partial step's product before it is accumulated), or "group" (the
    sum's group `group`, before the sum; `exposed`, the other group: a step where it holds
    a non-finite value is recomputed over the present terms).
    Element positions are block coordinate x tile + offset in the block; an index walked
    one value at a time is a scalar; a read of an integer operand is its block `reads[read]`."""

    condition: Term
    target: str  # "flush" | "product" | "group"
    group: int | None  # "group": the sum's group selected
    exposed: int | None  # "group": the sum's other group (checked for NaN and Inf)
    coords: tuple[tuple[str, Expr], ...]  # each index of the condition: its block coordinate at the step
    reads: tuple[tuple[object, str], ...]  # (ir.Read, Block.key) of each operand block the condition reads
    scalars: tuple[tuple[object, Expr], ...]  # (ir.Read, its element at the step): one value per step, from SMEM
    when: Expr  # the step is partial
    full: Expr  # the step is full (every term present)
    not_partial: Expr  # full, or nothing present (a flush writes what the sum gave: zeros)
    sizes: tuple[tuple[str, str], ...] = ()  # each size symbol the condition names: its variable


@dataclass(frozen=True)
class FlushCase:
    when: Expr | None
    products: tuple[Product, ...] | None  # multiplied into the result; None writes zeros
    name: str
    about: str
    scale: bool = True  # apply the statement's literal factors
    select: bool = False  # apply the body's Select (target "flush") to the value written


@dataclass(frozen=True)
class MaskSplit:
    """A mask operand inside the sum whose all-ones blocks are skipped: a step whose block is
    partial multiplies it in (`partial`), a full one (`full`) computes `summed` (the sum's
    groups without it) and does not read it; its index map follows the partial steps only."""

    mask: str
    partial: Expr
    full: Expr
    summed: tuple[Product, ...]


@dataclass(frozen=True)
class Body:
    accumulator: bool
    init_when: Expr | None
    compute_when: Expr | None
    summed: tuple[Product, ...]  # the sum's one or two groups; () without a sum
    step: tuple[Product, ...]  # without a sum: accumulated per step (a coo input's duplicates add up); with one: multiplied into each step's sum
    flush_when: Expr | None
    flush_cases: tuple[FlushCase, ...]
    summed_indices: tuple[str, ...]
    acc_live: tuple[str, ...]  # the accumulator's indices (output indices the sum produces)
    acc_shape: tuple[int, ...]
    out_live: tuple[str, ...]  # the output block's indices, in order
    tails: tuple[Tail, ...] = ()  # ragged summed indices, applied to the summed products
    out_tails: tuple[Tail, ...] = ()  # ragged output indices of a stored (coo) output block
    notes: tuple[str, ...] = ()
    lets: tuple[tuple[str, Expr], ...] = ()  # values the phases read (over axes, extents and tables)
    select: Select | None = None  # a condition on the statement's terms
    split: MaskSplit | None = None  # a mask in the sum: its all-ones blocks are not read

    @property
    def matrix_product(self) -> bool:
        """Two groups that share a summed index: a matrix product (the MXU's, on a TPU)."""
        return len(self.summed) == 2 and bool(set(self.summed[0].live) & set(self.summed[1].live) & set(self.summed_indices))


@dataclass(frozen=True)
class HostFunction:
    name: str
    params: tuple[str, ...]
    doc: str
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Fallback:
    """The walk's length where the classification reads traced operands: the grid runs the
    `needed` steps exactly (a traced grid dimension, `run`, as megablox's), over tables of
    `count` entries (static). `count` is the dense count, or a bound the data may exceed
    (`row blocks + groups - 1` for sorted group ids): then where the data needs more the pass
    runs the dense walk instead (`lax.cond`), in as many calls as its tables need to fit SMEM
    (both branches are compiled): correct for any data."""

    count: str  # the static length of the tables
    run: str  # the grid's traced extent: min(needed, count)
    needed: str  # the needed steps' variable
    needed_value: str  # host expression (traced) of the steps the data needs
    bound: str | None  # host expressions over the sizes
    dense: str
    # With a bound, the dense walk runs in pieces of consecutive rows whose tables fit SMEM
    # (`_pieces`): the walk's rows and columns (host expressions over the sizes), its tables
    # of `count` entries, the SMEM entries of its other tables, and the steps the data needs
    # in the rows `rows` (first, end) alone, from the block kinds (`kinds`: its variable
    # and value).
    rows: str = ""
    cols: str = ""
    tables: int = 0
    other: str = "0"
    kinds: str = ""
    kinds_value: str = ""


@dataclass(frozen=True)
class Pass:
    """One statement's kernel: its grid, tables, blocks and body, and how the wrapper feeds it."""

    statement: Einsum
    output: str
    walk: str  # "dense" | "coo input" | "mask" | "window" | "coo output" | "coo join"
    about: str
    axes: tuple[Axis, ...]
    tables: tuple[Table, ...]
    blocks: tuple[Block, ...]  # factors in statement order, then the output
    body: Body
    host: tuple[str, ...]  # wrapper lines computing the tables (jnp), run before the call
    guard: tuple[str, ...]  # wrapper lines returning early when nothing is stored or requested
    pre: tuple[str, ...]  # wrapper lines run before the tables (summing a coo input's duplicates)
    counts: tuple[tuple[str, str], ...]  # (variable, host expression): stored or requested block counts
    statics: tuple[tuple[str, Expr], ...]  # extents index maps and the kernel receive by name
    out_shape: tuple[Expr, ...]
    out_dtype: DType
    block_products: Expr  # steps that compute, at most (for cost estimates)
    flops_per_product: int
    accumulate: DType
    scale: Number | None = None
    kinds: tuple[str, ...] = ()  # named step or block kinds the tables use (_BLOCK, _EMPTY, ...)
    names: object = None  # the pass's own name scope (names.ModuleNames), for the target's locals
    functions: tuple["HostFunction", ...] = ()  # module-level host functions the wrapper lines call
    fallback: "Fallback | None" = None  # a walk whose length is a bound that data may exceed

    @property
    def inputs(self) -> tuple[Block, ...]:
        return tuple(b for b in self.blocks if not b.is_output)

    def count_values(self, env: dict, namespace: dict, stored: Callable[[str], int | None], partial: bool = False) -> dict:
        """`env` (the sizes by variable) with the pass's counts: a stored or requested block
        count (`x_blocks.shape[0]`) is `stored(x_blocks)`; a walk's length is its host
        expression over the sizes, evaluated in `namespace` (the generated module's own
        functions: the expression is its text). `partial`: a count that cannot be had (no
        stored count, a size or function missing) is left out instead of raising."""
        env = dict(env)
        for var, value in self.counts:
            if ".shape" in value:
                n = stored(value.split(".shape")[0])
                if n is not None:
                    env[var] = int(n)
                continue
            try:
                env[var] = int(eval(value, {**namespace, **env}))  # the module's own generated text
            except Exception:
                if not partial:
                    raise
        return env

    @property
    def out(self) -> Block:
        return next(b for b in self.blocks if b.is_output)


@dataclass(frozen=True)
class Schedule:
    kernel: object  # ir.Kernel
    passes: tuple[Pass, ...]
    outputs: tuple[tuple[str, str], ...]  # each output and the wrapper variable that holds it
