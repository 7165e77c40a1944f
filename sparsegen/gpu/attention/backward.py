"""The GPU backward of the row walk (FlashAttention-2 style): which arrays its two kernels
read, in which orientation, where each lives (copied once per CTA or a pipeline operand),
their shared memory, and the gradients not derived.

dq: a CTA per `TB` rows (as the forward), walking its row block's non-empty key blocks
(the forward's tables), `TB` keys a step: the scores again, p = exp(s - lse), dp = dO.V^T,
ds = p * (dp - delta), through the chain's derivative, then dq += ds.K.
dk, dv: a CTA per `TB` keys, walking its key block's non-empty row blocks (the transposed
classification), `TB` rows a step, on key x row tiles: dv += p^T.dO, dk += ds^T.Q.
Warp-specialized where the CTA's block holds 2 x `TB` rows (keys), as the forward
(FlashAttention-3's shape, tokamax's sm90 vjp): two consumer warpgroups of `TB` rows (keys)
each share the walk (the same tiles a step) while a producer warpgroup issues the TMA
copies; one warpgroup that copies and computes otherwise, or where the two consumers'
tiles would not fit in shared memory.
Per row, lse (the forward's, a residual) and delta = rowsum(dO * O) minus the logsumexp
output's cotangent (computed by the wrapper in jax.numpy, as the TPU module does).

WGMMA takes 16-bit tiles in either orientation (a transposed shared-memory tile), f32 (tf32)
only K-major (A as (m, k), B as (n, k) read transposed): there the wrapper passes an array
in each orientation a kernel needs (k twice for dq; q and dO twice for dk/dv).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...autodiff import Refusal
from ...ir import Kernel, Read
from ...schedule.attention import RowPlan
from ...walks.flash_gradients import derived_outputs, gradient_refusals
from ..rules import WARPGROUPS  # consumer warpgroups of a warp-specialized CTA, where the block holds their rows (keys)

TB = 64  # rows of a dq consumer and keys of a dk/dv one (one warpgroup's WGMMA M), and a step of either
MEMORY_REGISTERS = 24  # the producer's registers a thread (setmaxnreg), FlashAttention-3's for its backward: the consumers
# take 240 (the forward's 40 leaves them 232, and dk/dv at d = e = 128 then spills: docs/gpu-notes.md)
ALIGN = 1024
STAGES = 2


@dataclass(frozen=True)
class BArray:
    """One array a backward kernel reads: a read of the spec, a cotangent, or a per-row vector."""

    key: str  # what it is: "q", "k" ("q_t", "k_t": a second orientation), "v:NAME", "do:OUTPUT", "do_t:OUTPUT", "lse", "delta", "dsum:OUTPUT", "x:STEM"
    source: str  # "read" | "cotangent" | "lse" | "delta" | "dsum"
    dims: tuple[str, ...]  # the non-lead indices of the array the kernel receives, in order
    layout: str  # "tile" | "rows" (a vector along the query) | "cols" (along the key) | "scalar"
    scoped: bool  # copied once per CTA (else a pipeline operand, a tile per step)
    itemsize: int
    dtype: str  # jnp dtype of the array the kernel receives
    read: Read | None = None
    output: str | None = None  # the cotangent's output
    swapped: bool = False  # the wrapper swaps the read's two tile dimensions

    @property
    def name(self) -> str:
        """The stem of its names in the kernel (a spec name: the kernel's scope makes them unique)."""
        what, _, of = self.key.partition(":")
        return {"do": f"d{of}", "do_t": f"d{of}_t", "dsum": f"d{of}"}.get(what, of or what)


@dataclass(frozen=True)
class BKernel:
    which: str  # "dq" | "dkv"
    arrays: tuple[BArray, ...]
    scratch: tuple[tuple[str, int], ...]  # (what, itemsize): (TB, TB) tiles through which gradients enter WGMMA
    outs: tuple[tuple[str, tuple[str, ...], str], ...]  # (name, the indices it is laid out over after the lead, jnp dtype)
    smem: int
    warpgroups: int = 1  # 2: two consumer warpgroups of TB rows (keys) and a producer; 1: one warpgroup
    through: tuple[tuple[str, str | None], ...] = ()  # warp-specialized: each gradient's epilogue tile, a copied-once array's (its key) or its own (None)

    def array(self, key: str) -> BArray:
        return next(a for a in self.arrays if a.key == key)


@dataclass(frozen=True)
class GpuBackward:
    dq: BKernel
    dkv: BKernel
    refused: tuple[Refusal, ...]  # gradients not derived (each raised only where needed)
    grads: tuple[str, ...]  # the operands whose gradients the kernels compute
    outputs: tuple[str, ...]  # the outputs whose cotangents carry them


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _tile_bytes(a: BArray, tile: dict[str, int], p: RowPlan) -> int:
    if a.layout == "scalar":
        return 0
    elems = 1
    for i in a.dims:
        elems *= TB if i in (p.query, p.key) else tile[i]
    return elems * a.itemsize


def out_through(arrays, outs) -> tuple[tuple[str, str | None], ...]:
    """Warp-specialized, each gradient leaves through a tile of the consumer's: a copied-once
    array of its shape and dtype (q for dq, k and v for dk and dv: the walk has read them for
    the last time), else one of its own (a consumer cannot allocate shared memory alone)."""
    free = [a for a in arrays if a.scoped and a.layout == "tile"]
    through = []
    for name, over, dtype in outs:
        a = next((a for a in free if a.dims == tuple(over) and a.dtype == dtype), None)
        if a is not None:
            free.remove(a)
        through.append((name, a.key if a is not None else None))
    return tuple(through)


def kernel_smem(arrays, scratch, outs, tile: dict[str, int], p: RowPlan, wgs: int = 1) -> int:
    """Shared memory of a backward CTA as Mosaic GPU's resource estimate counts it (measured
    under an abstract H200, tests/test_gpu_attention.py and test_gpu_warp_specialized.py):
    every allocation from a 1024-byte boundary (the walk's copied-once arrays and scratch
    tiles, then the pipeline's tiles for every step in flight), then 8 bytes per barrier
    (the walk's and one per step in flight); or the epilogue's scope, which reuses the
    memory. Warp-specialized (`wgs` consumers): each copied-once array and scratch tile once
    per consumer (one allocation), the pipeline's tiles along the CTA's index `wgs` times as
    long, the epilogue's tiles not reusing an array in the walk's scope, and a barrier per
    consumer and two per step in flight (the copies' arrival, the consumers' release). No
    reduction runs in a step, so no reduction scratch (the forward's running max and sum take
    some)."""
    def tile_bytes(a: BArray, along: int) -> int:
        return _tile_bytes(a, tile, p) * (along if a.layout == "tile" and all(i in (p.query, p.key) for i in a.dims) else 1)

    walk = sum(_aligned(wgs * _tile_bytes(a, tile, p)) for a in arrays if a.scoped and a.layout != "scalar")
    walk += sum(_aligned(wgs * TB * TB * isz) for _, isz in scratch)
    epilogue = 0
    for _, over, dtype in outs:
        elems = 1
        for i in over:
            elems *= TB if i in (p.query, p.key) else tile[i]
        epilogue += _aligned(wgs * elems * (2 if dtype in ("jnp.bfloat16", "jnp.float16") else 4))
    if wgs > 1:
        # A pipeline tile spanning rows and keys spans the CTA's `wgs` x TB along its index.
        buffers = sum(_aligned(STAGES * tile_bytes(a, wgs)) for a in arrays if not a.scoped and a.layout != "scalar")
        own = [name for name, key in out_through(arrays, outs) if key is None]
        for name, over, dtype in outs:
            if name in own:
                elems = wgs
                for i in over:
                    elems *= TB if i in (p.query, p.key) else tile[i]
                walk += _aligned(elems * (2 if dtype in ("jnp.bfloat16", "jnp.float16") else 4))
        return walk + buffers + 8 * (wgs + 2 * STAGES)
    buffers = sum(_aligned(STAGES * _tile_bytes(a, tile, p)) for a in arrays if not a.scoped and a.layout != "scalar")
    return max(walk + buffers + 8 * (1 + STAGES), epilogue)


def backward_kernel(which: str, arrays, scratch, outs, tile: dict[str, int], p: RowPlan, along: str, limit: int) -> BKernel:
    """A backward kernel: warp-specialized (two consumers) where its block holds 2 x TB rows
    (keys) and their tiles fit in `limit` bytes of shared memory, else one warpgroup."""
    arrays, outs = tuple(arrays), tuple(outs)
    if tile[along] % (WARPGROUPS * TB) == 0:
        smem = kernel_smem(arrays, scratch, outs, tile, p, WARPGROUPS)
        if smem <= limit:
            return BKernel(which, arrays, scratch, outs, smem, WARPGROUPS, out_through(arrays, outs))
    return BKernel(which, arrays, scratch, outs, kernel_smem(arrays, scratch, outs, tile, p))


def _free(k: Kernel, p: RowPlan, c) -> str:
    return next(i for i in k.statement_of(c.output).target.indices if i not in p.lead and i != p.query)


def grad_dtype(k: Kernel, p: RowPlan, read: Read) -> str:
    """A gradient tile's dtype: the operand's where the kernel's tile is its whole gradient;
    f32 where the wrapper still sums partial gradients (grouped heads, a lead index the
    operand lacks, an operand read in two roles), as on the TPU."""
    op = k.operand(read.operand)
    roles = [r for r in (p.q, p.k, *(c.value for c in p.consumers if c.value is not None)) if r.operand == read.operand]
    direct = len(roles) == 1 and all(s.divisor == 1 for s in read.subs) and set(p.lead) <= set(read.indices)
    return op.dtype.jnp if direct else "jnp.float32"


def plan_backward(k: Kernel, p: RowPlan, ops, limit: int) -> GpuBackward:
    """The two backward kernels of a row kernel the GPU forward takes (`ops`: its operands;
    `limit`: the target's shared memory a CTA)."""
    tile = {i.name: i.tile for i in k.indices}
    refused = list(gradient_refusals(k, p))
    for r in p.float_reads():
        refused.append(Refusal(r.operand, None, f"the gradient of '{r.operand}' (read by the scores' elementwise steps as {r.text}) is not "
                                               f"lowered for GPUs yet: build '{k.name}' for a TPU target to differentiate it"))
    products = [c for c in p.consumers if c.kind == "softmax_product"]
    qd, kd = k.operand(p.q.operand).dtype, k.operand(p.k.operand).dtype
    by_role = {o.role: o for o in ops}

    def live(read: Read) -> tuple[str, ...]:
        return tuple(s.index for s in read.subs if s.index not in p.lead)

    def read_array(o, key: str, want: tuple[str, ...] | None, scoped: bool) -> BArray:
        """A read as a kernel wants it: 16-bit tiles as stored (either orientation serves),
        f32 tiles (and the extras' tiles) in the orientation `want`."""
        d = k.operand(o.read.operand).dtype
        natural = live(o.read)
        dims = natural if want is None else want
        return BArray(key, "read", dims, o.layout, scoped, d.itemsize, d.jnp, read=o.read, swapped=dims != natural)

    def order(dtype, first, second):
        return None if dtype.itemsize == 2 else (first, second)

    def cot_array(c, key: str, want, scoped: bool) -> BArray:
        vd = k.operand(c.value.operand).dtype  # dO enters WGMMA beside the values: their dtype
        natural = tuple(i for i in k.statement_of(c.output).target.indices if i not in p.lead)
        dims = natural if want is None else want
        return BArray(key, "cotangent", dims, "tile", scoped, vd.itemsize, vd.jnp, output=c.output, swapped=dims != natural)

    def vectors(scoped: bool) -> list[BArray]:
        out = [BArray("lse", "lse", (p.query,), "rows", scoped, 4, "jnp.float32"),
               BArray("delta", "delta", (p.query,), "rows", scoped, 4, "jnp.float32")]
        for c in p.consumers:
            if c.kind == "sum":
                out.append(BArray(f"dsum:{c.output}", "dsum", (p.query,), "rows", scoped, 4, "jnp.float32", output=c.output))
        return out

    extras = [o for o in ops if o.role == "extra"]
    # An extra's name stem: its operand and indices (seg[b, i] and seg[b, j] are two arrays).
    stem = {id(o): f"x:{o.read.operand}_{''.join(o.read.indices)}" for o in extras}

    # dq: rows x keys. Copied once: q, each dO, per-row vectors; a step: k, each value, per-key vectors, tiles.
    arrays = [read_array(by_role["q"], "q", order(qd, p.query, p.summed), True)]
    arrays += [cot_array(c, f"do:{c.output}", order(k.operand(c.value.operand).dtype, p.query, _free(k, p, c)), True) for c in products]
    arrays += vectors(True)
    arrays += [read_array(o, stem[id(o)], None, True) for o in extras if o.layout == "rows"]
    arrays.append(read_array(by_role["k"], "k", order(kd, p.key, p.summed), False))
    if kd.itemsize != 2:
        arrays.append(read_array(by_role["k"], "k_t", (p.summed, p.key), False))  # dq's B, K-major
    values = {}
    for c in products:
        vo = next(o for o in ops if o.role == "value" and o.read == c.value)
        if vo.read.operand not in values:
            values[vo.read.operand] = vo
            arrays.append(read_array(vo, f"v:{vo.read.operand}", order(k.operand(vo.read.operand).dtype, p.key, _free(k, p, c)), False))
    arrays += [read_array(o, stem[id(o)], (p.query, p.key) if o.layout == "tile" else None, False) for o in extras if o.layout in ("tile", "cols")]
    arrays += [read_array(o, stem[id(o)], None, True) for o in extras if o.layout == "scalar"]
    scratch = (("ds", kd.itemsize),)
    outs = (("dq", (p.query, p.summed), grad_dtype(k, p, p.q)),)
    dq = backward_kernel("dq", arrays, scratch, outs, tile, p, p.query, limit)

    # dk, dv: keys x rows. Copied once: k, each value, per-key vectors; a step: q, each dO, per-row vectors and tiles.
    arrays = [read_array(by_role["k"], "k", order(kd, p.key, p.summed), True)]
    for name, vo in values.items():
        c = next(c for c in products if c.value.operand == name)
        arrays.append(read_array(vo, f"v:{name}", order(k.operand(name).dtype, p.key, _free(k, p, c)), True))
    arrays += [read_array(o, stem[id(o)], None, True) for o in extras if o.layout == "cols"]
    arrays += [read_array(o, stem[id(o)], None, True) for o in extras if o.layout == "scalar"]
    arrays.append(read_array(by_role["q"], "q", order(qd, p.query, p.summed), False))
    if qd.itemsize != 2:
        arrays.append(read_array(by_role["q"], "q_t", (p.summed, p.query), False))  # dk's B, K-major
    for c in products:
        vd = k.operand(c.value.operand).dtype
        arrays.append(cot_array(c, f"do:{c.output}", order(vd, p.query, _free(k, p, c)), False))
        if vd.itemsize != 2:
            arrays.append(cot_array(c, f"do_t:{c.output}", (_free(k, p, c), p.query), False))  # dv's B, K-major
    arrays += vectors(False)
    arrays += [read_array(o, stem[id(o)], (p.key, p.query) if o.layout == "tile" else None, False) for o in extras if o.layout in ("tile", "rows")]
    value_sizes = list(dict.fromkeys(k.operand(name).dtype.itemsize for name in values))
    scratch = (("ds", qd.itemsize),) + tuple(("probs", isz) for isz in value_sizes)
    outs = (("dk", (p.key, p.summed), grad_dtype(k, p, p.k)),)
    outs += tuple((f"dv:{name}", (p.key, _free(k, p, next(c for c in products if c.value.operand == name))), grad_dtype(k, p, vo.read))
                  for name, vo in values.items())
    dkv = backward_kernel("dkv", arrays, scratch, outs, tile, p, p.key, limit)
    grads = [p.q.operand, p.k.operand] + [name for name in values if name not in (p.q.operand, p.k.operand)]
    return GpuBackward(dq, dkv, tuple(refused), tuple(dict.fromkeys(grads)), tuple(derived_outputs(p)))
