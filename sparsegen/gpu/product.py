"""A statement with a sum as a block-sparse matrix product on Mosaic GPU (Hopper).

`out[c.., m, n] = A[c.., m, k] * B[c.., k, n]` (any dimension order; `c` are the output's
other indices: batch, heads, each value a block of its own) becomes one kernel. An output
*block* (the spec's tile, the sparsity's grain) is computed as CTA *tiles* (tm x tn,
WGMMA's). GPUs have no scalar prefetch, so the kernel reads from tables in GMEM how many
steps a block takes and where they start, then runs `plgpu.emit_pipeline` over that dynamic
count: TMA copies of an A tile and a B tile into shared memory per step, one WGMMA each, the
accumulator in registers. A block nothing reaches runs zero steps, storing zeros.

The grid is persistent (the emitter and the `_deal` helper): a CTA per SM (per tile of a
block), each running a run of chunks of a work list in which every block's steps lie end to
end, cut into equal runs; a block whose steps cross a run's end is shared by CTAs, each
storing its piece's f32 partial sum, added by the wrapper in a fixed order
(`_add_pieces`). So a skewed pattern (one row of output blocks holding most of the steps)
does not serialise the kernel on that row's CTAs. The lowering gives each block's step count
(`steps`) in terms of the block (`cell`), which the wrapper evaluates for every block.

The walk (which steps a block takes) is the schedule's: `schedule.choose_walk` names it and
the operand whose blocks decide it, and `walk_of` says it in GPU terms, or refuses it:
- dense (the schedule's dense walk; a mask that is its group's covering factor is
  multiplied whole): every block along k;
- rows / cols (coo input, or masked by a factor covered in a summed group): a sparse A
  side (its coo blocks, or the mask's non-empty blocks) lists, per row of output blocks,
  the blocks along k it holds; a sparse B side, per column;
- coo output: one cell per requested block, every block along k;
- output mask (masked, by a factor applied after the sum): its empty blocks run no step,
  its all-ones blocks are not read.

The wrapper hands the kernel an operand only TMA reads as (coords.., rows, columns): its
grid coordinates leading dimensions (TMA copies squeeze them), its rows and columns at
their own sizes (`_rows`, `_width`: TMA fills a read past an edge with zeros, per
coordinate), a dimension inside a flattening (several summed indices) padded to whole
blocks; the kernel writes its output the same way, TMA clipping the edge tiles' stores.
A mask factor (its blocks classified) is 2-D, padded to whole blocks; a factor after the
sum is read as A and B are (clipped; its block kinds classified on whole blocks); one
along the rows or columns alone (`r[m]`, `c[n]`) is a vector, padded to whole blocks, read
per tile in the epilogue (`EndVector`). A mask the walk follows, covered by its group's
factor (`g * keep` in a masked product's backward), is multiplied into that factor's tile
by the kernel at the mask's partial blocks (`fused_selection`); other covered factors are
formed by the wrapper (XLA fuses them into one pass). A matrix stored (k, m) rather than
(m, k) is not copied: WGMMA reads its shared-memory tile MN-major (16-bit types; tf32
WGMMA takes K-major tiles only, so 32-bit matrices the other way are copied transposed).
"""

from __future__ import annotations

import dataclasses

from ..dtypes import DTYPES, after_sum_dtype, covered_dtype, matrix_dtype
from ..expr import Const, Expr, Lit, Load, Min, Neg, Var, Where, flat, names as expr_names, render
from ..ir import Einsum, Read
from ..pytext import py_tuple
from ..schedule.attention import Point
from ..schedule.build import ScheduleError
from ..schedule.choice import Source, Walk
from ..schedule.classify import Classifier, Conditions
from ..schedule.condition import condition_axes, selection
from ..terms import render_term
from .plan import Coord, EndVector, GpuError, Matrix, ProductPass, Selection, ds
from .rules import DTYPES_WGMMA, fail, product_tiles, smem_bytes

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Elements of a covered mask's tile a warpgroup multiplies in at once (64 a thread), in
# slices of a multiple of 64 rows (Mosaic GPU's layout inference finds no layout for fewer,
# nor for a whole tile of 32 rows: such a tile's mask is multiplied in by the wrapper).
_FUSED_ELEMENTS = 8192


