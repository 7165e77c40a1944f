"""Random arguments for a kernel, by sparsity pattern: for tests, `make run` and benchmarks.

Numpy only. `example_args(kernel, sizes, pattern, rng)` returns the positional arguments
of the generated function (its calling convention, `callconv`) and the size keywords it
needs.

Patterns (block level; `partial` blocks of a mask are mixed 0/1):
- random: about half the blocks, in shuffled order, one coordinate repeated;
- empty_lines: whole block rows and columns empty;
- duplicates: every stored block repeated at least once, unsorted;
- all_empty: nothing stored, or an all-zero mask;
- all_full: every block stored once, or an all-ones mask;
- tril: a causal (lower-triangular) mask / the blocks on or below the diagonal;
- padded: random, plus padding entries (every coordinate -1) among the stored or requested blocks.
"""

from __future__ import annotations

import math

import numpy as np

from .callconv import convention, operand_indices, stored_tiles, table_operands
from .dtypes import DTYPES
from .ir import Kernel, Operand
from .names import ModuleNames

PATTERNS = ("random", "empty_lines", "duplicates", "all_empty", "all_full", "tril", "padded")


def resolve_sizes(kernel: Kernel, sizes: dict[str, int]) -> dict[str, int]:
    """Every symbol's value: fixed ones from the spec, the rest from `sizes` (or a `h // n` relation)."""
    from .schedule.attention import whole_sizes

    out = {s: lit if lit is not None else sizes.get(s) for s, lit in kernel.symbols}
    out.update(whole_sizes(kernel))  # blocks that span their dimension fix its size
    for _ in range(2):
        for rel in kernel.relations:
            big, small = kernel.index(rel.index).size.symbol, rel.dim.symbol
            if out.get(small) is None and out.get(big) is not None:
                out[small] = out[big] // rel.divisor
            if out.get(big) is None and out.get(small) is not None:
                out[big] = out[small] * rel.divisor
    if any(v is None for v in out.values()):  # a page size, the table's length, the pages of a cache
        from .shapes import default_shapes

        defaults = default_shapes(kernel)
        out = {s: defaults.get(s) if v is None else v for s, v in out.items()}
    missing = [s for s, v in out.items() if v is None]
    if missing:
        raise KeyError(f"no size given for {', '.join(missing)}")
    return out


def dims(op: Operand, env: dict[str, int]) -> tuple[int, ...]:
    return tuple(d.literal if d.literal is not None else env[d.symbol] for d in op.dims)


def random_values(shape, dtype_name: str, rng: np.random.Generator) -> np.ndarray:
    dtype = DTYPES[dtype_name].np_dtype
    if dtype_name in ("f32", "bf16"):
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)
    if dtype_name.startswith("u"):
        return rng.integers(0, 4, shape).astype(dtype)
    return rng.integers(-3, 4, shape).astype(dtype)


