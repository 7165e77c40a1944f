"""GPU lowering of the row walk (schedule/attention.py): which arrays a CTA reads, how each
is laid out for WGMMA and TMA, its tiles, its shared memory, and the GPU's rules on them.

One CTA per (lead values, row tile of `TQ` rows): it holds its query tile in shared memory
and walks the non-empty key blocks of its row block (the classification's), `TK` keys a
pipeline step (TMA copies of the key-side tiles), with the online softmax in registers
(docs/gpu-notes.md, "Attention"). The kernel is written by `emit.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...autodiff import refusals
from ...callconv import convention
from ...dtypes import DType
from ...ir import Kernel, Read
from ...lowered import LoweredModule
from ...names import ModuleNames
from ...schedule.attention import RowPlan, read_key
from ...source import Diagnostic
from ..plan import GpuError
from ..rules import MEMORY_REGISTERS, WARPGROUPS  # FlashAttention-3's shape, where the row block holds the consumers' rows
from ..targets import GpuTarget
from .backward import GpuBackward, plan_backward

PAD_ROWS = 8  # a row block under TQ rows is a multiple of this (a TMA copy into the padded tile: 8-row swizzle atoms)
TQ = 64  # rows of a consumer warpgroup: one WGMMA M (a 128-row score tile spills: docs/gpu-notes.md)
STAGES = 2  # pipeline steps in flight (TMA copies of the key-side tiles)
ALIGN = 1024  # shared-memory tiles start at 1024-byte boundaries (the 128-byte swizzle's period)
CONSUMERS = ("softmax_product", "logsumexp", "max", "sum")  # what the GPU walk computes from the rows
WGMMA_FLOATS = ("bf16", "f16", "f32")  # f32 as tf32: K-major tiles only
SCRATCH_KEYS = 64  # keys of the values a partial step's checked product takes at a time (`_present_values`: counts of 64 stay apart)



@dataclass(frozen=True)
class GpuOperand:
    """One array a CTA reads: a read of the spec, as the kernel's GMEM ref and its tiles."""

    read: Read
    role: str  # "q" | "k" | "value" | "extra"
    layout: str  # "tile" (a 2-D tile), "rows" (a vector along the query), "cols" (along the key), "scalar"
    ref: str  # the kernel's GMEM ref
    smem: str  # its shared-memory tile (unused for "scalar")
    live: tuple[str, ...]  # the indices of its tile, in the array's order (after `swapped`)
    swapped: bool  # the wrapper swaps its two tile dimensions (tf32 WGMMA reads K-major tiles only; a mask stored key-major)


class GpuWalkModule(LoweredModule):
    """What a GPU walk's module answers alike (the compiler, `verify`, `describe`): the row
    walk's here, the paged walk's (gpu/paged/lower.py). Its `smem` (one CTA's shared
    memory), `operands` and `backward` (the paged walk: none) are its own."""

    backward = None

    @property
    def smem_bytes(self) -> int:
        return self.smem

    @property
    def tile(self) -> dict[str, int]:
        return {i.name: i.tile for i in self.kernel.indices}

    @property
    def has_backward(self) -> bool:
        return self.backward is not None

    @property
    def backward_smem(self) -> list[int]:
        """Shared memory of a dq CTA and of a dk/dv CTA (rules' estimate)."""
        return [self.backward.dq.smem, self.backward.dkv.smem] if self.backward is not None else []

    def operand(self, role: str) -> GpuOperand:
        return next(o for o in self.operands if o.role == role)


@dataclass(frozen=True)
class GpuAttentionModule(GpuWalkModule):
    target: GpuTarget
    plan: RowPlan
    operands: tuple[GpuOperand, ...]
    tq: int  # a consumer warpgroup's rows (a CTA holds `warpgroups` of them, a row block ti // tq)
    tk: int  # keys a pipeline step (a key block holds tj // tk)
    warpgroups: int  # 2: two consumer warpgroups and a producer (row blocks of 128 rows); 1: one warpgroup
    smem: int  # shared memory of one CTA (rules' estimate)
    backward: GpuBackward | None = None  # the dq and dk/dv kernels
    rows: int = TQ  # rows a CTA stores: `tq`, or a row block under 64 rows (decoding) padded to `tq` in shared memory
    splits: bool = False  # flash decoding: the forward walks each row block's key steps in parts (chosen at call time)
    walks = ("row walk",)

    @property
    def refused(self) -> tuple:
        return refusals(self.kernel, None, self.backward_error) + (self.backward.refused if self.backward is not None else ())