def _fused_chunk(rows: int, cols: int) -> int | None:
    """The rows of a covered mask's tile multiplied at once: the most under _FUSED_ELEMENTS
    that divide the tile (64 at least), None where the tile is no multiple of 64 rows."""
    if rows % 64:
        return None
    chunk = min(rows, max(64, _FUSED_ELEMENTS // cols) // 64 * 64)
    while rows % chunk:
        chunk -= 64
    return chunk


class ProductLowering:
    def __init__(self, ctx, st: Einsum, walk: Walk, fuse: bool = True):
        self.ctx, self.st, self.k = ctx, st, ctx.k
        self.fuse = fuse  # a covered mask may be multiplied in by the kernel (`fused_selection`)
        self.choice = walk  # the schedule's walk (schedule.choose_walk)
        self.conv, self.tile = ctx.conv, ctx.tile
        self.names = ctx.names.scope()
        self.host: list[str] = []
        self.tables: list[tuple[str, str]] = []
        self.kernel_lets: list[tuple[str, str]] = []
        self.step_lets: list[tuple[str, str]] = []
        self.statics: set[str] = set()
        # A `where` condition (the schedule's condition walk): its summed indices walked one
        # value at a time (`g` of `gid[m] == g`) are coordinates of the matrices that hold them.
        self.cond = st.condition if walk.name == "condition" else None
        self.cond_sums: list[str] = []
        self.fused: tuple[str, Read] | None = None  # ("a" | "b", a covered mask multiplied in by the kernel)
        self.wide = None  # the float dtype both sides take where a covered product can leave an integer factor's

    # ------------------------------------------------------------ helpers
    def kernel_expr(self, e: Expr) -> Expr:
        """An expression of kernel code; the size variables it reads become the kernel's statics."""
        self.statics.update(x for x in expr_names(e) if x in {s.internal for s in self.conv.sizes})
        return e

    def py(self, e: Expr) -> str:
        """Kernel code for an expression (its size variables the kernel's statics)."""
        return render(self.kernel_expr(e), "py")

    def clamped_step(self, pair: Expr, table: str) -> str:
        """The walk's entry of the chunk's step `s` (`pair`: its offset from the block's first),
        clamped: a pipeline may fetch ahead of its last step."""
        return self.py(Min(Var("start") + pair, Lit(f"{table}.shape[0]") - 1))

    def cell_extent(self, i: str) -> Expr:
        """Values of a grid coordinate; blocks along the product's rows and columns."""
        return self.ctx.size(i) if i in self.coords else self.ctx.blocks(i)

    def blocks(self, i: str) -> Expr:
        """Blocks along an index; along k, of the flattened contraction (other summed indices first)."""
        return self.KB if i == self.kidx else self.ctx.blocks(i)

    def coord_value(self, c: Coord) -> Expr:
        return Var(self.var_of[c.index]).div(c.divisor)

    def rows_of(self, cs: tuple[Coord, ...], lead: Expr, lead_extent: Expr, value=None) -> Expr:
        """A matrix's block row: its coordinates and `lead`, flattened row-major."""
        value = value or self.coord_value
        return flat([value(c) for c in cs] + [lead], [c.extent for c in cs] + [lead_extent])

    # ------------------------------------------------------------ roles
    def roles(self):
        """The summed index k, the output's rows m (from group A) and columns n (group B)."""
        st, k = self.st, self.k
        for read in (st.target, *st.factors):
            for s in read.subs:
                if s.offset is not None:
                    fail(read.span, f"the GPU backend reads whole indices in a matrix product: '{s.text}' (an offset) is not lowered for GPUs yet")
        wide_sums = [i for i in st.summed if self.tile[i] != 1]
        if not wide_sums:
            fail(st.span, "the GPU backend sums over an index with a tile of 16 or more (WGMMA's k); "
                          f"this statement sums over {', '.join(st.summed)}")
        if len(st.summed_groups) != 2:
            fail(st.span, "the GPU backend multiplies two groups of factors (a matrix product); this statement has "
                          f"{len(st.summed_groups)} with the summed index")
        groups = st.summed_groups

        def groups_of(i: str) -> list:
            return [g for g in groups if any(i in st.factors[f].indices for f in g.members)]

        # The product's columns: the output's last index with a tile of 16 or more that one
        # group has; its rows: the last such index of the other group. Every other output
        # index is a coordinate of the grid: each of its values a block of its own.
        wide = [i for i in st.out_indices if self.tile[i] != 1 and len(groups_of(i)) == 1]
        if not wide:
            fail(k.tile_span, "WGMMA computes a matrix: the output needs an index of each factor with a tile of 16 or more; "
                              f"{st.target.text} has none")
        n = wide[-1]
        gb = groups_of(n)[0]
        ga = next(g for g in groups if g is not gb)
        rows = [i for i in wide if groups_of(i)[0] is ga]
        if not rows:
            fail(k.tile_span, f"WGMMA computes a matrix: the output needs an index of '{st.factors[ga.main].text}' with a "
                              f"tile of 16 or more; {st.target.text} has none")
        m = rows[-1]
        if m not in st.factors[ga.main].indices or n not in st.factors[gb.main].indices:
            fail(st.span, f"the GPU backend needs '{m}' and '{n}' on the covering factors of the product")
        # WGMMA's k: the last summed index with a tile above 1; the others are walked one value
        # at a time, the contraction (others.., k) flattened on both sides.
        self.kidx, self.m, self.n, self.ga, self.gb = wide_sums[-1], m, n, ga, gb
        if self.cond is not None:
            _, _, sum_c = condition_axes(st)
            self.cond_sums = [i for i in sum_c if i != self.kidx and self.tile[i] == 1]
        self.extra_sums = [i for i in st.summed if i != self.kidx and i not in self.cond_sums]
        for i in self.extra_sums + [self.kidx]:
            if i not in st.factors[ga.main].indices or i not in st.factors[gb.main].indices:
                fail(st.span, f"the GPU backend sums over indices both factors of the product have; '{i}' is in one only")
        self.coords = [i for i in st.out_indices if i not in (m, n)]
        for read in (st.target, *st.factors):
            for s in read.subs:
                if s.divisor != 1 and s.index not in self.coords:
                    fail(read.span, f"'{s.text}' on GPUs: only a grid coordinate (not '{m}', '{n}' or a summed index) may be divided")

    def coords_of(self, read: Read) -> tuple[Coord, ...]:
        op = self.k.operand(read.operand)
        out = []
        for d, s in enumerate(read.subs):
            if s.index in self.coords or s.index in self.cond_sums:
                if op.sparsity == "coo" and self.tile[s.index] != 1:
                    fail(self.k.tile_span, f"'{read.text}' is coo: on GPUs its index {s.index} takes tile 1 (one block per value)")
                out.append(Coord(s.index, s.divisor, self.conv.size(op.dims[d]), d))
        return tuple(out)

    def coords_in_output_order(self, read: Read) -> tuple[Coord, ...]:
        """A factor after the sum's coordinates in the output's order: its tiles are read per
        cell (its block kinds too), and cells are in that order."""
        return tuple(sorted(self.coords_of(read), key=lambda c: self.coords.index(c.index)))

    # ------------------------------------------------------------ the two sides
    def side(self, group, row: str, col: str, is_b: bool) -> tuple[Matrix, str | None]:
        """A group of factors as a matrix: its covering factor, the factors it covers multiplied
        in by the wrapper; a mask among those (or a coo covering factor) is the walk's source."""
        st, k, names, host = self.st, self.k, self.names, self.host
        main = st.factors[group.main]
        op = k.operand(main.operand)
        stray = [i for i in main.indices if i not in (row, col) and i not in self.coords and i not in self.extra_sums
                 and i not in self.cond_sums]
        if stray:
            fail(main.span, f"'{main.text}' has '{stray[0]}', which is neither the product's rows, columns nor sum "
                            "nor an index of the output: not lowered for GPUs")
        if op.dtype.name not in DTYPES_WGMMA:
            fail(op.dtype_span, f"WGMMA multiplies bf16, f16, f32 (as tf32) or i8 (into i32) factors; '{op.name}' is {op.dtype.name}")
        dt = self.wide or op.dtype  # the dtype WGMMA takes this side in
        mine = self.coords_of(main)
        stored_cr = main.indices.index(col) < main.indices.index(row)  # stored (col, row)
        # 16-bit tiles are read either way (WGMMA reads a transposed view MN-major); tf32 and
        # s8 WGMMA take K-major tiles only: A as (m, k), B as (n, k). Several summed
        # indices flatten into one contraction: (rows, k..) for A, (k.., columns) for B.
        transposed = stored_cr if dt.itemsize == 2 and not self.extra_sums else is_b and dt.itemsize != 2
        copied = transposed != stored_cr
        why = ("  # the summed indices flattened into one contraction: a copy" if self.extra_sums else
               f"  # {'tf32' if dt.is_float else 's8'} WGMMA reads K-major tiles: a transposed copy") if copied else ""
        extras = [st.factors[e] for e in group.extras]
        divisors = {s.index: s.divisor for s in main.subs}
        for e in extras:
            eop = k.operand(e.operand)
            if any(s.divisor != divisors[s.index] for s in e.subs):
                fail(e.span, f"'{e.text}' reads an index of '{main.text}' divided differently: not lowered for GPUs yet")
            if eop.sparsity == "coo":
                fail(e.span, f"'{e.text}' is coo inside another factor's blocks: not lowered for GPUs yet")
            if eop.sparsity == "mask":
                if not set(e.indices) <= set(main.indices):
                    fail(e.span, f"a mask factor on GPUs reads only indices of the factor it multiplies ('{main.text}')")
        # The schedule's mask source, when this group holds it (covered: the main factor is not a mask's).
        mask = next((st.factors[s.factor] for s in self.skipped() if s.place == "sum" and s.sparsity == "mask" and st.summed_groups[s.group] is group), None)
        var = names.local(f"{main.operand}_matrix")
        if op.sparsity == "coo":
            if extras:
                fail(extras[0].span, f"'{extras[0].text}' multiplies the coo operand '{op.name}': not lowered for GPUs yet")
            blocks = self.ctx.source(main)
            if self.wide and op.dtype != dt:
                blocks = f"{blocks}.astype({dt.jnp})"  # the other side of a product formed wider: exact in it
            if any(op.dims[d].literal is None and self.tile[i] != 1 for d, i in enumerate(main.indices)):
                # A ragged size: what lies past the array's end in a stored block is absent
                # (zeroed, as `reference` does; the dense side's padding alone would turn a NaN there into NaN).
                tiles = py_tuple(str(self.tile[i]) for i in main.indices)
                coords = py_tuple(self.conv.param(op.name, "coords", d).internal for d in range(len(main.indices)))
                shape = py_tuple(render(self.conv.size(d), "host") for d in op.dims)
                host.append(f"{var} = _cut_blocks({blocks}.reshape(({blocks}.shape[0], *{tiles})), {coords}, {tiles}, {shape}).reshape({blocks}.shape)")
                blocks = var
            if copied:
                host.append(f"{var} = {blocks}.swapaxes(-1, -2){why}")
                blocks = var
            host.append(f"{var} = {blocks}.reshape(-1, {blocks}.shape[-1])  # stored block s: rows s*tile..")
            return Matrix(op.name, var, mine, row, col, transposed, True, copied), None
        src = self.ctx.source(main)
        # A mask the walk follows, alone in the group and laid out as the covering factor, is
        # multiplied into the covering factor's tile in the kernel, at its partial blocks only
        # (`fused`): empty blocks are never walked, all-ones blocks need no read, and the
        # wrapper forms no product over the whole operand.
        # A mask lacking some of the factor's coordinates (a batch index) is read by each of
        # their values, its block kinds broadcast along them.
        fused = self.fuse and mask is not None and extras == [mask] and set(main.indices) - set(mask.indices) <= set(self.coords) and not self.wide
        if fused:
            self.fused = (("b" if is_b else "a"), mask)
        if extras and not fused:
            letters = {i: _LETTERS[n] for n, i in enumerate(main.indices)}
            into = dt.jnp if self.wide else f"{src}.dtype"  # a product formed wider (`covered_dtype`), or in the factor's
            terms = ", ".join([f"{src}.astype({into})" if self.wide else src] + [f"{self.ctx.source(e)}.astype({into})" for e in extras])
            spec = ",".join("".join(letters[i] for i in r.indices) for r in (main, *extras))
            product = names.local(f"{main.operand}_product")
            host.append(f"# {' * '.join(r.text for r in (main, *extras))}, formed once (XLA fuses it into one pass)")
            host.append(f'{product} = jnp.einsum("{spec}->{"".join(letters[i] for i in main.indices)}", {terms})')
            src = product
        elif self.wide and op.dtype != dt:
            src = f"{src}.astype({dt.jnp})"  # the other side of a product formed wider: exact in it
        contraction = [*self.extra_sums, self.kidx]
        pair = [col, row] if transposed else [row, col]
        order = [c.index for c in mine] + [x for i in pair for x in (contraction if i == self.kidx else [i])]
        perm = tuple(main.indices.index(i) for i in order)
        tiles = tuple(1 if i in self.coords or i in self.extra_sums or i in self.cond_sums else self.tile[i] for i in order)
        # The contraction's dimensions are the columns where it comes last (A; B read K-major).
        columns = len(contraction) if pair[-1] == self.kidx else 1
        # Only TMA reads it: its ragged edges are left for TMA to fill with zeros (`clip`), its
        # coordinates kept as leading dimensions (`lead`: a row ragged per batch clips too).
        lead = f", lead={len(mine)}" if mine else ""
        host.append(f"{var} = _matrix({src}, {py_tuple(map(str, perm))}, {py_tuple(map(str, tiles))}"
                    + (f", {columns}" if columns > 1 else "") + f", clip=True{lead})" + why)
        mvar = None
        if mask is not None:
            mvar = names.local(f"{mask.operand}_matrix")
            msrc = self.ctx.source(mask)
            if fused:
                own = tuple(c for c in mine if c.index in mask.indices)
                morder = [c.index for c in own] + order[len(mine):]
                mperm = tuple(mask.indices.index(i) for i in morder)
                mtiles = (1,) * len(own) + tiles[len(mine):]
                host.append(f"{mvar} = _matrix({msrc}, {py_tuple(map(str, mperm))}, {py_tuple(map(str, mtiles))})")
                self.mask_var, self.mask_coords = mvar, own
                return Matrix(op.name, var, mine, row, col, transposed, False, copied, bool(mine)), mvar
            if len(mask.indices) < len(main.indices):
                # The mask lacks some of the factor's indices (a batch index): its blocks are
                # the same along them; laid out as the factor for the walk's tables.
                letters = {i: _LETTERS[n] for n, i in enumerate(main.indices)}
                held = "".join(letters[i] for i in mask.indices)
                host.append(f"{mvar} = jnp.broadcast_to(_expand({msrc}, \"{held}\", \"{''.join(letters[i] for i in main.indices)}\"), "
                            f"{self.ctx.source(main)}.shape)  # the same for every {', '.join(i for i in main.indices if i not in mask.indices)}")
                msrc, mindices = mvar, main.indices
            else:
                mindices = mask.indices
            mperm = tuple(mindices.index(i) for i in order)
            host.append(f"{mvar} = _matrix({msrc}, {py_tuple(map(str, mperm))}, {py_tuple(map(str, tiles))})")
        return Matrix(op.name, var, mine, row, col, transposed, False, copied, bool(mine)), mvar

    def after_sum(self):
        """The factors applied after the sum: one with the output's rows and columns (a dense
        or mask operand, read per output tile), and any dense ones with its rows but not its
        columns (`r[m]`, a per-row scale) or its columns but not its rows (`c[n]`), read per
        tile as vectors (`EndVector`). Neither depends on the summed index, so each leaves
        the sum: the accumulator is multiplied by it in the epilogue, never the wrapper an
        operand."""
        st, k = self.st, self.k
        out_op = k.operand(st.target.operand)
        self.end, self.end_mask, self.vectors = None, False, []
        tiles = []
        for g in st.end_groups:
            e = st.factors[g.main]
            eop = k.operand(e.operand)
            if eop.sparsity == "coo" or out_op.sparsity == "coo":
                what = f"'{e.text}' is coo" if eop.sparsity == "coo" else f"the output '{out_op.name}' is coo"
                fail(e.span, f"'{e.text}' after the sum: {what}; the GPU backend applies a dense or mask factor after the sum, "
                             "tile by tile of a dense output")
            lacking = [i for i in (self.m, self.n) if i not in e.indices]
            if len(lacking) == 2:
                fail(e.span, f"'{e.text}' after the sum lacks {self.m} and {self.n}, the product's rows and columns: the GPU "
                             "backend multiplies a factor after the sum in tile by tile of the output, or along its rows "
                             f"or columns (broadcast it to [{', '.join(i for i in st.out_indices if i in e.indices or i == self.m)}] first)")
            if lacking and eop.sparsity == "mask":
                fail(e.span, f"'{e.text}' after the sum is a mask lacking {lacking[0]}, the product's "
                             f"{'rows' if lacking[0] == self.m else 'columns'}: the GPU backend skips a mask's empty blocks "
                             "tile by tile of the output; declare it dense to multiply it in, or broadcast it to "
                             f"[{', '.join(st.out_indices)}]")
            if lacking:
                self.vectors.append(self.vector(e, "cols" if lacking[0] == self.m else "rows"))
            else:
                tiles.append(e)
        if len(tiles) > 1:
            fail(tiles[1].span, f"the GPU backend applies at most one factor after the sum with the product's rows and columns; "
                                f"'{tiles[0].text}' and '{tiles[1].text}' both are (multiply them into one first)")
        if not tiles:
            return
        e = tiles[0]
        eop = k.operand(e.operand)
        evar = self.names.local(f"{e.operand}_matrix")
        ecoords = self.coords_in_output_order(e)
        order = [c.index for c in ecoords] + [self.m, self.n]
        perm = tuple(e.indices.index(i) for i in order)
        tiles = tuple(1 if i in self.coords else self.tile[i] for i in order)
        # Only TMA reads it, as A and B: its ragged edges are left for TMA to fill with zeros
        # (`clip`), its coordinates kept as leading dimensions (`lead`: rows clip per batch).
        # A mask's block kinds are classified on whole blocks (`_block_kinds` pads them).
        lead = f", lead={len(ecoords)}" if ecoords else ""
        self.host.append(f"{evar} = _matrix({self.ctx.source(e)}, {py_tuple(map(str, perm))}, {py_tuple(map(str, tiles))}, "
                         f"clip=True{lead})")
        self.end = Matrix(eop.name, evar, ecoords, self.m, self.n, False, False, lead=bool(ecoords))
        self.end_mask = eop.sparsity == "mask"

    def vector(self, e: Read, axis: str) -> EndVector:
        """A factor after the sum along the output's rows (or columns) alone, as the wrapper
        hands it to the kernel: its coordinates first (in the output's order), then that
        index, padded to whole blocks (a vector's pad costs nothing, and each CTA's read of a
        tile's rows or columns stays inside it), flattened."""
        i = self.m if axis == "rows" else self.n
        eop = self.k.operand(e.operand)
        vcoords = self.coords_in_output_order(e)
        order = [c.index for c in vcoords] + [i]
        perm = tuple(e.indices.index(x) for x in order)
        var = self.names.local(f"{e.operand}_vector")
        src = self.ctx.source(e)
        if perm != tuple(range(len(perm))):
            src = f"{src}.transpose({py_tuple(map(str, perm))})"
        pads = ["(0, 0)"] * (len(order) - 1) + [f"(0, {render(Neg(self.ctx.size(i)).rem(self.tile[i]), 'host')})"]
        self.host.append(f"# {e.text} along the {'rows' if axis == 'rows' else 'columns'}, padded to whole blocks of {i} "
                         "(a vector: its pad costs nothing)")
        self.host.append(f"{var} = jnp.pad({src}, {py_tuple(pads)}).reshape(-1)")
        return EndVector(eop.name, var, axis, vcoords, eop.dtype)

    # ------------------------------------------------------------ walks
    def skipped(self) -> list[Source]:
        """The schedule's sources whose blocks the GPU walk follows: A's side, B's, the output,
        then a factor after the sum. A mask that is its group's covering factor is not one: it
        is multiplied whole, every block along k (the schedule's masked walk skips its empty
        blocks; here, the dense one)."""
        groups = self.st.summed_groups
        place = {"output": 2, "after": 3}

        def order(s: Source) -> int:
            return (0 if groups[s.group] is self.ga else 1) if s.place == "sum" else place[s.place]

        kept = [s for s in self.choice.sources if not (s.place == "sum" and s.sparsity == "mask" and not s.covered)]
        # Several masks multiplied into one group: any one of them skips soundly (each is
        # multiplied in anyway); the walk follows the last, as it always has.
        last = {s.group: s for s in kept if s.place == "sum" and s.sparsity == "mask"}
        kept = [s for s in kept if not (s.place == "sum" and s.sparsity == "mask") or last[s.group] is s]
        return sorted(kept, key=order)

    def walk_of(self) -> tuple[str, str | None]:
        """The schedule's walk in GPU terms, and the operand whose blocks decide it."""
        sources = self.skipped()
        if not sources:
            return "dense", None
        if len(sources) > 1:
            what = " and ".join(f"'{s.operand}'" for s in sources)
            fail(self.st.span, f"the GPU backend skips the blocks of one sparse operand per statement; here {what} both are")
        (s,) = sources
        if s.place == "output":  # the schedule's coo output walk
            return "coo output", s.operand
        if s.place == "after":  # masked, by a factor applied after the sum (a coo one was refused there)
            return "output mask", s.operand
        # coo input, or masked by a covered factor: the lines of output blocks on the side that holds it
        return ("rows" if self.st.summed_groups[s.group] is self.ga else "cols"), s.operand

    def requested_cells(self) -> Expr:
        """A coo output: a cell per requested block, its coordinates from tables."""
        st, names, t = self.st, self.names, self.t
        out_op = self.k.operand(st.target.operand)
        ncells = Var(names.local("nb"))
        stored_idx = {i: self.conv.param(out_op.name, "out_coords", d).internal for d, i in enumerate(st.target.indices)}
        for i in (*self.coords, self.m, self.n):
            tname = names.local(f"out_{i}")
            self.host.append(f"{tname} = jnp.maximum({stored_idx[i]}, 0).astype(jnp.int32)")
            self.tables.append((tname, f"coordinate {i} of each requested block of {out_op.name}"))
            self.kernel_lets.append((self.var_of[i], f"{tname}[cell]"))
        counts = names.local("count_of")
        self.host.append(f"{counts} = jnp.where({self.conv.pad(out_op.name)}, 0, {render(self.KB, 'host')}).astype(jnp.int32)"
                         "  # padding entries: no step, zeros")
        self.tables.append((counts, f"steps of each requested block: every block along {self.kidx} (none for padding)"))
        self.start, self.count = "0", self.py(Load(counts, Var("cell")) * t.ksub)
        self.guard = [f"{ncells.name} = {stored_idx[self.m]}.shape[0]", f"if {ncells.name} == 0:", "    # Nothing is requested."]
        return ncells

    def dense_cells(self) -> Expr:
        """Every output block, row-major over (coords.., m blocks, n blocks)."""
        order = [*self.coords, self.m, self.n]
        extents = [self.cell_extent(i) for i in order]
        ncells = Const(1)
        for e in extents:
            ncells = ncells * e
        decoded, rest = {}, Var("cell")
        for pos in range(len(order) - 1, -1, -1):
            decoded[order[pos]] = rest.rem(extents[pos]) if pos > 0 else rest
            rest = rest.div(extents[pos])
        self.kernel_lets += [(self.var_of[i], self.py(decoded[i])) for i in order]
        self.start, self.count = "0", self.py(self.KB * self.t.ksub)
        return ncells

    def line_walk(self, walk: str, sparse: str):
        """Rows (or columns) of output blocks, each with the list of blocks along k its sparse
        side holds: a coo operand's stored blocks, or a mask factor's non-empty blocks."""
        st, k, names, t, kidx = self.st, self.k, self.names, self.t, self.kidx
        mat, mvar = (self.a, self.a_mask) if walk == "rows" else (self.b, self.b_mask)
        key_index = self.m if walk == "rows" else self.n
        nkeys = Const(1)
        for c in mat.coords:
            nkeys = nkeys * c.extent
        nkeys = nkeys * self.ctx.blocks(key_index)
        order_t, start_t, count_t = names.local(f"{sparse}_order"), names.local(f"{sparse}_start"), names.local(f"{sparse}_count")
        k_t = names.local(f"{sparse}_{kidx}")
        line = "row" if walk == "rows" else "column"
        if mat.stored:
            op = k.operand(sparse)
            read = next(r for r in st.factors if r.operand == sparse)
            cp = [self.conv.param(op.name, "coords", d).internal for d in range(len(read.indices))]
            keys = render(self.rows_of(mat.coords, Var(cp[read.indices.index(key_index)]), self.ctx.blocks(key_index), lambda c: Var(cp[c.dim])), "host")
            self.host.append(f"# The stored blocks of {sparse}, grouped by the {line} of output blocks they feed.")
            self.host.append(f"{order_t}, {start_t}, {count_t} = _walk(jnp.where({self.conv.pad(op.name)}, {render(nkeys, 'host')}, {keys}), "
                             f"{render(nkeys, 'host')})")
            self.host.append(f"{k_t} = jnp.maximum({cp[read.indices.index(kidx)]}, 0)[{order_t}]  # block {kidx} of each step")
            self.tables.append((order_t, f"the stored blocks of {sparse}, grouped by output {line}"))
            nb = names.local("nb")
            self.guard = [f"{nb} = {cp[0]}.shape[0]", f"if {nb} == 0:", "    # Nothing is stored: the result is all zeros."]
        else:
            kinds, live = names.local(f"{sparse}_kinds"), names.local(f"{sparse}_live")
            first, second = (mat.col, mat.row) if mat.transposed else (mat.row, mat.col)
            lead = Const(1)
            for c in mat.coords:
                lead = lead * c.extent
            tb = (self.tile[first], self.tile[second])
            self.host.append(f"# The non-empty blocks of {sparse}: the only steps, grouped by the {line} of output blocks.")
            fused = self.fused is not None and self.fused[0] == ("a" if walk == "rows" else "b")
            blocks = f"{render(self.ctx.blocks(first), 'host')}, {render(self.ctx.blocks(second), 'host')}"
            if fused and len(self.mask_coords) < len(mat.coords):
                # The mask lacks some coordinates: its blocks' kinds, the same for each of their values.
                own = [render(c.extent, "host") if c in self.mask_coords else "1" for c in mat.coords]
                full = [render(c.extent, "host") for c in mat.coords]
                lacked = ", ".join(c.index for c in mat.coords if c not in self.mask_coords)
                self.host.append(f"{kinds} = _block_kinds({mvar}, {py_tuple(map(str, tb))}, True).reshape({', '.join(own)}, {blocks})")
                flat_ = f".reshape({render(lead, 'host')}, {blocks})" if len(full) > 1 else ""
                self.host.append(f"{kinds} = jnp.broadcast_to({kinds}, ({', '.join(full)}, {blocks})){flat_}  # the same for every {lacked}")
            else:
                self.host.append(f"{kinds} = _block_kinds({mvar}, {py_tuple(map(str, tb))}, {fused}).reshape({render(lead, 'host')}, {blocks})")
            if first == kidx:  # bring the key index next to the coordinates, k last
                self.host.append(f"{kinds} = {kinds}.transpose(0, 2, 1)")
            self.host.append(f"{live} = ({kinds} != _EMPTY).reshape(-1)")
            pos = Lit(f"jnp.arange({live}.shape[0], dtype=jnp.int32)")
            self.host.append(f"{order_t}, {start_t}, {count_t} = _walk(jnp.where({live}, {render(pos.div(self.KB), 'host')}, "
                             f"{render(nkeys, 'host')}), {render(nkeys, 'host')})")
            self.host.append(f"{k_t} = {render(Var(order_t).rem(self.KB), 'host')}  # block {kidx} of each step")
            if fused:
                kind_t = names.local(f"{sparse}_kind")
                self.host.append(f"{kind_t} = {kinds}.reshape(-1)[{order_t}]  # _PARTIAL: {sparse}'s tile is multiplied in")
                self.tables.append((kind_t, f"the kind of each step's {sparse} block"))
                self.fused_kinds = kind_t
        self.tables += [(start_t, f"the first step of each output {line}"), (count_t, f"the steps of each output {line}"),
                        (k_t, f"block {kidx} of each step")]
        key = names.local("key")
        self.kernel_lets.append((key, self.py(self.rows_of(mat.coords, Var(self.var_of[key_index]), self.ctx.blocks(key_index)))))
        self.start, self.count = render(Load(start_t, Var(key)), "py"), self.py(Load(count_t, Var(key)) * t.ksub)
        self.step_lets.append(("step", self.clamped_step(Var("s").div(t.ksub), k_t)))
        self.step_lets.append((self.kvar, f"{k_t}[step]"))
        if mat.stored:
            self.step_lets.append(("stored", f"{order_t}[step]"))

    def output_mask(self, sparse: str) -> str:
        """Empty mask blocks run no step (zeros); the kernel reads only partial ones. A mask
        lacking some of the output's coordinates (a batch index) is read by every value of
        them: its kinds are broadcast to the output's cells."""
        kinds = self.names.local(f"{sparse}_kinds")
        self.host.append(f"# The blocks of {sparse}: empty ones run no step, all-ones ones are not read.")
        mine = [c.index for c in self.end.coords]
        tiles = py_tuple(["1"] * len(mine) + [str(self.t.bm), str(self.t.bn)])
        if len(mine) == len(self.coords):
            self.host.append(f"{kinds} = _block_kinds({self.end.array}, {tiles}, True).reshape(-1)")
        else:
            lacked = ", ".join(i for i in self.coords if i not in mine)
            blocks = [render(self.ctx.blocks(i), "host") for i in (self.m, self.n)]
            cells = [render(self.cell_extent(i), "host") if i in mine else "1" for i in self.coords]
            full = [render(self.cell_extent(i), "host") for i in (*self.coords, self.m, self.n)]
            self.host.append(f"{kinds} = _block_kinds({self.end.array}, {tiles}, True)"
                             f".reshape({', '.join(cells + blocks)})")
            self.host.append(f"{kinds} = jnp.broadcast_to({kinds}, ({', '.join(full)})).reshape(-1)  # the same for every {lacked}")
        self.tables.append((kinds, f"_EMPTY, _PARTIAL or _FULL: each output block's {sparse} block"))
        self.count = self.py(Where(Load(kinds, Var("cell")).eq(Var("_EMPTY")), 0, self.KB * self.t.ksub))
        return kinds

    # ------------------------------------------------------------ the condition walk
    def condition_plan(self):
        """Where a `where` condition's absent terms are selected out (the schedule's rule,
        `schedule.condition.selection`, language v3 section 0: an absent term never reaches a
        result, whatever any of its factors holds), and the operands it reads:
        - "a" / "b": the indices of the condition a block spans are a factor's: its tile at a
          partial step; where the other factor holds them too, its tile as well (`both`), so
          neither's NaN or Inf meets an absent term;
        - "out": the condition reads no summed index: the accumulator, once, before the store;
        - "step": the indices it spans are the output's, but a summed index is walked one value
          at a time beside it (read: `gid[m] == g`, `n < width[g]`, `m < rows[b]`; or not:
          then the walk's columns): each step's product, computed apart and selected at a
          partial step before it is added, as the value of the summed index changes from
          step to step (a factor's tile selected there would leave 0 * Inf from the other's).
        A condition no factor's tile can select alone (`k <= m`: y[k, n] lacks m) leaves the
        other factor `exposed`: the wrapper checks the result (`_present_value`)."""
        st, k, cond = self.st, self.k, self.cond
        for r in st.factors:
            op = k.operand(r.operand)
            if op.sparsity in ("coo", "mask"):
                fail(r.span, f"a `where` condition on a statement with a {op.sparsity} operand ('{op.name}') is not lowered for GPUs yet")
        if k.operand(st.target.operand).sparsity == "coo":
            fail(st.target.span, "a `where` condition on a statement with a coo output is not lowered for GPUs yet")
        self.used, self.out_c, self.sum_c = condition_axes(st)
        try:
            rule = selection(st, self.tile, self.used)
        except ScheduleError as exc:
            raise GpuError([exc.diagnostic]) from None
        self.both, self.exposed = False, None
        if rule.target == "group":
            self.sel_on = "a" if st.summed_groups[rule.group] is self.ga else "b"
            if rule.exposed is not None:
                spanned = {i for i in self.used if self.tile[i] > 1}
                if spanned <= set(st.factors[st.summed_groups[rule.exposed].main].indices):
                    self.both = True  # both tiles hold what the condition spans: both selected
                else:
                    self.exposed = rule
        else:  # the value written: once, or per step where a summed index is walked one value at a time
            self.sel_on = "step" if self.cond_sums else "out"
        inner = [i for i in st.summed if i not in self.sum_c]
        if self.extra_sums or any(i != self.kidx for i in inner):
            fail(st.span, "the GPU backend walks a condition's blocks along one summed index; this statement sums over "
                          f"{', '.join(st.summed)}")
        self.held_reads = []  # integer operands the condition reads along a dimension of the masked tile
        for r in dict.fromkeys(cond.reads):
            spanned = [i for i in r.indices if self.tile[i] > 1]
            if not spanned:
                continue
            if self.sel_on == "out":
                fail(r.span, f"the condition reads '{r.text}' along an index with a tile above 1, and selects in the "
                             f"output ({st.target.text}): the GPU backend masks the accumulator by positions and by "
                             "operands read one element at a time; not lowered for GPUs yet")
            if len(r.indices) != 1 or r.subs[0].shift:
                masked = st.target.text if self.sel_on == "step" else st.factors[self.ga.main if self.sel_on == "a" else self.gb.main].text
                fail(r.span, f"the condition reads '{r.text}' along an index with a tile above 1: the GPU backend reads one "
                             f"index of the tile it masks ({masked}), not shifted; not lowered for GPUs yet")
            self.held_reads.append(r)

    def masked_sides(self) -> tuple[str, ...]:
        """The tiles a partial step selects in: "a", "b" or both, or the product ("out", "step")."""
        return ("a", "b") if self.both else (self.sel_on,)

    def mask_dims(self, t, on: str | None = None) -> tuple[tuple[str, int], tuple[str, int]]:
        """The masked tile's dimensions (index, length) as it lies in shared memory (or the
        accumulator's); `on`: the side ("a" or "b"), by default the selection's."""
        on = on or self.sel_on
        if on in ("out", "step"):
            return (self.m, t.tm), (self.n, t.tn)
        mat = self.a if on == "a" else self.b
        dims = ((mat.row, t.tm), (mat.col, t.tk)) if on == "a" else ((mat.row, t.tk), (mat.col, t.cta_n))
        return dims[::-1] if mat.transposed else dims

    def held(self, t) -> tuple[int, int]:
        """Shared memory the condition's operand tiles take (int32, each masked tile's shape) and their barriers."""
        bytes_ = 0
        for on in self.masked_sides():
            (_, d0), (_, d1) = self.mask_dims(t, on)
            bytes_ += len(self.held_reads) * d0 * d1 * 4
        return bytes_, len(self.held_reads) * len(self.masked_sides())

    # ------------------------------------------------------------ a covered mask, in the kernel
    def fused_dims(self, t) -> tuple[int, int]:
        """The tile of the covered mask a consumer multiplies in, as it lies in shared memory:
        A's (tm x tk), or B's (tk x the consumer's columns); transposed where the factor is."""
        on, _ = self.fused
        mat = self.a if on == "a" else self.b
        dims = (t.tm, t.tk) if on == "a" else (t.tk, t.tn if t.wgs > 1 else t.cta_n)
        return dims[::-1] if mat.transposed else dims

    def fused_held(self, t) -> tuple[int, int]:
        """Shared memory (and barriers) the covered mask takes beside the pipeline: a tile of it per consumer."""
        _, mask = self.fused
        d0, d1 = self.fused_dims(t)
        return t.wgs * d0 * d1 * self.k.operand(mask.operand).dtype.itemsize, t.wgs

    def fused_selection(self) -> Selection:
        """The covered mask at a partial step: its tile copied into shared memory and multiplied
        into the covering factor's in place before the WGMMA (warp-specialized, B's: each
        consumer its own columns). An all-ones block's steps read no mask."""
        on, mask = self.fused
        t, names = self.t, self.names
        ws = t.wgs > 1
        mat = self.a if on == "a" else self.b
        mop = self.k.operand(mask.operand)
        mmat = Matrix(mop.name, self.mask_var, self.mask_coords, mat.row, mat.col, mat.transposed, False)
        if on == "a":
            index = self.matrix_index(mmat, t.bm // t.tm, t.ksub, "mi", "kk")
        else:  # the consumer's columns (the CTA's, one warpgroup)
            index = self.matrix_index(mmat, t.ksub, t.bn // t.tn, "kk", self.col_tile())
        d0, d1 = self.fused_dims(t)
        at = ", ".join(render(ds(i, d), "py") for i, d in zip(index, (d0, d1)))
        ref, smem, barrier = names.local(f"{mop.name}_gmem"), names.local(f"{mop.name}_smem"), names.local(f"{mop.name}_barrier")
        mine = ".at[wg]" if ws else ""
        dtype = self.k.operand(mat.operand).dtype.jnp
        if ws:
            alloc = f"{smem}=plgpu.SMEM(({t.wgs}, {d0}, {d1}), {mop.dtype.jnp}), {barrier}=plgpu.Barrier(num_barriers={t.wgs})"
        else:
            alloc = f"{smem}=plgpu.SMEM(({d0}, {d1}), {mop.dtype.jnp}), {barrier}=plgpu.Barrier()"
        lines = [f"plgpu.copy_gmem_to_smem({ref}.at[{at}], {smem}{mine}, {barrier}{mine})",
                 f"plgpu.barrier_wait({barrier}{mine})"]
        tile = f"@{on.upper()}@"  # the tile the emitter names
        chunk = _fused_chunk(d0, d1)
        at_rows = "" if chunk == d0 else ".at[rows]"
        if self.k.operand(mat.operand).dtype.itemsize == 1:
            # Mosaic GPU has no 8-bit arithmetic: in int32, rounded back (an i8 product wraps, as the operand must be i8).
            value = f"({tile}{at_rows}[...].astype(jnp.int32) * {smem}{mine}{at_rows}[...].astype(jnp.int32)).astype({dtype})"
        else:
            value = f"{tile}{at_rows}[...] * {smem}{mine}{at_rows}[...].astype({dtype})"
        if chunk == d0:
            lines.append(f"{tile}[...] = {value}")
        else:
            lines += [f"for r in range(0, {d0}, {chunk}):",
                      f"    # {chunk} rows at a time: the tiles' registers beside the accumulator's stay in the budget",
                      f"    rows = pl.ds(r, {chunk})",
                      f"    {tile}{at_rows}[...] = {value}"]
        lines.append("plgpu.commit_smem()  # the product, visible to the WGMMA")
        bytes_, barriers = self.fused_held(t)
        return Selection(on, f"{self.fused_kinds}[step] == _PARTIAL", lines, list(self.step_lets),
                         [(ref, self.mask_var, (smem, barrier), alloc)], bytes_, barriers,
                         about=f"{mask.text} multiplies {mat.operand}'s tile (a partial block of {mop.name}; an all-ones one is not read)")

    def tile_start(self, i: str) -> Expr:
        """The first position along `i` of the masked tile (or the output tile)."""
        t = self.t
        if i == self.kidx:
            return Var(self.kvar) * t.bk + self.sub("kk", t.ksub) * t.tk
        if i == self.m:
            return Var(self.var_of[i]) * t.bm + self.sub("mi", t.bm // t.tm) * t.tm
        return Var(self.var_of[i]) * t.bn + self.sub("ni", t.bn // t.cta_n) * t.cta_n

    def scalar(self, i: str) -> Expr:
        """An index walked one value at a time: a grid coordinate, or a summed index of the condition's columns."""
        if i in self.var_of:
            return Var(self.var_of[i])
        fail(self.st.span, f"the condition's index '{i}' is neither a coordinate nor spanned by the tile it masks: not lowered for GPUs yet")

    def condition_lines(self, on: str | None = None) -> tuple[list[str], list[tuple]]:
        """The condition evaluated over the masked tile of side `on` (`present`), and what it copies."""
        names, cond, k = self.names, self.cond, self.k
        dims = self.mask_dims(self.t, on)
        shape = py_tuple(str(d) for _, d in dims)
        lines, pos, held, smem_of = [], {}, [], {}
        for r in self.held_reads:
            op = k.operand(r.operand)
            i = r.indices[0]
            d = [x for x, _ in dims].index(i)
            width = dims[1 - d][1]
            array, ref = names.local(f"{op.name}_{'rows' if d == 0 else 'cols'}"), names.local(f"{op.name}_gmem")
            smem, barrier = names.local(f"{op.name}_smem"), names.local(f"{op.name}_barrier")
            whole = self.ctx.blocks(i) * self.tile[i]
            padded = render(whole, "host")
            src = f"jnp.pad({self.conv.param(op.name).internal}.astype(jnp.int32), (0, {render(whole - self.conv.size(op.dims[0]), 'host')}))"
            self.host.append(f"{array} = jnp.broadcast_to({src}[{':, None' if d == 0 else 'None, :'}], "
                             f"{'(' + padded + ', ' + str(width) + ')' if d == 0 else '(' + str(width) + ', ' + padded + ')'})"
                             f"  # {r.text} along the {'rows' if d == 0 else 'columns'} of {op.name}'s tiles the condition masks")
            start = self.py(self.tile_start(i))
            at = f"pl.ds({start}, {dims[d][1]}), pl.ds(0, {width})" if d == 0 else f"pl.ds(0, {width}), pl.ds({start}, {dims[d][1]})"
            lines += [f"plgpu.copy_gmem_to_smem({ref}.at[{at}], {smem}, {barrier})", f"plgpu.barrier_wait({barrier})"]
            held.append((ref, array, (smem, barrier), f"{smem}=plgpu.SMEM({shape}, jnp.int32), {barrier}=plgpu.Barrier()"))
            smem_of[r] = smem
        scalar_tables = {}

        def leaf(term) -> str:
            if term.op == "index":
                i = term.name
                if any(i == x for x, _ in dims):
                    if i not in pos:
                        pos[i] = names.local(f"{i}_pos")
                        d = [x for x, _ in dims].index(i)
                        lines.append(f"{pos[i]} = lax.broadcasted_iota(jnp.int32, {shape}, {d}) + "
                                     f"jnp.full({shape}, {self.py(self.tile_start(i))}, jnp.int32)")
                    return pos[i]
                return f"jnp.full({shape}, {self.py(self.scalar(i))}, jnp.int32)"
            if term.op == "size":
                v = self.conv.size_var(term.name)
                self.statics.add(v)
                return f"jnp.full({shape}, {v}, jnp.int32)"
            r = term.read
            if r in smem_of:
                v = f"{smem_of[r]}[...]"
            else:
                op = k.operand(r.operand)
                if op.name not in scalar_tables:
                    table = names.local(f"{op.name}_flat")
                    self.host.append(f"{table} = {self.conv.param(op.name).internal}.reshape(-1).astype(jnp.int32)")
                    self.tables.append((table, f"{op.name}, flattened: the condition reads one element"))
                    scalar_tables[op.name] = table
                at = Const(0)
                for d, sub in enumerate(r.subs):
                    value = self.scalar(sub.index) + sub.shift if sub.shift else self.scalar(sub.index)
                    at = at * self.conv.size(op.dims[d]) + value if d else value
                v = f"jnp.full({shape}, {scalar_tables[op.name]}[{self.py(at)}], jnp.int32)"
            return f"({v} != 0)" if term.op == "truth" else v

        present = render_term(cond, leaf)
        lines.append(f"present = {present}")
        return lines, held

    def condition_walk(self) -> tuple[str, str]:
        """The schedule's classification of the condition's blocks (`Classifier`: per row, the
        output blocks along the indices it reads; per column, the summed blocks) as the walk's
        tables. Selecting out of A or B: an output block's steps are its row's non-empty
        columns (each the summed blocks the condition does not read, walked inside), a
        partial step masking the tile it reads (or, selecting per step, its own product).
        Selecting out of the accumulator: an output
        block whose row is empty runs no step (zeros); the others run every step and the
        condition masks the accumulator before it is stored."""
        names, t, k, cond = self.names, self.t, self.k, self.cond
        out_c, sum_c = self.out_c, self.sum_c
        scope = names.scope()
        cl = Classifier(Conditions((Point(None, None, cond),), tuple(out_c + sum_c), k), self.conv, scope.local,
                        lambda i: self.tile[i], self.ctx.size)
        body = cl.kinds([])
        data = bool(cond.reads)
        fn, kinds = names.local("classify"), names.local("cond_kinds")
        rows, cols = Const(1), Const(1)
        for i in out_c:
            rows = rows * self.ctx.blocks(i)
        for i in sum_c:
            cols = cols * self.ctx.blocks(i)
        R, C = render(rows, "host"), render(cols, "host")
        self.host.append(f"# The condition's blocks, classified as on every target: per (row: output blocks along "
                         f"{', '.join(out_c)}) x (column: blocks of the summed {', '.join(sum_c)}), _EMPTY, _PARTIAL or _FULL.")
        self.host += [f"def {fn}(xp):", *("    " + line for line in body)]
        self.host.append(f"{kinds} = jnp.asarray({fn}({'jnp' if data else 'np'})).reshape({R}, {C})")
        # The CTA's row of the condition: its output block along out_c, row-major.
        key = names.local("cond_row")
        values, extents = [], []
        for i in out_c:
            v = Var(self.var_of[i])
            values.append(v.div(self.tile[i]) if i in self.coords and self.tile[i] != 1 else v)
            extents.append(self.ctx.blocks(i))
        self.kernel_lets.append((key, self.py(flat(values, extents))))
        if self.sel_on == "out":
            row_kinds = names.local("cond_row_kinds")
            self.host.append(f"{row_kinds} = {kinds}.max(axis=1)  # the same for every column: the condition reads no summed index")
            self.tables.append((row_kinds, f"_EMPTY (no step: zeros), _PARTIAL or _FULL: each row of output blocks along {', '.join(out_c)}"))
            self.count = self.py(Where(Load(row_kinds, Var(key)).eq(Var("_EMPTY")), 0, self.KB * t.ksub))
            return "condition output", row_kinds
        order_t, start_t, count_t = names.local("cond_order"), names.local("cond_start"), names.local("cond_count")
        col_t, kind_t = names.local("cond_col"), names.local("cond_kind")
        # Each (row, column) pair's position, row-major: its row is position // columns.
        pos = Lit(f"jnp.arange({render(rows * cols, 'host')}, dtype=jnp.int32)")
        self.host += [f"{order_t}, {start_t}, {count_t} = _walk(jnp.where(({kinds} != _EMPTY).reshape(-1), "
                      f"{render(pos.div(cols), 'host')}, {R}), {R})",
                      f"{col_t} = ({render(Var(order_t).rem(cols), 'host')}).astype(jnp.int32)  # the column of each step",
                      f"{kind_t} = {kinds}.reshape(-1)[{order_t}].astype(jnp.int32)  # _PARTIAL: the condition is evaluated"]
        self.tables += [(start_t, "the first step of each row of the condition"), (count_t, "the non-empty columns of each row"),
                        (col_t, f"the column of each step: its block of {', '.join(sum_c)}"), (kind_t, "the kind of each step")]
        inner = self.KB if self.kidx not in sum_c else Const(1)
        self.start = render(Load(start_t, Var(key)), "py")
        self.count = self.py(Load(count_t, Var(key)) * (inner * t.ksub))
        block = Var("s").div(t.ksub)
        pair = block.div(inner) if self.kidx not in sum_c else block
        self.step_lets.append(("step", self.clamped_step(pair, col_t)))
        col = names.local("col_block")
        self.step_lets.append((col, f"{col_t}[step]"))
        for n_, i in enumerate(sum_c):
            later = Const(1)
            for j in sum_c[n_ + 1:]:
                later = later * self.ctx.blocks(j)
            value = Var(col).div(later)
            if n_ > 0:
                value = value.rem(self.ctx.blocks(i))
            self.step_lets.append((self.kvar if i == self.kidx else self.var_of[i], self.py(value)))
        if self.kidx not in sum_c:
            self.step_lets.append((self.kvar, self.py(block.rem(inner))))
        self.block_products = self.cells * cols * inner  # at most: every column of a row
        return "condition", kind_t

    def selection(self, kind_t: str) -> Selection:
        """The condition at a partial step (or on the accumulator): kernel lines."""
        if self.sel_on in ("out", "step"):
            lines, held = self.condition_lines()
        if self.sel_on == "out":
            lines.append(f"acc = jnp.where(present, acc, jnp.zeros({py_tuple(map(str, (self.t.tm, self.t.tn)))}, acc.dtype))")
            return Selection("out", "", lines, [], [])
        bytes_, barriers = self.held(self.t)
        kind = f"{kind_t}[step] == _PARTIAL"
        if self.sel_on == "step":
            shape = py_tuple(str(d) for _, d in self.mask_dims(self.t))
            lines.append(f"return jnp.where(present, value, jnp.zeros({shape}, value.dtype))")
            return Selection("step", kind, lines, list(self.step_lets), held, bytes_, barriers,
                             about="its product (every step's is computed apart, in a second accumulator, then added to the running "
                                   "one) zeroed where the condition is false before it is added")
        lines, held = [], []
        for on in self.masked_sides():
            # `@A@`, `@B@`: the tile the emitter names (warp-specialized, the consumer's columns).
            more, kept = self.condition_lines(on)
            dtype = self.k.operand((self.a if on == "a" else self.b).operand).dtype.jnp
            shape = py_tuple(str(d) for _, d in self.mask_dims(self.t, on))
            tile = f"@{on.upper()}@"
            lines += more + [f"{tile}[...] = jnp.where(present, {tile}[...], jnp.zeros({shape}, {dtype}))"]
            held += kept
        lines.append("plgpu.commit_smem()  # the masked tile, visible to the WGMMA")
        about = ""
        if self.both:
            # Both factors hold the indices the condition spans: a NaN or Inf in either never meets an absent term.
            about = (f"Some terms absent: the condition selects them out of both {self.a.operand}'s and {self.b.operand}'s "
                     "tiles before the WGMMA (a NaN or Inf in either never meets an absent term).")
        return Selection(self.sel_on, kind, lines, list(self.step_lets), held, bytes_, barriers, about=about)

    # ------------------------------------------------------------ tiles each step reads
    def sub(self, name: str, count: int) -> Expr:
        """A CTA's (or step's) tile within its block: always 0 where the block is one tile."""
        return Var(name) if count > 1 else Const(0)

    def matrix_index(self, mat: Matrix, row_tiles: int, col_tiles: int, row_sub: str, col_sub: "str | Expr") -> tuple[Expr, ...]:
        """The tile a step reads: block coordinates times tiles per block, plus the tile inside
        (`col_sub` a name, or the expression of it)."""
        lead, other = (mat.col, mat.row) if mat.transposed else (mat.row, mat.col)
        if mat.stored:
            # Stored block s is rows s*tile.. of the matrix, along `lead`.
            first, second = Var("stored"), Const(0)
        else:
            value = {i: Var(self.kvar) if i == self.kidx else Var(self.var_of[i]) for i in (mat.row, mat.col)}
            first, second = self.rows_of(() if mat.lead else mat.coords, value[lead], self.blocks(lead)), value[other]
        r, c = (second, first) if mat.transposed else (first, second)
        rr = self.kernel_expr(r * row_tiles + self.sub(row_sub, row_tiles))
        cc = self.kernel_expr(c * col_tiles + (col_sub if isinstance(col_sub, Expr) else self.sub(col_sub, col_tiles)))
        return self.leading(mat) + ((cc, rr) if mat.transposed else (rr, cc))

    def leading(self, mat: Matrix) -> tuple[Expr, ...]:
        """A matrix's coordinates where they are leading dimensions (`lead`): their values."""
        return tuple(self.kernel_expr(self.coord_value(c)) for c in mat.coords) if mat.lead else ()

    def col_tile(self) -> Expr:
        """The output's column tile (of tn) inside its block: the CTA's (`ni`), or, warp-specialized,
        the consumer's (`wg`) within the CTA's."""
        t = self.t
        if t.wgs == 1:
            return self.sub("ni", t.bn // t.tn)
        return self.sub("ni", t.bn // t.cta_n) * t.wgs + Var("wg")

    def out_tile(self, mat: Matrix) -> tuple[Expr, ...]:
        t = self.t
        r = self.rows_of(() if mat.lead else mat.coords, Var(self.var_of[self.m]), self.ctx.blocks(self.m))
        return self.leading(mat) + (self.kernel_expr(r * (t.bm // t.tm) + self.sub("mi", t.bm // t.tm)),
                                    self.kernel_expr(Var(self.var_of[self.n]) * (t.bn // t.tn) + self.col_tile()))

    # ------------------------------------------------------------ the pass
    def lower(self) -> ProductPass:
        st, k, names = self.st, self.k, self.names
        self.roles()
        m, n, kidx = self.m, self.n, self.kidx
        out_op = k.operand(st.target.operand)
        # An integer product whose covered factor can leave the factor's dtype (`covered_dtype`):
        # both sides in a float dtype WGMMA takes, formed by the wrapper, summed in f32.
        rules = [(g, covered_dtype(k.operand(st.factors[g.main].operand).dtype,
                                   tuple(k.operand(st.factors[e].operand).dtype for e in g.extras))) for g in (self.ga, self.gb)]
        wide = matrix_dtype(tuple(d for _, (d, _) in rules), k.accumulate)
        self.wide = wide if wide.is_float and not k.accumulate.is_float else None
        covered = tuple(f"{' * '.join(st.factors[i].operand for i in (g.main, *g.extras))} for WGMMA: {why}"
                        for g, (_, why) in rules if why is not None)
        if self.wide:
            covered += (f"both sides in {wide.name}, summed in f32" + (" (tf32: exact for integers up to 2048)" if wide.name == "f32" else ""),)
        self.a, self.a_mask = self.side(self.ga, m, kidx, False)
        self.b, self.b_mask = self.side(self.gb, kidx, n, True)
        da, db = (self.wide, self.wide) if self.wide else (k.operand(self.a.operand).dtype, k.operand(self.b.operand).dtype)
        if da.name != db.name:
            fail(k.operand(self.b.operand).dtype_span, f"WGMMA multiplies two factors of one dtype; '{self.a.operand}' is {da.name}, "
                                                       f"'{self.b.operand}' is {db.name}")
        integer = not da.is_float  # s8 factors: WGMMA accumulates in s32
        want = "i32" if integer else "f32"
        acc = DTYPES["f32"] if self.wide else k.accumulate  # a wide product's sum: f32, cast to the i32 output
        if acc.name != want:
            fail(k.accumulate_span or k.tile_span, f"accumulate {k.accumulate.name}: WGMMA accumulates {da.name} products in {want}")
        if not out_op.dtype.is_float and not ((integer or self.wide) and out_op.dtype.name == "i32"):
            fail(out_op.dtype_span, f"the GPU backend writes float outputs (or i32 for i8 factors); '{out_op.name}' is {out_op.dtype.name}")
        self.after_sum()
        if integer and (self.end is not None or st.scale is not None):
            what = f"'{self.end.operand}' after the sum" if self.end is not None else "a constant factor"
            fail(st.span, f"{what} on an i8 product (s32 on the GPU): not lowered for GPUs yet; apply it to the result")
        end_dtype = k.operand(self.end.operand).dtype if self.end else None
        if self.cond is not None:
            self.condition_plan()
        # A condition walk keeps one warpgroup: a partial step masks the tile consumers would
        # share; so does a covered mask on A's side (warp-specialized consumers split B's columns).
        # Each consumer multiplying into its own copy of A instead needs a WGMMA in either branch
        # of the partial step's test, which spilled (28 bytes at 64 x 128 a consumer, measured).
        one_wg = self.cond is not None or (self.fused is not None and self.fused[0] == "a")
        vectors = tuple((v.axis, v.dtype.itemsize) for v in self.vectors)
        held = self.held if self.cond is not None else self.fused_held if self.fused is not None else (lambda _: (0, 0))
        self.t = t = product_tiles(k, self.ctx.target, m, n, kidx, da, out_op.dtype, end_dtype, one_warpgroup=one_wg,
                                   held=held, vectors=vectors, multiplies=self.fused is not None,
                                   step_product=self.cond is not None and self.sel_on == "step")
        if self.fused is not None and _fused_chunk(*self.fused_dims(t)) is None:
            # A tile the kernel cannot multiply (under 64 rows): the wrapper forms the product, as before.
            return ProductLowering(self.ctx, self.st, self.choice, fuse=False).lower()
        self.KB = self.ctx.blocks(kidx)
        for i in self.extra_sums:
            self.KB = self.ctx.size(i) * self.KB
        if self.extra_sums and any(s.place == "sum" for s in self.skipped()):
            fail(st.span, f"the GPU backend skips blocks along one summed index; this statement sums over {', '.join(st.summed)}")
        walk, sparse = ("condition", None) if self.cond is not None else self.walk_of()
        self.var_of = {i: names.local(f"{i}_block" if i in (m, n) else i) for i in (*self.coords, m, n, *self.cond_sums)}
        self.kvar = names.local(f"{kidx}_block")
        self.guard: list[str] = []
        kind_table = cond_kinds = None
        if walk == "coo output":
            ncells = self.requested_cells()
        else:
            ncells = self.dense_cells()
            self.cells, self.block_products = ncells, ncells * self.KB
            if walk == "condition":
                walk, cond_kinds = self.condition_walk()
            elif walk in ("rows", "cols"):
                self.line_walk(walk, sparse)
            elif walk == "output mask":
                kind_table = self.output_mask(sparse)
        if not self.step_lets:
            self.step_lets.append((self.kvar, render(Var("s").div(t.ksub), "py")))
        if t.ksub > 1:
            self.step_lets.insert(0, ("kk", f"s % {t.ksub}"))
        selection = self.selection(cond_kinds) if self.cond is not None else self.fused_selection() if self.fused else None
        a_index = self.matrix_index(self.a, t.bm // t.tm, t.ksub, "mi", "kk")
        b_index = self.matrix_index(self.b, t.ksub, t.bn // t.cta_n, "kk", "ni")  # the CTA's columns (all its consumers')
        out_coords = self.coords_of(st.target)
        if walk == "coo output":
            out_index = (Var("cell") * (t.bm // t.tm) + self.sub("mi", t.bm // t.tm), self.col_tile())
        else:
            out_index = self.out_tile(Matrix(out_op.name, "", out_coords, m, n, False, False, lead=bool(out_coords)))
        end_index = self.out_tile(self.end) if self.end is not None else None
        vecs = tuple(self.vector_tile(v) for v in self.vectors)
        self.kernel_lets.append(("start", self.start))  # the count is the chunk's: the work list's (`steps` per block)

        # The wrapper's result: the kernel's 2-D output as the operand.
        out_var, raw = names.local(st.target.operand), names.local(f"{st.target.operand}_matrix")
        raw_shape = None
        if walk == "coo output":
            rows_first = st.target.indices.index(m) < st.target.indices.index(n)
            finish = [f"{out_var} = {raw}.reshape(-1, {t.bm}, {t.bn})" + ("" if rows_first else ".transpose(0, 2, 1)")]
        else:
            # The kernel writes the output through TMA stores, which clip a tile at the array's
            # edges: its coordinates leading dimensions (a store clips per batch), its rows m's
            # own (`_rows`), its columns n's own where `_width` allows for the tiles the
            # epilogue stores, so the wrapper slices nothing there.
            order = [c.index for c in out_coords] + [m, n]
            host = {i: render(self.ctx.size(i), "host") for i in order}
            stored = t.epi if t.wgs > 1 else t.tn
            dims = [host[i] for i in order[:-2]] + [f"_rows({host[m]}, {self.tile[m]})",
                                                    f"_width({host[n]}, {stored}, {out_op.dtype.itemsize})"]
            raw_shape = tuple(dims)
            inv = tuple(order.index(i) for i in st.target.indices)
            finish = [f"{out_var} = _unmatrix({raw}, {py_tuple(dims)}, {py_tuple(host[i] for i in order)}, {py_tuple(map(str, inv))})"]
        return ProductPass(
            statement=st, output=out_op.name, walk=walk, sparse=sparse, a=self.a, b=self.b, end=self.end,
            end_mask=self.end_mask, tiles=t, in_dtype=da, acc_dtype=acc, out_dtype=out_op.dtype, scale=st.scale,
            after_dtype=after_sum_dtype(acc, tuple(v.dtype for v in self.vectors) + ((end_dtype,) if end_dtype else ())),
            cell_coords=tuple((i, self.cell_extent(i)) for i in (*self.coords, m, n)), cells=ncells, host=self.host,
            guard=self.guard, tables=self.tables, kernel_lets=self.kernel_lets, a_index=a_index, b_index=b_index,
            out_index=out_index, end_index=end_index, step_lets=self.step_lets, steps=self.count, kind_table=kind_table, finish=finish,
            out_var=out_var, raw=raw, raw_shape=raw_shape, statics=tuple(sorted(self.statics)), names=names,
            fn=names.function(f"_{st.target.operand}_kernel"), call_fn=names.function(f"_{st.target.operand}_call"),
            block_products=self.block_products if walk != "coo output" else ncells * self.KB, flops_per_product=2 * t.bm * t.bn * t.bk,
            smem=smem_bytes(t, da.itemsize, out_op.dtype.itemsize, end_dtype.itemsize if end_dtype else 0,
                            held(t), vectors),
            selection=selection, vectors=vecs, covered=covered,
            exposed=self.cond is not None and self.exposed is not None and k.accumulate.is_float,
        )

    def vector_tile(self, v: EndVector) -> EndVector:
        """The vector's tile a CTA (a consumer, warp-specialized) reads: its coordinates, then
        the tile's rows (of tm) or columns (of tn) within the output block."""
        t = self.t
        if v.axis == "rows":
            r = self.rows_of(v.coords, Var(self.var_of[self.m]), self.ctx.blocks(self.m))
            return dataclasses.replace(v, index=self.kernel_expr(r * (t.bm // t.tm) + self.sub("mi", t.bm // t.tm)), length=t.tm)
        c = self.rows_of(v.coords, Var(self.var_of[self.n]), self.ctx.blocks(self.n))
        return dataclasses.replace(v, index=self.kernel_expr(c * (t.bn // t.tn) + self.col_tile()), length=t.tn)
