"""The calling convention of a generated kernel, derived once from the IR.

The emitter writes it (signature, argument checks, docstring), `verify` and the tests
build arguments from it, the simulator reads its tables through it.

- a dense or `mask` input is one array; an `index` input one int32 vector;
- a `coo` input is `NAME_blocks` (shape `(nb, *tile)` with tile-1 dimensions dropped;
  with them kept is accepted too) and one int32 coordinate vector `NAME_idx_d` per dimension;
- a `coo` output adds its coordinates `NAME_idx_d` after the inputs;
- a size no argument determines is a keyword named after its symbol.
"""

from __future__ import annotations

from dataclasses import dataclass

from .expr import Const, Expr, Var
from .ir import Kernel, Operand, Read, Size
from .names import ModuleNames


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
class OffsetUse:
    """One offset subscript: `index_op[position] + i` in dimension `dim` of `operand`."""

    statement: str  # the output its statement assigns
    operand: str
    dim: int
    param: str  # internal name of the index operand
    index_operand: str
    position: int
    tile: int
    max_start: Expr  # largest valid offset, over sizes
    what: str  # "x dim 0", for messages
    slot: int = 0  # its entry in the offsets array


@dataclass(frozen=True)
class Convention:
    params: tuple[Param, ...]
    sizes: tuple[SizeParam, ...]
    pads: tuple[tuple[str, str], ...]  # per coo operand: its padding flags (every coordinate -1), from _prepare
    offsets: str | None  # block offsets read from index operands, computed by _prepare
    offset_uses: tuple[OffsetUse, ...] = ()  # one slot of `offsets` each
    args: tuple[str, ...] | None = None  # the arrays a derived kernel receives, where not the params'

    def pad(self, operand: str) -> str:
        return dict(self.pads)[operand]

    def size(self, size: Size) -> Expr:
        """A size as an expression over the wrapper's size variables."""
        if size.literal is not None:
            return Const(size.literal)
        if size.product:  # `j // T` and `j % T`: j ranges over NP * T (language v2, section 2)
            out = None
            for f in size.product:
                x = Const(f) if isinstance(f, int) else Var(self.size_var(f))
                out = x if out is None else out * x
            return out
        return Var(self.size_var(size.symbol))

    def offset_slot(self, statement: str, operand: str, dim: int) -> int:
        return next(u.slot for u in self.offset_uses if (u.statement, u.operand, u.dim) == (statement, operand, dim))

    def param(self, operand: str, kind: str | None = None, dim: int | None = None) -> Param:
        return next(p for p in self.params if p.operand == operand and (kind is None or p.kind == kind) and (dim is None or p.dim == dim))

    def size_var(self, symbol: str) -> str:
        return next(s.internal for s in self.sizes if s.symbol == symbol)

    @property
    def impl_args(self) -> tuple[str, ...]:
        """What `_prepare` hands the kernel: the arrays, the padding flags, the offsets."""
        if self.args is not None:
            return self.args
        args = [p.internal for p in self.params if p.kind != "index"]  # tables are passed as they are
        args += [var for _, var in self.pads]
        return tuple(args + ([self.offsets] if self.offsets else []))


def stored_tiles(kernel: Kernel, op: Operand) -> tuple[int, ...]:
    """The tile shape of a coo operand's stored blocks, tile-1 dimensions dropped."""
    reads = [r for st in kernel.statements for r in (st.target, *st.reads) if r.operand == op.name]
    tiles = [kernel.index(s.index).tile for s in reads[0].subs]
    return tuple(t for t in tiles if t != 1)


def operand_indices(kernel: Kernel, op: Operand) -> tuple[str, ...]:
    """The indices an operand is read (or written) with: one per dimension."""
    reads = [r for st in kernel.statements for r in (st.target, *st.reads) if r.operand == op.name]
    return reads[0].indices


def table_operands(kernel: Kernel) -> set[str]:
    """The index operands read as tables in subscripts (`pages[b, j // T]`, language v2)."""
    found = set()

    def visit(read) -> None:
        for sub in read.subs:
            if sub.table is not None:
                found.add(sub.table.operand)
                visit(sub.table)

    for st in kernel.statements:
        for read in (st.target, *st.reads):
            visit(read)
        for c in (getattr(st, "value", None),):
            if isinstance(c, Read):
                visit(c)
    return found


def reads_through_tables(kernel: Kernel) -> bool:
    """Does some read of the kernel address an operand through a table?"""
    return bool(table_operands(kernel))


