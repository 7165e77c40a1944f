"""TPU lowering of the row walk (schedule/attention.py): which arrays the pallas_calls read,
how each is laid out for its block, the VMEM estimate, and whether gradients are derived.

The kernels themselves are written by `kernels.py`, the module around them by `emit.py`.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

from ...autodiff import refusals
from ...dtypes import DTYPES
from ...callconv import convention
from ...ir import Kernel, Read
from ...lowered import LoweredModule
from ...names import ModuleNames
from ...schedule.build import ScheduleError
from ...source import Diagnostic
from ...expr import Const
from ...schedule.attention import RowPlan, read_key
from ...schedule.row import RowWalk, row_walk
from ...walks.flash_gradients import derived_outputs, gradient_refusals
from ..targets import Target
from ..layout import padded_bytes
from ..vmem import MOSAIC_SCRATCH, VmemItem, attention_vmem, vmem_limit

LANES, SUBLANES = 128, 8



@dataclass(frozen=True)
class Operand:
    """One array the pallas_call reads: a read of the spec, laid out for its block."""

    read: Read
    role: str  # "q" | "k" | "value" | "extra"
    ref: str  # the kernel's ref
    var: str  # the kernel's local for its block value
    fn: str  # index map
    layout: str  # "natural" | "rows" (lane-broadcast column) | "cols" (sublane-broadcast row) | "scalar"
    block: tuple  # block shape (None: squeezed)
    coords: tuple  # per array dimension, the block coordinate (an expr: `RowWalk.coord`)


@dataclass(frozen=True)
class AttentionModule(LoweredModule):
    target: Target
    plan: RowPlan
    walk: RowWalk
    operands: tuple[Operand, ...]
    vmem: tuple[VmemItem, ...]
    vmem_limit_override: int | None = None  # verify's probe
    refused: tuple = ()  # autodiff.Refusal: every gradient not derived, each raised only where needed
    backward_walk: "BackwardWalk | None" = None  # fused or two passes (`backward_walk`), None without a backward

    @property
    def vmem_bytes(self) -> int:
        return sum(item.bytes for item in self.vmem)

    def vmem_limit(self) -> int | None:
        """vmem_limit_bytes for the compiler (`vmem.vmem_limit`, Mosaic's scratch on top of the estimate)."""
        return vmem_limit(self.vmem_bytes + MOSAIC_SCRATCH, self.target, self.vmem_limit_override)

    @property
    def has_backward(self) -> bool:
        """The dq and dk/dv kernels, unless no gradient can be derived at all."""
        return self.backward_error is None

    def with_vmem_limit(self, limit: int) -> "AttentionModule":
        """The module compiled with `vmem_limit_bytes=limit` in every call (verify's probe)."""
        return dataclasses.replace(self, vmem_limit_override=limit)

    walks = ("row walk",)

    def must_span(self) -> list[tuple[str, int, str, str]]:
        """(index, tile, size symbol, why) for each tile that must equal its symbolic size: a
        score block sums all of the summed index, a value block holds all of its own index."""
        return [(i, self.kernel.index(i).tile, self.kernel.index(i).size.symbol, f"an attention block sums (or holds) all of '{i}'")
                for i in self.plan.inner if self.kernel.index(i).size.literal is None]

    def block_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(operand, the block shape its kernel sees) of each array read, for naming it in a
        compiler's error."""
        return [(o.read.operand, tuple(b for b in o.block if b is not None)) for o in self.operands]


def lower_attention(kernel: Kernel, plan: RowPlan, target: Target) -> AttentionModule:
    for r in [plan.k] + [c.value for c in plan.consumers if c.value is not None]:
        for sub in r.subs if r is not None else ():
            if sub.index == plan.query and sub.divisor != 1:  # the paged walk's rows of several heads read so
                raise ScheduleError(Diagnostic(r.span, f"not supported yet: '{r.operand}' read through {sub.text}; "
                                                       "in an attention-like kernel only a batch or head index may be divided"))
    names = ModuleNames(kernel)
    conv = convention(kernel, names)
    p = plan
    walk = row_walk(kernel, plan, conv, names)
    ops: list[Operand] = []
    tile = {i.name: i.tile for i in kernel.indices}

    def add(read: Read, role: str):
        if any(read_key(o.read) == read_key(read) for o in ops):
            return
        has_q, has_k = p.query in read.indices, p.key in read.indices
        layout = "natural" if role != "extra" or (has_q and has_k) else ("rows" if has_q else "cols" if has_k else "scalar")
        block, coords = layout_block(read, layout, walk, tile)
        ops.append(Operand(read, role, names.local(f"{read.operand}_ref"), names.local(f"{read.operand}_blk"),
                           names.function(f"_{read.operand}_map" if role != "extra" else f"_{read.operand}_{''.join(read.indices)}_map"),
                           layout, block, coords))

    if not p.stored_score:
        add(p.q, "q")
        add(p.k, "k")
    for c in p.consumers:
        if c.value is not None:
            add(c.value, "value")
    for r in p.reads:
        add(r, "extra")
    vmem = attention_vmem(kernel, p, ops)
    error = gradient_error(kernel, plan)
    return AttentionModule(kernel, target, conv, names, plan, walk, tuple(ops), vmem, backward_error=error,
                           refused=refusals(kernel, None, error) + gradient_refusals(kernel, plan),  # the kernel-wide reason first
                           backward_walk=backward_walk(kernel, plan, target, ops) if error is None and derived_outputs(plan) else None)


def layout_block(read: Read, layout: str, walk: RowWalk, tile: dict) -> tuple[tuple, tuple]:
    """A read's block and coordinates (the walk's) for a layout: "natural" (the array as it
    is), "rows" (a lane-broadcast copy: the kernel sees a column), "cols" (a sublane-broadcast
    copy: a row), "scalar" (a tile-broadcast copy: one value)."""
    block = [None if s.index in walk.plan.lead else tile[s.index] for s in read.subs]
    coords = [walk.coord(s.index, s.divisor) for s in read.subs]
    zero = Const(0)
    if layout == "rows":
        block, coords = block + [LANES], coords + [zero]
    elif layout == "cols":
        block, coords = block[:-1] + [SUBLANES, block[-1]], coords[:-1] + [zero, coords[-1]]
    elif layout == "scalar":
        block, coords = block + [SUBLANES, LANES], coords + [zero, zero]
    return tuple(block), tuple(coords)


def gradient_error(kernel: Kernel, p: RowPlan) -> str | None:
    """Why the flash-attention backward cannot be derived for this kernel at all (None: it can;
    the gradients through a max or stored output are refused one by one, `gradient_refusals`)."""
    if len(p.points) > 1:
        names = ", ".join(f"'{pt.name}'" for pt in p.points)
        return f"the gradient of outputs that reduce different scores ({names}) in one kernel is not derived yet"
    if p.stored_score and not p.float_reads():
        return "a stored score of integer operands has no gradient"
    return None


def gradient_dtype(kernel: Kernel, p: RowPlan, read: Read):
    """A gradient block's dtype: the operand's where the kernel's block is the whole
    gradient; f32 where the wrapper still sums partial gradients (grouped heads, a head the
    operand lacks, an operand read twice)."""
    op = kernel.operand(read.operand)
    roles = [r for r in (p.q, p.k, *(c.value for c in p.consumers if c.value is not None)) if r is not None and r.operand == read.operand]
    direct = len(set(roles)) == 1 and len(roles) == 1 and all(s.divisor == 1 for s in read.subs) and set(p.lead) <= set(read.indices)
    return op.dtype if direct else DTYPES["f32"]


# ------------------------------------------------------------------ the backward's walk


@dataclass(frozen=True)
class BackwardWalk:
    """How the gradients walk (the one rule: `backward_walk`). Fused: one walk over key
    blocks computes dk, dv and dq, each (key block, row block) pair's scores and
    probabilities once; dq of a whole lead group (a batch and head) is summed in VMEM and
    written once at the group's last step, so no output block is revisited out of turn.
    Otherwise two passes: dq over the row walk, dk and dv over the key-side walk, each
    recomputing the scores."""

    fused: bool
    why: str  # the reason, in words (`sparsegen plan`)
    max_rows: int | None = None  # fused while the query index's size, padded to its tile, is at most this (None: always)
    row_bytes: int = 0  # VMEM a row of dq takes: its f32 sum and its output block's two buffers
    vmem: tuple[VmemItem, ...] = ()  # the fused walk's VMEM besides dq's rows
    static_bytes: int = 0  # their sum, with Mosaic's scratch
    limit: int | None = None  # vmem_limit_bytes for the fused call at a literal size (`vmem.vmem_limit`)


def backward_walk(kernel: Kernel, p: RowPlan, target: Target, ops) -> BackwardWalk:
    """Fused or two passes, and why. Fused needs: a score product (dq is its row factor's
    gradient); no float operand the chain reads per row, per block or per walk (their
    gradients are summed over the row walk, which the fused walk does not take); a row tile
    the dynamic store of a dq block can address (a multiple of 8 rows); and dq of one group
    and the walk's blocks within three quarters of the target's VMEM, decided here for a
    literal size, else by the generated code against `max_rows` (the size is known at
    trace time). tests/test_fused_backward.py compiles the fused walk at `max_rows`."""
    if p.stored_score:
        return BackwardWalk(False, "two passes: a stored score has no row factor whose gradient the key walk could sum")
    for r in p.float_reads():
        o = next(o for o in ops if read_key(o.read) == read_key(r))
        if o.layout != "cols":
            what = {"natural": "per block", "rows": "per row", "scalar": "per walk"}[o.layout]
            return BackwardWalk(False, f"two passes: the chain reads '{r.operand}' {what}, whose gradient the row walk sums")
    tile = {i.name: i.tile for i in kernel.indices}
    ti, tj, d = tile[p.query], tile[p.key], tile[p.summed]
    if ti % kernel.accumulate.sublanes:
        return BackwardWalk(False, f"two passes: a row tile of {ti} is no multiple of {kernel.accumulate.sublanes}, "
                                   "so dq's blocks cannot be stored at a dynamic row")
    acc = kernel.accumulate
    dq_dtype = gradient_dtype(kernel, p, p.q)
    row_bytes = padded_bytes((SUBLANES, d), acc) // SUBLANES + 2 * padded_bytes((16, d), dq_dtype) // 16
    vmem = [VmemItem(f"{o.read.operand} block x2", tuple(b for b in o.block if b is not None), kernel.operand(o.read.operand).dtype, 2) for o in ops]
    for c in p.consumers:
        if c.kind == "softmax_product":
            e = [i for i in kernel.statement_of(c.output).target.indices if i not in p.lead and i != p.query][0]
            vmem.append(VmemItem(f"d{c.output} block x2", (ti, tile[e]), kernel.operand(c.output).dtype, 2))
            vmem.append(VmemItem(f"d{c.value.operand} block x2 and its sum", (tj, tile[e]), acc, 3))
    vmem.append(VmemItem("row statistics x2", (SUBLANES, ti), acc, 2 * (2 + any(c.kind == "sum" for c in p.consumers))))
    vmem.append(VmemItem(f"d{p.k.operand} block x2 and its sum", (tj, d), acc, 3))
    vmem.append(VmemItem("score, probability and gradient blocks (f32 temporaries)", (tj, ti), acc, 4))
    static = sum(item.bytes for item in vmem) + MOSAIC_SCRATCH
    budget = target.vmem_bytes * 3 // 4  # a quarter for what the estimate misses (spills, Mosaic's copies)
    max_rows = (budget - static) // row_bytes // ti * ti
    group = ", ".join(p.lead) or "walk"
    if max_rows < ti:
        return BackwardWalk(False, f"two passes: dq of one ({group}) would not fit in {target.name}'s VMEM beside the walk's blocks")
    size = kernel.index(p.query).size
    rows = -(-size.literal // ti) * ti if size.literal is not None else None
    if rows is not None and rows > max_rows:
        return BackwardWalk(False, f"two passes: dq of one ({group}), {rows} rows, would take {rows * row_bytes >> 20} MiB of VMEM "
                                   f"(at most {max_rows} rows fit in three quarters of {target.name}'s)")
    limit = vmem_limit(static + rows * row_bytes, target) if rows is not None else None
    why = (f"fused: one walk over key blocks computes d{p.k.operand}, the values' gradients and d{p.q.operand} "
           f"(d{p.q.operand} of one ({group}) summed in VMEM, {row_bytes} bytes a row)")
    if rows is None:
        why += f", while {size.text} padded to {ti} is at most {max_rows}"
    return BackwardWalk(True, why, None if rows is not None else max_rows, row_bytes, tuple(vmem), static, limit)
