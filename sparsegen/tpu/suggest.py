"""Smaller tiles that fit a target's VMEM, found by lowering the kernel again with each
candidate (so this sits above `lower` and `attention.lower`; the rules in `rules.py`, below
both, take what it finds as a callable and ask only on an overflow)."""

from __future__ import annotations

import dataclasses

from ..ir import Kernel
from ..schedule.attention import row_plan
from .attention.lower import lower_attention
from .lower import LayoutError, TpuModule, lower
from .targets import Target


def with_tile(kernel: Kernel, name: str, tile: int) -> Kernel:
    return dataclasses.replace(kernel, indices=tuple(dataclasses.replace(i, tile=tile) if i.name == name else i for i in kernel.indices))


def _lowers(kernel: Kernel, target: Target) -> TpuModule | None:
    for i in kernel.indices:
        if i.tile < 1 or (i.size.literal is not None and i.size.literal % i.tile):
            return None
    try:
        return lower(kernel, target, backward=False)  # the forward decides the tiles
    except LayoutError:
        return None


def _halve_until_it_fits(kernel: Kernel, target: Target, vmem_of, halvable) -> Kernel | None:
    """Halve the largest tile `halvable(trial kernel, index)` accepts halved until
    `vmem_of(kernel)` (None: it does not lower) fits the target's VMEM; None if none does."""
    for _ in range(64):
        need = vmem_of(kernel)
        if need is not None and need <= target.vmem_bytes:
            return kernel
        for index in sorted(kernel.indices, key=lambda i: -i.tile):
            trial = with_tile(kernel, index.name, index.tile // 2)
            if halvable(trial, index):
                kernel = trial
                break
        else:
            return None
    return None


def suggest_tiles(kernel: Kernel, target: Target) -> Kernel | None:
    """Smaller tiles that fit the target's VMEM: halve the largest tile until it fits."""

    def vmem_of(k: Kernel) -> int | None:
        m = _lowers(k, target)
        return m.vmem_bytes if m is not None else None

    return _halve_until_it_fits(kernel, target, vmem_of, lambda trial, _: _lowers(trial, target) is not None)


def suggest_attention_tiles(kernel: Kernel, target: Target) -> Kernel | None:
    """Smaller query and key tiles that fit: halve the larger of the two while the score block
    keeps its layout (key tile a multiple of 128 lanes, query tile of 8 sublanes)."""
    plan = row_plan(kernel)
    floor = {plan.query: 8, plan.key: 128}

    def halvable(_, index) -> bool:
        half = index.tile // 2
        return index.name in floor and half >= floor[index.name] and half % floor[index.name] == 0 and (
            index.size.literal is None or index.size.literal % half == 0)

    return _halve_until_it_fits(kernel, target, lambda k: lower_attention(k, row_plan(k), target).vmem_bytes, halvable)
