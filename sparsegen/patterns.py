"""Sparsity patterns for `plan --pattern` and `variants`: parsed and checked up front, then
laid over a kernel's sparse operand. Backend-neutral: numpy only.

A pattern is `tril` (causal), `density=F` (a random fraction F of the blocks, 0 <= F <= 1),
`band=W` (elements within W of the diagonal, W >= 1), or a `.npy` file (numpy.save) holding
a bool or numeric array: the operand's dense mask or its block-level pattern (nonzero: set).

An attention-like kernel's condition reads its data from the pattern too: a mask operand as
above, and integer operands (segment ids, `where seg[b, i] == seg[b, j]`) as sorted ids
along their last dimension (`segment_ids`). A condition on sizes alone reads nothing.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from .ir import Kernel

USAGE = "use tril, density=F, band=W or FILE.npy"
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"  # numpy.savez writes zip archives


class PatternError(ValueError):
    """A pattern that cannot be used; the message names the file or value."""


@dataclass(frozen=True, eq=False)
class Pattern:
    text: str  # as given
    kind: str  # tril, density, band or file
    value: float = 0.0  # density's fraction, band's width
    data: np.ndarray | None = None  # a file's array


def parse_pattern(pattern: str) -> Pattern:
    """The pattern, checked as far as it can be without an operand (PatternError if bad).

    A file is read here, so the CLI reports a bad one before any long work.
    """
    if pattern.endswith(".npy"):
        return Pattern(pattern, "file", data=_load(pattern))
    if pattern == "tril":
        return Pattern(pattern, "tril")
    if pattern.startswith("density="):
        raw = pattern.split("=", 1)[1]
        try:
            fraction = float(raw)
        except ValueError:
            fraction = math.nan
        if not 0 <= fraction <= 1:  # also rejects nan
            raise PatternError(f"{pattern}: the fraction of blocks must be a number from 0 to 1")
        return Pattern(pattern, "density", fraction)
    if pattern.startswith("band="):
        raw = pattern.split("=", 1)[1]
        width = int(raw) if raw.strip().isdigit() else 0
        if width < 1:
            raise PatternError(f"{pattern}: the band's width must be a whole number of elements, at least 1")
        return Pattern(pattern, "band", width)
    if os.path.isfile(pattern):
        raise PatternError(f"pattern file {pattern} is not a .npy file: save the pattern with numpy.save")
    raise PatternError(f"unknown pattern {pattern!r}: {USAGE}")


def _load(path: str) -> np.ndarray:
    """A .npy file's array; PatternError saying what is wrong with the file otherwise."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(_NPY_MAGIC))
            if magic.startswith(_ZIP_MAGIC):
                raise PatternError(
                    f"pattern file {path} is an .npz archive (numpy.savez), not a .npy array: save one array with numpy.save"
                )
            if magic != _NPY_MAGIC:
                raise PatternError(f"pattern file {path} is not a .npy array (numpy.save format)")
            # The header first: object arrays (pickles) are never loaded, strings are refused by name.
            f.seek(0)
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            _, _, dtype = header(f)
            if dtype.kind not in "biuf":
                what = (
                    "Python objects (dtype object)"
                    if dtype.hasobject
                    else f"strings (dtype {dtype})" if dtype.kind in "SU" else f"{dtype} values"
                )
                raise PatternError(f"pattern file {path} holds {what}; expected bool or numbers")
            f.seek(0)
            return np.load(f, allow_pickle=False)
    except PatternError:
        raise
    except FileNotFoundError:
        raise PatternError(f"pattern file {path} does not exist") from None
    except IsADirectoryError:
        raise PatternError(f"pattern file {path} is a directory") from None
    except OSError as exc:
        raise PatternError(f"pattern file {path}: cannot read: {exc.strerror or exc}") from None
    except (ValueError, EOFError) as exc:  # a damaged header or truncated data
        raise PatternError(f"pattern file {path} is not a readable .npy array: {exc}") from None


