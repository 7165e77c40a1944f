"""The VMEM estimates, and the limit asked of the compiler, for every kernel family: the
einsum passes (`lower.py`) and the row walk (`attention/lower.py`). Every item is a padded
block (`layout.padded_bytes`) times its buffers; the rules (`rules.vmem_overflow`) hold the
sum against the target's VMEM, and `vmem_limit` turns it into `vmem_limit_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import DTYPES, DType
from ..ir import Kernel
from ..schedule.core import Pass
from ..schedule.attention import RowPlan
from .layout import padded_bytes
from .targets import Target

# VMEM the compiler keeps for itself beside a kernel's buffers (measured: 64-90 KiB).
MOSAIC_SCRATCH = 128 * 1024


@dataclass(frozen=True)
class VmemItem:
    what: str
    shape: tuple[int, ...]
    dtype: DType
    buffers: int

    @property
    def bytes(self) -> int:
        return self.buffers * padded_bytes(self.shape, self.dtype)


def vmem_limit(need: int, target: Target, override: int | None = None) -> int | None:
    """vmem_limit_bytes for the compiler: None while the default scoped limit is ample
    (`override`, verify's probe, wins).

    The estimate leaves out Mosaic's own scratch and spills, so the limit adds a
    quarter and 2 MiB on top, within the chip's capacity.
    """
    if override is not None:
        return override
    if need <= target.scoped_vmem_bytes * 3 // 4:
        return None
    limit = need * 5 // 4 + 2 * (1 << 20)
    limit = -(-limit // (1 << 20)) * (1 << 20)
    return min(max(limit, target.scoped_vmem_bytes), target.vmem_bytes)


def einsum_vmem(kernel: Kernel, p: Pass, specs, target: Target) -> tuple[VmemItem, ...]:
    """An einsum pass's footprint: two buffers of every block (lower.Spec), the accumulator,
    the body's temporaries, Mosaic's scratch."""
    items = []
    for s in specs:
        op = kernel.operand(s.block.operand)
        items.append(VmemItem(f"{op.name} block" + (" (output)" if s.block.is_output else ""), s.view.ref_shape or (1,), op.dtype, 2))
    body = p.body
    acc_shape = body.acc_shape or (1, 1)
    if body.accumulator:
        items.append(VmemItem("accumulator", acc_shape, p.accumulate, 1))
    # Values the body computes on a whole block may spill from vector registers to VMEM: the
    # product of the sum and the product with each end factor (output-sized), and a factor of
    # the sum that a covered factor is broadcast into (one copy in the accumulate dtype:
    # measured, 8 MiB for f32 128x128x128 blocks; same-shaped covered factors and ragged
    # tails are computed in place).
    out_shape = tuple(d.extent for d in p.out.dims if d.live) or (1, 1)
    temporaries = (1 if body.summed or body.step else 0) + max(len(c.products or ()) for c in body.flush_cases)
    # A factor brought into the output's index order keeps its aligned copy; Mosaic moves a
    # block of three or more dimensions through several (measured: 64-80 MiB for 128^3
    # blocks multiplied as (b, a) x (c, a, b) -> (a, b, c)).
    for q in (*body.step, *(q for c in body.flush_cases for q in (c.products or ()))):
        for f in q.factors:
            if f.live != body.out_live[-len(f.live):] if f.live else False:
                temporaries += target.transpose_copies if len(body.out_live) >= 3 else 1
    if temporaries:
        items.append(VmemItem("body temporaries", out_shape, p.accumulate, temporaries))
    if len(body.summed) == 2 and any(len(q.live) >= 3 for q in body.summed):
        # A product of blocks of three or more dimensions goes through jnp.einsum, which
        # transposes them for the MXU (measured: 41 MiB where a 128^3 f32 block takes 16).
        for q in body.summed:
            if len(q.live) >= 3:
                shape = next(tuple(d.extent for d in b.dims if d.live) for b in p.blocks if b.key == q.factors[0].block)
                items.append(VmemItem(f"{q.factors[0].operand} block, transposed", shape, p.accumulate, 3))
        items.append(VmemItem("product, transposed", out_shape, p.accumulate, 3))
    for q in (*body.summed, *body.step):
        main = q.factors[0]
        if any(len(f.live) < len(main.live) for f in q.factors[1:]):
            shape = next(tuple(d.extent for d in b.dims if d.live) for b in p.blocks if b.key == main.block)
            items.append(VmemItem(f"{main.operand} block, widened", shape, p.accumulate, 1))
    items.append(VmemItem("Mosaic internal scratch", (MOSAIC_SCRATCH // 4,), DTYPES["i32"], 1))
    return tuple(items)


def attention_vmem(kernel: Kernel, p: RowPlan, ops) -> tuple[VmemItem, ...]:
    """A row walk's footprint: two buffers of every operand's block (attention.lower.Operand)
    and output block, the accumulators, the running statistics, the score block's f32
    temporaries. Mosaic's scratch is not in it: `vmem_limit` is asked for it on top."""
    tile = {i.name: i.tile for i in kernel.indices}
    vmem = []
    acc = kernel.accumulate
    for o in ops:
        shape = tuple(b for b in o.block if b is not None)
        vmem.append(VmemItem(f"{o.read.operand} block x2", shape, kernel.operand(o.read.operand).dtype, 2))
    ti, tj = tile[p.query], tile[p.key]
    for c in p.consumers:
        out = kernel.operand(c.output)
        if c.kind == "softmax_product":
            e = [i for i in kernel.statement_of(c.output).target.indices if i not in p.lead and i != p.query][0]
            vmem.append(VmemItem(f"{c.output} block x2", (ti, tile[e]), out.dtype, 2))
            vmem.append(VmemItem(f"{c.output} accumulator", (ti, tile[e]), acc, 1))
        else:
            vmem.append(VmemItem(f"{c.output} block x2", (1, ti), out.dtype, 2))
    vmem.append(VmemItem("running max and sum", (ti, 1), acc, 3 * len(p.points)))
    vmem.append(VmemItem("score block and its softmax (f32 temporaries)", (ti, tj), acc, 3))
    return tuple(vmem)
