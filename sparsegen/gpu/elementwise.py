"""A statement without a sum on Mosaic GPU: factors with the output's indices, multiplied tile by tile.

A CTA per output tile copies each factor's tile into shared memory (TMA), multiplies them
in registers and stores the tile through shared memory. Offsets read a factor at a shifted
block; offsets on the left write a window, and the tiles outside it are written as zeros.
"""

from __future__ import annotations

from ..expr import Const, Expr, Load, Var, flat, names as expr_names, render
from ..ir import Einsum
from ..pytext import py_tuple
from ..schedule.choice import Walk
from .plan import ElementwisePass
from .rules import elementwise_smem_bytes, elementwise_tiles, fail


class ElementwiseLowering:
    def __init__(self, ctx, st: Einsum, walk: Walk):
        self.ctx, self.st = ctx, st
        self.choice = walk  # the schedule's walk (schedule.choose_walk)
        self.k, self.conv, self.tile, self.names = ctx.k, ctx.conv, ctx.tile, ctx.names
        self.target = ctx.target

    def size(self, index: str) -> Expr:
        return self.ctx.size(index)

    def source(self, read) -> str:
        return self.ctx.source(read)

    def fail(self, span, message: str):
        fail(span, message)

    def lower(self) -> ElementwisePass:
        st, k = self.st, self.k
        target, out_op = st.target, k.operand(st.target.operand)
        wide = [i for i in target.indices if self.tile[i] != 1]
        if len(wide) < 2:
            self.fail(k.tile_span, f"an elementwise statement on GPUs has 2-D blocks: {target.text} needs two indices with tiles above 1")
        r, c = wide[-2], wide[-1]
        # Of the schedule's walks, a tile-by-tile copy runs the dense one and the masked one (a
        # mask multiplied whole, a window written at offsets); not the coo ones.
        if self.choice.name == "coo output":
            self.fail(target.span, "elementwise statements with a coo output are not lowered for GPUs yet")
        coo = {s.factor for s in self.choice.of("coo")}
        for n, f in enumerate(st.factors):
            if n in coo:
                self.fail(f.span, f"'{f.text}' is coo in an elementwise statement: not lowered for GPUs yet")
            if set(f.indices) != set(target.indices):
                self.fail(f.span, f"'{f.text}': an elementwise statement on GPUs multiplies factors with the output's indices (broadcasts are not lowered yet)")
        for read in (target, *st.factors):
            for s in read.subs:
                if s.divisor != 1:
                    self.fail(read.span, f"'{s.text}' in an elementwise statement is not lowered for GPUs yet")
                if s.offset is not None and s.index not in (r, c) and self.tile[s.index] != 1:
                    self.fail(read.span, f"'{s.text}': on GPUs an offset outside the block's two dimensions takes tile 1")

        def unit(index: str) -> int:
            """Elements per grid step along an index: the tile in the block's two dimensions, else 1."""
            return self.tile[index] if index in (r, c) else 1

        names = self.names.scope()
        host: list[str] = []
        statics: set[str] = set()

        def used(e: Expr) -> Expr:
            """Kernel code: the size variables it reads become the kernel's statics."""
            statics.update(x for x in expr_names(e) if x in {s.internal for s in self.conv.sizes})
            return e

        def py(e: Expr) -> str:
            return render(used(e), "py")

        bm, bn = self.tile[r], self.tile[c]
        dtypes = [out_op.dtype] + [k.operand(f.operand).dtype for f in st.factors]
        tm, tn = elementwise_tiles(k, self.target, r, c, dtypes)
        var_of = {i: names.local(i) for i in target.indices}
        lets: list[tuple[str, str]] = []
        # The grid: the output array's blocks, row-major (a window's outside included).
        out_dims = [(d, s.index) for d, s in enumerate(target.subs)]
        order = [d for d, i in out_dims if i not in (r, c)] + [target.indices.index(r), target.indices.index(c)]
        extents = [self.conv.size(out_op.dims[d]).cdiv(unit(target.indices[d])) for d in order]
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
                inside += [value.ge(0), value.lt(self.size(s.index).cdiv(unit(s.index)))]
            lets.append((var_of[s.index], py(value)))
        offsets_used = any(s.offset is not None for read in (target, *st.factors) for s in read.subs)
        tables = [(self.conv.offsets, "block offsets read from index operands")] if offsets_used else []
        factors = []
        for n, f in enumerate(st.factors):
            op = k.operand(f.operand)
            forder = [d for d, s in enumerate(f.subs) if s.index not in (r, c)] + [f.indices.index(r), f.indices.index(c)]
            var = names.local(f"{f.operand}_matrix")
            tiles = tuple(str(self.tile[f.indices[d]]) if f.indices[d] in (r, c) else "1" for d in forder)
            host.append(f"{var} = _matrix({self.source(f)}, {py_tuple(map(str, forder))}, {py_tuple(tiles)})")

            def at(d, f=f):
                s = f.subs[d]
                value = Var(var_of[s.index])
                if s.offset is not None:
                    value = Load(self.conv.offsets, Const(self.conv.offset_slot(target.operand, f.operand, d))) + value
                return value

            lead = flat([at(d) for d in forder[:-1]], [self.conv.size(op.dims[d]).cdiv(unit(f.indices[d])) for d in forder[:-1]])
            index = (used(lead * (bm // tm) + (Var("mi") if bm > tm else Const(0))), used(at(forder[-1]) * (bn // tn) + (Var("ni") if bn > tn else Const(0))))
            factors.append({"operand": f.operand, "array": var, "dtype": op.dtype, "index": index, "ref": names.local(f"{f.operand}_gmem"),
                            "smem": names.local(f"{f.operand}_smem"), "barrier": names.local(f"{f.operand}_barrier")})
        out_rows = flat([blocks_at[d] for d in order[:-1]], extents[:-1])
        out_index = (used(out_rows * (bm // tm) + (Var("mi") if bm > tm else Const(0))), used(blocks_at[order[-1]] * (bn // tn) + (Var("ni") if bn > tn else Const(0))))
        out_var, raw = names.local(target.operand), names.local(f"{target.operand}_matrix")
        padded = [self.conv.size(out_op.dims[d]).cdiv(unit(target.indices[d])) * unit(target.indices[d]) for d in order]
        inv = tuple(order.index(d) for d in range(len(order)))
        finish = [f"{out_var} = _unmatrix({raw}, {py_tuple(render(e, 'host') for e in padded)}, "
                  f"{py_tuple(render(self.conv.size(out_op.dims[d]), 'host') for d in order)}, {py_tuple(map(str, inv))})"]
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
            smem=elementwise_smem_bytes(tm, tn, sum(d.itemsize for d in dtypes), len(st.factors)),
        )

