"""The GPU's rules on tiles: what WGMMA, TMA and shared memory take, as spec diagnostics.

One source of truth for the CTA tiles inside the spec's blocks and for the shared memory a
CTA needs (`verify` measures the latter against what Mosaic GPU allocates). Measured with
Mosaic GPU lowering for an abstract H200 (docs/gpu-notes.md): WGMMA's accumulator rows are
a multiple of 64; its N a multiple of 8 up to 256 (16 and up lay out in shared memory); its
K a multiple of 16 for 16-bit factors (8 for tf32) within one 128-byte swizzle row; a 256 x
256 f32 accumulator in one warpgroup spills, so a CTA keeps at most 128 x 128.
"""

from __future__ import annotations

from ..dtypes import DType
from ..ir import Kernel
from ..source import Diagnostic
from .plan import GpuError, Tiles
from .targets import GpuTarget

DTYPES_WGMMA = ("bf16", "f16", "f32", "i8")  # f32 as tf32, i8 into s32 (both: K-major tiles only)
MAX_ACC = 128 * 128  # accumulator elements per warpgroup: its registers
# A warp-specialized consumer that also multiplies a covered mask's tile into its operand's
# (registers: the two tiles beside the accumulator) keeps at most 64 x 128 (measured under
# its 168 registers: a 128 x 128 accumulator spilled 248 to 320 bytes, 64 x 128 none).
MAX_ACC_MULTIPLYING = 64 * 128
# A condition selecting each step's product (`Selection` "step") holds a second accumulator
# beside the running one (the step's, selected before it is added).
MAX_ACC_STEP = 64 * 128
WARPGROUPS = 2  # consumer warpgroups of a warp-specialized CTA (and a producer): products, attention
MEMORY_REGISTERS = 40  # a forward producer's registers a thread (setmaxnreg): it only issues TMA copies


def fail(span, message: str, notes=()):
    raise GpuError([Diagnostic(span, message, tuple(notes))])


