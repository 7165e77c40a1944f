"""Resource checks on a plan against its target chip: VMEM, SMEM, and what the MXU supports.

This runs after planning because the footprint depends on the plan's blocks and
scratch; its diagnostics still point at the spec (the tile line, an operand's dtype).
"""

from __future__ import annotations

import dataclasses

from .model import Kernel
from .plan import Plan, plan as make_plan, smem_entries
from .source import Diagnostic
from .targets import format_bytes


def _tiles_text(kernel: Kernel) -> str:
    return ", ".join(f"{i.name}={i.tile}" for i in kernel.indices)


def _valid_tile(kernel: Kernel, name: str, tile: int) -> bool:
    from .layout import layout_problem

    index = kernel.index(name)
    if tile < 1 or (index.size.literal is not None and index.size.literal % tile):
        return False
    trial = dataclasses.replace(kernel, indices=tuple(dataclasses.replace(i, tile=tile) if i.name == name else i for i in kernel.indices))
    for op in trial.operands:
        if op.sparsity in ("coo", "index"):
            continue
        block = tuple(trial.index(t.index).tile for t in op.terms)
        if layout_problem(block, tuple(d.literal for d in op.dims), op.dtype):
            return False
    return True


def suggest_tiles(plan: Plan) -> Kernel | None:
    """Smaller tiles that fit the target's VMEM: halve the largest tile until it fits."""
    kernel = plan.kernel
    for _ in range(64):
        trial = make_plan(kernel, plan.target)
        if trial.vmem_bytes <= plan.target.vmem_bytes:
            return kernel
        for index in sorted(kernel.indices, key=lambda i: -i.tile):
            if _valid_tile(kernel, index.name, index.tile // 2):
                kernel = dataclasses.replace(
                    kernel, indices=tuple(dataclasses.replace(i, tile=i.tile // 2) if i.name == index.name else i for i in kernel.indices)
                )
                break
        else:
            return None
    return None


def check_budget(plan: Plan) -> list[Diagnostic]:
    k, target = plan.kernel, plan.target
    errors = []
    need = plan.vmem_bytes
    if need > target.vmem_bytes:
        notes = [
            "VMEM holds two buffers of every block (double buffering) plus the accumulator: "
            + ", ".join(f"{item.what} {format_bytes(item.bytes)}" for item in plan.vmem)
        ]
        smaller = suggest_tiles(plan)
        if smaller is not None:
            notes.append(f"tiles that fit: {_tiles_text(smaller)}")
        errors.append(
            Diagnostic(
                k.tile_span,
                f"tiles {_tiles_text(k)} need {format_bytes(need)} of VMEM on {target.name} (limit {format_bytes(target.vmem_bytes)})",
                tuple(notes),
            )
        )
    entries = smem_entries(plan)
    if entries is not None and entries * 4 > target.smem_bytes:
        errors.append(
            Diagnostic(
                k.tile_span,
                f"tiles {_tiles_text(k)} need {format_bytes(entries * 4)} of SMEM for the prefetch tables on {target.name} "
                f"(limit {format_bytes(target.smem_bytes)}); use larger tiles",
            )
        )
    if k.contraction and not target.int8_matmul:
        for name in k.contraction:
            op = k.operand(name)
            if op.dtype.bits == 8:
                errors.append(Diagnostic(op.dtype_span, f"{target.name} has no int8 matmul: '{op.name}' is {op.dtype.name}"))
    return errors
