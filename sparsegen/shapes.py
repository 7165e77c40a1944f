"""Concrete shapes for a kernel without a device: default sizes, `--shape` parsing, the
calling convention's argument shapes for a stored-block count, and loading a module's code.
Shared by `verify` on every target and by `variants`.
"""

from __future__ import annotations

import math
import types

import numpy as np

from .callconv import convention, operand_indices, stored_tiles
from .ir import Kernel
from .names import ModuleNames


def default_shapes(kernel: Kernel) -> dict[str, int]:
    """Eight blocks of every tile that divides a symbol: big enough to pipeline, small to compile."""
    shapes = {}
    for symbol, literal in kernel.symbols:
        if literal is not None:
            continue
        tiles = [i.tile for i in kernel.indices if i.size.symbol == symbol]
        for st in kernel.statements:
            for r in (st.target, *st.factors):
                if r.operand not in {o.name for o in kernel.operands}:
                    continue  # a local tensor
                for d, s in zip(kernel.operand(r.operand).dims, r.subs):
                    if d.symbol == symbol and (s.offset is not None or s.divisor != 1):
                        tiles.append(kernel.index(s.index).tile)
        shapes[symbol] = 8 * math.lcm(*tiles) if tiles else 1024
    from .schedule.attention import whole_sizes

    shapes.update(whole_sizes(kernel))
    shapes.update(page_sizes(kernel))
    # A `h // n` relation: the smaller size follows from the larger one.
    for rel in kernel.relations:
        big = kernel.index(rel.index).size.symbol
        if big in shapes and rel.dim.symbol in shapes:
            shapes[big] = math.lcm(shapes[big], rel.divisor)
            shapes[rel.dim.symbol] = shapes[big] // rel.divisor
    return shapes


def page_sizes(kernel: Kernel) -> dict[str, int]:
    """A size read as a divisor (`j // T`, a page size): 16 tokens, a common serving page,
    where it divides the tile of its index (else the tile); the table's length then gives
    eight blocks of that index."""
    out = {}

    def visit(read) -> None:
        for sub in read.subs:
            if sub.table is not None:
                visit(sub.table)
                op = kernel.operand(sub.table.operand)
                last = sub.table.subs[-1]
                if isinstance(last.divisor, str):
                    tile = kernel.index(last.index).tile
                    page = 16 if tile % 16 == 0 else tile
                    out[last.divisor] = page
                    if op.dims[-1].symbol is not None:
                        out[op.dims[-1].symbol] = 8 * max(1, tile // page)

    for st in kernel.statements:
        for r in (st.target, *st.reads, *((st.value,) if hasattr(st, "value") and hasattr(st.value, "subs") else ())):
            visit(r)
    return out


def parse_shapes(text: str | None) -> dict[str, int]:
    """`M=4096,K=4096` -> {"M": 4096, "K": 4096}; ValueError on a malformed item or a size
    that is not positive."""
    out: dict[str, int] = {}
    for item in filter(None, (text or "").split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name.strip().isidentifier() or not value.strip().isdigit():
            raise ValueError(f"--shape takes NAME=INT items separated by commas, got {item!r}")
        if int(value) <= 0:
            raise ValueError(f"--shape {item.strip()}: sizes must be positive")
        out[name.strip()] = int(value)
    return out


def arg_structs(kernel: Kernel, env: dict[str, int], nb: int):
    """(shape, numpy dtype) per positional argument (the calling convention), and the keyword sizes."""
    conv = convention(kernel, ModuleNames(kernel))

    def dims(op):
        return tuple(d.literal if d.literal is not None else env[d.symbol] for d in op.dims)

    args = []
    for p in conv.params:
        op = kernel.operand(p.operand)
        if p.kind == "blocks":
            args.append(((nb, *stored_tiles(kernel, op)), op.dtype.np_dtype))
        elif p.kind == "table":
            args.append((dims(op), np.dtype(np.int32)))
        elif p.kind in ("coords", "out_coords", "index"):
            args.append(((nb,) if p.kind != "index" else dims(op), np.dtype(np.int32)))
        else:
            args.append((dims(op), op.dtype.np_dtype))
    keywords = {s: env[s] for s, lit in kernel.symbols if lit is None}
    return args, keywords


def sizes(kernel: Kernel, shapes: dict[str, int] | None) -> dict[str, int]:
    """Every size of a kernel for a compile without data: the defaults, `shapes` over them,
    the spec's literals over both."""
    env = {**default_shapes(kernel), **(shapes or {})}
    return {s: (lit if lit is not None else env[s]) for s, lit in kernel.symbols}


def differentiated(conv, dtypes, refused) -> tuple[int, ...]:
    """The argument positions `verify` differentiates to compile the backward: the float
    arrays whose gradients are derived (`refused`: autodiff.Refusal, the ones not)."""
    import jax.numpy as jnp

    not_derived = {r.operand for r in refused}
    return tuple(n for n, dtype in enumerate(dtypes) if jnp.issubdtype(dtype, jnp.floating) and conv.params[n].operand not in not_derived)


def concrete(kernel: Kernel, shapes: dict[str, int] | None, nnz: float):
    """What `verify` compiles a kernel for: every size (the defaults, `shapes` over them, the
    spec's literals), the stored-block count for `nnz`, the argument shapes and keywords."""
    env = sizes(kernel, shapes)
    nb = stored_blocks(kernel, env, nnz)
    args, keywords = arg_structs(kernel, env, nb or 0)
    return env, nb, args, keywords


def stored_blocks(kernel: Kernel, env: dict[str, int], nnz: float) -> int | None:
    """Stored (or requested) blocks for a density: `nnz` of the coo operand's block grid."""
    op = next((o for o in kernel.operands if o.sparsity == "coo"), None)
    if op is None:
        return None
    grid = 1
    for d, i in zip(op.dims, operand_indices(kernel, op)):
        size = d.literal if d.literal is not None else env[d.symbol]
        grid *= -(-size // kernel.index(i).tile)
    return max(1, round(nnz * grid))


def _load(code: str, name: str):
    module = types.ModuleType(name)
    exec(compile(code, f"<sparsegen {name}>", "exec"), module.__dict__)
    return module