def _fail(span, message: str, notes=()):
    raise GpuError([Diagnostic(span, message, tuple(notes))])


def _k_step(dtype: DType, size: int, span, what: str, target: GpuTarget) -> None:
    """WGMMA's K (the score's summed index; the keys of a step for P.V) in rows of 32, 64
    or 128 bytes, or whole 128-byte rows (as the einsum rule, gpu/rules.py)."""
    swizzle, step = 128 // dtype.itemsize, 32 // dtype.itemsize
    if size % swizzle and size not in (step, 2 * step):
        _fail(span, f"{what} = {size}: WGMMA's K steps are multiples of {step} ({dtype.name}) in rows of 32, 64 or 128 bytes; "
                    f"on {target.name} use {step}, {2 * step} or a multiple of {swizzle}")


def lower_gpu_attention(kernel: Kernel, plan: RowPlan, target: GpuTarget) -> GpuAttentionModule:
    """The GPU plan of a row kernel, or a GpuError at every part of the spec it cannot take."""
    p, k = plan, kernel
    problems: list[Diagnostic] = []

    def refuse(span, message):
        problems.append(Diagnostic(span, message))

    for c in p.consumers:
        if c.kind not in CONSUMERS:
            refuse(k.statement_of(c.output).span, f"not lowered for GPUs yet: a stored {'softmax' if c.kind == 'softmax_out' else 'score'} "
                                                   f"('{c.output}'); build '{k.name}' for a TPU target")
    if len(p.points) > 1:
        refuse(k.statement_of(p.consumers[-1].output).span, "not lowered for GPUs yet: reductions of different scores in one kernel; "
                                                            f"build '{k.name}' for a TPU target")
    if p.stored_score:
        refuse(k.statements[0].span, f"not lowered for GPUs yet: scores read from stored operands (no product); build '{k.name}' for a TPU target")
    if problems:
        raise GpuError(problems)
    tile = {i.name: i.tile for i in k.indices}
    span = {i.name: i.tile_span for i in k.indices}
    qd, kd = k.operand(p.q.operand).dtype, k.operand(p.k.operand).dtype
    for r, d in ((p.q, qd), (p.k, kd)):
        if d.name not in WGMMA_FLOATS:
            refuse(k.operand(r.operand).dtype_span, f"WGMMA multiplies bf16, f16 or f32 (tf32) tiles; '{r.operand}' is {d.name} "
                                                    f"(on {target.name}, declare it bf16, f16 or f32)")
    if qd != kd and qd.name in WGMMA_FLOATS and kd.name in WGMMA_FLOATS:
        refuse(k.operand(p.k.operand).dtype_span, f"the score's factors have one dtype on {target.name} (WGMMA): "
                                                  f"'{p.q.operand}' is {qd.name}, '{p.k.operand}' {kd.name}")
    for c in p.consumers:
        if c.value is not None and k.operand(c.value.operand).dtype.name not in WGMMA_FLOATS:
            refuse(k.operand(c.value.operand).dtype_span, f"WGMMA multiplies bf16, f16 or f32 (tf32) tiles; '{c.value.operand}' is "
                                                          f"{k.operand(c.value.operand).dtype.name}")
    if k.accumulate.name != "f32":
        refuse(k.accumulate_span or k.name_span, f"a GPU attention kernel accumulates in f32 (WGMMA's accumulator), not {k.accumulate.name}")
    if problems:
        raise GpuError(problems)
    ti, tj = tile[p.query], tile[p.key]
    if ti % TQ and (ti > TQ or ti % PAD_ROWS):
        refuse(span[p.query], f"tile {p.query} = {ti}: a CTA takes {TQ} rows (one warpgroup's WGMMA); on {target.name} "
                              f"the row block is a multiple of {TQ}, or a multiple of {PAD_ROWS} under {TQ} (padded to {TQ})")
    for r in [p.k] + [c.value for c in p.consumers if c.value is not None]:
        for s_ in r.subs:
            if s_.index == p.query and s_.divisor != 1 and (not isinstance(s_.divisor, int) or s_.divisor % ti):
                refuse(r.span, f"a row block of {ti} '{p.query}' must read one '{r.operand}' head: {s_.text} needs "
                               f"{p.query}'s tile to divide {s_.divisor}")
    steps = key_steps(tj)  # shared memory decides (below)
    if not steps:
        refuse(span[p.key], f"tile {p.key} = {tj}: a pipeline step reads 64 or 128 keys (WGMMA's N, then P.V's K); "
                            f"on {target.name} the key block is a multiple of 64")
    try:
        _k_step(qd, tile[p.summed], span[p.summed], f"tile {p.summed}", target)
    except GpuError as exc:
        problems += exc.diagnostics
    for c in p.consumers:
        if c.kind == "softmax_product":
            e = _free_index(k, p, c)
            if tile[e] % 16 or tile[e] > 256:
                refuse(span[e], f"tile {e} = {tile[e]}: WGMMA's N (the values' columns) is a multiple of 16 up to 256 on {target.name}")
    if problems:
        raise GpuError(problems)

    names = ModuleNames(k)
    conv = convention(k, names)
    ops: list[GpuOperand] = []

    def live_of(read: Read) -> tuple[str, ...]:
        return tuple(s.index for s in read.subs if s.index not in p.lead and not (s.index == p.query and s.divisor != 1))

    def add(read: Read, role: str, want: tuple[str, ...] | None):
        if any(read_key(o.read) == read_key(read) for o in ops):
            return
        live = live_of(read)
        has_q, has_k = p.query in read.indices, p.key in read.indices
        layout = "tile" if role != "extra" or (has_q and has_k) else "rows" if has_q else "cols" if has_k else "scalar"
        if role == "extra":
            extra = [i for i in live if i not in (p.query, p.key)]
            if extra:
                _fail(read.span, f"not lowered for GPUs yet: '{read.operand}' read with '{extra[0]}', which the walk does not block "
                                 f"(a condition or expression reads the rows, the keys and the batch or head indices); build '{k.name}' for a TPU target")
        swapped = want is not None and live != want
        if want is not None and sorted(live) != sorted(want):
            _fail(read.span, f"not lowered for GPUs yet: '{read.operand}' read as {read.text}")
        ops.append(GpuOperand(read, role, layout, names.local(f"{read.operand}_gmem"), names.local(f"{read.operand}_smem"),
                              want if swapped else live, swapped))

    # WGMMA's tiles: A (m, k) in either order for 16-bit types (a transposed shared-memory
    # tile), B read K-major as (n, k); tf32 takes only A (m, k) and B (n, k): the wrapper
    # swaps an operand stored otherwise.
    def order(read, first, second, dtype):
        return None if dtype.itemsize == 2 else (first, second)

    add(p.q, "q", order(p.q, p.query, p.summed, qd))
    add(p.k, "k", order(p.k, p.key, p.summed, kd))
    for c in p.consumers:
        if c.value is not None:
            vd = k.operand(c.value.operand).dtype
            e = _free_index(k, p, c)
            add(c.value, "value", order(c.value, e, p.key, vd))
    for r in p.reads:
        add(r, "extra", (p.query, p.key) if p.query in r.indices and p.key in r.indices else None)
    if ti < TQ:
        for o in ops:
            if o.layout == "tile" and o.role == "extra":
                _fail(o.read.span, f"not lowered for GPUs yet: '{o.read.operand}' read along the rows and the keys in a row block of "
                                   f"{ti} rows (under WGMMA's {TQ}); build '{k.name}' for a TPU target")

    # The CTA's shape (`cta_shape`). With a backward the forward also keeps each row's
    # logsumexp (its residual); where only the forward without it fits, the gradients are
    # refused and the forward runs.
    def shaped(lse: bool) -> tuple[int, int, int]:
        shape = cta_shape(k, p, ops, ti, steps, target, row_lse=lse)
        fitting(k, p, shape[2], target)
        return shape

    rows = min(ti, TQ)
    if rows < TQ or any(s_.index == p.query and s_.divisor != 1 for o in ops for s_ in o.read.subs):
        # Decoding (language v2, section 3): inference only on GPU, as the TPU's paged walk.
        why = (f"a row block of {ti} rows padded to WGMMA's {TQ}" if rows < TQ else
               f"the key side read through '{p.query} // n' (grouped heads packed into the rows)")
        # Flash decoding: each key part also stores its rows' logsumexps (their weights in
        # the merge), where the CTA keeps its shape with them; else the walk stays whole.
        wgs, tk, smem = shaped(False)
        split = cta_shape(k, p, ops, ti, steps, target, row_lse=True)
        splits = fits(split, target) and split[:2] == (wgs, tk)
        if splits:
            smem = split[2]
        return GpuAttentionModule(k, target, conv, names, p, tuple(ops), TQ, tk, wgs, smem, None, rows, splits, backward_error=(
                                  f"the GPU backward walks row blocks of {TQ} rows and one key head each; '{k.name}' has {why}: "
                                  f"it is not differentiated on {target.name} (decoding kernels are for inference)"))
    backward, error = plan_backward(k, p, ops, target.smem_bytes), None
    for bk, what in ((backward.dq, "dq"), (backward.dkv, "dk/dv")):
        if bk.smem > target.smem_bytes and error is None:
            error = (f"the backward's {what} kernel needs {bk.smem} bytes of shared memory per CTA on {target.name} (limit "
                     f"{target.smem_bytes}): use smaller tiles of {p.summed} or the values' columns to differentiate '{k.name}'")
    if error is None and not fits(cta_shape(k, p, ops, ti, steps, target, row_lse=True), target) and \
            fits(cta_shape(k, p, ops, ti, steps, target), target):
        error = (f"the forward with each row's logsumexp needs more than {target.smem_bytes} bytes of shared memory per CTA on "
                 f"{target.name}: use smaller tiles of {p.summed} or the values' columns to differentiate '{k.name}'")
    wgs, tk, smem = shaped(error is None)
    if error is not None:
        return GpuAttentionModule(k, target, conv, names, p, tuple(ops), TQ, tk, wgs, smem, None, backward_error=error)
    return GpuAttentionModule(k, target, conv, names, p, tuple(ops), TQ, tk, wgs, smem, backward)


