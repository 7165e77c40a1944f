"""The TPU's rules on a lowered kernel: 32-bit accumulation, the MXU's dtypes, VMEM and SMEM.

Layout problems are found while lowering (`layout.view`); the rest here, after, because
the footprint depends on the blocks and scratch. Diagnostics still point at the spec
(the tile line, an operand's dtype, the accumulate line). Tiles that would fit are found
by lowering again (`suggest.py`, above the lowerings); a caller passes that search in as
`suggest`, so `lower` can check the backward kernel it derives against these rules.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

from ..dtypes import matrix_dtype
from ..expr import evaluate
from ..ir import Kernel
from ..source import Diagnostic
from .attention.lower import AttentionModule
from .targets import Target, format_bytes
from .vmem import VmemItem

ACCUMULATORS = ("f32", "i32")


def _tiles_text(kernel: Kernel) -> str:
    return ", ".join(f"{i.name}={i.tile}" for i in kernel.indices)


def check_kernel(kernel: Kernel, target: Target) -> list[Diagnostic]:
    """Rules that need no lowering: the accumulator's width."""
    if kernel.accumulate.name not in ACCUMULATORS:
        return [Diagnostic(kernel.accumulate_span, f"accumulate {kernel.accumulate.name}: the TPU accumulates in 32 bits; use f32 or i32")]
    return []


def vmem_overflow(k: Kernel, target: Target, items: tuple[VmemItem, ...], what: str, suggest=None) -> Diagnostic | None:
    """The one VMEM rule for every kernel family: the estimate against the target's VMEM,
    reported at the tile line with what takes the room and, when `suggest()` finds them
    (asked only on an overflow), tiles that fit."""
    need = sum(item.bytes for item in items)
    if need <= target.vmem_bytes:
        return None
    notes = [f"VMEM holds {what}: " + ", ".join(f"{item.what} {format_bytes(item.bytes)}" for item in items)]
    smaller = suggest() if suggest is not None else None
    if smaller is not None:
        notes.append(f"tiles that fit: {_tiles_text(smaller)}")
    return Diagnostic(k.tile_span, f"tiles {_tiles_text(k)} need {format_bytes(need)} of VMEM on {target.name} (limit {format_bytes(target.vmem_bytes)})", tuple(notes))


def check_attention(m: AttentionModule, suggest: Callable[[], Kernel | None] | None = None) -> list[Diagnostic]:
    """The target's limits on a row walk (attention-like kernel): its VMEM estimate
    (`suggest`: tiles that fit, asked only on an overflow; `suggest.suggest_attention_tiles`)."""
    problem = vmem_overflow(m.kernel, m.target, m.vmem, "two buffers of every block plus the running statistics and f32 temporaries",
                            suggest)
    return [problem] if problem else []


# What a walk length's host expression may use when evaluated at build time (sizes known).
_LENGTH_NAMES = {"__builtins__": {}, "pl": SimpleNamespace(cdiv=lambda a, b: -(-a // b))}


def smem_entries(tp, env: dict[str, int | None]) -> int | None:
    """Int32 entries of a pass's (lower.TpuPass) scalar-prefetch tables at build time, or None
    when a size is unknown (a stored block count, or a walk length only the data or the
    module's functions give: `verify` reads what the traced program allocates)."""
    env = tp.p.count_values(env, _LENGTH_NAMES, lambda _: None, partial=True)
    total = 0
    for t in tp.p.tables:
        value = evaluate(t.length, env)
        if value is None:
            return None
        total += value
    return total


def check_module(m, suggest: Callable[[], Kernel | None] | None = None) -> list[Diagnostic]:
    """The target's limits on a lowered module (lower.TpuModule). `suggest`: tiles that fit,
    asked only on an overflow (`suggest.suggest_tiles`); none for a derived backward kernel:
    its tiles are the forward's, and its calling convention is its own."""
    k, target = m.kernel, m.target
    errors = []
    problem = vmem_overflow(k, target, m.vmem, "two buffers of every block (double buffering) plus the accumulator",
                            suggest)
    if problem:
        errors.append(problem)
    env = {s.internal: s.literal for s in m.conv.sizes}
    for tp in m.passes:
        entries = smem_entries(tp, env)
        if entries is not None and entries * 4 > target.smem_bytes:
            errors.append(
                Diagnostic(
                    k.tile_span,
                    f"tiles {_tiles_text(k)} need {format_bytes(entries * 4)} of SMEM for the prefetch tables on {target.name} "
                    f"(limit {format_bytes(target.smem_bytes)}); use larger tiles",
                )
            )
            break
    if target.name == "v4":
        # Measured: Mosaic on v4 cannot sum a block over its last dimension (lanes) outside a
        # matrix product: the result needs a "sublane gather" that generation lacks.
        for tp in m.passes:
            body = tp.p.body
            for q in body.summed:
                others = [o for o in body.summed if o is not q]
                last = q.live[-1] if q.live else None
                if last in body.summed_indices and not any(last in o.live for o in others):
                    errors.append(Diagnostic(tp.p.statement.span, f"v4 cannot sum over '{last}' here: it is the last dimension of "
                                             f"'{q.factors[0].operand}' blocks and no matrix product contracts it "
                                             "(Mosaic has no sublane gather on v4); build for v5e or v6e"))
                    break
                # Measured too: a block summed over its other dimensions down to one (lane)
                # dimension, then multiplied as a vector by a matrix (d, c) x (c, a) -> (a).
                alone = [i for i in q.live if i in body.summed_indices and not any(i in o.live for o in others)]
                rest = [i for i in q.live if i not in alone]
                if others and alone and len(rest) == 1 and rest[0] in body.summed_indices:
                    errors.append(Diagnostic(tp.p.statement.span, f"v4 cannot sum '{q.factors[0].operand}' blocks over "
                                             f"{', '.join(repr(i) for i in alone)} into a vector for a matrix product "
                                             "(Mosaic has no sublane gather on v4); build for v5e or v6e"))
                    break
    # The MXU multiplies f32, bf16 and i8 blocks (v4: no i8); Mosaic refuses the other integers.
    # The body feeds it the factors' dtype when both groups share one, else both in the
    # accumulate dtype (see tpu/body.py).
    reported = set()
    for tp in m.passes:
        body = tp.p.body
        if not body.matrix_product:
            continue
        ops = [k.operand(q.factors[0].operand) for q in body.summed]
        dtypes = {q.fed[0].name for q in body.summed}  # a covered product may be formed wider
        fed = matrix_dtype(tuple(q.fed[0] for q in body.summed), k.accumulate).name
        if fed in ("f32", "bf16") or (fed == "i8" and target.int8_matmul):
            continue
        op = next((op for op in ops if op.dtype.name == fed), ops[0])
        if op.name in reported:
            continue
        reported.add(op.name)
        if fed == "i8":
            errors.append(Diagnostic(op.dtype_span, f"{target.name} has no int8 matmul: '{op.name}' is {op.dtype.name}"))
        else:
            errors.append(Diagnostic(op.dtype_span, f"the TPU's matrix unit multiplies f32, bf16 or i8 blocks (i8 with i8); "
                                                    f"'{op.name}' is {op.dtype.name} in a matrix product"
                                                    + ("" if len(dtypes) == 1 else f" (its factors meet in the accumulate dtype, {fed})")))
    return errors