def carried_symbols(kernel: Kernel) -> dict[str, list[str]]:
    """Per symbol, the dense arguments whose shapes carry it (directly or through `h // n`)."""
    carried: dict[str, list[str]] = {s: [] for s, _ in kernel.symbols}
    tables = table_operands(kernel)
    for op in kernel.inputs:
        if op.sparsity in ("dense", "mask") or op.name in tables:
            for d in op.dims:
                if d.symbol is not None and op.name not in carried[d.symbol]:
                    carried[d.symbol].append(op.name)
    changed = True
    while changed:  # a relation G = H / n carries each symbol from the other
        changed = False
        for rel in kernel.relations:
            index_symbol = kernel.index(rel.index).size.symbol
            pair = [s for s in (rel.dim.symbol, index_symbol) if s is not None]
            if len(pair) == 2:
                for a, b in (pair, pair[::-1]):
                    if carried[a] and not carried[b]:
                        carried[b] = [f"{rel.what} (through {rel.index} // {rel.divisor})"]
                        changed = True
    return carried


def convention(kernel: Kernel, names: ModuleNames) -> Convention:
    params: list[Param] = []

    def add(public, operand, kind, dim, shape, dtype, about):
        params.append(Param(names.public.take(public), names.local(public), operand, kind, dim, shape, dtype, about))

    tile = {i.name: i.tile for i in kernel.indices}
    for op in kernel.inputs:
        dims = tuple(d.text for d in op.dims)
        if op.sparsity == "coo":
            indices = operand_indices(kernel, op)
            tiles = tuple(str(t) for t in stored_tiles(kernel, op))
            add(f"{op.name}_blocks", op.name, "blocks", None, ("nb", *tiles), op.dtype.name, f"the stored blocks of {op.name}")
            for d, idx in enumerate(indices):
                add(f"{op.name}_idx_{d}", op.name, "coords", d, ("nb",), "int32",
                    f"block coordinate of each stored block along {op.name} dim {d} (0 <= . < {_blocks(op, d, tile[idx])})")
        elif op.sparsity == "index" and op.name in table_operands(kernel):
            add(op.name, op.name, "table", None, dims, "int32", "a table of coordinates, read in subscripts")
        elif op.sparsity == "index":
            add(op.name, op.name, "index", None, dims, "int32", "block-aligned offsets")
        else:
            kind = "mask" if op.sparsity == "mask" else "dense"
            about = "dense; its all-zero blocks mark skipped work" if kind == "mask" else ""
            add(op.name, op.name, kind, None, dims, op.dtype.name, about)
    for out in kernel.outputs:
        if out.sparsity == "coo":
            for d, idx in enumerate(operand_indices(kernel, out)):
                add(f"{out.name}_idx_{d}", out.name, "out_coords", d, ("nb",), "int32",
                    f"block coordinate of each requested output block along {out.name} dim {d} (0 <= . < {_blocks(out, d, tile[idx])})")
    carried = carried_symbols(kernel)
    sizes = []
    for symbol, literal in kernel.symbols:
        holders = [op.name for op in kernel.operands if any(d.symbol == symbol for d in op.dims)]
        about = " and ".join(f"'{h}'" for h in holders) or "the kernel's conditions and expressions"  # a size only they name
        sizes.append(SizeParam(symbol, names.local(symbol), literal, not carried[symbol] and literal is None, about))
    coo = [op for op in kernel.operands if op.sparsity == "coo"]
    pads = tuple((op.name, names.local("pad" if len(coo) == 1 else f"{op.name}_pad")) for op in coo)
    offsets = names.local("offsets") if any(p.kind == "index" for p in params) else None  # index operands read as offsets
    conv = Convention(tuple(params), tuple(sizes), pads, offsets)
    # One slot per offset subscript: each is clamped to its own operand's extent.
    uses = []
    for st in kernel.statements:
        for read in (st.target, *st.factors):
            if read.operand not in {o.name for o in kernel.operands}:
                continue  # a local tensor
            op = kernel.operand(read.operand)
            for d, sub in enumerate(read.subs):
                if sub.offset is None:
                    continue
                index = kernel.index(sub.index)
                span = conv.size(op.dims[d]) - conv.size(index.size)
                uses.append(OffsetUse(st.target.operand, op.name, d, conv.param(sub.offset.operand).internal, sub.offset.operand,
                                      sub.offset.position, index.tile, span, f"{op.name} dim {d}", len(uses)))
    return Convention(conv.params, conv.sizes, pads, offsets, tuple(uses))


def _blocks(op: Operand, d: int, tile: int) -> str:
    dim = op.dims[d]
    if dim.literal is not None:
        return str(-(-dim.literal // tile))
    return f"ceil({dim.symbol} / {tile})" if tile != 1 else dim.symbol
