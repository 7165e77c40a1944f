"""What every walk shares: axes, tables, the blocks of factors and output, and the body's products.

A walk (one module each: dense, coo_input, kinds, coo_output) decides which blocks a pass
visits and in which order; this builder turns those decisions into the schedule's
vocabulary, so that each walk module says only what is particular to it.
"""

from __future__ import annotations

from ..callconv import Convention
from ..expr import Const, Expr, Load, Var
from ..expr import names as expr_names
from ..ir import Einsum, Kernel, Read
from ..names import ModuleNames
from ..source import Diagnostic
from .choice import choose_walk
from .core import Axis, Block, BlockDim, Body, Factor, FlushCase, Pass, Product, Table, Tail


class ScheduleError(Exception):
    """A statement the language allows but no walk can run yet (a Diagnostic at the spec)."""

    def __init__(self, diagnostic: Diagnostic):
        self.diagnostic = diagnostic
        super().__init__(diagnostic.message)


def operand_array(kernel: Kernel, conv: Convention, outputs: dict[str, str], read: Read) -> str:
    """The wrapper variable an operand is read from: its argument (a coo input's stored
    blocks), or the array of an output a statement above assigned (`outputs`). Every backend's."""
    op = kernel.operand(read.operand)
    if op.direction == "out":
        return outputs[op.name]
    return conv.param(op.name, "blocks" if op.sparsity == "coo" else None).internal


