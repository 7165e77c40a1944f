"""Random arguments for a kernel, by sparsity pattern: for tests, `make run` and benchmarks.

Numpy only. `example_args(kernel, sizes, pattern, rng)` returns the positional
arguments of the generated function (in its calling convention) and the size
keywords it needs.

Patterns (block level; `partial` blocks of a mask are mixed 0/1):
- random: about half the blocks, in shuffled order, one coordinate repeated;
- empty_lines: whole block rows and columns empty;
- duplicates: every stored block repeated at least once, unsorted;
- all_empty: nothing stored, or an all-zero mask;
- all_full: every block stored once, or an all-ones mask;
- tril: a causal (lower-triangular) mask / the blocks on or below the diagonal.
"""

from __future__ import annotations

import math

import numpy as np

from .dtypes import DTYPES
from .model import Kernel, Operand

PATTERNS = ("random", "empty_lines", "duplicates", "all_empty", "all_full", "tril")


def resolve_sizes(kernel: Kernel, sizes: dict[str, int]) -> dict[str, int]:
    """Every symbol's value: fixed ones from the spec, the rest from `sizes`."""
    out = {}
    for symbol, literal in kernel.symbols:
        out[symbol] = literal if literal is not None else sizes[symbol]
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
    """Block coordinates (a list, maybe with repeats) for a pattern over a block grid."""
    cells = [tuple(int(v) for v in c) for c in np.ndindex(*grid)]
    if pattern == "all_empty":
        return []
    if pattern == "all_full":
        return cells
    if pattern == "tril":
        return [c for c in cells if len(c) < 2 or c[0] >= c[1]]
    if pattern == "empty_lines":
        skip_rows = set(rng.choice(grid[0], size=max(1, grid[0] // 2), replace=False).tolist())
        skip_cols = set(rng.choice(grid[-1], size=max(1, grid[-1] // 2), replace=False).tolist()) if len(grid) > 1 else set()
        chosen = [c for c in cells if c[0] not in skip_rows and (len(c) < 2 or c[-1] not in skip_cols)]
        return chosen or [cells[-1]]
    chosen = [c for c in cells if rng.random() < 0.5] or [cells[0]]
    if pattern == "duplicates":
        chosen = chosen + [chosen[int(i)] for i in rng.integers(0, len(chosen), size=len(chosen))]
    else:  # random
        chosen.append(chosen[int(rng.integers(0, len(chosen)))])
    order = rng.permutation(len(chosen))
    return [chosen[int(i)] for i in order]


def _mask(shape, tiles, pattern: str, rng: np.random.Generator, dtype_name: str) -> np.ndarray:
    dtype = DTYPES[dtype_name].np_dtype
    if pattern == "tril" and len(shape) == 2:
        return np.tril(np.ones(shape, np.int32)).astype(dtype)
    grid = tuple(s // t for s, t in zip(shape, tiles))
    mask = np.zeros(shape, np.int32)
    if pattern == "all_full":
        return np.ones(shape, dtype)
    nonzero = set(block_pattern(grid, pattern, rng))
    for c in nonzero:
        sl = tuple(slice(i * t, (i + 1) * t) for i, t in zip(c, tiles))
        kind = rng.integers(0, 3)
        if kind == 0:
            mask[sl] = 1  # full
        elif kind == 1:
            mask[sl] = (rng.random([t for t in tiles]) < 0.5).astype(np.int32)  # partial 0/1
            mask[sl][(0,) * len(tiles)] = 1  # never all zero
        else:
            mask[sl] = 2  # all nonzero but not ones: still needs the multiply
    return mask.astype(dtype)


def example_args(kernel: Kernel, sizes: dict[str, int], pattern: str, rng: np.random.Generator):
    """(positional args, keyword sizes) for the generated function `kernel.name`."""
    env = resolve_sizes(kernel, sizes)
    tile = {i.name: i.tile for i in kernel.indices}
    args: list = []
    for op in kernel.inputs:
        shape = dims(op, env)
        if op.sparsity == "coo":
            tiles = tuple(tile[i] for i in op.indices)
            grid = tuple(s // t for s, t in zip(shape, tiles))
            coords = block_pattern(grid, pattern, rng)
            args.append(random_values((len(coords), *tiles), op.dtype.name, rng))
            for d in range(op.rank):
                args.append(np.array([c[d] for c in coords], np.int32))
        elif op.sparsity == "mask":
            tiles = tuple(tile[i] for i in op.indices)
            mask = _mask(shape, tiles, pattern, rng, op.dtype.name)
            if op.name not in kernel.end_factors:
                # A data operand whose zero blocks mark skipped work: random values on its nonzero blocks.
                mask = (random_values(shape, op.dtype.name, rng).astype(np.float32) * (mask != 0)).astype(op.dtype.np_dtype)
            args.append(mask)
        elif op.sparsity == "index":
            args.append(_offsets(kernel, op, env, tile, rng))
        else:
            args.append(random_values(shape, op.dtype.name, rng))
    out = kernel.output
    if out.sparsity == "coo":
        tiles = tuple(tile[i] for i in out.indices)
        grid = tuple(s // t for s, t in zip(dims(out, env), tiles))
        coords = block_pattern(grid, pattern, rng)
        for d in range(out.rank):
            args.append(np.array([c[d] for c in coords], np.int32))
    keywords = {s: env[s] for s, lit in kernel.symbols if lit is None and not _carried(kernel, s)}
    return args, keywords


def _carried(kernel: Kernel, symbol: str) -> bool:
    return any(op.direction == "in" and op.sparsity in ("dense", "mask") and any(d.symbol == symbol for d in op.dims) for op in kernel.operands)


def _offsets(kernel: Kernel, index_op: Operand, env, tile, rng) -> np.ndarray:
    """Aligned, in-range offsets for every use of an index operand."""
    length = index_op.dims[0].literal
    values = np.zeros(length, np.int32)
    for op in kernel.data_inputs:
        for d, t in enumerate(op.terms):
            if t.offset is None or t.offset.operand != index_op.name:
                continue
            extent = kernel.index(t.index).size
            extent = extent.literal if extent.literal is not None else env[extent.symbol]
            dim = dims(op, env)[d]
            choices = (dim - extent) // tile[t.index] + 1
            values[t.offset.position] = int(rng.integers(0, choices)) * tile[t.index]
    return values


def tolerance(kernel: Kernel) -> tuple[float, float]:
    """(rtol, atol) for comparing a kernel with its reference, from dtypes and the summed extent."""
    out = kernel.output.dtype
    if not out.is_float:
        return 0.0, 0.0
    if out.name == "bf16":
        return 2e-2, 2e-2
    summed = kernel.summed
    n = summed.tile if summed is not None else 1
    return 1e-4, 1e-4 * math.sqrt(n)