def sparse_arrays(k: Kernel, env: dict[str, int], pattern: str | Pattern, seed: int = 0, ids=(), lazy: bool = False) -> dict:
    """The pattern laid over each sparse operand of `k` at sizes `env`: {name: mask array
    (the operand's dtype) or coordinate arrays (int32)}, and over the integer operands a
    condition reads (`ids`, from `condition_ids`: sorted segment ids). What a backend's
    function takes for them is the backend's business (`tpu.simulate.pattern_args`).
    With `lazy`, a mask is a `LazyMask`: its elements are made only if something reads them."""
    from .callconv import operand_indices

    pattern = pattern if isinstance(pattern, Pattern) else parse_pattern(pattern)
    tile = {i.name: i.tile for i in k.indices}
    args = {}
    for op, key in ids:
        shape = tuple(d.literal if d.literal is not None else env[d.symbol] for d in op.dims)
        args[op.name] = segment_ids(pattern, op.name, shape, tile[key], seed)
    for sparse in (o for o in k.operands if o.sparsity in ("coo", "mask")):
        shape = tuple(d.literal if d.literal is not None else env[d.symbol] for d in sparse.dims)
        tiles = tuple(tile[i] for i in operand_indices(k, sparse))
        if sparse.sparsity == "mask":
            mask = LazyMask(pattern, shape, tiles, seed, sparse.dtype.np_dtype)
            args[sparse.name] = mask if lazy else np.asarray(mask)
        else:
            coords = np.nonzero(_pattern_blocks(pattern, shape, tiles, seed))
            args[sparse.name] = tuple(c.astype(np.int32) for c in coords)
    return args


class LazyMask:
    """A pattern's element mask over an operand (`_pattern_elements`, in the operand's dtype),
    made only when something reads its elements (`numpy.asarray`). Where the pattern is known
    per block, `blocks` says which blocks hold a nonzero and which are all ones without it:
    the simulator classifies a 16384 x 16384 mask's blocks so in microseconds, not seconds
    (and without its gigabyte)."""

    def __init__(self, pattern: Pattern, shape, tiles, seed: int, dtype):
        self.pattern, self.shape, self.tiles, self.seed = pattern, tuple(shape), tuple(tiles), seed
        self.dtype, self.ndim = np.dtype(dtype), len(shape)
        self._elements: np.ndarray | None = None

    def __array__(self, dtype=None, copy=None):
        if self._elements is None:
            self._elements = _pattern_elements(self.pattern, self.shape, self.tiles, self.seed).astype(self.dtype)
        return self._elements if dtype is None else self._elements.astype(dtype)

    def blocks(self, tiles) -> tuple[np.ndarray, np.ndarray] | None:
        """Per block of `tiles` (a partial last block padded with zeros): (holds a nonzero,
        all ones), as the elements would give them; None where only the elements can say."""
        tiles, shape = tuple(int(t) for t in tiles), self.shape
        grid = _grid(shape, tiles)
        # A block is whole where it ends inside the array: only a whole block can be all ones.
        whole = np.ones(grid, bool)
        for d, (size, tile) in enumerate(zip(shape, tiles)):
            if size % tile:
                index = [slice(None)] * len(grid)
                index[d] = -1
                whole[tuple(index)] = False
        kind = self.pattern.kind
        if kind == "density" or kind == "file" and self.pattern.data.shape == _grid(shape, self.tiles):
            if tiles != self.tiles:  # the pattern is drawn per block of the operand's own tiles
                return None
            nonzero = _pattern_blocks(self.pattern, shape, tiles, self.seed)
            return nonzero, nonzero & whole
        if kind not in ("tril", "band") or len(shape) != 2:
            return None
        # Each block's first and last element row and column (a partial block ends at the array's end).
        first = [np.arange(g) * t for g, t in zip(grid, tiles)]
        last = [np.minimum(f + t, s) - 1 for f, t, s in zip(first, tiles, shape)]
        r0, r1 = first[0][:, None], last[0][:, None]
        c0, c1 = first[1][None, :], last[1][None, :]
        if kind == "tril":  # i >= j: some element where the last row reaches the first column; all where the first row passes the last
            return np.broadcast_to(r1 >= c0, grid), (r0 >= c1) & whole
        # band: |i - j| < W, nearest and farthest pairs of the block
        nearest = np.maximum(np.maximum(r0 - c1, c0 - r1), 0)
        farthest = np.maximum(r1 - c0, c1 - r0)
        return np.broadcast_to(nearest < self.pattern.value, grid), (farthest < self.pattern.value) & whole


def condition_ids(plan) -> list:
    """Integer operands an attention-like kernel's condition reads (segment ids), with the
    key index whose blocks a document starts at; [] for other kernels."""
    row = getattr(plan, "plan", None)
    k = plan.kernel
    if row is None or not hasattr(row, "conditions"):
        # A product's condition (grouped ids, `gid[m] == g`): ids along the index they are read with.
        out = {}
        for st in k.statements:
            for r in (st.condition.reads if getattr(st, "condition", None) is not None else ()):
                op = k.operand(r.operand)
                if op.sparsity == "dense" and not op.dtype.is_float and op.name not in out:
                    out[op.name] = (op, r.indices[-1])
        return list(out.values())
    names = dict.fromkeys(r.operand for cond in row.conditions for r in cond.reads)
    return [(k.operand(n), row.key) for n in names if k.operand(n).sparsity == "dense" and not k.operand(n).dtype.is_float]


