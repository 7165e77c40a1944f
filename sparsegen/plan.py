"""Plan: a checked kernel becomes a description of the Pallas TPU kernel to generate.

The plan says *what* the kernel is — the grid and the role of each axis, the
scalar-prefetch arrays, one BlockSpec per operand with its index map as an
expression, the accumulator and when it is initialised and flushed, how output
blocks no work reaches get zeros, dimension_semantics, and the memory estimate. It
knows nothing of templates; the emitter turns it into code, `plan` into words.

Strategies (see README "How kernels are planned"):

- dense: a plain tiled kernel; grid (output axes..., summed axis).
- coo_input: the grid walks the stored blocks of the coo input, sorted by the
  output block they feed, each output block's run closed by a flush step; output
  blocks no stored block reaches are flushed as zeros by their own flush step, so
  every output block is written exactly once and no output is aliased.
- mask: a dense grid; steps whose mask block is all zero skip their compute, and
  every operand's index map follows a prefetch map to the block of the next step
  that computes, so a skipped step starts no new copy. An all-ones mask block needs
  no mask read, so the mask's own map follows only the partial blocks.
- coo_output: the grid walks the caller's output blocks and the summed axis.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .dtypes import DTYPES, DType
from .expr import Bin, Call, Const, Expr, Load, Max, Var, Where, flat
from .expr import names as expr_names
from .layout import padded_bytes
from .model import Kernel, Operand
from .names import FIXED_LOCALS, MODULE_NAMES, PYTHON_NAMES, NameTable
from .targets import Target


# VMEM the compiler keeps for itself beside a kernel's buffers (measured: 64-90 KiB).
MOSAIC_SCRATCH = 128 * 1024
DTYPE_I32 = DTYPES["i32"]


@dataclass(frozen=True)
class Axis:
    var: str  # name of the grid index in the kernel and the index maps
    role: str  # "output" | "steps" | "reduction" | "out_blocks"
    index: str | None  # the spec index it walks, if any
    extent: Expr  # number of grid steps, over the wrapper's size variables
    static: str  # name under which index maps receive the extent
    parallel: bool
    about: str  # what the axis walks, for people


@dataclass(frozen=True)
class Prefetch:
    var: str
    length: Expr
    about: str


@dataclass(frozen=True)
class Param:
    """A positional argument of the generated function."""

    public: str
    internal: str
    operand: str
    kind: str  # "dense" | "mask" | "blocks" | "coords" | "index" | "out_coords"
    dim: int | None  # coordinate dimension, for coords
    shape: tuple[str, ...]  # for the docstring
    dtype: str
    about: str


@dataclass(frozen=True)
class SizeParam:
    symbol: str
    internal: str
    literal: int | None
    keyword_only: bool  # no argument carries it: the caller must pass it
    carriers: str  # who carries it, for messages


@dataclass(frozen=True)
class BlockPlan:
    operand: str
    array: str  # internal name of the array pallas_call receives
    ref: str  # its ref in the kernel
    fn: str  # index map function
    shape: tuple[int | None, ...]  # None: a squeezed dimension
    index: tuple[Expr, ...]
    lets: tuple[tuple[str, Expr], ...]
    statics: tuple[tuple[str, Expr], ...]  # static extents bound with functools.partial
    about: str
    is_output: bool = False


@dataclass(frozen=True)
class FactorRead:
    """How the kernel body reads one factor's block, in the output's index order."""

    operand: str
    ref: str
    perm: tuple[int, ...] | None  # transpose of the block, if its indices are out of order
    expand: tuple[int, ...]  # positions of new unit axes (indices the factor lacks)
    dtype: DType
    squeezed: bool = False  # a coo block: the leading block axis is squeezed


@dataclass(frozen=True)
class Contraction:
    lhs: FactorRead
    rhs: FactorRead
    lhs_dim: int  # the contracted dimension of each block
    rhs_dim: int


@dataclass(frozen=True)
class FlushCase:
    when: Expr | None
    factors: tuple[FactorRead, ...] | None  # None: write zeros
    name: str
    about: str


@dataclass(frozen=True)
class Body:
    lets: tuple[tuple[str, Expr], ...]
    scratch: bool
    init_when: Expr | None
    compute_when: Expr | None
    contraction: Contraction | None
    compute_factors: tuple[FactorRead, ...]  # elementwise product accumulated at compute steps
    flush_when: Expr | None
    flush_cases: tuple[FlushCase, ...]
    notes: tuple[str, ...] = ()  # one line per non-obvious condition, for comments


@dataclass(frozen=True)
class CooPlan:
    operand: str
    blocks: str  # internal names
    coords: tuple[str, ...]
    row_coords: tuple[tuple[str, Expr], ...]  # (coords array, blocks along it) per output index it carries
    rows: Expr  # number of output blocks along the indices it carries
    held: tuple[tuple[str, str], ...]  # (prefetch var, coords array) for coordinates compute operands read
    nb: str
    pad: str  # which entries are padding (every coordinate -1)


@dataclass(frozen=True)
class MaskPlan:
    operand: str
    array: str
    tiles: tuple[int, ...]
    to_grid: tuple[int, ...] | None  # transpose of the block-kind grid into grid order
    ones: bool  # all-ones blocks skip the mask read (the mask is applied at the end)
    kind_var: str
    next_var: str
    prefix: tuple[tuple[Expr, bool], ...]  # grid axes the next-step maps cover: (extent, walks a mask dim)
    partial_var: str | None
    gather: tuple[str, ...] | None = None  # coo output: index the block-kind grid at the requested blocks


@dataclass(frozen=True)
class CooOutPlan:
    coords: tuple[str, ...]
    nb: str


@dataclass(frozen=True)
class OffsetUse:
    param: str  # internal name of the index operand
    operand: str  # the index operand's spec name
    position: int
    tile: int
    max_start: Expr  # largest valid offset, over sizes
    target: str  # "x dim 0", for messages


@dataclass(frozen=True)
class VmemItem:
    what: str
    shape: tuple[int, ...]
    dtype: DType
    buffers: int

    @property
    def bytes(self) -> int:
        return self.buffers * padded_bytes(self.shape, self.dtype)


@dataclass(frozen=True)
class Plan:
    kernel: Kernel
    strategy: str
    target: Target
    params: tuple[Param, ...]
    sizes: tuple[SizeParam, ...]
    axes: tuple[Axis, ...]
    prefetch: tuple[Prefetch, ...]
    blocks: tuple[BlockPlan, ...]  # inputs in call order, then the output
    body: Body
    out_shape: tuple[Expr, ...]
    out_dtype: DType
    offsets: tuple[OffsetUse, ...]
    vmem: tuple[VmemItem, ...]
    names: dict[str, str]  # internal names of generated locals
    coo: CooPlan | None = None
    mask: MaskPlan | None = None
    coo_out: CooOutPlan | None = None
    offsets_var: str | None = None
    reads: tuple[FactorRead, ...] = ()  # every data input as a factor, in declaration order
    vmem_limit_override: int | None = None  # `verify` probes the compiler's VMEM need with a tiny limit
    block_products: Expr | None = None  # grid steps that compute, at most (static: for pl.CostEstimate)
    flops_per_product: int = 0
    bytes_per_product: int = 0  # input block bytes one computing step reads

    @property
    def name(self) -> str:
        return self.kernel.name

    @property
    def vmem_bytes(self) -> int:
        return sum(item.bytes for item in self.vmem)

    @property
    def vmem_limit(self) -> int | None:
        """vmem_limit_bytes for the compiler: None while the default scoped limit is ample.

        The estimate leaves out Mosaic's own scratch and spills, so the limit adds a
        quarter and 2 MiB on top, within the chip's capacity.
        """
        if self.vmem_limit_override is not None:
            return self.vmem_limit_override
        need = self.vmem_bytes
        if need <= self.target.scoped_vmem_bytes * 3 // 4:
            return None
        limit = need * 5 // 4 + 2 * (1 << 20)
        limit = -(-limit // (1 << 20)) * (1 << 20)
        return min(max(limit, self.target.scoped_vmem_bytes), self.target.vmem_bytes)

    @property
    def dimension_semantics(self) -> tuple[str, ...]:
        return tuple("parallel" if a.parallel else "arbitrary" for a in self.axes)

    def size_var(self, symbol: str) -> str:
        return next(s.internal for s in self.sizes if s.symbol == symbol)


class _Planner:
    def __init__(self, kernel: Kernel, target: Target):
        self.k = kernel
        self.target = target
        self.strategy = kernel.strategy
        self.tile = {i.name: i.tile for i in kernel.indices}
        # Public names: the spec's own, renamed only where they would clash.
        symbols = [s for s, _ in kernel.symbols]
        # The public functions' bodies use only these names besides their parameters.
        self.public = NameTable({"_prepare", "_impl", "_reference", "interpret"} | set(symbols))
        self.internal = NameTable(MODULE_NAMES | PYTHON_NAMES | FIXED_LOCALS | {kernel.name})
        self.names: dict[str, str] = {}

    # ------------------------------------------------------------ naming
    def local(self, role: str, preferred: str | None = None) -> str:
        name = self.internal.take(preferred or role)
        self.names[role] = name
        return name

    def plan_sizes(self) -> None:
        k = self.k
        self.size_params = []
        self.size_expr: dict[str, Expr] = {}
        carried: dict[str, list[str]] = {}
        for op in k.operands:
            for d in op.dims:
                if d.symbol is None:
                    continue
                dense_arg = op.direction == "in" and op.sparsity in ("dense", "mask")
                carried.setdefault(d.symbol, [])
                if dense_arg:
                    carried[d.symbol].append(op.name)
        for symbol, literal in k.symbols:
            internal = self.internal.take(symbol)
            carriers = carried[symbol]
            holders = [op.name for op in k.operands if any(d.symbol == symbol for d in op.dims)]
            about = " and ".join(f"'{h}'" for h in holders)
            self.size_params.append(SizeParam(symbol, internal, literal, not carriers and literal is None, about))
            self.size_expr[symbol] = Const(literal) if literal is not None else Var(internal)

    def dim_expr(self, size) -> Expr:
        return Const(size.literal) if size.literal is not None else self.size_expr[size.symbol]

    def blocks_along(self, index: str) -> Expr:
        return self.dim_expr(self.k.index(index).size).div(self.tile[index])

    # ------------------------------------------------------------ params
    def plan_params(self) -> None:
        k = self.k
        params = []

        def add(public, operand, kind, dim, shape, dtype, about):
            params.append(Param(self.public.take(public), self.internal.take(public), operand, kind, dim, shape, dtype, about))

        for op in k.inputs:
            dims = tuple(d.text for d in op.dims)
            if op.sparsity == "coo":
                tiles = tuple(str(self.tile[i]) for i in op.indices)
                add(f"{op.name}_blocks", op.name, "blocks", None, ("nb", *tiles), op.dtype.name, f"the stored blocks of {op.name}")
                for d, idx in enumerate(op.indices):
                    add(f"{op.name}_idx_{d}", op.name, "coords", d, ("nb",), "int32",
                        f"block coordinate of each stored block along {op.name} dim {d} (0 <= . < {op.dims[d].text} / {self.tile[idx]})")
            elif op.sparsity == "index":
                add(op.name, op.name, "index", None, dims, "int32", "block-aligned offsets")
            else:
                kind = "mask" if op.sparsity == "mask" else "dense"
                about = "dense; its all-zero blocks mark skipped work" if kind == "mask" else ""
                add(op.name, op.name, kind, None, dims, op.dtype.name, about)
        out = k.output
        if out.sparsity == "coo":
            for d, idx in enumerate(out.indices):
                add(f"{out.name}_idx_{d}", out.name, "out_coords", d, ("nb",), "int32",
                    f"block coordinate of each requested output block along {out.name} dim {d} (0 <= . < {out.dims[d].text} / {self.tile[idx]})")
        self.params = params

    def param(self, operand: str, kind: str | None = None, dim: int | None = None) -> Param:
        return next(p for p in self.params if p.operand == operand and (kind is None or p.kind == kind) and (dim is None or p.dim == dim))

    # ------------------------------------------------------------ grid
    def plan_axes(self) -> None:
        k = self.k
        self.index_var = {i.name: self.internal.take(i.name) for i in k.indices}
        axes = []

        def axis(var, role, index, extent, parallel, about):
            axes.append(Axis(var, role, index, extent, self.internal.take(f"n_{var}"), parallel, about))

        out_indices = [i.name for i in k.output_indices]
        summed = k.summed
        if self.strategy == "dense" or self.strategy == "mask":
            for name in out_indices:
                axis(self.index_var[name], "output", name, self.blocks_along(name), True, f"output blocks along {name}")
        elif self.strategy == "coo_input":
            coo = k.sparse_input
            for name in out_indices:
                if name not in coo.indices:
                    axis(self.index_var[name], "output", name, self.blocks_along(name), True, f"output blocks along {name}")
            self.steps_var = self.internal.take("step")
            self.nb = self.local("nb")
            carried = [n for n in out_indices if n in coo.indices]
            rows = Const(1)
            for n in carried:
                rows = rows * self.blocks_along(n)
            self.rows = rows
            axis(self.steps_var, "steps", None, Var(self.nb) + rows, False,
                 f"the stored blocks of {coo.name} in output-block order, plus one flush step per output block")
        else:  # coo_output
            self.block_var = self.internal.take("b")
            self.nb = self.local("nb")
            axis(self.block_var, "out_blocks", None, Var(self.nb), True, f"the requested blocks of {k.output.name}")
        if summed is not None and self.strategy != "coo_input":
            axis(self.index_var[summed.name], "reduction", summed.name, self.blocks_along(summed.name), False,
                 f"the sum over {summed.name}, innermost so each output block's visits are consecutive")
        self.axes = axes
        self.axis_of = {a.index: a for a in axes if a.index is not None}
        self.statics = {a.static: a.extent for a in axes}

    # ------------------------------------------------------------ helpers
    def factor_read(self, op: Operand, ref: str) -> FactorRead:
        out = list(self.k.output.indices)
        mine = [t.index for t in op.terms]
        present = [i for i in out if i in mine]
        perm = tuple(mine.index(i) for i in present)
        expand = tuple(pos for pos, i in enumerate(out) if i not in mine)
        return FactorRead(op.name, ref, perm if perm != tuple(range(len(perm))) else None, expand, op.dtype, op.sparsity == "coo")

    def term_expr(self, op: Operand, d: int, coord: Expr) -> Expr:
        if op.terms[d].offset is None:
            return coord
        return Load(self.offsets_var, Const(self.offset_slot[(op.name, d)])) + coord

    # ------------------------------------------------------------ offsets
    def plan_offsets(self) -> None:
        uses = []
        self.offset_slot = {}
        for op in self.k.data_inputs:
            for d, term in enumerate(op.terms):
                if term.offset is None:
                    continue
                # One slot per offset subscript: each is clamped to its own operand's extent.
                self.offset_slot[(op.name, d)] = len(uses)
                dim = self.dim_expr(op.dims[d])
                span = self.dim_expr(self.k.index(term.index).size)
                uses.append(OffsetUse(self.param(term.offset.operand).internal, term.offset.operand, term.offset.position,
                                      self.tile[term.index], dim - span, f"{op.name} dim {d}"))
        self.offsets = tuple(uses)
        self.offsets_var = self.internal.take("offsets") if uses else None

    # ------------------------------------------------------------ strategies
    def plan(self) -> Plan:
        fns = NameTable(MODULE_NAMES | {self.k.name})
        self.fn_of = {op.name: fns.take(f"_{op.name}_index_map") for op in self.k.operands}
        self.internal.used |= set(self.fn_of.values())
        self.plan_sizes()
        self.plan_params()
        self.plan_axes()
        self.plan_offsets()
        self.refs = {op.name: self.internal.take(f"{op.name}_ref") for op in self.k.operands if op.sparsity != "index"}
        self.acc_ref = self.local("acc_ref")
        self.local("size")
        self.local("out")
        for op in self.k.data_inputs:
            if op.sparsity == "coo" or any(t.offset for t in op.terms):
                self.local(f"view:{op.name}", f"{op.name}_view")
        getattr(self, f"plan_{self.strategy}")()
        prefetch = list(self.prefetch)
        if self.offsets_var:
            prefetch.append(Prefetch(self.offsets_var, Const(len(self.offsets)), "block offsets read from index operands, one per offset subscript"))
        out = self.k.output
        out_shape = tuple(self.dim_expr(d) for d in out.dims)
        if out.sparsity == "coo":
            out_shape = (Var(self.nb), *(Const(self.tile[i]) for i in out.indices))
        return Plan(
            kernel=self.k,
            strategy=self.strategy,
            target=self.target,
            params=tuple(self.params),
            sizes=tuple(self.size_params),
            axes=tuple(self.axes),
            prefetch=tuple(prefetch),
            blocks=tuple(self.blocks),
            body=self.body,
            out_shape=out_shape,
            out_dtype=out.dtype,
            offsets=self.offsets,
            vmem=self.vmem(),
            names=self.names,
            coo=getattr(self, "coo_plan", None),
            mask=getattr(self, "mask_plan", None),
            coo_out=getattr(self, "coo_out_plan", None),
            offsets_var=self.offsets_var,
            reads=self.reads(op.name for op in self.k.data_inputs),
            **self.cost(),
        )

    def block(self, op: Operand, shape, index, lets=(), about="", array=None, is_output=False) -> BlockPlan:
        used = set()
        for e in (*index, *(v for _, v in lets)):
            used |= expr_names(e)
        statics = tuple((name, value) for name, value in self.statics.items() if name in used)
        array = array or (self.param(op.name).internal if not is_output else "")
        return BlockPlan(op.name, array, self.refs[op.name], self.fn_of[op.name], tuple(shape),
                         tuple(index), tuple(lets), statics, about, is_output)

    def natural_block(self, op: Operand, coord_of, about: str, is_output=False) -> BlockPlan:
        shape = [self.tile[t.index] for t in op.terms]
        index = [self.term_expr(op, d, coord_of(t.index)) for d, t in enumerate(op.terms)]
        return self.block(op, shape, index, about=about, is_output=is_output)

    def grid_coord(self, index: str) -> Expr:
        return Var(self.axis_of[index].var)

    def contraction(self) -> Contraction | None:
        k = self.k
        if not k.contraction:
            return None
        lhs, rhs = (k.operand(n) for n in k.contraction)
        summed = k.summed.name
        return Contraction(self.factor_read(lhs, self.refs[lhs.name]), self.factor_read(rhs, self.refs[rhs.name]),
                           lhs.indices.index(summed), rhs.indices.index(summed))

    def reads(self, names) -> tuple[FactorRead, ...]:
        return tuple(self.factor_read(self.k.operand(n), self.refs[n]) for n in names)

    # dense -----------------------------------------------------------------
    def plan_dense(self) -> None:
        k = self.k
        self.prefetch = []
        self.blocks = [self.natural_block(op, self.grid_coord, "") for op in k.data_inputs]
        self.blocks.append(self.natural_block(k.output, self.grid_coord, "", is_output=True))
        self.reduction_body()

    def grid_lets(self) -> list[tuple[str, Expr]]:
        return [(a.var, Call("pl.program_id", (Const(d),))) for d, a in enumerate(self.axes)]

    def reduction_body(self, extra_lets=(), compute_when=None) -> None:
        """Init at the first step of the summed axis, flush at its last; no sum, no accumulator."""
        k = self.k
        lets = self.grid_lets() + list(extra_lets)
        contraction = self.contraction()
        flush = (FlushCase(None, self.reads(k.end_factors), "flush", "Write the block."),)
        if k.summed is None:
            self.body = Body(tuple(lets), False, None, None, None, (), None, flush)
            return
        red = self.axis_of[k.summed.name]
        d = self.axes.index(red)
        last = Var(red.var).eq(Call("pl.num_programs", (Const(d),)) - 1)
        self.body = Body(tuple(lets), True, Var(red.var).eq(0), compute_when, contraction, (), last, flush)

    # coo_output --------------------------------------------------------------
    def plan_coo_output(self) -> None:
        k = self.k
        out = k.output
        coords = tuple(self.param(out.name, "out_coords", d).internal for d in range(out.rank))
        self.coo_out_plan = CooOutPlan(coords, self.nb)
        self.prefetch = [Prefetch(c, Var(self.nb), f"requested block coordinate along {out.name} dim {d}") for d, c in enumerate(coords)]
        b = Var(self.block_var)
        coord_of_out = {idx: Load(coords[d], b) for d, idx in enumerate(out.indices)}

        def coord(index):
            return coord_of_out[index] if index in coord_of_out else self.grid_coord(index)

        shape = (None, *(self.tile[i] for i in out.indices))
        output_block = self.block(out, shape, (b, *([Const(0)] * out.rank)), is_output=True, about="Block b of the stacked output.")
        if k.sparse_input is not None:
            self.coo_output_masked(coords, output_block)
            return
        self.blocks = [self.natural_block(op, coord, "") for op in k.data_inputs]
        self.blocks.append(output_block)
        self.reduction_body()

    def coo_output_masked(self, coords: tuple[str, ...], output_block: BlockPlan) -> None:
        """A mask input with a coo output: the mask's block kinds are gathered at the
        requested output blocks (and along the summed axis), then skipped as usual."""
        k = self.k
        out, mask = k.output, k.sparse_input
        block_axis = self.axes[0]
        through = {index: coords[d] for d, index in enumerate(out.indices)}

        def source(index):
            return (block_axis, through[index]) if index in through else (self.axis_of[index], None)

        summed = k.summed
        gather = []
        for index in mask.indices:
            if index in through:
                gather.append(f"{through[index]}[:, None]" if summed is not None and summed.name in mask.indices else through[index])
            else:
                extent = self.axis_of[index].extent
                gather.append(f"jnp.arange({_host(extent)})[None, :]")
        self.mask_body(source, output_block, tuple(gather))

    # coo_input ---------------------------------------------------------------
    def plan_coo_input(self) -> None:
        k = self.k
        coo = k.sparse_input
        step = Var(self.steps_var)
        blocks_param = self.param(coo.name, "blocks").internal
        coords = tuple(self.param(coo.name, "coords", d).internal for d in range(coo.rank))
        kind = self.internal.take("step_kind")
        block = self.internal.take("step_block")
        out_indices = [i.name for i in k.output_indices]
        carried = [n for n in out_indices if n in coo.indices]
        row = self.internal.take("step_row") if carried else None
        # Which coordinates of the coo operand do the other compute operands read?
        compute_ops = [k.operand(n) for n in (k.contraction or ())] if k.contraction else list(k.data_inputs)
        held = {}
        for op in compute_ops:
            if op is coo:
                continue
            for t in op.terms:
                if t.index in coo.indices and t.index not in held:
                    held[t.index] = self.internal.take(f"step_{t.index}")
        self.prefetch = [
            Prefetch(kind, Var(self.nb) + self.rows, "_BLOCK for a step that multiplies a stored block, _FLUSH for the step that writes an output block, _SKIP for padding"),
            Prefetch(block, Var(self.nb) + self.rows, f"the stored block of {coo.name} a step reads (flush steps hold the next one, so they start no copy)"),
        ]
        if row:
            self.prefetch.append(Prefetch(row, Var(self.nb) + self.rows, "the output block a step accumulates into, row-major over " + ", ".join(carried)))
        for idx, var in held.items():
            self.prefetch.append(Prefetch(var, Var(self.nb) + self.rows, f"coordinate {idx} of the stored block a step reads"))
        extents = [self.blocks_along(n) for n in carried]
        row_coords = tuple((coords[coo.indices.index(n)], e) for n, e in zip(carried, extents))
        self.coo_plan = CooPlan(coo.name, blocks_param, coords, row_coords, self.rows,
                                tuple((var, coords[coo.indices.index(idx)]) for idx, var in held.items()), self.nb,
                                self.local("pad"))
        statics = {}
        for n in carried:
            static = self.internal.take(f"n_{self.index_var[n]}")
            statics[n] = Var(static)
            self.statics[static] = self.blocks_along(n)

        def decode_row(index):
            # Position of `index` inside the flattened row number.
            pos = carried.index(index)
            value = Load(row, step)
            later = Const(1)
            for n in carried[pos + 1 :]:
                later = later * statics[n]
            value = value.div(later)
            if pos > 0:
                value = value.rem(statics[index])
            return value

        def compute_coord(index):
            return Load(held[index], step) if index in held else self.grid_coord(index)

        def flush_coord(index):
            return decode_row(index) if index in carried else self.grid_coord(index)

        self.blocks = []
        for op in k.data_inputs:
            if op is coo:
                shape = (None, *(self.tile[i] for i in op.indices))
                self.blocks.append(self.block(op, shape, (Load(block, step), *([Const(0)] * op.rank)), array=blocks_param,
                                              about="The stored block this step multiplies (flush steps hold the next one)."))
            elif op in compute_ops:
                self.blocks.append(self.natural_block(op, compute_coord, "The block the stored block of this step meets (flush steps hold the next one)."))
            else:
                self.blocks.append(self.natural_block(op, flush_coord, "Read when the output block is flushed."))
        self.blocks.append(self.natural_block(k.output, flush_coord, "", is_output=True))
        init = step.eq(0) | Load(kind, Max(step - 1, 0)).eq(Var("_FLUSH"))
        compute = Load(kind, step).eq(Var("_BLOCK"))
        flush = Load(kind, step).eq(Var("_FLUSH"))
        if k.contraction:
            compute_factors, flush_factors = (), self.reads(k.end_factors)
        else:
            # No sum: the product is accumulated per stored block, so duplicates add up.
            compute_factors, flush_factors = self.reads(op.name for op in k.data_inputs), ()
        self.body = Body(tuple(self.grid_lets()), True, init, compute, self.contraction(), compute_factors, flush,
                         (FlushCase(None, flush_factors, "flush", "Write the finished block (zeros if no stored block reached it)."),),
                         ("A run of steps accumulates one output block; it starts after a flush step.",))

    # mask --------------------------------------------------------------------
    def plan_mask(self) -> None:
        self.prefetch = []
        self.mask_body(lambda index: (self.axis_of[index], None),
                       self.natural_block(self.k.output, self.grid_coord, "", is_output=True), None)

    def mask_body(self, source, output_block: BlockPlan, gather: tuple[str, ...] | None) -> None:
        """The mask machinery over this plan's grid. `source(index)` names the grid axis that
        determines a mask index and, for a coo output, the coordinate array it is read
        through; `gather` says how the block-kind grid is gathered for those arrays."""
        k = self.k
        mask = k.sparse_input
        axes = self.axes
        pos = {id(a): n for n, a in enumerate(axes)}
        kind_axes = sorted({id(source(i)[0]): source(i)[0] for i in mask.indices}.values(), key=lambda a: pos[id(a)])
        last = max(pos[id(a)] for a in kind_axes)
        prefix = axes[: last + 1]
        after = axes[last + 1 :]
        ones = mask.name in k.end_factors
        kind_var = self.internal.take("kind")
        next_var = self.internal.take("next_step")
        partial_var = self.internal.take(f"next_{mask.name}") if ones else None
        mask_param = self.param(mask.name).internal
        # The kind grid comes out of the mask in the mask's index order; transpose to grid order.
        order = [mask.indices.index(a.index) for a in kind_axes] if gather is None else list(range(len(kind_axes)))
        to_grid = tuple(order) if order != list(range(len(order))) else None
        self.mask_plan = MaskPlan(mask.name, mask_param, tuple(self.tile[i] for i in mask.indices), to_grid, ones, kind_var,
                                  next_var, tuple((a.extent, any(a is b for b in kind_axes)) for a in prefix), partial_var, gather)
        size_kind = Const(1)
        for a in kind_axes:
            size_kind = size_kind * a.extent
        size_prefix = Const(1)
        for a in prefix:
            size_prefix = size_prefix * a.extent
        where = "per block of" if gather is None else "per requested output block, the kind of its block of"
        self.prefetch += [
            Prefetch(kind_var, size_kind,
                     f"{where} {mask.name}: _EMPTY (all zero: skip), _PARTIAL" + (", _FULL (all ones: no mask read)" if ones else " (compute)")),
            Prefetch(next_var, size_prefix, "per grid cell over " + ", ".join(a.var for a in prefix)
                     + ": the next cell that computes (the last one after it), so skipped steps fetch nothing new"),
        ]
        if ones:
            self.prefetch.append(Prefetch(partial_var, size_prefix, f"per grid cell: the next cell whose {mask.name} block is partial, the only blocks the kernel reads"))

        cell = flat([Var(a.var) for a in prefix], [Var(a.static) for a in prefix])
        kind_cell = flat([Var(a.var) for a in kind_axes], [Var(a.static) for a in kind_axes])

        def decode(nxt: Expr, axis_pos: int) -> Expr:
            value = nxt
            later = Const(1)
            for a in prefix[axis_pos + 1 :]:
                later = later * Var(a.static)
            value = value.div(later)
            if axis_pos > 0:
                value = value.rem(Var(prefix[axis_pos].static))
            return value

        cell_var, nxt_var, live_var = self.local("cell"), self.local("nxt"), self.local("live")
        after_ids = {id(a) for a in after}

        def follow(op: Operand, array: str, about: str) -> BlockPlan:
            nxt = Var(nxt_var)
            lets = [(cell_var, cell), (nxt_var, Load(array, Var(cell_var)))]
            if any(id(source(t.index)[0]) in after_ids for t in op.terms):
                same = [a.var for a in kind_axes] == [a.var for a in prefix]
                lets.append((live_var, Load(kind_var, Var(cell_var) if same else kind_cell).ne(Var("_EMPTY"))))

            def coord(index):
                axis, through = source(index)
                if id(axis) in after_ids:
                    # Past the mask's axes: walk them while computing; otherwise park at
                    # the first (next computing cell ahead) or last (none ahead) block.
                    value = Where(Var(live_var), Var(axis.var), Where(nxt.gt(Var(cell_var)), 0, Var(axis.static) - 1))
                else:
                    value = decode(nxt, pos[id(axis)])
                return Load(through, value) if through is not None else value

            shape = [self.tile[t.index] for t in op.terms]
            index = [self.term_expr(op, d, coord(t.index)) for d, t in enumerate(op.terms)]
            return self.block(op, shape, index, lets=lets, about=about)

        self.blocks = []
        for op in k.data_inputs:
            if op is mask and ones:
                self.blocks.append(follow(op, partial_var, "Only partial mask blocks are read: every other step holds the next partial one."))
            else:
                self.blocks.append(follow(op, next_var, "Skipped steps hold the block of the next step that computes, so they start no copy."))
        self.blocks.append(output_block)
        # Body: the kind of the current cell decides compute and flush.
        here = self.internal.take("block_kind")
        kernel_kind_cell = flat([Var(a.var) for a in kind_axes], [Call("pl.num_programs", (Const(pos[id(a)]),)) for a in kind_axes])
        self.reduction_body(extra_lets=[(here, Load(kind_var, kernel_kind_cell))], compute_when=Var(here).ne(Var("_EMPTY")))
        self.body = dataclasses.replace(self.body, notes=(f"Steps whose {mask.name} block is all zero skip the compute (and their copies).",))
        if ones:
            ends = list(k.end_factors)
            reads = dict(zip(ends, self.reads(ends)))
            others = tuple(reads[n] for n in ends if n != mask.name)
            cases = (
                FlushCase(Var(here).eq(Var("_EMPTY")), None, "flush_empty", f"{mask.name} is all zero here: the block is zero."),
                FlushCase(Var(here).eq(Var("_PARTIAL")), tuple(reads[n] for n in ends), "flush_partial", f"Apply {mask.name}."),
                FlushCase(Var(here).eq(Var("_FULL")), others, "flush_full", f"{mask.name} is all ones here: no need to read it."),
            )
            b = self.body
            self.body = Body(b.lets, b.scratch, b.init_when, b.compute_when, b.contraction, b.compute_factors, b.flush_when, cases, b.notes)

    # ------------------------------------------------------------ cost
    def cost(self) -> dict:
        """Static work per call, for pl.CostEstimate: block products (an upper bound where
        a mask's sparsity is only known at run time), flops and input bytes per product."""
        k = self.k
        tiles = [i.tile for i in k.indices]
        if k.contraction:
            flops = 2 * math.prod(tiles)
        else:
            flops = max(1, len(k.data_inputs)) * math.prod(tiles)
        if self.strategy == "coo_input":
            products = Var(self.nb)
            for a in self.axes:
                if a.role == "output":
                    products = products * a.extent
        else:
            products = Const(1)
            for a in self.axes:
                products = products * a.extent
        per = sum(math.prod(1 if s is None else s for s in b.shape) * k.operand(b.operand).dtype.itemsize for b in self.blocks if not b.is_output)
        return {"block_products": products, "flops_per_product": flops, "bytes_per_product": per}

    # ------------------------------------------------------------ memory
    def vmem(self) -> tuple[VmemItem, ...]:
        items = []
        for b in self.blocks:
            op = self.k.operand(b.operand)
            shape = tuple(1 if s is None else s for s in b.shape)
            items.append(VmemItem(f"{op.name} block" + (" (output)" if b.is_output else ""), shape, op.dtype, 2))
        out = self.k.output
        shape = tuple(self.tile[i] for i in out.indices)
        if self.body.scratch:
            items.append(VmemItem("accumulator", shape, self.k.accumulate, 1))
        # Values the body computes on a whole block (the matmul result, the product with
        # each end factor) may spill from vector registers to VMEM: one block each.
        temporaries = (1 if self.body.contraction is not None else 0) + len(self.k.end_factors)
        if temporaries:
            items.append(VmemItem("body temporaries", shape, self.k.accumulate, temporaries))
        items.append(VmemItem("Mosaic internal scratch", (MOSAIC_SCRATCH // 4,), DTYPE_I32, 1))
        return tuple(items)


def _host(e: Expr) -> str:
    from .expr import render

    return render(e, "host")


def plan(kernel: Kernel, target: Target) -> Plan:
    return _Planner(kernel, target).plan()


def smem_entries(plan: Plan, nb: int | None = None) -> int | None:
    """Int32 entries of the scalar-prefetch arrays, or None when a size is unknown."""
    env = {s.internal: s.literal for s in plan.sizes}
    if "nb" in plan.names:
        env[plan.names["nb"]] = nb
    total = 0
    for p in plan.prefetch:
        value = evaluate(p.length, env)
        if value is None:
            return None
        total += value
    return total


def evaluate(e: Expr, env: dict[str, int | None]) -> int | None:
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Var):
        return env.get(e.name)
    if isinstance(e, Bin):
        a, b = evaluate(e.a, env), evaluate(e.b, env)
        if a is None or b is None:
            return None
        return {"+": a + b, "-": a - b, "*": a * b, "//": a // b if b else None, "%": a % b if b else None}.get(e.op)
    return None