def cta_shape(k: Kernel, p: RowPlan, ops, rows: int, steps: list[int], target: GpuTarget, row_lse: bool = False,
              checked: bool | None = None) -> tuple[int, int, int]:
    """A CTA's shape: its consumer warpgroups, the keys a step reads (of `steps`, `key_steps`'),
    and its shared memory (`smem_bytes`); the widest that fits shared memory (the first, where
    none does: `fitting` says so). Two consumer warpgroups before one where the row block of
    `rows` holds them (`consumer_warpgroups`: a paged walk's row block, at most 64 rows, takes
    one), then 128 keys a step before 64 (64 halve the key-side buffers: f32 at d = 128 fits
    one warpgroup). `row_lse`: the forward also keeps each row's logsumexp (the backward's
    residual); `checked`: its steps may hold absent elements (default: `partial_steps`; a
    paged walk's always may)."""
    shapes = [(w, t) for w in dict.fromkeys((consumer_warpgroups(rows), 1)) for t in steps]
    sized = [(w, t, smem_bytes(k, p, ops, TQ, t, w, row_lse=row_lse, checked=checked)) for w, t in shapes]
    return next((s for s in sized if fits(s, target)), sized[0])


def fits(shape: tuple[int, int, int], target: GpuTarget) -> bool:
    return shape[2] <= target.smem_bytes


