"""GPU lowering of the paged walk (schedule/paged.py): one CTA per (lead values, row block),
its rows padded to WGMMA's M = 64 in shared memory (as the row walk's decoding row blocks);
a loop over steps of `tk` keys between the first and the last page the condition reaches,
each step gathering its pages with one TMA copy per page and operand into one of two
shared-memory buffers (the next step's copies issued before this step is computed).

The rules are the row walk's (`gpu/attention/lower.py`: WGMMA's dtypes and shapes, the
CTA's shape `cta_shape` (the key step) and the shared-memory estimate `smem_bytes`, whose
layout this kernel keeps); the paged walk's own (one table, softmax products only) are
`schedule/paged.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...autodiff import Refusal
from ...callconv import convention
from ...ir import Kernel
from ...names import ModuleNames
from ...schedule.attention import RowPlan
from ...schedule.paged import PagedPlan
from ...schedule.row import RowWalk, row_walk
from ...source import Diagnostic
from ..attention.lower import PAD_ROWS, TQ, WGMMA_FLOATS, GpuOperand, GpuWalkModule, _k_step, cta_shape, fitting, key_steps
from ..plan import GpuError
from ..targets import GpuTarget

GRADIENT_REFUSED = ("the gradient through a read through a table ('{read}') is not derived on GPU targets "
                    "(a scatter-add at the addressed pages; issue 19): paged kernels are for inference")


@dataclass(frozen=True)
class GpuPagedModule(GpuWalkModule):
    target: GpuTarget
    plan: RowPlan
    walk: RowWalk  # its names only (the lead axes), as the TPU's paged module
    paged: PagedPlan
    operands: tuple[GpuOperand, ...]  # q, then the gathered key factor and values (their tiles: a step's keys x inner)
    rows: int  # rows of a row block (packed heads included): under TQ, padded to TQ in shared memory
    tk: int  # keys a step (64 or 128: the row walk's rule, `cta_shape`)
    smem: int
    refused: tuple = ()
    tq = TQ
    walks = ("paged walk",)


def lower_gpu_paged(kernel: Kernel, plan: RowPlan, paged: PagedPlan, target: GpuTarget) -> GpuPagedModule:
    """The GPU plan of a paged walk, or a GpuError at every part of the spec it cannot take."""
    k, p, pg = kernel, plan, paged
    problems: list[Diagnostic] = []

    def refuse(span, message):
        problems.append(Diagnostic(span, message))

    tile = {i.name: i.tile for i in k.indices}
    span = {i.name: i.tile_span for i in k.indices}
    for r in [p.q] + [g.read for g in pg.gathers]:
        d = k.operand(r.operand).dtype
        if d.name not in WGMMA_FLOATS:
            refuse(k.operand(r.operand).dtype_span, f"WGMMA multiplies bf16, f16 or f32 (tf32) tiles; '{r.operand}' is {d.name} "
                                                    f"(on {target.name}, declare it bf16, f16 or f32)")
    qd = k.operand(p.q.operand).dtype
    if any(k.operand(r.operand).dtype != qd for r in [g.read for g in pg.gathers]) and not problems:
        refuse(k.operand(p.k.operand).dtype_span, f"a paged walk's query, keys and values have one dtype on {target.name} (WGMMA)")
    if qd.name == "f32":
        refuse(k.operand(p.q.operand).dtype_span, f"not lowered for GPUs yet: a paged walk over f32 (tf32 WGMMA reads K-major tiles "
                                                  f"only: the pages' values would be transposed); declare bf16 or f16")
    if k.accumulate.name != "f32":
        refuse(k.accumulate_span or k.name_span, f"a GPU attention kernel accumulates in f32 (WGMMA's accumulator), not {k.accumulate.name}")
    ti, tj = tile[p.query], pg.key_tile
    rows = ti
    for i in pg.packed:
        rows *= tile[i]
    if pg.packed:
        # Heads packed with the query's rows (language v2, section 3): the arrays' two
        # dimensions merged into one of rows, each row block a run of them (the query whole).
        (i,) = pg.packed[-1:] if len(pg.packed) == 1 else (None,)
        size = k.index(p.query).size.literal
        reads = [p.q.indices] + [k.statement_of(c.output).target.indices for c in p.consumers]
        adjacent = i is not None and all(list(ix).index(p.query) == list(ix).index(i) + 1 for ix in reads if i in ix and p.query in ix)
        if not adjacent or size != ti or not all(i in ix for ix in reads):
            refuse(span[pg.packed[0]], f"not lowered for GPUs yet: '{pg.packed[0]}' packed into the rows with '{p.query}' on {target.name} "
                                       f"takes one packed index just before '{p.query}' in the query and the outputs, and '{p.query}' "
                                       f"whole (tile {p.query} = its literal size); build for a TPU target")
    if rows > TQ or rows % PAD_ROWS:
        what = " x ".join(f"{tile[i]} '{i}'" for i in (*pg.packed, p.query))
        refuse(span[p.query], f"tile {p.query} = {ti}: a paged row block on {target.name} is a multiple of {PAD_ROWS} up to {TQ} rows "
                              f"(one warpgroup's WGMMA, padded to {TQ}); here {what} = {rows}")
    names = ModuleNames(k)
    conv = convention(k, names)
    walk = row_walk(k, p, conv, names)  # its names only: the lead axes
    ops = [GpuOperand(p.q, "q", "tile", names.local(f"{p.q.operand}_gmem"), names.local(f"{p.q.operand}_smem"),
                      (p.query, p.summed), False)]
    for g in pg.gathers:
        role = "k" if g.read is p.k else "value"
        ops.append(GpuOperand(g.read, role, "tile", names.local(f"{g.read.operand}_gmem"), names.local(f"{g.read.operand}_pages"),
                              (p.key, g.inner.index), False))
    # The CTA's shape: the row walk's rule, for a row block of `rows` (at most 64, one
    # consumer warpgroup: the kernel copies and computes in it).
    steps = key_steps(tj)
    # Its rows' logsumexps are stored too: the key parts' merge (flash decoding) weighs by them.
    # Its steps may hold absent elements (keys past `lens`, outside the bounds): checked.
    tk, smem = cta_shape(k, p, ops, rows, steps, target, row_lse=True, checked=True)[1:] if steps else (None, 0)
    if tk is None:
        refuse(span[p.key], f"tile {p.key} = {tj}: a step reads 64 or 128 keys (WGMMA's N, then P.V's K); "
                            f"on {target.name} the key block is a multiple of 64")
    try:
        _k_step(qd, tile[p.summed], span[p.summed], f"tile {p.summed}", target)
    except GpuError as exc:
        problems += exc.diagnostics
    for g in pg.gathers[1:]:
        e = g.inner.index
        if tile[e] % 16 or tile[e] > 256:
            refuse(span[e], f"tile {e} = {tile[e]}: WGMMA's N (the values' columns) is a multiple of 16 up to 256 on {target.name}")
    if isinstance(pg.page, int) and tk is not None and (pg.page % PAD_ROWS or (pg.page < tk and tk % pg.page) or (pg.page > tk and pg.page % tk)):
        refuse(pg.gathers[0].table.span, f"pages of {pg.page}: on {target.name} a page is a multiple of {PAD_ROWS} rows (a TMA copy "
                                         f"into the step's buffer) that divides the step of {tk} keys, or a multiple of it")
    if problems:
        raise GpuError(problems)
    fitting(k, p, smem, target)
    refused = tuple(Refusal(op.name, None, GRADIENT_REFUSED.format(read=g.read.text))
                    for g in pg.gathers for op in [k.operand(g.read.operand)] if op.dtype.is_float)
    refused += tuple(Refusal(op.name, None, f"the gradient of '{op.name}' in a paged walk is not derived on GPU targets (issue 19)")
                     for op in k.inputs if op.dtype.is_float and op.name not in {g.read.operand for g in pg.gathers})
    error = "gradients through reads through tables are not derived on GPU targets (issue 19): paged kernels are for inference"
    return GpuPagedModule(k, target, conv, names, p, walk, pg, tuple(ops), rows, tk, smem, refused, backward_error=error)
