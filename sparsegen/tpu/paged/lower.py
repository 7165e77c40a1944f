"""TPU lowering of the paged walk (schedule/paged.py): the arrays the pallas_call reads, the
gathered operands' buffers, the VMEM estimate and the gradients refused.

The kernel is written by `emit.py`. Grid: the lead indices and the row blocks, all
parallel; in each step a loop over key blocks, whose pages are copied from HBM (the
operand stays in HBM: `memory_space=pl.ANY`) into two VMEM buffers, the next block's
copies started before the current block is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...autodiff import Refusal
from ...callconv import convention
from ...expr import Const
from ...ir import Kernel
from ...names import ModuleNames
from ...schedule.attention import RowPlan
from ...schedule.paged import PagedPlan
from ...schedule.row import row_walk
from ..attention.lower import AttentionModule, Operand
from ..targets import Target
from ..vmem import VmemItem

GRADIENT_REFUSED = ("the gradient through a read through a table ('{read}') is not derived yet on TPU "
                    "(a scatter-add at the addressed pages; issue 19): paged kernels are for inference")


@dataclass(frozen=True)
class PagedModule(AttentionModule):
    paged: PagedPlan = None

    walks = ("paged walk",)


def lower_paged(kernel: Kernel, plan: RowPlan, paged: PagedPlan, target: Target) -> PagedModule:
    names = ModuleNames(kernel)
    conv = convention(kernel, names)
    walk = row_walk(kernel, plan, conv, names)  # its names only: the lead axes
    tile = {i.name: i.tile for i in kernel.indices}
    ops = []
    q = plan.q
    block = tuple(None if s.index in plan.lead else tile[s.index] for s in q.subs)
    ops.append(Operand(q, "q", f"{q.operand}_ref", f"{q.operand}_blk", f"_{q.operand}_map",  # named by the emitter
                       "natural", block, tuple(Const(0) for _ in q.subs)))
    for g in paged.gathers:
        r = g.read
        role = "k" if r is plan.k else "value"
        ops.append(Operand(r, role, f"{r.operand}_hbm", f"{r.operand}_blk", "", "gathered",
                           (paged.key_tile, tile[g.inner.index]), ()))
    vmem = paged_vmem(kernel, plan, paged)
    refused = tuple(Refusal(op.name, None, GRADIENT_REFUSED.format(read=g.read.text))
                    for g in paged.gathers for op in [kernel.operand(g.read.operand)] if op.dtype.is_float)
    refused += tuple(Refusal(op.name, None, f"the gradient of '{op.name}' in a paged walk is not derived yet (issue 19)")
                     for op in kernel.inputs if op.dtype.is_float and op.name not in {g.read.operand for g in paged.gathers})
    error = "gradients through reads through tables are not derived yet on TPU (issue 19): paged kernels are for inference"
    return PagedModule(kernel, target, conv, names, plan, walk, tuple(ops), vmem, backward_error=error, refused=refused, paged=paged)


def paged_vmem(kernel: Kernel, p: RowPlan, paged: PagedPlan) -> tuple[VmemItem, ...]:
    """Two buffers of the row block of q and of each output, two gathered key blocks per
    gathered operand, the running statistics and the score block's f32 temporaries."""
    tile = {i.name: i.tile for i in kernel.indices}
    acc = kernel.accumulate
    ti, tj = tile[p.query], paged.key_tile
    for i in paged.packed:  # heads (or tokens) packed into the rows
        ti *= tile[i]
    vmem = [VmemItem(f"{p.q.operand} block x2", (ti, tile[p.summed]), kernel.operand(p.q.operand).dtype, 2)]
    for g in paged.gathers:
        vmem.append(VmemItem(f"{g.read.operand} gathered pages x2", (tj, tile[g.inner.index]), kernel.operand(g.read.operand).dtype, 2))
    for c in p.consumers:
        out = kernel.operand(c.output)
        if c.kind == "softmax_product":
            e = [i for i in kernel.statement_of(c.output).target.indices if i not in p.lead and i != p.query][0]
            vmem.append(VmemItem(f"{c.output} block x2", (ti, tile[e]), out.dtype, 2))
            vmem.append(VmemItem(f"{c.output} accumulator", (ti, tile[e]), acc, 1))
        else:
            vmem.append(VmemItem(f"{c.output} block x2", (1, ti), out.dtype, 2))
    vmem.append(VmemItem("running max and sum", (ti, 1), acc, 3))
    vmem.append(VmemItem("score block and its softmax (f32 temporaries)", (ti, tj), acc, 3))
    return tuple(vmem)
