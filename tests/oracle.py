"""An independent oracle: what a kernel must compute, in float64 numpy from the checked model.

It does not share code with the generated `reference`, so it checks that one too.
"""

from __future__ import annotations

import numpy as np

from sparsegen.testing import dims, resolve_sizes


def oracle(kernel, args, keywords) -> np.ndarray:
    env = resolve_sizes(kernel, {**keywords, **_sizes_from_args(kernel, args)})
    tile = {i.name: i.tile for i in kernel.indices}
    views = {}
    offsets = {}
    pos = 0
    for op in kernel.inputs:
        if op.sparsity == "coo":
            blocks = np.asarray(args[pos]).astype(np.float64)
            coords = [np.asarray(a) for a in args[pos + 1 : pos + 1 + op.rank]]
            pos += 1 + op.rank
            dense = np.zeros(dims(op, env))
            tiles = [tile[i] for i in op.indices]
            for b in range(blocks.shape[0]):
                if all(int(c[b]) == -1 for c in coords):
                    continue  # padding
                sl = tuple(slice(int(c[b]) * t, (int(c[b]) + 1) * t) for c, t in zip(coords, tiles))
                dense[sl] += blocks[b]
            views[op.name] = dense
        elif op.sparsity == "index":
            offsets[op.name] = np.asarray(args[pos]).astype(np.int64)
            pos += 1
        else:
            views[op.name] = np.asarray(args[pos]).astype(np.float64)
            pos += 1
    # Offset subscripts: slice the operand first.
    for op in kernel.data_inputs:
        if any(t.offset for t in op.terms):
            sl = []
            for t in op.terms:
                if t.offset is None:
                    sl.append(slice(None))
                else:
                    start = int(offsets[t.offset.operand][t.offset.position])
                    extent = kernel.index(t.index).size
                    extent = extent.literal if extent.literal is not None else env[extent.symbol]
                    sl.append(slice(start, start + extent))
            views[op.name] = views[op.name][tuple(sl)]
    letters = {i.name: chr(ord("a") + n) for n, i in enumerate(kernel.indices)}
    terms = ",".join("".join(letters[i] for i in op.indices) for op in kernel.data_inputs)
    out_letters = "".join(letters[i] for i in kernel.output.indices)
    result = np.einsum(f"{terms}->{out_letters}", *(views[op.name] for op in kernel.data_inputs))
    if kernel.output.sparsity == "coo":
        coords = [np.asarray(a) for a in args[pos : pos + kernel.output.rank]]
        tiles = [tile[i] for i in kernel.output.indices]
        blocks = []
        for b in range(len(coords[0]) if coords else 0):
            sl = tuple(slice(int(c[b]) * t, (int(c[b]) + 1) * t) for c, t in zip(coords, tiles))
            blocks.append(result[sl])
        result = np.stack(blocks) if blocks else np.zeros((0, *tiles))
    return result


def _sizes_from_args(kernel, args) -> dict[str, int]:
    found = {}
    pos = 0
    for op in kernel.inputs:
        if op.sparsity == "coo":
            pos += 1 + op.rank
            continue
        shape = np.shape(args[pos])
        pos += 1
        if op.sparsity == "index":
            continue
        for d, size in zip(op.dims, shape):
            if d.symbol is not None:
                found[d.symbol] = int(size)
    return found
