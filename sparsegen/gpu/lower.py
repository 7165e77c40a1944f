"""GPU lowering: each statement as a block-sparse matrix product on Mosaic GPU (Hopper).

A statement `out[c.., m, n] = A[c.., m, k] * B[c.., k, n]` (any dimension order; `c` are
tile-1 indices: batch, heads) becomes one kernel. Its grid has a CTA per output *tile*
(tm x tn, WGMMA's) of every output *block* (the spec's tile, the sparsity's grain). GPUs
have no scalar prefetch, so a CTA reads from tables in GMEM how many steps its block takes
and where they start, then runs `plgpu.emit_pipeline` over that dynamic count: TMA copies of
an A tile and a B tile into shared memory per step, one WGMMA each, the accumulator in
registers. A block nothing reaches runs zero steps and stores zeros.

The walks (which steps a block takes) are the schedule's, said in GPU terms:
- dense: every block along k;
- rows / cols: a sparse A side (its coo blocks, or a mask factor's non-empty blocks) lists,
  per row of blocks, the blocks along k it holds; a sparse B side, per column;
- coo output: one cell per requested block, every block along k;
- output mask: a mask applied after the sum; its empty blocks run no step, its all-ones
  blocks are not read.

The wrapper hands the kernel 2-D arrays: an operand with its tile-1 dimensions leading,
padded to whole blocks (ragged sizes), flattened; factors a covering factor multiplies are
formed by the wrapper (XLA fuses them into one pass). A matrix stored (k, m) rather than
(m, k) is not copied: the kernel transposes the shared-memory tile (16-bit types).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..callconv import Convention, convention
from ..dtypes import DType
from ..expr import Const, Expr, Load, Var, flat, names as expr_names, render
from ..ir import Einsum, Kernel, Read
from ..names import ModuleNames
from ..source import Diagnostic
from .targets import GpuTarget

DTYPES_WGMMA = ("bf16", "f16", "f32")  # f32 as tf32 (K-major tiles only)
# The GPU kernels' fixed local names (templates/gpu/module.py.j2): per CTA, per pipeline step,
# the epilogue. Spec names never take them.
FIXED = frozenset({
    "cell", "mi", "ni", "start", "count", "s", "kk", "step", "stored", "acc", "acc_ref", "multiply", "product",
    "out_smem", "end_smem", "barrier", "kind", "row", "col", "_store", "_masked", "_whole", "_inside", "_outside",
})  # fmt: skip
MAX_ACC = 128 * 128  # accumulator elements per CTA: one warpgroup's registers (256x256 spills, measured)


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

    @property
    def ksub(self) -> int:
        return self.bk // self.tk


def smem_bytes(tiles: Tiles, in_itemsize: int, out_itemsize: int, end_itemsize: int = 0) -> int:
    """Shared memory of one CTA. Measured with Mosaic GPU (docs/gpu-notes.md): scoped
    allocations are reused, so the pipeline's buffers and the epilogue's tiles do not add;
    each barrier takes 8 bytes (one per buffer, and the epilogue's)."""
    t = tiles
    pipeline = t.stages * (t.tm * t.tk + t.tk * t.tn) * in_itemsize
    epilogue = t.tm * t.tn * (out_itemsize + end_itemsize)
    return max(pipeline, epilogue) + 8 * (t.stages + 1)


@dataclass(frozen=True)
class Coord:
    """A grid coordinate in an operand's dimension `dim`: the output index, maybe divided (`h // 4`)."""

    index: str
    divisor: int
    extent: Expr  # the dimension's size
    dim: int


@dataclass(frozen=True)
class Matrix:
    """An operand as the kernel sees it: a 2-D array of (coords.., row) x col, or its transpose."""

    operand: str
    array: str  # the wrapper's variable
    coords: tuple[Coord, ...]  # grid coordinates, in the operand's order (leading, flattened into the rows)
    row: str
    col: str
    transposed: bool  # stored (coords.., col) x row: the kernel transposes the shared-memory tile
    stored: bool  # a coo operand's blocks: stored block s is rows s*tile.. of the matrix
    copied: bool = False  # the wrapper transposed it (tf32 reads K-major tiles only)


@dataclass
class GpuPass:
    statement: Einsum
    output: str  # the output operand
    walk: str  # "dense" | "rows" | "cols" | "coo output" | "output mask"
    sparse: str | None  # the operand whose blocks decide the walk
    a: Matrix
    b: Matrix
    out: Matrix
    end: Matrix | None  # a factor applied after the sum (mask or dense), read per output tile
    end_mask: bool
    tiles: Tiles
    in_dtype: DType
    out_dtype: DType
    scale: float | int | None
    cell_coords: tuple[tuple[str, Expr], ...]  # the output's block coordinates, per cell, in grid order
    cells: Expr  # the number of output blocks the grid covers
    host: list[str]  # wrapper lines: matrices and tables
    guard: list[str]  # wrapper lines returning zeros early (nothing stored or requested)
    tables: list[tuple[str, str]]  # (name, about): int32 vectors the kernel reads from GMEM
    kernel_lets: list[tuple[str, str]]  # per-CTA values in the kernel: cell coordinates, start, count
    a_index: tuple[str, str]
    b_index: tuple[str, str]
    out_index: tuple[str, str]
    end_index: tuple[str, str] | None
    step_lets: list[tuple[str, str]]  # per-step values the index maps read
    kind_table: str | None  # output mask: the kind of each cell's block
    finish: list[str]  # wrapper lines turning the kernel's 2-D output into the operand
    out_var: str
    statics: tuple[str, ...]  # size variables the kernel reads
    names: ModuleNames
    fn: str = ""
    call_fn: str = ""
    block_products: Expr = Const(0)
    flops_per_product: int = 0
    smem: int = 0
    notes: list[str] = field(default_factory=list)


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
    out_index: tuple[str, str]
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
    guard: tuple = ()
    sparse: None = None


@dataclass(frozen=True)
class GpuModule:
    kernel: Kernel
    target: GpuTarget
    conv: Convention
    names: ModuleNames
    passes: tuple[GpuPass, ...]
    outputs: tuple[tuple[str, str], ...]
    backward: object | None = None  # autodiff.Backward: how the gradients are derived
    backward_module: "GpuModule | None" = None  # its passes, lowered like any kernel's
    backward_error: str | None = None  # why `jax.grad` cannot go through this kernel

    @property
    def name(self) -> str:
        return self.kernel.name

    @property
    def smem_bytes(self) -> int:
        return max(p.smem for p in self.passes)


def _letters(indices) -> dict[str, str]:
    return {i: "abcdefghijklmnopqrstuvwxyz"[n] for n, i in enumerate(indices)}


class _Lowering:
    def __init__(self, kernel: Kernel, target: GpuTarget, names: ModuleNames | None = None, conv: Convention | None = None):
        self.k = kernel
        self.target = target
        if names is None:
            names = ModuleNames(kernel)
            names.internal.used |= FIXED
        self.names = names
        self.conv = conv or convention(kernel, self.names)
        self.tile = {i.name: i.tile for i in kernel.indices}
        self.outputs: dict[str, str] = {}
        self.errors: list[Diagnostic] = []

    # ------------------------------------------------------------ helpers
    def size(self, index: str) -> Expr:
        return self.conv.size(self.k.index(index).size)

    def blocks(self, index: str) -> Expr:
        return self.size(index).cdiv(self.tile[index])

    def extent(self, index: str) -> Expr:
        """Blocks along an index (for a tile-1 index: its size)."""
        return self.blocks(index) if self.tile[index] != 1 else self.size(index)

    def fail(self, span, message: str, notes=()):
        raise GpuError([Diagnostic(span, message, tuple(notes))])

    def source(self, read: Read) -> str:
        op = self.k.operand(read.operand)
        if op.direction == "out":
            return self.outputs[op.name]
        return self.conv.param(op.name, "blocks" if op.sparsity == "coo" else None).internal

    # ------------------------------------------------------------ the form
    def lower(self) -> GpuModule:
        passes = []
        several = len(self.k.statements) > 1
        for st in self.k.statements:
            try:
                p = self.statement(st, several)
            except GpuError as exc:
                self.errors += exc.diagnostics
                continue
            passes.append(p)
            self.outputs[st.target.operand] = p.out_var
        if self.errors:
            raise GpuError(self.errors)
        return GpuModule(self.k, self.target, self.conv, self.names, tuple(passes), tuple(self.outputs.items()))

    def statement(self, st: Einsum, several: bool) -> GpuPass:
        k = self.k
        if st.condition is not None:
            self.fail(st.span, "`where` conditions are not lowered for GPUs yet")
        if not st.summed:
            return self.elementwise(st)
        for read in (st.target, *st.factors):
            for s in read.subs:
                if s.offset is not None:
                    self.fail(read.span, f"the GPU backend reads whole indices in a matrix product: '{s.text}' (an offset) is not lowered for GPUs yet")
        if len(st.summed) != 1 or self.tile[st.summed[0]] == 1:
            self.fail(st.span, "the GPU backend sums over one index with a tile of 16 or more (WGMMA's k); "
                               f"this statement sums over {', '.join(st.summed)}")
        kidx = st.summed[0]
        if len(st.summed_groups) != 2:
            self.fail(st.span, "the GPU backend multiplies two groups of factors (a matrix product); this statement has "
                               f"{len(st.summed_groups)} with the summed index")
        groups = st.summed_groups

        def groups_of(i: str) -> list:
            return [g for g in groups if any(i in st.factors[f].indices for f in g.members)]

        # The product's columns: the output's last index with a tile of 16 or more that one
        # group has; its rows: the last such index of the other group. Every other output
        # index is a coordinate of the grid: each of its values a block of its own.
        wide = [i for i in st.out_indices if self.tile[i] != 1 and len(groups_of(i)) == 1]
        if not wide:
            self.fail(k.tile_span, "WGMMA computes a matrix: the output needs an index of each factor with a tile of 16 or more; "
                                   f"{st.target.text} has none")
        n = wide[-1]
        gb = groups_of(n)[0]
        ga = next(g for g in groups if g is not gb)
        rows = [i for i in wide if groups_of(i)[0] is ga]
        if not rows:
            self.fail(k.tile_span, f"WGMMA computes a matrix: the output needs an index of '{st.factors[ga.main].text}' with a "
                                   f"tile of 16 or more; {st.target.text} has none")
        m = rows[-1]
        if m not in st.factors[ga.main].indices or n not in st.factors[gb.main].indices:
            self.fail(st.span, f"the GPU backend needs '{m}' and '{n}' on the covering factors of the product")
        coords = [i for i in st.out_indices if i not in (m, n)]
        for read in (st.target, *st.factors):
            for s in read.subs:
                if s.divisor != 1 and s.index not in coords:
                    self.fail(read.span, f"'{s.text}' on GPUs: only a grid coordinate (not '{m}', '{n}' or '{kidx}') may be divided")
        names = self.names.scope()
        out_op = k.operand(st.target.operand)
        host: list[str] = []
        tables: list[tuple[str, str]] = []

        def coords_of(read: Read) -> tuple[Coord, ...]:
            op = k.operand(read.operand)
            out = []
            for d, s in enumerate(read.subs):
                if s.index in coords:
                    if op.sparsity == "coo" and self.tile[s.index] != 1:
                        self.fail(k.tile_span, f"'{read.text}' is coo: on GPUs its index {s.index} takes tile 1 (one block per value)")
                    out.append(Coord(s.index, s.divisor, self.conv.size(op.dims[d]), d))
            return tuple(out)

        # ---- sides: the group's main operand, members formed by the wrapper, its sparsity
        sparse_sources = []

        def side(group, row: str, col: str, is_b: bool) -> tuple[Matrix, str | None]:
            main = st.factors[group.main]
            op = k.operand(main.operand)
            if len(set(main.indices)) != len(main.indices):
                self.fail(main.span, f"'{main.text}' repeats an index (a diagonal): not lowered for GPUs")
            stray = [i for i in main.indices if i not in (row, col) and i not in coords]
            if stray:
                self.fail(main.span, f"'{main.text}' has '{stray[0]}', which is neither the product's rows, columns nor sum "
                                     "nor an index of the output: not lowered for GPUs")
            if op.dtype.name not in DTYPES_WGMMA:
                self.fail(op.dtype_span, f"WGMMA multiplies bf16, f16 or f32 (as tf32) factors; '{op.name}' is {op.dtype.name}")
            mine = coords_of(main)
            stored_cr = main.indices.index(col) < main.indices.index(row)  # stored (col, row)
            # 16-bit tiles are read either way (the kernel transposes in shared memory); 32-bit
            # (tf32) WGMMA takes K-major tiles only: A as (m, k), B as (n, k).
            transposed = stored_cr if op.dtype.itemsize == 2 else is_b
            copied = transposed != stored_cr
            mask = None
            extras = [st.factors[e] for e in group.extras]
            for e in extras:
                eop = k.operand(e.operand)
                if eop.sparsity == "coo":
                    self.fail(e.span, f"'{e.text}' is coo inside another factor's blocks: not lowered for GPUs yet")
                if eop.sparsity == "mask":
                    if set(e.indices) != set(main.indices):
                        self.fail(e.span, f"a mask factor on GPUs has the indices of the factor it multiplies ('{main.text}')")
                    mask = e
            var = names.local(f"{main.operand}_matrix")
            why = "  # tf32 WGMMA reads K-major tiles: a transposed copy" if copied else ""
            if op.sparsity == "coo":
                if extras:
                    self.fail(extras[0].span, f"'{extras[0].text}' multiplies the coo operand '{op.name}': not lowered for GPUs yet")
                blocks = self.source(main)
                if copied:
                    host.append(f"{var} = {blocks}.swapaxes(-1, -2){why}")
                    blocks = var
                host.append(f"{var} = {blocks}.reshape(-1, {blocks}.shape[-1])  # stored block s: rows s*tile..")
                sparse_sources.append(("coo", main))
                return Matrix(op.name, var, mine, row, col, transposed, True, copied), None
            src = self.source(main)
            if extras:
                letters = _letters(main.indices)
                terms = ", ".join([src] + [f"{self.source(e)}.astype({src}.dtype)" for e in extras])
                spec = ",".join("".join(letters[i] for i in r.indices) for r in (main, *extras))
                product = names.local(f"{main.operand}_product")
                host.append(f"# {' * '.join(r.text for r in (main, *extras))}, formed once (XLA fuses it into one pass)")
                host.append(f'{product} = jnp.einsum("{spec}->{"".join(letters[i] for i in main.indices)}", {terms})')
                src = product
            order = [c.index for c in mine] + ([col, row] if transposed else [row, col])
            perm = tuple(main.indices.index(i) for i in order)
            tiles = tuple(1 if i in coords else self.tile[i] for i in order)
            host.append(f"{var} = _matrix({src}, {_tuple(map(str, perm))}, {_tuple(map(str, tiles))}){why}")
            if mask is not None:
                sparse_sources.append(("mask", mask))
                mvar = names.local(f"{mask.operand}_matrix")
                mperm = tuple(mask.indices.index(i) for i in order)
                host.append(f"{mvar} = _matrix({self.source(mask)}, {_tuple(map(str, mperm))}, {_tuple(map(str, tiles))})")
                return Matrix(op.name, var, mine, row, col, transposed, False, copied), mvar
            return Matrix(op.name, var, mine, row, col, transposed, False, copied), None

        a, a_mask = side(ga, m, kidx, False)
        b, b_mask = side(gb, kidx, n, True)

        # ---- dtypes
        da, db = k.operand(a.operand).dtype, k.operand(b.operand).dtype
        if da.name != db.name:
            self.fail(k.operand(b.operand).dtype_span, f"WGMMA multiplies two factors of one dtype; '{a.operand}' is {da.name}, '{b.operand}' is {db.name}")
        if k.accumulate.name != "f32":
            self.fail(k.accumulate_span or k.tile_span, f"accumulate {k.accumulate.name}: WGMMA accumulates in f32")
        if not out_op.dtype.is_float:
            self.fail(out_op.dtype_span, f"the GPU backend writes float outputs; '{out_op.name}' is {out_op.dtype.name}")

        # ---- the output and a factor applied after the sum
        end = None
        end_mask = False
        if len(st.end_groups) > 1 or any(g.extras for g in st.end_groups):
            self.fail(st.span, "the GPU backend applies at most one factor after the sum")
        out_coords = coords_of(st.target)
        if out_op.sparsity == "coo":
            sparse_sources.append(("coo output", st.target))
        if st.end_groups:
            e = st.factors[st.end_groups[0].main]
            eop = k.operand(e.operand)
            if set(e.indices) != set(st.out_indices) or eop.sparsity == "coo" or out_op.sparsity == "coo":
                self.fail(e.span, f"'{e.text}' after the sum: the GPU backend applies a dense or mask factor with the output's indices only")
            evar = names.local(f"{e.operand}_matrix")
            ecoords = coords_of(e)
            order = [c.index for c in ecoords] + [m, n]
            perm = tuple(e.indices.index(i) for i in order)
            tiles = tuple(1 if i in coords else self.tile[i] for i in order)
            host.append(f"{evar} = _matrix({self.source(e)}, {_tuple(map(str, perm))}, {_tuple(map(str, tiles))})")
            end = Matrix(eop.name, evar, ecoords, m, n, False, False)
            end_mask = eop.sparsity == "mask"
            if end_mask:
                sparse_sources.append(("output mask", e))
        if len(sparse_sources) > 1:
            what = " and ".join(f"'{r.operand}'" for _, r in sparse_sources)
            self.fail(st.span, f"the GPU backend skips the blocks of one sparse operand per statement; here {what} both are")

        # ---- tiles
        tiles = self.tiles(m, n, kidx, da, out_op.dtype, k.operand(end.operand).dtype if end else None)
        t = tiles
        KB = self.blocks(kidx)

        # ---- cells and walk
        walk, sparse = "dense", None
        if sparse_sources:
            what, read = sparse_sources[0]
            sparse = read.operand
            if what in ("coo output", "output mask"):
                walk = what
            elif (what == "coo" and read.operand == a.operand) or (what == "mask" and a_mask is not None):
                walk = "rows"
            else:
                walk = "cols"
        kernel_lets: list[tuple[str, str]] = []
        step_lets: list[tuple[str, str]] = []
        statics: set[str] = set()
        cell = "cell"
        var_of = {i: names.local(f"{i}_block" if i in (m, n) else i) for i in (*coords, m, n)}
        kvar = names.local(f"{kidx}_block")
        kind_table = None

        def py(e: Expr) -> str:
            statics.update(x for x in expr_names(e) if x in {s.internal for s in self.conv.sizes})
            return render(e, "py")

        def cell_extent(i: str) -> Expr:
            """Values of a grid coordinate; blocks along the product's rows and columns."""
            return self.size(i) if i in coords else self.blocks(i)

        def rows_of(cs: tuple[Coord, ...], lead: Expr, lead_extent: Expr, value=lambda c: Var(var_of[c.index]).div(c.divisor)) -> Expr:
            """A matrix's block row: its coordinates and `lead`, flattened row-major."""
            return flat([value(c) for c in cs] + [lead], [c.extent for c in cs] + [lead_extent])

        if walk == "coo output":
            ncells = Var(names.local("nb"))
            stored_idx = {i: self.conv.param(out_op.name, "out_coords", d).internal for d, i in enumerate(st.target.indices)}
            pad = self.conv.pad(out_op.name)
            for i in (*coords, m, n):
                tname = names.local(f"out_{i}")
                host.append(f"{tname} = jnp.maximum({stored_idx[i]}, 0).astype(jnp.int32)")
                tables.append((tname, f"coordinate {i} of each requested block of {out_op.name}"))
                kernel_lets.append((var_of[i], f"{tname}[{cell}]"))
            counts = names.local("count_of")
            host.append(f"{counts} = jnp.where({pad}, 0, {render(KB, 'host')}).astype(jnp.int32)  # padding entries: no step, zeros")
            tables.append((counts, "steps of each requested block: every block along " + kidx + " (none for padding)"))
            count_expr, start_expr = f"{counts}[{cell}] * {t.ksub}", "0"
            guard = [f"{ncells.name} = {stored_idx[m]}.shape[0]", f"if {ncells.name} == 0:", "    # Nothing is requested."]
        else:
            order = [*coords, m, n]
            extents = [cell_extent(i) for i in order]
            ncells = Const(1)
            for e in extents:
                ncells = ncells * e
            # Decode the cell: row-major over (coords.., m blocks, n blocks).
            decoded = {}
            rest = Var(cell)
            for pos in range(len(order) - 1, -1, -1):
                decoded[order[pos]] = rest.rem(extents[pos]) if pos > 0 else rest
                rest = rest.div(extents[pos])
            kernel_lets += [(var_of[i], py(decoded[i])) for i in order]
            guard = []
            start_expr, count_expr = "0", py(KB * t.ksub)
            if walk in ("rows", "cols"):
                mat, mvar = (a, a_mask) if walk == "rows" else (b, b_mask)
                key_index = m if walk == "rows" else n
                nkeys = Const(1)
                for c in mat.coords:
                    nkeys = nkeys * c.extent
                nkeys = nkeys * self.blocks(key_index)
                order_t, start_t, count_t = names.local(f"{sparse}_order"), names.local(f"{sparse}_start"), names.local(f"{sparse}_count")
                k_t = names.local(f"{sparse}_{kidx}")
                line = "row" if walk == "rows" else "column"
                if mat.stored:
                    op = k.operand(sparse)
                    read = next(r for r in st.factors if r.operand == sparse)
                    cp = [self.conv.param(op.name, "coords", d).internal for d in range(len(read.indices))]
                    pad = self.conv.pad(op.name)
                    keys = render(rows_of(mat.coords, Var(cp[read.indices.index(key_index)]), self.blocks(key_index), lambda c: Var(cp[c.dim])), "host")
                    host.append(f"# The stored blocks of {sparse}, grouped by the {line} of output blocks they feed.")
                    host.append(f"{order_t}, {start_t}, {count_t} = _walk(jnp.where({pad}, {render(nkeys, 'host')}, {keys}), {render(nkeys, 'host')})")
                    host.append(f"{k_t} = jnp.maximum({cp[read.indices.index(kidx)]}, 0)[{order_t}]  # block {kidx} of each step")
                    tables.append((order_t, f"the stored blocks of {sparse}, grouped by output {line}"))
                    nb = names.local("nb")
                    guard = [f"{nb} = {cp[0]}.shape[0]", f"if {nb} == 0:", "    # Nothing is stored: the result is all zeros."]
                else:
                    # Non-empty mask blocks, per row (or column) of output blocks, in order along k.
                    kinds = names.local(f"{sparse}_kinds")
                    first, second = (mat.col, mat.row) if mat.transposed else (mat.row, mat.col)
                    lead = Const(1)
                    for c in mat.coords:
                        lead = lead * c.extent
                    tb = (self.tile[first], self.tile[second])
                    host.append(f"# The non-empty blocks of {sparse}: the only steps, grouped by the {line} of output blocks.")
                    host.append(f"{kinds} = _block_kinds({mvar}, {_tuple(map(str, tb))}, False).reshape("
                                f"{render(lead, 'host')}, {render(self.blocks(first), 'host')}, {render(self.blocks(second), 'host')})")
                    if first == kidx:  # bring the key index next to the coordinates, k last
                        host.append(f"{kinds} = {kinds}.transpose(0, 2, 1)")
                    live = names.local(f"{sparse}_live")
                    host.append(f"{live} = ({kinds} != _EMPTY).reshape(-1)")
                    pos = f"jnp.arange({live}.shape[0], dtype=jnp.int32)"
                    host.append(f"{order_t}, {start_t}, {count_t} = _walk(jnp.where({live}, {pos} // {render(KB, 'host')}, "
                                f"{render(nkeys, 'host')}), {render(nkeys, 'host')})")
                    host.append(f"{k_t} = {order_t} % {render(KB, 'host')}  # block {kidx} of each step")
                tables += [(start_t, f"the first step of each output {line}"), (count_t, f"the steps of each output {line}"),
                           (k_t, f"block {kidx} of each step")]
                key = names.local("key")
                kernel_lets.append((key, py(rows_of(mat.coords, Var(var_of[key_index]), self.blocks(key_index)))))
                start_expr, count_expr = f"{start_t}[{key}]", f"{count_t}[{key}] * {t.ksub}"
                # Clamped: a pipeline may fetch ahead of its last step.
                step_lets.append(("step", f"jnp.minimum(start + {render(Var('s').div(t.ksub), 'py')}, {k_t}.shape[0] - 1)"))
                step_lets.append((kvar, f"{k_t}[step]"))
                if mat.stored:
                    step_lets.append(("stored", f"{order_t}[step]"))
            elif walk == "output mask":
                kinds = names.local(f"{sparse}_kinds")
                host.append(f"# The blocks of {sparse}: empty ones run no step, all-ones ones are not read.")
                host.append(f"{kinds} = _block_kinds({end.array}, ({t.bm}, {t.bn}), True).reshape(-1)")
                tables.append((kinds, f"_EMPTY, _PARTIAL or _FULL: each output block's {sparse} block"))
                kind_table = kinds
                count_expr = f"jnp.where({kinds}[{cell}] == _EMPTY, 0, {py(KB * t.ksub)})"
        if not step_lets:
            step_lets.append((kvar, render(Var("s").div(t.ksub), "py")))
        if t.ksub > 1:
            step_lets.insert(0, ("kk", f"s % {t.ksub}"))

        def sub(name: str, count: int) -> Expr:
            """A CTA's (or step's) tile within its block: always 0 where the block is one tile."""
            return Var(name) if count > 1 else Const(0)

        def matrix_index(mat: Matrix, row_tiles: int, col_tiles: int, row_sub: str, col_sub: str) -> tuple[str, str]:
            """The tile a step reads: block coordinates times tiles per block, plus the tile inside."""
            lead, other = (mat.col, mat.row) if mat.transposed else (mat.row, mat.col)
            if mat.stored:
                # Stored block s is rows s*tile.. of the matrix, along `lead`.
                first, second = Var("stored"), Const(0)
            else:
                value = {i: Var(kvar) if i == kidx else Var(var_of[i]) for i in (mat.row, mat.col)}
                first, second = rows_of(mat.coords, value[lead], self.blocks(lead)), value[other]
            r, c = (second, first) if mat.transposed else (first, second)
            rr = py(r * row_tiles + sub(row_sub, row_tiles))
            cc = py(c * col_tiles + sub(col_sub, col_tiles))
            return (cc, rr) if mat.transposed else (rr, cc)

        def out_tile(mat: Matrix) -> tuple[str, str]:
            r = rows_of(mat.coords, Var(var_of[m]), self.blocks(m))
            return py(r * (t.bm // t.tm) + sub("mi", t.bm // t.tm)), py(Var(var_of[n]) * (t.bn // t.tn) + sub("ni", t.bn // t.tn))

        a_index = matrix_index(a, t.bm // t.tm, t.ksub, "mi", "kk")
        b_index = matrix_index(b, t.ksub, t.bn // t.tn, "kk", "ni")
        if walk == "coo output":
            out_mat = Matrix(out_op.name, "", (), m, n, False, True)
            out_index = (py(Var(cell) * (t.bm // t.tm) + sub("mi", t.bm // t.tm)), py(sub("ni", t.bn // t.tn)))
        else:
            out_mat = Matrix(out_op.name, "", out_coords, m, n, False, False)
            out_index = out_tile(out_mat)
        end_index = out_tile(end) if end is not None else None
        kernel_lets += [("start", start_expr), ("count", count_expr)]

        # ---- the wrapper's result
        out_var = names.local(st.target.operand)
        raw = names.local(f"{st.target.operand}_matrix")
        finish = []
        if walk == "coo output":
            rows_first = st.target.indices.index(m) < st.target.indices.index(n)
            finish.append(f"{out_var} = {raw}.reshape(-1, {t.bm}, {t.bn})" + ("" if rows_first else ".transpose(0, 2, 1)"))
        else:
            order = [c.index for c in out_coords] + [m, n]
            padded = [self.size(i) if i in coords else self.blocks(i) * self.tile[i] for i in order]
            inv = tuple(order.index(i) for i in st.target.indices)
            finish.append(f"{out_var} = _unmatrix({raw}, {_tuple(render(e, 'host') for e in padded)}, "
                          f"{_tuple(render(self.size(i), 'host') for i in order)}, {_tuple(map(str, inv))})")
        p = GpuPass(
            statement=st, output=out_op.name, walk=walk, sparse=sparse, a=a, b=b, out=out_mat, end=end, end_mask=end_mask,
            tiles=tiles, in_dtype=da, out_dtype=out_op.dtype, scale=st.scale, cell_coords=tuple((i, cell_extent(i)) for i in (*coords, m, n)),
            cells=ncells, host=host, guard=guard, tables=tables, kernel_lets=kernel_lets, a_index=a_index, b_index=b_index,
            out_index=out_index, end_index=end_index, step_lets=step_lets, kind_table=kind_table, finish=finish, out_var=out_var,
            statics=tuple(sorted(statics)), names=names,
            fn=names.function(f"_{st.target.operand}_kernel"), call_fn=names.function(f"_{st.target.operand}_call"),
            block_products=ncells * KB, flops_per_product=2 * t.bm * t.bn * t.bk,
            smem=smem_bytes(tiles, da.itemsize, out_op.dtype.itemsize, k.operand(end.operand).dtype.itemsize if end else 0),
        )
        p.raw = raw
        return p

    # ------------------------------------------------------------ elementwise statements
    def elementwise(self, st: Einsum) -> "ElementwisePass":
        """A statement without a sum: a CTA per output tile copies each factor's tile into shared
        memory (TMA), multiplies them in registers and stores the tile; with offsets on the left
        (a window), tiles outside it are written as zeros."""
        k = self.k
        target, out_op = st.target, k.operand(st.target.operand)
        wide = [i for i in target.indices if self.tile[i] != 1]
        if len(wide) < 2:
            self.fail(k.tile_span, f"an elementwise statement on GPUs has 2-D blocks: {target.text} needs two indices with tiles above 1")
        r, c = wide[-2], wide[-1]
        if out_op.sparsity == "coo":
            self.fail(target.span, "elementwise statements with a coo output are not lowered for GPUs yet")
        for f in st.factors:
            op = k.operand(f.operand)
            if op.sparsity == "coo":
                self.fail(f.span, f"'{f.text}' is coo in an elementwise statement: not lowered for GPUs yet")
            if set(f.indices) != set(target.indices) or len(set(f.indices)) != len(f.indices):
                self.fail(f.span, f"'{f.text}': an elementwise statement on GPUs multiplies factors with the output's indices (broadcasts are not lowered yet)")
        for read in (target, *st.factors):
            for s in read.subs:
                if s.divisor != 1:
                    self.fail(read.span, f"'{s.text}' in an elementwise statement is not lowered for GPUs yet")
        names = self.names.scope()
        host: list[str] = []
        statics: set[str] = set()

        def py(e: Expr) -> str:
            statics.update(x for x in expr_names(e) if x in {s.internal for s in self.conv.sizes})
            return render(e, "py")

        bm, bn = self.tile[r], self.tile[c]
        itemsizes = out_op.dtype.itemsize + sum(k.operand(f.operand).dtype.itemsize for f in st.factors)
        tn = next((t for t in (128, 64, 32, 16, 8) if bn % t == 0 and t <= bn), None)
        if tn is None or (tn * out_op.dtype.itemsize) % 16:
            self.fail(self.k.index(c).tile_span, f"tile {c} = {bn}: TMA copies rows of a multiple of 16 bytes; use a multiple of "
                                                 f"{16 // min(16, out_op.dtype.itemsize)}")
        tm = next(t for t in (128, 64, 32, 16, 8, 4, 2, 1) if bm % t == 0)
        while tm > 1 and tm * tn * itemsizes + 8 * len(st.factors) > self.target.smem_bytes:
            tm //= 2
        var_of = {i: names.local(i) for i in target.indices}
        lets: list[tuple[str, str]] = []
        # The grid: the output array's blocks, row-major (a window's outside included).
        out_dims = [(d, s.index) for d, s in enumerate(target.subs)]
        order = [d for d, i in out_dims if i not in (r, c)] + [target.indices.index(r), target.indices.index(c)]
        extents = [self.conv.size(out_op.dims[d]).cdiv(self.tile[target.indices[d]]) for d in order]
        ncells = Const(1)
        for e in extents:
            ncells = ncells * e
        rest, blocks_at = Var("cell"), {}
        for pos in range(len(order) - 1, -1, -1):
            blocks_at[order[pos]] = rest.rem(extents[pos]) if pos > 0 else rest
            rest = rest.div(extents[pos])
        inside = []
        for d in order:
            s = target.subs[d]
            value = blocks_at[d]
            if s.offset is not None:
                slot = self.conv.offset_slot(target.operand, target.operand, d)
                value = value - Load(self.conv.offsets, Const(slot))
                inside += [value.ge(0), value.lt(self.blocks(s.index) if self.tile[s.index] != 1 else self.size(s.index))]
            lets.append((var_of[s.index], py(value)))
        offsets_used = any(s.offset is not None for read in (target, *st.factors) for s in read.subs)
        tables = [(self.conv.offsets, "block offsets read from index operands")] if offsets_used else []
        factors = []
        for n, f in enumerate(st.factors):
            op = k.operand(f.operand)
            forder = [d for d, s in enumerate(f.subs) if s.index not in (r, c)] + [f.indices.index(r), f.indices.index(c)]
            var = names.local(f"{f.operand}_matrix")
            tiles = tuple(str(self.tile[f.indices[d]]) if f.indices[d] in (r, c) else "1" for d in forder)
            host.append(f"{var} = _matrix({self.source(f)}, {_tuple(map(str, forder))}, {_tuple(tiles)})")

            def at(d, f=f):
                s = f.subs[d]
                value = Var(var_of[s.index])
                if s.offset is not None:
                    value = Load(self.conv.offsets, Const(self.conv.offset_slot(target.operand, f.operand, d))) + value
                return value

            lead = flat([at(d) for d in forder[:-1]], [self.conv.size(op.dims[d]).cdiv(self.tile[f.indices[d]]) for d in forder[:-1]])
            index = (py(lead * (bm // tm) + (Var("mi") if bm > tm else Const(0))), py(at(forder[-1]) * (bn // tn) + (Var("ni") if bn > tn else Const(0))))
            factors.append({"operand": f.operand, "array": var, "dtype": op.dtype, "index": index, "ref": names.local(f"{f.operand}_gmem"),
                            "smem": names.local(f"{f.operand}_smem"), "barrier": names.local(f"{f.operand}_barrier")})
        out_rows = flat([blocks_at[d] for d in order[:-1]], extents[:-1])
        out_index = (py(out_rows * (bm // tm) + (Var("mi") if bm > tm else Const(0))), py(blocks_at[order[-1]] * (bn // tn) + (Var("ni") if bn > tn else Const(0))))
        out_var, raw = names.local(target.operand), names.local(f"{target.operand}_matrix")
        padded = [self.conv.size(out_op.dims[d]).cdiv(self.tile[target.indices[d]]) * self.tile[target.indices[d]] for d in order]
        inv = tuple(order.index(d) for d in range(len(order)))
        finish = [f"{out_var} = _unmatrix({raw}, {_tuple(render(e, 'host') for e in padded)}, "
                  f"{_tuple(render(self.conv.size(out_op.dims[d]), 'host') for d in order)}, {_tuple(map(str, inv))})"]
        rows = Const(1)
        for e in padded[:-1]:
            rows = rows * e
        cond = None
        for e in inside:
            cond = e if cond is None else cond & e
        return ElementwisePass(
            statement=st, output=out_op.name, out_dtype=out_op.dtype, tm=tm, tn=tn, bm=bm, bn=bn, cells=ncells, lets=lets,
            factors=factors, out_index=out_index, inside=py(cond) if cond is not None else None, scale=st.scale, host=host,
            tables=tables, finish=finish, out_var=out_var, raw=raw, raw_shape=(rows, padded[-1]), statics=tuple(sorted(statics)),
            names=names, fn=names.function(f"_{target.operand}_kernel"), call_fn=names.function(f"_{target.operand}_call"),
            smem=tm * tn * itemsizes + 8 * len(st.factors),
        )

    # ------------------------------------------------------------ tiles
    def tiles(self, m: str, n: str, kidx: str, dtype: DType, out_dtype: DType, end_dtype: DType | None) -> Tiles:
        k = self.k
        bm, bn, bk = self.tile[m], self.tile[n], self.tile[kidx]
        span = {i.name: i.tile_span for i in k.indices}
        if bm % 64:
            self.fail(span[m], f"tile {m} = {bm}: WGMMA computes 64 rows at a time; on {self.target.name} the output block's "
                               f"rows ({m}) take a multiple of 64", ["tiles that work: 64, 128, 256, ..."])
        if bn % 128 == 0:
            tn = 128
        elif bn % 16 == 0 and bn <= 256:
            tn = bn
        else:
            self.fail(span[n], f"tile {n} = {bn}: WGMMA's N is a multiple of 16 up to 256 (or the block a multiple of 128, "
                               f"split into 128-wide tiles); on {self.target.name} use 16, 32, ..., 256, or a multiple of 128")
        tm = 128 if bm % 128 == 0 and 128 * tn <= MAX_ACC else 64
        swizzle = 128 // dtype.itemsize  # elements per 128-byte row: the widest swizzle
        step = 32 // dtype.itemsize  # WGMMA's K: 16 for 16-bit factors, 8 for tf32
        if bk % swizzle == 0:
            tk = swizzle
        elif bk % step == 0 and bk < swizzle:
            tk = bk
        else:
            self.fail(span[kidx], f"tile {kidx} = {bk}: WGMMA's K steps are multiples of {step} ({dtype.name}); on "
                                  f"{self.target.name} use a multiple of {swizzle}, or {step}, {2 * step}, ... below it")
        for stages in (4, 3, 2):
            t = Tiles(bm, bn, bk, tm, tn, tk, stages)
            need = smem_bytes(t, dtype.itemsize, out_dtype.itemsize, end_dtype.itemsize if end_dtype else 0)
            if need <= self.target.smem_bytes:
                return t
        self.fail(k.tile_span, f"tiles need {need} bytes of shared memory per CTA on {self.target.name} (limit {self.target.smem_bytes})")


def _tuple(items) -> str:
    items = list(items)
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def lower_gpu(kernel: Kernel, target: GpuTarget, backward: bool = True) -> GpuModule:
    """A kernel as Mosaic GPU passes (GpuError with spec-located diagnostics if it cannot be),
    with the backward kernel its gradients need (autodiff), lowered the same way."""
    m = _Lowering(kernel, target).lower()
    if not backward:
        return m
    import dataclasses

    from ..autodiff import derive

    b = derive(m.kernel, m.conv, m.names)
    if b.error or b.kernel is None:
        return dataclasses.replace(m, backward=b, backward_error=b.error)
    if b.prelude:
        return dataclasses.replace(m, backward=b, backward_error="gradients that densify a coo input are not lowered for GPUs yet")
    try:
        bm = _Lowering(b.kernel, target, m.names, b.conv).lower()
    except GpuError as exc:
        return dataclasses.replace(m, backward=b, backward_error=f"the backward kernel has no GPU lowering: {exc.diagnostics[0].message}")
    return dataclasses.replace(m, backward=b, backward_module=bm)


def cost(m: GpuModule, total_steps: int | None = None) -> dict:
    del total_steps
    return {"smem": m.smem_bytes}


__all__ = ["GpuError", "GpuModule", "GpuPass", "Matrix", "Tiles", "lower_gpu", "smem_bytes", "math"]