def smem_bytes(tiles: Tiles, in_itemsize: int, out_itemsize: int, end_itemsize: int = 0, held: tuple[int, int] = (0, 0),
               vectors: tuple[tuple[str, int], ...] = ()) -> int:
    """Shared memory of one product CTA. Scoped allocations are reused (measured), so the
    pipeline's buffers and the epilogue's tiles do not add; nor do the epilogue's two ways
    out (the output's tile, or an f32 piece of a block shared by CTAs), but a tile of the
    factor after the sum is held under either. A barrier takes 8 bytes (one per buffer, and
    the epilogue's where it reads a factor).

    Warp-specialized, the pipeline's buffers are allocated once for all of a CTA's chunks,
    beside each consumer's epilogue tiles (the output's, the f32 piece's, the factor after
    the sum's), so they add; the pipeline has two barriers a buffer (copied, consumed), and
    the factor after the sum one a consumer.

    `held`: (bytes, barriers) a CTA holds beside the pipeline's buffers while it runs (a
    condition's operand tiles, or a covered mask's, copied at partial steps; warp-specialized,
    each consumer's, beside its epilogue tiles).

    `vectors`: (axis, itemsize) of each factor after the sum along the rows ("rows": `tm`
    elements a tile) or the columns alone ("cols": `tn`), with a barrier each. Warp-specialized,
    each consumer's sit beside its epilogue tiles; else they are read in a scope of their own
    between the pipeline's and the store's, whose memory they reuse, and their barriers the
    epilogue's (measured: a 64x128 product with one vector takes the plain one's 98,344
    bytes; with three, 16 more)."""
    t = tiles
    pipeline = t.stages * (t.tm * t.tk + t.tk * t.cta_n) * in_itemsize
    # Each vector's allocation from a 1,024-byte boundary (measured: a (2, 128) bf16 vector
    # beside the epilogue tiles takes 1,024 bytes and its barriers 16; two take 2,048 and 32).
    vector = sum(-(-t.wgs * (t.tm if axis == "rows" else t.tn) * itemsize // 1024) * 1024 for axis, itemsize in vectors)
    if t.wgs > 1:
        epilogue = t.wgs * t.tm * t.epi * (out_itemsize + 4 + end_itemsize) + vector
        return pipeline + epilogue + held[0] + 8 * (2 * t.stages + (t.wgs if end_itemsize else 0) + t.wgs * len(vectors) + held[1])
    epilogue = t.tm * t.tn * (max(out_itemsize, 4) + end_itemsize)
    # The epilogue's barriers: the vectors', or the factor after the sum's (measured: a plain
    # 64x128 product takes 98,336 bytes, with a factor after the sum or one vector 98,344).
    return max(pipeline + held[0], epilogue, vector) + 8 * (t.stages + max(len(vectors), 1 if end_itemsize else 0) + held[1])


def elementwise_smem_bytes(tm: int, tn: int, itemsizes: int, factors: int) -> int:
    """Shared memory of one elementwise CTA: a tile of every factor and of the output, a barrier per factor."""
    return tm * tn * itemsizes + 8 * factors


def product_tiles(k: Kernel, target: GpuTarget, m: str, n: str, kidx: str, dtype: DType, out_dtype: DType, end_dtype: DType | None,
                  one_warpgroup: bool = False, held=lambda t: (0, 0), vectors: tuple[tuple[str, int], ...] = (),
                  multiplies: bool = False, step_product: bool = False) -> Tiles:
    """The CTA tiles of a matrix product inside the spec's blocks, and its pipeline depth.
    `one_warpgroup`: never warp-specialized (a condition walk masks the A or B tile a partial
    step reads in shared memory, which consumers sharing it would race on); `held(tiles)`:
    what the CTA holds beside the pipeline, and `vectors` the factors after the sum along
    the rows or columns alone (`smem_bytes`); `multiplies`: a partial step multiplies a
    covered mask's tile into its operand's in registers (`MAX_ACC_MULTIPLYING`); `step_product`:
    each step's product is computed apart and selected before it is added (`MAX_ACC_STEP`)."""
    tile = {i.name: i.tile for i in k.indices}
    span = {i.name: i.tile_span for i in k.indices}
    bm, bn, bk = tile[m], tile[n], tile[kidx]
    if bm % 64:
        fail(span[m], f"tile {m} = {bm}: WGMMA computes 64 rows at a time; on {target.name} the output block's "
                      f"rows ({m}) take a multiple of 64", ["tiles that work: 64, 128, 256, ..."])
    if bn % 128 == 0:
        tn = 128
    elif bn % 16 == 0 and bn <= 256:
        tn = bn
    else:
        fail(span[n], f"tile {n} = {bn}: WGMMA's N is a multiple of 16 up to 256 (or the block a multiple of 128, "
                      f"split into 128-wide tiles); on {target.name} use 16, 32, ..., 256, or a multiple of 128")
    tm = 128 if bm % 128 == 0 and 128 * tn <= (MAX_ACC_STEP if step_product else MAX_ACC) else 64
    swizzle = 128 // dtype.itemsize  # elements per 128-byte row: the widest swizzle
    step = 32 // dtype.itemsize  # WGMMA's K: 16 for 16-bit factors, 8 for tf32
    if bk % swizzle == 0:
        tk = swizzle
    elif bk == 2 * step or (bk == step and dtype.itemsize != 1):  # a 32- or 64-byte row: the narrower swizzles (s8: 64 only)
        tk = bk
    else:
        rows = "64 or 128 bytes (s8 takes no 32-byte swizzle)" if dtype.itemsize == 1 else "32, 64 or 128 bytes"
        ok = f"{2 * step}" if dtype.itemsize == 1 else f"{step}, {2 * step}"
        fail(span[kidx], f"tile {kidx} = {bk}: WGMMA's K steps are multiples of {step} ({dtype.name}) in rows of {rows}; "
                         f"on {target.name} use {ok} or a multiple of {swizzle}")
    end = end_dtype.itemsize if end_dtype else 0
    if bn % (WARPGROUPS * tn) == 0 and not one_warpgroup:
        # Warp-specialized where the block holds the consumers' tiles side by side: the
        # deepest pipeline that fits, then the widest epilogue tile (a TMA row of 16 bytes
        # or more).
        wm = 64 if multiplies and tm * tn > MAX_ACC_MULTIPLYING else tm
        for stages in (4, 3, 2):
            for epi in (tn, tn // 2, tn // 4, tn // 8):
                t = Tiles(bm, bn, bk, wm, tn, tk, stages, WARPGROUPS, epi)
                if epi * out_dtype.itemsize >= 16 and smem_bytes(t, dtype.itemsize, out_dtype.itemsize, end, held(t), vectors) <= target.smem_bytes:
                    return t
    need = 0
    for stages in (4, 3, 2):
        t = Tiles(bm, bn, bk, tm, tn, tk, stages)
        need = smem_bytes(t, dtype.itemsize, out_dtype.itemsize, end, held(t), vectors)
        if need <= target.smem_bytes:
            return t
    fail(k.tile_span, f"tiles need {need} bytes of shared memory per CTA on {target.name} (limit {target.smem_bytes})")


def elementwise_tiles(k: Kernel, target: GpuTarget, r: str, c: str, dtypes: list[DType]) -> tuple[int, int]:
    """The CTA tile of an elementwise statement (`dtypes`: the output's, then each factor's):
    at most 128 x 128 of the block, rows halved until every tile fits shared memory."""
    tile = {i.name: i.tile for i in k.indices}
    bm, bn = tile[r], tile[c]
    narrowest = min(d.itemsize for d in dtypes)
    itemsizes = sum(d.itemsize for d in dtypes)
    tn = next((t for t in (128, 64, 32, 16, 8) if bn % t == 0), None)
    if tn is None or (tn * narrowest) % 16:
        fail(k.index(c).tile_span, f"tile {c} = {bn}: TMA copies rows of a multiple of 16 bytes; use a multiple of "
                                   f"{16 // min(16, narrowest)}")
    tm = next(t for t in (128, 64, 32, 16, 8, 4, 2, 1) if bm % t == 0)
    while tm > 1 and elementwise_smem_bytes(tm, tn, itemsizes, len(dtypes) - 1) > target.smem_bytes:
        tm //= 2
    if elementwise_smem_bytes(tm, tn, itemsizes, len(dtypes) - 1) > target.smem_bytes:
        fail(k.tile_span, f"the tiles of this statement's factors need more shared memory than {target.name} has ({target.smem_bytes} bytes)")
    return tm, tn
