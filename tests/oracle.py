"""An independent oracle: what a kernel must compute, in float64 numpy from the IR.

It does not share code with the generated `reference`, so it checks that one too. Each
statement is an einsum over dense views of its factors: coo inputs scattered into a dense
array (repeats add up, padding entries dropped, ragged blocks cut), offsets sliced,
`h // n` subscripts repeated along h; offsets on the left place the result in zeros; a coo
output gathers the requested blocks (zeros for padding entries and past a ragged end).
"""

from __future__ import annotations

import numpy as np

from sparsegen.callconv import convention, operand_indices
from sparsegen.names import ModuleNames
from sparsegen.testing import dims, resolve_sizes


def oracle(kernel, args, keywords):
    """The kernel's outputs (one array, or a tuple for several) from its arguments."""
    conv = convention(kernel, ModuleNames(kernel))
    env = resolve_sizes(kernel, {**keywords, **_sizes_from_args(kernel, conv, args)})
    tile = {i.name: i.tile for i in kernel.indices}
    by_param = dict(zip((p.internal for p in conv.params), args))
    values: dict[str, np.ndarray] = {}
    offsets: dict[str, np.ndarray] = {}
    coo: dict[str, tuple] = {}
    for p in conv.params:
        op = kernel.operand(p.operand)
        arg = by_param[p.internal]
        if p.kind in ("dense", "mask"):
            values[op.name] = np.asarray(arg).astype(np.float64)
        elif p.kind == "index":
            offsets[op.name] = np.asarray(arg).astype(np.int64)
        elif p.kind in ("blocks", "coords", "out_coords"):
            entry = coo.setdefault(op.name, [None, []])
            if p.kind == "blocks":
                entry[0] = np.asarray(arg).astype(np.float64)
            else:
                entry[1].append(np.asarray(arg).astype(np.int64))
    for name, (blocks, coords) in coo.items():
        op = kernel.operand(name)
        if op.direction == "out":
            continue
        tiles = [tile[i] for i in operand_indices(kernel, op)]
        shape = dims(op, env)
        grid = [-(-s // t) for s, t in zip(shape, tiles)]
        dense = np.zeros([g * t for g, t in zip(grid, tiles)])
        blocks = blocks.reshape((blocks.shape[0], *tiles))
        for b in range(blocks.shape[0]):
            if all(int(c[b]) == -1 for c in coords):
                continue  # padding
            sl = tuple(slice(int(c[b]) * t, (int(c[b]) + 1) * t) for c, t in zip(coords, tiles))
            dense[sl] += blocks[b]
        values[name] = dense[tuple(slice(0, s) for s in shape)]
    results = {}
    for st in kernel.statements:
        out = kernel.operand(st.target.operand)
        views = []
        for r in st.factors:
            op = kernel.operand(r.operand)
            v = results[op.name] if op.direction == "out" else values[op.name]
            sl = []
            for d, s in enumerate(r.subs):
                if s.offset is None:
                    sl.append(slice(None))
                else:
                    start = int(offsets[s.offset.operand][s.offset.position])
                    extent = _size(kernel, s.index, env)
                    sl.append(slice(start, start + extent))
            v = v[tuple(sl)]
            for d, s in enumerate(r.subs):
                if s.divisor != 1:
                    v = np.repeat(v, s.divisor, axis=d)
            views.append(v)
        letters = {i: chr(ord("a") + n) for n, i in enumerate(st.indices)}
        spec = ",".join("".join(letters[i] for i in r.indices) for r in st.factors) + "->" + "".join(letters[i] for i in st.out_indices)
        result = np.einsum(spec, *views, optimize=True)
        if st.scale is not None:
            result = result * st.scale
        if any(s.offset for s in st.target.subs):
            placed = np.zeros(dims(out, env))
            sl = []
            for s in st.target.subs:
                start = 0 if s.offset is None else int(offsets[s.offset.operand][s.offset.position])
                sl.append(slice(start, start + _size(kernel, s.index, env)))
            placed[tuple(sl)] = result
            result = placed
        # What later statements read is the output as stored.
        result = result.astype(out.dtype.np_dtype).astype(np.float64)
        if out.sparsity == "coo":
            tiles = [tile[i] for i in st.out_indices]
            padded = np.pad(result, [(0, -s % t) for s, t in zip(result.shape, tiles)])
            coords = coo[out.name][1]
            blocks = []
            for b in range(len(coords[0]) if coords else 0):
                if all(int(c[b]) == -1 for c in coords):
                    blocks.append(np.zeros(tiles))
                    continue
                sl = tuple(slice(int(c[b]) * t, (int(c[b]) + 1) * t) for c, t in zip(coords, tiles))
                blocks.append(padded[sl])
            stacked = np.stack(blocks) if blocks else np.zeros((0, *tiles))
            results[out.name] = stacked.reshape((stacked.shape[0], *[t for t in tiles if t != 1]))
        else:
            results[out.name] = result
    outs = [results[o.name] for o in kernel.outputs]
    return outs[0] if len(outs) == 1 else tuple(outs)


def _size(kernel, index, env):
    size = kernel.index(index).size
    return size.literal if size.literal is not None else env[size.symbol]


def _sizes_from_args(kernel, conv, args) -> dict[str, int]:
    found = {}
    for p, arg in zip(conv.params, args):
        if p.kind not in ("dense", "mask"):
            continue
        for d, size in zip(kernel.operand(p.operand).dims, np.shape(arg)):
            if d.symbol is not None:
                found[d.symbol] = int(size)
    return found
