"""The TPU block rules, in one place: the (sublane, 128) layout rule and VMEM padding.

A block's last two dimensions are mapped onto (sublane, lane) vector tiles: the last
must be a multiple of 128 lanes and the one before a multiple of the dtype's
sublane count (8 for 32-bit, 16 for 16-bit, 32 for 8-bit data), unless the block
spans the whole array dimension. VMEM buffers are padded to whole tiles.
"""

from __future__ import annotations

import math

from .dtypes import DType

LANES = 128


def layout_problem(block: tuple[int, ...], dims: tuple[int | None, ...], dtype: DType) -> tuple[int, str] | None:
    """Check a block of an array against the layout rule.

    `block` and `dims` run over the array's dimensions; a dim is None when its size is
    symbolic (then the block cannot be known to span it). Returns (array dim, reason)
    for the first violation, or None.
    """
    rank = len(block)
    rules = [(rank - 1, LANES, "lanes")]
    if rank >= 2:
        rules.append((rank - 2, dtype.sublanes, f"sublanes for {dtype.bits}-bit data"))
    for axis, multiple, what in rules:
        size, full = block[axis], dims[axis]
        if size % multiple == 0 or size == full:
            continue
        spans = "span the whole dimension" if full is not None else "span the whole dimension (which needs a literal size)"
        return axis, f"must be a multiple of {multiple} ({what}) or {spans}"
    return None


def padded_bytes(block: tuple[int, ...], dtype: DType) -> int:
    """Bytes a block occupies in VMEM once padded to whole (sublane, lane) tiles."""
    if not block:
        return dtype.itemsize
    dims = list(block)
    dims[-1] = math.ceil(dims[-1] / LANES) * LANES
    if len(dims) >= 2:
        dims[-2] = math.ceil(dims[-2] / dtype.sublanes) * dtype.sublanes
    return math.prod(dims) * dtype.itemsize