def fitting(k: Kernel, p: RowPlan, smem: int, target: GpuTarget) -> None:
    """A CTA's shared memory within the target's, or a GpuError at the tiles."""
    if smem > target.smem_bytes:
        _fail(k.tile_span, f"the tiles need {smem} bytes of shared memory per CTA on {target.name} (limit {target.smem_bytes}): "
                           f"use smaller tiles of {p.summed} or the values' columns")


def key_steps(tj: int) -> list[int]:
    """The keys a pipeline step may read in a key block of `tj` (WGMMA's N, then P.V's K),
    widest first; none where the block is not a multiple of 64."""
    return [t for t in (128, 64) if tj % t == 0]


def scratch_width(columns: int, dtype: DType) -> int:
    """The values' columns a checked product takes at a time (`_present_values`): 128 bytes
    of them (a swizzled row: 64 bf16, 32 f32) where that divides the tile, else all. Wider
    spilled (f32 at 64 columns: 92 bytes, masked_attention as written), narrower too (bf16
    at 32: 156, two consumers)."""
    width = 128 // dtype.itemsize
    return width if columns % width == 0 else columns


def partial_steps(k: Kernel, p: RowPlan) -> bool:
    """Can a step of the row walk hold absent elements: a condition, or a ragged end (sizes
    not known, or not a multiple of their tile)? Its P . V is checked then."""
    def ragged(i):
        idx = k.index(i)
        return idx.size.literal is None or idx.size.literal % idx.tile != 0
    return bool(p.conditions) or ragged(p.query) or ragged(p.key)


