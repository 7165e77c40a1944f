"""Host-side helpers that build a generated kernel's inputs from what users have.

Numpy only at import (jax and scipy are used when their objects are passed in); it does
not need the compiler or its templates.

- `BlockCOO`: a blocked COO matrix (stored blocks + int32 block coordinates), from dense
  arrays, scipy.sparse and jax.experimental.sparse; `args()` is the calling convention
  of a `coo` input. A jax pytree when jax is installed.
- `sparsify_mask`: the tutorial's function, vectorised, with exact block deduplication.
- Bucketing: `BlockCOO.pad_to` / `BlockCOO.bucketed` pad the number of stored blocks so
  that new sparsity patterns reuse a compiled kernel; `BlockCOO.split` deals them to the
  shards of a device mesh by their coordinates, each shard's padded to one bucket.
- Mixture of experts: `group_ids` / `group_offsets` turn group sizes into the sorted ids
  (`where gid[m] == g`) or offsets (`lo[g] <= m < lo[g + 1]`) a grouped matmul reads, and
  `route` turns per-token expert choices into the sorting permutation, ids and sizes.
  numpy in, numpy out; jax arrays in (traced too), jax arrays out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["BlockCOO", "Routing", "Shards", "bucket_size", "group_ids", "group_offsets", "route", "sparsify_mask"]


def _check_block_shape(shape: tuple[int, ...], block_shape) -> tuple[int, ...]:
    try:
        block_shape = tuple(int(b) for b in block_shape)
    except TypeError:
        raise ValueError(f"block_shape must be a tuple of ints, got {block_shape!r}") from None
    if len(block_shape) != len(shape):
        raise ValueError(f"block_shape {block_shape} has {len(block_shape)} dimensions, the array {len(shape)} (shape {shape})")
    for d, (size, block) in enumerate(zip(shape, block_shape)):
        if block <= 0:
            raise ValueError(f"block_shape {block_shape}: dim {d} must be positive")
        if size % block:
            raise ValueError(f"block_shape {block_shape} does not divide the shape {shape} along dim {d} ({size} % {block} = {size % block})")
    return block_shape


def _blocked_view(array: np.ndarray, block_shape: tuple[int, ...]) -> np.ndarray:
    """(g0, b0, g1, b1, ...) view of an array, no copy."""
    shape = []
    for size, block in zip(array.shape, block_shape):
        shape += [size // block, block]
    return array.reshape(shape)


def bucket_size(nb: int, buckets: Sequence[int] | None = None) -> int:
    """The padded block count for `nb` stored blocks: the next power of two (at least 1) by
    default, or the smallest of `buckets` that holds `nb`."""
    if buckets is None:
        return 1 if nb <= 1 else 1 << (nb - 1).bit_length()
    fitting = [b for b in buckets if b >= nb]
    if not fitting:
        raise ValueError(f"{nb} stored blocks do not fit any bucket of {sorted(buckets)}")
    return min(fitting)


class BlockCOO:
    """A blocked COO array: `blocks[nb, *block_shape]` and one int32 coordinate vector per
    dimension (in blocks). Entries whose coordinates are all -1 are padding.

    `shape` is the dense shape. Blocks may repeat coordinates (they add up) and come in any
    order; the constructors produce them in row-major order, without repeats.
    """

    __slots__ = ("blocks", "coords", "shape")

    def __init__(self, blocks, coords: Sequence, shape: Sequence[int]):
        shape = tuple(int(s) for s in shape)
        coords = tuple(coords)
        if len(coords) != len(shape):
            raise ValueError(f"BlockCOO of shape {shape} needs {len(shape)} coordinate vectors, got {len(coords)}")
        block_shape = tuple(blocks.shape[1:])
        if blocks.ndim != len(shape) + 1:
            raise ValueError(f"blocks must have shape (nb, *block_shape) with {len(shape)} block dims, got {tuple(blocks.shape)}")
        _check_block_shape(shape, block_shape)
        nb = blocks.shape[0]
        checked = []
        for d, c in enumerate(coords):
            if _is_traced(c):
                checked.append(c)
                continue
            c = np.asarray(c)
            if c.shape != (nb,):
                raise ValueError(f"coordinate vector {d} must have shape ({nb},), got {c.shape}")
            if c.size and not np.issubdtype(c.dtype, np.integer):
                raise ValueError(f"coordinate vector {d} must hold integers, got {c.dtype}")
            limit = shape[d] // block_shape[d]
            bad = np.flatnonzero((c < -1) | (c >= limit))
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"coordinate {d} of block {i} is {int(c[i])}, outside 0..{limit - 1} (dim {d} has {limit} blocks)")
            checked.append(c.astype(np.int32))
        self.blocks = blocks
        self.coords = tuple(checked)
        self.shape = shape

    # ----------------------------------------------------------------- basics
    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.blocks.shape[1:])

    @property
    def nb(self) -> int:
        """Stored entries, padding included."""
        return int(self.blocks.shape[0])

    @property
    def dtype(self):
        return self.blocks.dtype

    def args(self) -> tuple:
        """`(blocks, idx_0, idx_1, ...)`: a `coo` input in a generated kernel's calling convention."""
        return (self.blocks, *self.coords)

    def __repr__(self) -> str:
        return f"BlockCOO(shape={self.shape}, block_shape={self.block_shape}, nb={self.nb}, dtype={self.dtype})"

    # ------------------------------------------------------------ constructors
    @classmethod
    def from_dense(cls, array, block_shape) -> "BlockCOO":
        """Keep every block with a nonzero element, in row-major order."""
        array = np.asarray(array)
        block_shape = _check_block_shape(array.shape, block_shape)
        view = _blocked_view(array, block_shape)
        rank = array.ndim
        inner = tuple(range(1, 2 * rank, 2))
        nonzero = np.any(view != 0, axis=inner)
        coords = np.nonzero(nonzero)
        outer_first = [2 * d for d in range(rank)] + [2 * d + 1 for d in range(rank)]
        blocks = view.transpose(outer_first)[coords]
        return cls(np.ascontiguousarray(blocks), tuple(c.astype(np.int32) for c in coords), array.shape)

    @classmethod
    def from_entries(cls, indices: np.ndarray, values: np.ndarray, shape, block_shape, dtype=None) -> "BlockCOO":
        """From element coordinates `indices[n, rank]` and `values[n]` (repeats add up)."""
        shape = tuple(int(s) for s in shape)
        block_shape = _check_block_shape(shape, block_shape)
        indices = np.asarray(indices, np.int64).reshape(-1, len(shape))
        values = np.asarray(values)
        dtype = dtype or values.dtype
        grid = np.array([s // b for s, b in zip(shape, block_shape)])
        blocks_of = indices // np.array(block_shape)
        keys = np.ravel_multi_index(blocks_of.T, grid) if len(indices) else np.zeros(0, np.int64)
        unique, slot = np.unique(keys, return_inverse=True)
        blocks = np.zeros((len(unique), *block_shape), dtype)
        within = indices % np.array(block_shape)
        np.add.at(blocks, (slot, *within.T), values.astype(dtype))
        keep = np.any(blocks.reshape(len(unique), -1) != 0, axis=1)
        coords = np.unravel_index(unique[keep], tuple(grid)) if len(unique) else tuple(np.zeros(0, np.int64) for _ in shape)
        return cls(blocks[keep], tuple(np.asarray(c, np.int32) for c in coords), shape)

    @classmethod
    def from_scipy(cls, matrix, block_shape) -> "BlockCOO":
        """From any scipy.sparse matrix or array (bsr, csr, csc, coo, ...)."""
        coo = matrix.tocoo()
        indices = np.stack([coo.row, coo.col], axis=1)
        return cls.from_entries(indices, coo.data, coo.shape, block_shape)

    @classmethod
    def from_bcoo(cls, matrix, block_shape) -> "BlockCOO":
        """From a jax.experimental.sparse BCOO or BCSR array."""
        from jax.experimental import sparse

        if isinstance(matrix, sparse.BCSR):
            matrix = matrix.to_bcoo()
        if not isinstance(matrix, sparse.BCOO):
            raise ValueError(f"from_bcoo takes a jax.experimental.sparse BCOO or BCSR, got {type(matrix).__name__}")
        if matrix.n_batch or matrix.n_dense:
            return cls.from_dense(np.asarray(matrix.todense()), block_shape)
        return cls.from_entries(np.asarray(matrix.indices), np.asarray(matrix.data), matrix.shape, block_shape)

    # -------------------------------------------------------------- transforms
    def to_dense(self):
        """The dense array (padding entries dropped, repeats added)."""
        xp = _array_module(self.blocks)
        grid = tuple(s // b for s, b in zip(self.shape, self.block_shape))
        rank = len(self.shape)
        pad = _all(xp, [c < 0 for c in self.coords])
        coords = tuple(xp.where(pad, g, c) for c, g in zip(self.coords, grid))
        if xp is np:
            dense = np.zeros(grid + self.block_shape, self.dtype)
            keep = ~pad
            np.add.at(dense, tuple(c[keep] for c in coords), self.blocks[keep])
        else:
            dense = xp.zeros(grid + self.block_shape, self.dtype).at[coords].add(self.blocks, mode="drop")
        interleave = [p for d in range(rank) for p in (d, rank + d)]
        return dense.transpose(interleave).reshape(self.shape)

    def transpose(self) -> "BlockCOO":
        """The transpose (dimensions reversed), still blocked."""
        rank = len(self.shape)
        xp = _array_module(self.blocks)
        blocks = xp.transpose(self.blocks, (0, *range(rank, 0, -1)))
        return BlockCOO(blocks, self.coords[::-1], self.shape[::-1])

    @property
    def T(self) -> "BlockCOO":
        return self.transpose()

    def pad_to(self, nb: int) -> "BlockCOO":
        """Pad to `nb` entries with padding entries (every coordinate -1, zero blocks): a
        generated kernel sorts them last and runs them as steps that compute nothing and
        start no copy, so the result is unchanged and the shape is static."""
        if nb < self.nb:
            raise ValueError(f"cannot pad {self.nb} stored blocks down to {nb}")
        extra = nb - self.nb
        if not extra:
            return self
        xp = _array_module(self.blocks)
        blocks = xp.concatenate([self.blocks, xp.zeros((extra, *self.block_shape), self.dtype)])
        coords = tuple(xp.concatenate([c, xp.full((extra,), -1, np.int32)]) for c in self.coords)
        return BlockCOO(blocks, coords, self.shape)

    def bucketed(self, buckets: Sequence[int] | None = None) -> "BlockCOO":
        """Pad to the bucket size for this many blocks (`bucket_size`): patterns of similar
        density then share one compiled kernel."""
        return self.pad_to(bucket_size(self.nb, buckets))

    def split(self, dim: int | Sequence[int], n: int | Sequence[int], bucket: int | None = None) -> "Shards":
        """The stored blocks dealt to `n` shards by their coordinate along `dim`, the dense
        dimension cut into `n` equal slices of whole blocks: shard s gets the blocks whose
        coordinate falls in its slice, in their order here, that coordinate made local,
        padded to one bucket with padding entries (zero blocks, every coordinate -1). The
        bucket is the most blocks any shard gets, or `bucket` (at least that).

        Returns `Shards`: a BlockCOO of one shard's shape holding n * bucket entries, shard
        s's at [s * bucket, (s + 1) * bucket) (what a shard_map in_spec on dimension 0 gives
        device s), the bucket, and each entry's source block (-1: padding). `dim` and `n` may
        be sequences: shards row-major over those dimensions (the first major, as
        `PartitionSpec(("a", "b"))` deals). A generated module's `sharded` deals a coo input
        a split index reads the same way (on device, its bucket counted on the host)."""
        dims = (dim,) if isinstance(dim, (int, np.integer)) else tuple(dim)
        counts = (n,) if isinstance(n, (int, np.integer)) else tuple(n)
        if len(dims) != len(counts) or len(set(dims)) != len(dims):
            raise ValueError(f"split: dims {dims} and shard counts {counts} must pair up, each dim once")
        if any(_is_traced(c) for c in self.coords):
            raise ValueError("split: needs concrete coordinates (it counts each shard's blocks on the host)")
        shape, cut = list(self.shape), []
        for d, k in zip(dims, counts):
            if not 0 <= d < len(shape):
                raise ValueError(f"split: dim {d} is not a dimension of a BlockCOO of shape {self.shape}")
            k = int(k)
            if k < 1 or shape[d] % (k * self.block_shape[d]):
                raise ValueError(f"split: dim {d} of size {shape[d]} cannot be cut into {k} slices of whole blocks "
                                 f"({self.block_shape[d]} along it)")
            shape[d] //= k
            cut.append((d, k, shape[d] // self.block_shape[d]))
        shards = int(np.prod([k for _, k, _ in cut]))
        coords = [np.asarray(c) for c in self.coords]
        pad = _all(np, [c < 0 for c in coords]) if coords else np.zeros(self.nb, bool)
        shard = np.zeros(self.nb, np.int64)
        for d, k, per in cut:
            shard = shard * k + np.clip(coords[d], 0, k * per - 1) // per
        key = np.where(pad, shards, shard)  # padding after every shard's blocks
        have = np.bincount(key, minlength=shards + 1)[:shards]
        most = int(have.max())
        if bucket is None:
            bucket = most
        elif bucket < most:
            raise ValueError(f"split: a shard gets {most} stored blocks, more than the bucket {bucket}")
        order = np.argsort(key, kind="stable")
        first = np.concatenate([[0], np.cumsum(have)[:-1]])
        s, p = np.divmod(np.arange(shards * bucket), max(bucket, 1))
        kept = p < have[s]
        source = np.where(kept, order[np.minimum(first[s] + p, max(self.nb - 1, 0))] if self.nb else 0, -1).astype(np.int64)
        take = np.maximum(source, 0)
        xp = _array_module(self.blocks)
        blocks = xp.where(xp.asarray(kept.reshape((-1,) + (1,) * len(self.block_shape))), self.blocks[take],
                          xp.zeros((), self.dtype)) if self.nb else xp.zeros((shards * bucket, *self.block_shape), self.dtype)
        per = {d: p for d, _, p in cut}
        local = []
        for d, c in enumerate(coords):
            c = c[take] if self.nb else np.zeros(len(take), np.int32)
            local.append(np.where(kept, c % per[d] if d in per else c, -1).astype(np.int32))
        return Shards(BlockCOO(blocks, tuple(local), shape), bucket, source)


class Shards(NamedTuple):
    """`BlockCOO.split`'s result: `coo` (one shard's shape, n * bucket entries, shard s's at
    [s * bucket, (s + 1) * bucket)), `bucket`, and `source[e]`, the block of the BlockCOO
    split that entry e holds (-1: padding)."""

    coo: BlockCOO
    bucket: int
    source: np.ndarray


def _is_traced(value) -> bool:
    try:
        import jax
    except ImportError:
        return False
    return isinstance(value, jax.core.Tracer)


def _array_module(value):
    if isinstance(value, np.ndarray):
        return np
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return np
    return jnp if isinstance(value, (jax.Array, jax.core.Tracer)) else np


def _all(xp, conditions):
    out = conditions[0]
    for c in conditions[1:]:
        out = xp.logical_and(out, c)
    return out


def _register_pytree() -> None:
    try:
        from jax import tree_util
    except ImportError:
        return
    tree_util.register_pytree_node(
        BlockCOO,
        lambda x: ((x.blocks, *x.coords), x.shape),
        lambda shape, leaves: _unchecked(leaves[0], leaves[1:], shape),
    )


def _unchecked(blocks, coords, shape) -> BlockCOO:
    """Rebuild from pytree leaves without validation (leaves may be tracers or placeholders)."""
    out = object.__new__(BlockCOO)
    out.blocks, out.coords, out.shape = blocks, tuple(coords), shape
    return out


_register_pytree()


# ------------------------------------------------------------------ sparsify_mask


def sparsify_mask(mask, block_shape: tuple[int, int]):
    """The tutorial's `sparsify_mask`, vectorised, with exact block deduplication.

    Returns `(block_mask, prefetch_mask, prefetch_i, prefetch_j, mask_data)`:
    - block_mask[i, j]: 1 where block (i, j) has a nonzero (in the mask's dtype);
    - prefetch_i/j[i, j]: coordinates of the first nonzero block at or after (i, j) in
      row-major order (past the last one: the last block of the grid), as the tutorial;
    - mask_data[u]: the distinct nonzero blocks, in the order the tutorial's backward scan
      first meets them; prefetch_mask[i, j] indexes it for that same next nonzero block
      (0 past the last one). Blocks are equal when their bits are equal; the tutorial
      compared `str(block)`, which numpy truncates for blocks over 1000 elements, so
      different partial blocks merged.

    Invariant: mask_data[prefetch_mask[i, j]] == block (i, j) for every nonzero block.
    """
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"mask must be 2-D, got shape {mask.shape}")
    bm, bn = _check_block_shape(mask.shape, block_shape)
    gm, gn = mask.shape[0] // bm, mask.shape[1] // bn
    view = mask.reshape(gm, bm, gn, bn)
    nonzero, groups_of = _classify_blocks(mask, bm, bn)
    flat = nonzero.reshape(-1)
    cells = gm * gn
    # The first nonzero cell at or after each cell (row-major); past the last: the grid's last cell.
    positions = np.where(flat, np.arange(cells), cells)
    following = np.minimum.accumulate(positions[::-1])[::-1]
    has_next = following < cells
    following = np.where(has_next, following, cells - 1)
    prefetch_i = (following // gn).reshape(gm, gn).astype(np.int32)
    prefetch_j = (following % gn).reshape(gm, gn).astype(np.int32)
    # Distinct nonzero blocks, numbered by first meeting in the tutorial's backward scan.
    nz_cells = np.flatnonzero(flat)
    type_of_cell = np.zeros(cells, np.int64)
    if nz_cells.size:
        groups = groups_of(nz_cells)
        order = nz_cells[::-1]
        first_seen, first_at = np.unique(groups[::-1], return_index=True)
        rank = np.empty(first_seen.size, np.int64)
        rank[np.argsort(first_at, kind="stable")] = np.arange(first_seen.size)
        renumber = np.zeros(int(groups.max()) + 1, np.int64)
        renumber[first_seen] = rank
        type_of_cell[nz_cells] = renumber[groups]
        reps = order[np.sort(first_at)]  # the backward scan's first member of each group, in type order
        mask_data = view[reps // gn, :, reps % gn, :]
    else:
        mask_data = np.zeros((0, bm, bn), mask.dtype)
    prefetch_mask = np.where(has_next, type_of_cell[following], 0).reshape(gm, gn).astype(np.int32)
    block_mask = nonzero.astype(mask.dtype)
    return block_mask, prefetch_mask, prefetch_i, prefetch_j, mask_data


def _classify_blocks(mask: np.ndarray, bm: int, bn: int):
    """Which (bm, bn) blocks are nonzero, and a function giving group ids (equal iff the
    blocks' bits are equal) for a list of nonzero cells.

    Integer and bool masks are read as 64-bit words, reducing over rows first (the fast
    direction): per block the largest and smallest word. A block whose largest word is 0
    is zero; one whose largest and smallest words agree is constant (all ones, say) and
    equals every other block of the same word, with no further reads. Only the remaining
    blocks are compared in full, against candidates that share their per-column min/max.
    """
    gm, gn = mask.shape[0] // bm, mask.shape[1] // bn
    row_bytes = bn * mask.itemsize
    view = mask.reshape(gm, bm, gn, bn)
    if not (mask.dtype.kind in "biu" and mask.flags.c_contiguous and row_bytes % 8 == 0):
        # Floats (where -0.0 is zero) and odd layouts: one value pass, then compare blocks.
        nonzero = np.any(view != 0, axis=(1, 3))
        return nonzero, lambda cells: _group_by_compare(mask, bm, bn, cells, None)
    wpr = row_bytes // 8
    words = mask.view(np.uint64).reshape(gm, bm, gn * wpr)
    col_max = np.empty((gm, gn * wpr), np.uint64)
    col_min = np.empty_like(col_max)

    def reduce_rows(lo: int, hi: int) -> None:
        words[lo:hi].max(axis=1, out=col_max[lo:hi])
        words[lo:hi].min(axis=1, out=col_min[lo:hi])

    _in_parallel(reduce_rows, gm, mask.nbytes)
    col_max = col_max.reshape(gm * gn, wpr)
    col_min = col_min.reshape(gm * gn, wpr)
    block_max = col_max.max(axis=1)
    block_min = col_min.min(axis=1)
    nonzero = (block_max != 0).reshape(gm, gn)

    def groups_of(cells: np.ndarray) -> np.ndarray:
        constant = block_max[cells] == block_min[cells]
        groups = np.empty(len(cells), np.int64)
        # Constant blocks: one group per word value.
        _, const_ids = np.unique(block_max[cells][constant], return_inverse=True)
        groups[constant] = const_ids
        offset = int(const_ids.max()) + 1 if const_ids.size else 0
        rest = np.flatnonzero(~constant)
        if rest.size:
            fingerprint = np.concatenate([col_max[cells[rest]], col_min[cells[rest]]], axis=1)
            groups[rest] = offset + _group_by_compare(mask, bm, bn, cells[rest], fingerprint)
        return groups

    return nonzero, groups_of


_POOL = None


def _in_parallel(work, n: int, nbytes: int) -> None:
    """Run work(lo, hi) over [0, n) split across the CPU cores (numpy releases the GIL in its
    loops; one core alone does not saturate memory bandwidth). Small inputs stay serial."""
    global _POOL
    parts = min(n, os.cpu_count() or 1)
    if parts < 2 or nbytes < (4 << 20):
        work(0, n)
        return
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=parts, thread_name_prefix="sparsegen")
    bounds = np.linspace(0, n, parts + 1).astype(int)
    for future in [_POOL.submit(work, int(bounds[k]), int(bounds[k + 1])) for k in range(parts)]:
        future.result()


def _group_by_compare(mask: np.ndarray, bm: int, bn: int, cells: np.ndarray, fingerprint: np.ndarray | None) -> np.ndarray:
    """Group ids for the blocks at `cells`: equal ids iff equal bits. Blocks are compared in
    full with the first member of each group that shares their fingerprint."""
    gm, gn = mask.shape[0] // bm, mask.shape[1] // bn
    # Compare bit patterns (exact for -0.0 and NaN), 8 bytes at a time where rows allow.
    if mask.flags.c_contiguous and (bn * mask.itemsize) % 8 == 0:
        bits = mask.view(np.uint64).reshape(gm, bm, gn, bn * mask.itemsize // 8)
    else:
        bits = mask.view(np.dtype(f"u{mask.itemsize}")).reshape(gm, bm, gn, bn)

    def block(cell):
        return bits[cell // gn, :, cell % gn, :]

    if fingerprint is None:
        rows = np.unique(np.linspace(0, bm - 1, num=min(bm, 4)).astype(np.int64))
        fingerprint = bits[:, rows, :, :].transpose(0, 2, 1, 3).reshape(gm * gn, -1)[cells]
    fingerprint = np.ascontiguousarray(fingerprint)
    keys = fingerprint.view(np.dtype((np.void, fingerprint.dtype.itemsize * fingerprint.shape[1]))).ravel()
    _, candidate = np.unique(keys, return_inverse=True)
    groups = np.empty(len(cells), np.int64)
    firsts: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (candidate, content hash) -> [(group, cell)]
    crowded: set[int] = set()  # candidates with many distinct groups switch to hashing content
    count: dict[int, int] = {}
    next_id = 0
    for n, (cell, cand) in enumerate(zip(cells.tolist(), candidate.reshape(-1).tolist())):
        this = block(cell)
        key = (cand, hash(this.tobytes()) if cand in crowded else 0)
        members = firsts.setdefault(key, [])
        gid = next((g for g, first in members if np.array_equal(this, block(first))), None)
        if gid is None:
            gid, next_id = next_id, next_id + 1
            members.append((gid, cell))
            count[cand] = count.get(cand, 0) + 1
            if cand not in crowded and count[cand] > 8:
                # Keep comparisons linear: rehash this candidate's groups by content.
                crowded.add(cand)
                for g, first in firsts.pop((cand, 0)):
                    firsts.setdefault((cand, hash(block(first).tobytes())), []).append((g, first))
        groups[n] = gid
    return groups


# ------------------------------------------------------------------ mixture of experts


def _integers(name: str, value, ndims: tuple[int, ...]):
    xp = _array_module(value)
    value = xp.asarray(value)
    if value.ndim not in ndims or not xp.issubdtype(value.dtype, xp.integer):
        raise ValueError(f"{name}: expected an integer array of {' or '.join(map(str, ndims))} dimensions, got {value.dtype}{list(value.shape)}")
    return xp, value


def group_ids(group_sizes, num_rows: int | None = None):
    """Row m's group, rows sorted by group: `[0]*sizes[0] + [1]*sizes[1] + ...` (int32).

    `num_rows` fixes the length (needed under `jit`, where the sizes are traced); rows past
    the sizes' total are in no group: their id is E, the group count (ids stay sorted, and
    `gid[m] == g` holds for no g: the offsets form's rows past `lo[E]`, `route`'s dropped
    choices). On concrete sizes it defaults to their total and is checked against it."""
    xp, sizes = _integers("group_sizes", group_sizes, (1,))
    if not _is_traced(sizes):
        concrete = np.asarray(sizes)
        if (concrete < 0).any():
            raise ValueError(f"group_sizes: sizes must be >= 0, got {int(concrete.min())} at group {int(concrete.argmin())}")
        total = int(concrete.sum())
        if num_rows is None:
            num_rows = total
        elif total > num_rows:
            raise ValueError(f"group_sizes: the sizes add up to {total}, more than num_rows={num_rows}")
    elif num_rows is None:
        raise ValueError("group_ids: pass num_rows when group_sizes is traced (the row count must be static under jit)")
    ends = xp.cumsum(sizes)
    # searchsorted with side="right": row m belongs to the first group whose end exceeds m
    # (past the total: E, no group).
    return xp.searchsorted(ends, xp.arange(num_rows), side="right").astype(xp.int32)


def group_offsets(group_sizes):
    """Group g's rows are `offsets[g] <= m < offsets[g + 1]`: `[0, cumsum(sizes)]` (int32, E + 1)."""
    xp, sizes = _integers("group_sizes", group_sizes, (1,))
    return xp.concatenate([xp.zeros((1,), xp.int32), xp.cumsum(sizes).astype(xp.int32)])


class Routing(NamedTuple):
    """Per-token expert choices sorted by expert.

    `order[r]` is the flat (token * top_k + choice) slot at sorted row r: gather the tokens
    with `x[order // top_k]`, scatter results back with `out.at[order].set(y)` or by
    `inverse`. `ids` are the sorted rows' experts, `sizes` the rows per expert. Dropped
    choices (-1) come last, with id E (no expert) and counted in no size, so both forms
    (`gid[m] == g` with `ids`, `lo[g] <= m < lo[g + 1]` with `group_offsets(sizes)`) leave
    their rows out."""

    order: object
    inverse: object
    ids: object
    sizes: object


def route(choices, num_experts: int) -> Routing:
    """Sort per-token expert choices (`choices[t, c]`, an expert per token and choice, or a
    1-D array of one choice per token) by expert, stably (tokens keep their order within an
    expert): the permutation, its inverse, the sorted ids and the group sizes (all int32).
    A choice of -1 is dropped (capacity routers drop tokens so): it sorts after every
    expert, its id is `num_experts` and no size counts it. Other choices outside
    [0, num_experts) raise on concrete arguments and are dropped under `jit`.
    jit-able: shapes depend only on `choices.shape`."""
    xp, flat = _integers("choices", choices, (1, 2))
    flat = flat.reshape(-1)
    if not _is_traced(flat) and flat.size:
        concrete = np.asarray(flat)
        bad = np.flatnonzero((concrete < -1) | (concrete >= num_experts))
        if bad.size:
            raise ValueError(f"choices: expert {int(concrete[bad[0]])} at slot {int(bad[0])} is outside [0, {num_experts}) (-1 drops a choice)")
    # Dropped choices take the id one past the last expert: they sort last (the rows past
    # `lo[E]` of the offsets form) and match no expert in the ids form.
    key = xp.where((flat >= 0) & (flat < num_experts), flat, num_experts).astype(xp.int32)
    stable = {"kind": "stable"} if xp is np else {"stable": True}  # numpy 1.26 has no stable=
    order = xp.argsort(key, **stable).astype(xp.int32)
    inverse = xp.argsort(order, **stable).astype(xp.int32)
    ids = key[order]
    # Counted over E + 1 bins, the last (the dropped) left out.
    if xp is np:
        sizes = np.bincount(key, minlength=num_experts + 1)[:num_experts].astype(np.int32)
    else:
        sizes = xp.bincount(key, length=num_experts + 1)[:num_experts].astype(xp.int32)
    return Routing(order, inverse, ids, sizes)