def segment_ids(pattern: Pattern, name: str, shape, tile: int, seed: int) -> np.ndarray:
    """Sorted ids along the last dimension (one document per run), the same layout for every
    leading index unless a file gives them all: `tril` one document (the condition's other
    parts decide), `band=W` documents of W positions, `density=F` a new document at each
    block of `tile` with probability 1 - F (F=1: one document), a file the ids themselves
    (the operand's shape, or its last dimension's)."""
    n = shape[-1]
    if pattern.kind == "file":
        data = pattern.data
        if data.dtype.kind not in "biu":
            raise PatternError(f"pattern file {pattern.text} holds {data.dtype} values; '{name}' takes integer ids")
        if data.shape not in (tuple(shape), (n,)):
            raise PatternError(f"pattern file {pattern.text} has shape {data.shape}; '{name}' takes ids of shape {tuple(shape)} or ({n},)")
        return np.broadcast_to(data.astype(np.int32), shape).copy()
    if pattern.kind == "tril":
        ids = np.zeros(n, np.int32)
    elif pattern.kind == "band":
        ids = (np.arange(n) // int(pattern.value)).astype(np.int32)
    else:
        blocks = -(-n // tile)
        starts = np.random.default_rng(seed).random(blocks) >= pattern.value
        starts[0] = False
        ids = np.repeat(np.cumsum(starts), tile)[:n].astype(np.int32)
    return np.broadcast_to(ids, shape).copy()


def _grid(shape, tiles) -> tuple[int, ...]:
    """Blocks along each dimension; a partial last block counts."""
    return tuple(-(-s // t) for s, t in zip(shape, tiles))


def _pattern_blocks(pattern: Pattern, shape, tiles, seed: int) -> np.ndarray:
    """Which blocks a pattern touches, computed per block (no element-level array)."""
    grid = _grid(shape, tiles)
    if pattern.kind == "density":
        return np.random.default_rng(seed).random(grid) < pattern.value
    if pattern.kind == "file":
        if pattern.data.shape == grid:
            return pattern.data != 0
        elements = _pattern_elements(pattern, shape, tiles, seed)
        elements = np.pad(elements, [(0, -s % t) for s, t in zip(shape, tiles)])
        return elements.reshape([v for g, t in zip(grid, tiles) for v in (g, t)]).any(
            axis=tuple(range(1, 2 * len(grid), 2))
        )
    if len(shape) != 2:
        raise PatternError(f"pattern {pattern.text!r} needs a 2-D operand")
    rows = np.arange(grid[0])[:, None] * tiles[0]  # first element row of each block row
    cols = np.arange(grid[1])[None, :] * tiles[1]
    if pattern.kind == "tril":  # some element with i >= j: the block's last row reaches its first column
        return rows + tiles[0] - 1 >= cols
    # band: the closest |i - j| in the block is under the width
    gap = np.maximum(rows - (cols + tiles[1] - 1), cols - (rows + tiles[0] - 1))
    return np.maximum(gap, 0) < pattern.value


def _pattern_elements(pattern: Pattern, shape, tiles, seed: int) -> np.ndarray:
    if pattern.kind == "file":
        data = pattern.data
        if data.shape == tuple(shape):
            return data != 0
        grid = _grid(shape, tiles)
        if data.shape == grid:
            return _crop(np.kron(data != 0, np.ones(tiles, bool)), shape)
        raise PatternError(
            f"pattern file {pattern.text} has shape {data.shape}; expected the operand's {tuple(shape)} or its block grid {grid}"
        )
    if len(shape) != 2 and pattern.kind != "density":
        raise PatternError(f"pattern {pattern.text!r} needs a 2-D operand")
    if pattern.kind == "tril":
        return np.tril(np.ones(shape, bool))
    if pattern.kind == "band":
        i = np.arange(shape[0])[:, None]
        j = np.arange(shape[1])[None, :]
        return np.abs(i - j) < pattern.value
    blocks = np.random.default_rng(seed).random(_grid(shape, tiles)) < pattern.value
    return _crop(np.kron(blocks, np.ones(tiles, bool)), shape)


def _crop(a: np.ndarray, shape) -> np.ndarray:
    return a[tuple(slice(0, s) for s in shape)]