def _free_index(k: Kernel, p: RowPlan, c) -> str:
    return next(i for i in k.statement_of(c.output).target.indices if i not in p.lead and i != p.query)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def consumer_warpgroups(ti: int) -> int:
    """A CTA's consumer warpgroups: two (128 rows, FlashAttention-3's shape, and a producer
    warpgroup issuing the copies) where the row block holds them, sharing its walk (the same
    key tiles); else one warpgroup that copies and computes (warp-specialized, a CTA claims
    the whole register file at launch: one consumer an SM would compute less than two
    64-row CTAs side by side)."""
    return WARPGROUPS if ti % (WARPGROUPS * TQ) == 0 else 1


def out_through_q(k: Kernel, p: RowPlan, ops) -> str | None:
    """The output that leaves through the query tile (the walk reads that tile for the last
    time before the outputs are written): the first softmax product whose tile has the query
    tile's shape and dtype, or None."""
    qo = next(o for o in ops if o.role == "q")
    tile = {i.name: i.tile for i in k.indices}
    if qo.swapped or list(qo.live) != [p.query, p.summed]:
        return None
    for c in p.consumers:
        if (c.kind == "softmax_product" and tile[_free_index(k, p, c)] == tile[p.summed]
                and k.operand(c.output).dtype == k.operand(qo.read.operand).dtype):
            return c.output
    return None


def smem_bytes(k: Kernel, p: RowPlan, ops, tq: int, tk: int, wgs: int, row_lse: bool = False, checked: bool | None = None) -> int:
    """Shared memory of one CTA, as Mosaic GPU lays it out (measured under an abstract H200,
    tests/test_gpu_attention.py): the walk's scope, which every warpgroup shares (per
    consumer its query tile, per-row vectors, probabilities' tile and outputs' tiles, each
    allocation from a 1024-byte boundary), then the pipeline's buffers (per key-side operand
    its tiles for every step in flight, from a 1024-byte boundary); then each of the two
    scopes' barriers, 1024 bytes and 8 a barrier (a consumer's query copy; per step in
    flight the copies' arrival and, warp-specialized, the consumers' release). Where a step
    may hold absent elements (`checked`, `partial_steps` by default), the walk's scope also
    holds the checked product's tiles (`_checked_values`)."""
    tile = {i.name: i.tile for i in k.indices}
    walk = 0
    buffers = 0
    for o in ops:
        isz = k.operand(o.read.operand).dtype.itemsize
        if o.role == "q":
            walk += _aligned(wgs * tq * tile[p.summed] * isz)
        elif o.layout == "rows":
            walk += _aligned(wgs * tq * isz)
        elif o.layout == "cols":
            buffers += _aligned(STAGES * tk * isz)
        elif o.layout == "tile" and o.role == "extra":
            buffers += _aligned(STAGES * wgs * tq * tk * isz)
        elif o.role in ("k", "value"):
            other = [i for i in o.live if i != p.key][0]
            buffers += _aligned(STAGES * tk * tile[other] * isz)
    dtypes = {k.operand(c.value.operand).dtype.itemsize for c in p.consumers if c.kind == "softmax_product"}
    walk += sum(_aligned(wgs * tq * tk * isz) for isz in dtypes)  # the probabilities, as each values' dtype
    products = [c for c in p.consumers if c.kind == "softmax_product"]
    if products and (checked if checked is not None else partial_steps(k, p)):
        # A partial step's checked P . V: per consumer a tile of 64 keys of the values'
        # columns (each dtype and width) and each product's row sums.
        tiles = {(k.operand(c.value.operand).dtype, scratch_width(tile[_free_index(k, p, c)], k.operand(c.value.operand).dtype))
                 for c in products}
        walk += sum(_aligned(wgs * w * SCRATCH_KEYS * d.itemsize) for d, w in tiles)
        walk += _aligned(wgs * len(products) * tq * 4)
    through_q = out_through_q(k, p, ops)
    for c in p.consumers:
        if c.output != through_q:
            out = k.operand(c.output)
            walk += _aligned(wgs * tq * (tile[_free_index(k, p, c)] if c.kind == "softmax_product" else 1) * out.dtype.itemsize)
    if row_lse:
        walk += _aligned(wgs * tq * 4)  # each row's logsumexp, kept for the gradients
    pipeline_barriers = 2 * STAGES if wgs > 1 else STAGES
    # Two consumers' sums read by every warpgroup after the walk: one more barrier.
    verdicts = 1 if wgs > 1 and products and (checked if checked is not None else partial_steps(k, p)) else 0
    return walk + buffers + 2 * ALIGN + 8 * (wgs + pipeline_barriers + verdicts)