def block_pattern(grid: tuple[int, ...], pattern: str, rng: np.random.Generator) -> list[tuple[int, ...]]:
    """Block coordinates (a list, maybe with repeats and padding entries) for a pattern over a block grid."""
    cells = [tuple(int(v) for v in c) for c in np.ndindex(*grid)]
    if pattern == "all_empty":
        return []
    if pattern == "all_full":
        return cells
    if pattern == "tril":
        return [c for c in cells if len(c) < 2 or c[-2] >= c[-1]]
    if pattern == "empty_lines":
        skip_rows = set(rng.choice(grid[0], size=max(1, grid[0] // 2), replace=False).tolist())
        skip_cols = set(rng.choice(grid[-1], size=max(1, grid[-1] // 2), replace=False).tolist()) if len(grid) > 1 else set()
        chosen = [c for c in cells if c[0] not in skip_rows and (len(c) < 2 or c[-1] not in skip_cols)]
        return chosen or [cells[-1]]
    chosen = [c for c in cells if rng.random() < 0.5] or [cells[0]]
    if pattern == "duplicates":
        chosen = chosen + [chosen[int(i)] for i in rng.integers(0, len(chosen), size=len(chosen))]
    else:  # random, padded
        chosen.append(chosen[int(rng.integers(0, len(chosen)))])
    if pattern == "padded":
        chosen += [(-1,) * len(grid)] * 2
    order = rng.permutation(len(chosen))
    return [chosen[int(i)] for i in order]


def _mask(shape, tiles, pattern: str, rng: np.random.Generator, dtype_name: str) -> np.ndarray:
    dtype = DTYPES[dtype_name].np_dtype
    if pattern == "tril" and len(shape) >= 2:
        return np.broadcast_to(np.tril(np.ones(shape[-2:], np.int32)), shape).astype(dtype)
    if pattern == "all_full":
        return np.ones(shape, dtype)
    grid = tuple(-(-s // t) for s, t in zip(shape, tiles))
    mask = np.zeros(shape, np.int32)
    nonzero = {c for c in block_pattern(grid, pattern, rng) if c[0] >= 0}
    for c in sorted(nonzero):
        sl = tuple(slice(i * t, (i + 1) * t) for i, t in zip(c, tiles))
        view = mask[sl]
        kind = rng.integers(0, 3)
        if kind == 0:
            view[...] = 1  # full
        elif kind == 1:
            view[...] = (rng.random(view.shape) < 0.5).astype(np.int32)  # partial 0/1
            view[(0,) * len(tiles)] = 1  # never all zero
        else:
            view[...] = 2  # all nonzero but not ones: still needs the multiply
    return mask.astype(dtype)


def _is_data_mask(kernel: Kernel, op: Operand) -> bool:
    """A mask that takes part in a sum is data (random values on its nonzero blocks)."""
    for st in kernel.statements:
        for n, r in enumerate(st.factors):
            if r.operand == op.name and any(n in g.members for g in st.summed_groups):
                return True
    return False


def example_args(kernel: Kernel, sizes: dict[str, int], pattern: str, rng: np.random.Generator):
    """(positional args, keyword sizes) for the generated function `kernel.name`."""
    env = resolve_sizes(kernel, sizes)
    tile = {i.name: i.tile for i in kernel.indices}
    conv = convention(kernel, ModuleNames(kernel))
    args: list = []
    coords: dict[str, list[tuple[int, ...]]] = {}
    offsets = _offsets(kernel, env, rng)
    for p in conv.params:
        op = kernel.operand(p.operand)
        if p.kind == "index":
            args.append(offsets[op.name])
            continue
        if p.kind == "table":  # entries address the dimension the table is read at
            args.append(rng.integers(0, _addressed(kernel, op.name, env), dims(op, env)).astype(np.int32))
            continue
        shape = dims(op, env)
        tiles = tuple(tile[i] for i in operand_indices(kernel, op))
        grid = tuple(-(-s // t) for s, t in zip(shape, tiles))
        if p.kind in ("blocks", "out_coords") and op.name not in coords:
            coords[op.name] = block_pattern(grid, pattern, rng)
        if p.kind == "blocks":
            args.append(random_values((len(coords[op.name]), *stored_tiles(kernel, op)), op.dtype.name, rng))
        elif p.kind in ("coords", "out_coords"):
            args.append(np.array([c[p.dim] for c in coords[op.name]], np.int32))
        elif p.kind == "mask":
            mask = _mask(shape, tiles, pattern, rng, op.dtype.name)
            if _is_data_mask(kernel, op):
                mask = (random_values(shape, op.dtype.name, rng).astype(np.float32) * (mask != 0)).astype(op.dtype.np_dtype)
            args.append(mask)
        else:
            args.append(random_values(shape, op.dtype.name, rng))
    keywords = {s.symbol: env[s.symbol] for s in conv.sizes if s.keyword_only}
    return args, keywords


def _addressed(kernel: Kernel, table: str, env) -> int:
    """The smallest extent among the dimensions a table's entries address."""
    sizes = []
    for st in kernel.statements:
        for r in (st.target, *st.reads, *((st.value,) if hasattr(getattr(st, "value", None), "subs") else ())):
            for d, sub in enumerate(r.subs):
                if sub.table is not None and sub.table.operand == table:
                    sizes.append(dims(kernel.operand(r.operand), env)[d])
    return min(sizes)


def _offsets(kernel: Kernel, env, rng) -> dict[str, np.ndarray]:
    """Aligned, in-range offsets for every index operand: one offset may be read by operands
    of different extents and tiles, so it is valid for all of them."""
    limits: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for st in kernel.statements:
        for r in (st.target, *st.factors):
            if not any(s.offset for s in r.subs):
                continue
            op = kernel.operand(r.operand)
            for d, s in enumerate(r.subs):
                if s.offset is None:
                    continue
                index = kernel.index(s.index)
                extent = index.size.literal if index.size.literal is not None else env[index.size.symbol]
                limits.setdefault((s.offset.operand, s.offset.position), []).append((dims(op, env)[d] - extent, index.tile))
    out = {}
    for op in kernel.inputs:
        if op.sparsity != "index" or op.name in table_operands(kernel):
            continue
        values = np.zeros(op.dims[0].literal, np.int32)
        for (name, position), uses in limits.items():
            if name != op.name:
                continue
            step = math.lcm(*(t for _, t in uses))
            top = min(limit for limit, _ in uses)
            values[position] = int(rng.integers(0, top // step + 1)) * step
        out[op.name] = values
    return out


# Unit roundoff of each float dtype.
_EPS = {"f32": 2.0**-24, "bf16": 2.0**-8}


def tolerance(kernel: Kernel, output: str, env: dict[str, int] | None = None) -> tuple[float, float]:
    """(rtol, atol as a fraction of max|reference|) for one output of a kernel.

    The reference sums in f32 at full precision; the kernel rounds once to the output dtype,
    once per covered factor multiplied into a factor of its dtype, and accumulates in f32
    (error growing like the square root of the sum's length). A kernel that accumulates in
    bf16 instead is off by about 2^-8 * sqrt(length): caught for any sum of 64 or more.
    """
    out = kernel.operand(output)
    if not out.dtype.is_float:
        return 0.0, 0.0
    st = kernel.statement_of(output)
    if not hasattr(st, "summed"):
        # An attention-like output: the softmax is rounded to the value's dtype before its
        # product, the result once to the output's; the sum is f32 (flash), relative to 1.
        floats = [_EPS.get(op.dtype.name, 0.0) for op in kernel.inputs if op.dtype.is_float]
        err = _EPS[out.dtype.name] * 2 + 2 * max(floats, default=0.0)
        return max(err, 1e-4), max(err, 1e-4)
    length = 1
    for i in st.summed:
        size = kernel.index(i).size
        length *= size.literal if size.literal is not None else (env or {}).get(size.symbol, 4096)
    err = _EPS[out.dtype.name] * 2
    for g in st.summed_groups:
        if g.extras:
            err += _EPS.get(kernel.operand(st.factors[g.main].operand).dtype.name, 0.0) * 2
    # A coo input meeting a coo output has its repeated blocks summed and rounded first.
    if out.sparsity == "coo":
        for r in st.factors:
            op = kernel.operand(r.operand)
            if op.sparsity == "coo":
                err += _EPS.get(op.dtype.name, 0.0) * 4
    # Chained statements read earlier outputs rounded to their dtype.
    for r in st.factors:
        op = kernel.operand(r.operand)
        if op.direction == "out":
            err += tolerance(kernel, op.name, env)[1]
    err += _EPS["f32"] * 8 * math.sqrt(length)
    return err, err