class PassBuilder:
    walk = ""

    def __init__(self, kernel: Kernel, conv: Convention, names: ModuleNames, statement: Einsum, prefix: str, outputs: dict[str, str]):
        self.k = kernel
        self.outputs = outputs  # outputs of statements above: their arrays in the wrapper
        self.conv = conv
        self.names = names
        self.st = statement
        self.prefix = prefix  # name prefix of this pass's functions when a module runs several
        self.out = kernel.operand(statement.target.operand)
        self.choice = choose_walk(kernel, statement)  # the walk and the operands whose blocks decide it
        self.tile = {i.name: i.tile for i in kernel.indices}
        self.axes: list[Axis] = []
        self.tables: list[Table] = []
        self.statics: dict[str, Expr] = {}
        self.kinds: list[str] = []
        self.host: list[str] = []
        self.guard: list[str] = []
        self.pre: list[str] = []
        self.counts: list[tuple[str, str]] = []

    # ------------------------------------------------------------ naming
    def local(self, preferred: str) -> str:
        return self.names.local(preferred)

    def fn(self, preferred: str) -> str:
        return self.names.function(f"_{self.prefix}{preferred}")

    # ------------------------------------------------------------ sizes
    def size(self, index: str) -> Expr:
        return self.conv.size(self.k.index(index).size)

    def blocks_along(self, index: str) -> Expr:
        return self.size(index).cdiv(self.tile[index])

    def ragged(self, index: str) -> bool:
        """Can the last block along `index` be partial (a symbolic size)?"""
        return self.k.index(index).size.literal is None and self.tile[index] > 1

    # ------------------------------------------------------------ grid
    def axis(self, role: str, index: str | None, extent: Expr, parallel: bool, about: str, var: str | None = None) -> Axis:
        var = var or self.local(index or role)
        a = Axis(var, role, index, extent, self.local(f"n_{var}"), parallel, about)
        self.axes.append(a)
        self.statics[a.static] = extent
        return a

    def axis_of(self, index: str) -> Axis:
        return next(a for a in self.axes if a.index == index)

    def table(self, preferred: str, length: Expr, about: str) -> str:
        var = self.local(preferred)
        self.tables.append(Table(var, length, about))
        return var

    def reduce_axes(self) -> list[Axis]:
        return [
            self.axis("reduce", i, self.blocks_along(i), False, f"the sum over {i}, innermost so each output block's visits are consecutive")
            for i in self.st.summed
        ]

    # ------------------------------------------------------------ blocks
    def dims(self, read: Read) -> tuple[BlockDim, ...]:
        out = []
        for sub in read.subs:
            t = self.tile[sub.index]
            if sub.divisor == 1:
                out.append(BlockDim(sub.index, t))
            elif sub.divisor % t == 0:
                out.append(BlockDim(sub.index, 1, sub.divisor))  # the block's values of the index share one element
            else:
                index = self.k.index(sub.index)
                raise ScheduleError(Diagnostic(
                    index.tile_span,
                    f"tile {sub.index} = {t} with `{sub.index} // {sub.divisor}`: a block of {sub.index} must share one element of '{read.operand}', so the tile must divide {sub.divisor}",
                ))
        return tuple(out)

    def coords(self, read: Read, coord_of) -> tuple[Expr, ...]:
        """Block coordinates of a read, given the block coordinate of each index."""
        out = []
        for d, sub in enumerate(read.subs):
            c = coord_of(sub.index)
            if sub.divisor != 1:
                c = c.div(sub.divisor // self.tile[sub.index])
            if sub.shift:  # a condition's read at `g + 1`, walked one value at a time
                c = c + sub.shift
            if sub.offset is not None:
                slot = self.conv.offset_slot(self.st.target.operand, read.operand, d)
                c = Load(self.conv.offsets, Const(slot)) + c
            out.append(c)
        return tuple(out)

    def array(self, read: Read) -> str:
        return operand_array(self.k, self.conv, self.outputs, read)

    def factor_block(self, n: int, coords, about: str = "", lets=()) -> Block:
        read = self.st.factors[n]
        op = self.k.operand(read.operand)
        dims = self.dims(read)
        if op.sparsity == "coo" and op.direction == "in":
            # The stored blocks: (nb, *tile) with tile-1 dimensions dropped.
            dims = (BlockDim(None, 1),) + tuple(d for d in dims if d.extent != 1)
        return Block(f"f{n}", op.name, self.array(read), op.sparsity == "coo", dims, tuple(coords), tuple(lets), about)

    def natural_block(self, n: int, coord_of, about: str = "") -> Block:
        return self.factor_block(n, self.coords(self.st.factors[n], coord_of), about)

    def out_block(self, coords, about: str = "", lets=(), stored: bool = False) -> Block:
        dims = self.dims(self.st.target)
        if stored:
            dims = (BlockDim(None, 1),) + tuple(d for d in dims if d.extent != 1)
        return Block("out", self.out.name, "", stored, dims, tuple(coords), tuple(lets), about, is_output=True)

    # ------------------------------------------------------------ body
    def factor(self, n: int, blocks: dict[str, Block]) -> Factor:
        b = blocks[f"f{n}"]
        return Factor(b.key, b.operand, b.live, self.k.operand(b.operand).dtype)

    def products(self, blocks: dict[str, Block]) -> tuple[tuple[Product, ...], tuple[Product, ...]]:
        """(the sum's groups, the factors applied after it)."""
        summed = tuple(Product(tuple(self.factor(n, blocks) for n in g.members)) for g in self.st.summed_groups)
        end = tuple(Product((self.factor(g.main, blocks),)) for g in self.st.end_groups)
        return summed, end

    def out_live(self, out: Block) -> tuple[str, ...]:
        return out.live

    def acc_layout(self, out: Block, summed) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The accumulator has the output block's indices (a sum that lacks some is broadcast)."""
        del summed
        return out.live, tuple(self.tile[i] for i in out.live)

    def tails(self, coord_at_compute) -> tuple[Tail, ...]:
        return tuple(Tail(i, coord_at_compute(i), self.conv.size_var(self.k.index(i).size.symbol), self.tile[i]) for i in self.st.summed if self.ragged(i))

    def reduction_body(self, blocks: dict[str, Block], compute_when: Expr | None = None, first=None, last=None) -> Body:
        """Init at the first step of the summed axes, flush at their last; no sum, no accumulator."""
        summed, end = self.products(blocks)
        out = blocks["out"]
        acc_live, acc_shape = self.acc_layout(out, summed)
        reduce = [a for a in self.axes if a.role == "reduce"]
        flush = (FlushCase(None, end, "flush", "Write the block."),)
        if not summed:
            return Body(False, None, None, (), (), None, flush, (), acc_live, acc_shape, out.live, out_tails=self.out_tails(out))
        init = first if first is not None else _all([Var(a.var).eq(0) for a in reduce])
        done = last if last is not None else _all([Var(a.var).eq(Var(a.static) - 1) for a in reduce])
        return Body(True, init, compute_when, summed, (), done, flush, self.st.summed, acc_live, acc_shape, out.live,
                    tails=self.tails(lambda i: Var(self.axis_of(i).var)), out_tails=self.out_tails(out))

    def out_tails(self, out: Block) -> tuple[Tail, ...]:
        """A stored output block is written whole: its elements past a ragged end are written as zeros."""
        return ()

    # ------------------------------------------------------------ result
    def finish(self, blocks: list[Block], body: Body, about: str, out_shape, block_products: Expr) -> Pass:
        flops = 1
        for i in self.st.indices:
            flops *= self.tile[i]
        # A multiply and an add per element of the block product; without a sum, one multiply per factor.
        flops = 2 * flops if self.st.summed else max(1, len(self.st.factors)) * flops
        offsets = self.conv.offsets
        if offsets and any(offsets in expr_names(e) for b in blocks for e in (*b.coords, *(v for _, v in b.lets))):
            self.tables.append(Table(offsets, Const(len(self.conv.offset_uses)), "block offsets read from index operands, one per offset subscript"))
        return Pass(
            statement=self.st,
            output=self.out.name,
            walk=self.walk,
            about=about,
            axes=tuple(self.axes),
            tables=tuple(self.tables),
            blocks=tuple(blocks),
            body=body,
            host=tuple(self.host),
            guard=tuple(self.guard),
            pre=tuple(self.pre),
            counts=tuple(self.counts),
            statics=tuple(self.statics.items()),
            out_shape=tuple(out_shape),
            out_dtype=self.out.dtype,
            block_products=block_products,
            flops_per_product=flops,
            accumulate=self.k.accumulate,
            scale=_scale(self.st),
            kinds=tuple(self.kinds),
            names=self.names,
        )

    def dense_out_shape(self) -> tuple[Expr, ...]:
        return tuple(self.conv.size(d) for d in self.out.dims)


def _all(conds: list[Expr]) -> Expr:
    out = conds[0]
    for c in conds[1:]:
        out = out & c
    return out


def _scale(st: Einsum):
    from ..ir import Number

    value = st.scale
    return None if value is None else Number(value)
