"""A TPU module's arguments for a sparsity pattern: the pattern's arrays (patterns.py, backend
neutral) laid onto the module's parameters, for `plan --pattern`, `variants` and `verify
--cycles` alike."""

from __future__ import annotations

import numpy as np

from ..patterns import Pattern, condition_ids, sparse_arrays
from .lower import TpuModule


def pattern_args(plan: TpuModule, env: dict[str, int], pattern: str | Pattern, seed: int = 0, lazy: bool = False):
    """Arguments of `_prefetch` for a sparsity pattern (arrays the tables do not read are None).

    Also the pattern per sparse operand: {name: mask array or coordinate arrays}. With
    `lazy`, masks are `patterns.LazyMask`s (the simulator's host `_block_kinds` reads their blocks).
    """
    args = sparse_arrays(plan.kernel, env, pattern, seed, condition_ids(plan), lazy=lazy)
    out = []
    for p in plan.conv.params:
        if p.kind == "mask":
            out.append(args[p.operand])
        elif p.kind in ("coords", "out_coords"):
            out.append(args[p.operand][p.dim])
        elif p.kind == "blocks":
            out.append(np.zeros((len(args[p.operand][0]), 1), np.float32))  # only its length is read
        elif p.kind != "index":
            out.append(args.get(p.operand))  # None: data the tables never read
    return out, args
