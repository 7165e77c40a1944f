"""The TPU block rules, in one place: the (sublane, 128) layout rule, views, VMEM padding.

A block's last two dimensions are mapped onto (sublane, lane) vector tiles: the last must
be a multiple of 128 lanes and the one before a multiple of the dtype's sublane count (8
for 32-bit, 16 for 16-bit, 32 for 8-bit data), unless the block spans the whole array
dimension. A squeezed dimension (a tile of 1) counts as a block of 1 there, so where one
falls among the last two, the array is *viewed* with unit dimensions inserted (a free
reshape): `seg[B, S]` read with tiles (1, 256) becomes `[B, 1, S]` with blocks
(squeezed, 1, 256), and `slope[H]` with a tile of 1 becomes `[H, 1, 1]`. A block read one
element at a time along the array's last dimension (a column) has no such view.
VMEM buffers are padded to whole tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..dtypes import DType

LANES = 128


@dataclass(frozen=True)
class View:
    """How the kernel sees one array: unit dimensions inserted, and the block shape over them."""

    inserted: tuple[int, ...]  # positions in the view where a unit dimension is inserted
    block: tuple[int | None, ...]  # over the view's dimensions; None is squeezed
    spans: tuple[tuple[int, int], ...]  # (array dim, tile): a tile that must span a symbolic dim

    @property
    def reshapes(self) -> bool:
        return bool(self.inserted)

    @property
    def ref_shape(self) -> tuple[int, ...]:
        return tuple(b for b in self.block if b is not None)


@dataclass(frozen=True)
class LayoutProblem:
    dim: int  # the array dimension whose tile breaks the rule
    reason: str


def view(block: tuple[int | None, ...], dims: tuple[int | None, ...], dtype: DType) -> View | LayoutProblem:
    """The view of an array for a block (None: squeezed); `dims` None where symbolic."""
    rank = len(block)
    spans: list[tuple[int, int]] = []

    def fits(axis: int, multiple: int, what: str) -> LayoutProblem | None:
        size, full = block[axis], dims[axis]
        if size % multiple == 0 or size == full:
            return None
        if full is None:  # accepted if it spans the dimension: checked when the kernel is called
            spans.append((axis, size))
            return None
        return LayoutProblem(axis, f"must be a multiple of {multiple} ({what}) or span the whole dimension")

    last = block[-1]
    second = block[-2] if rank >= 2 else None
    if last is None:
        if rank >= 2 and second is not None:
            return LayoutProblem(rank - 1, "is read one element at a time (a tile of 1) while the dimension before it is not: a column, which the TPU cannot block")
        return View((rank, rank + 1), block + (1, 1), ())
    problem = fits(rank - 1, LANES, "lanes")
    if problem:
        return problem
    if rank == 1:
        # Mosaic takes a 1-D block that spans its array, or a power of two of at least 128
        # 32-bit words, or a multiple of 1024; any other lane multiple is read as a row (1, t).
        size, native = last, LANES * 32 // dtype.bits
        if size == dims[0] or size % 1024 == 0 or (size & (size - 1) == 0 and size >= native):
            return View((), block, tuple(spans))
        return View((0,), (1, last), tuple(spans))
    if second is None:
        return View((rank - 1,), block[:-1] + (1, last), tuple(spans))
    problem = fits(rank - 2, dtype.sublanes, f"sublanes for {dtype.bits}-bit data")
    if problem:
        return problem
    return View((), block, tuple(spans))


def view_shape(shape: tuple, inserted: tuple[int, ...]) -> tuple:
    """An array shape with unit dimensions inserted at the view's positions."""
    out = list(shape)
    for p in sorted(inserted):
        out.insert(p, 1)
    return tuple(out)


def padded_bytes(block: tuple[int, ...], dtype: DType) -> int:
    """Bytes a block occupies in VMEM once padded to whole (sublane, lane) tiles."""
    if not block:
        return dtype.itemsize
    dims = list(block)
    dims[-1] = math.ceil(dims[-1] / LANES) * LANES
    if len(dims) >= 2:
        dims[-2] = math.ceil(dims[-2] / dtype.sublanes) * dtype.sublanes
    return math.prod(dims) * dtype.itemsize
