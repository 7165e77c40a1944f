"""The Splash Attention side of the sparsegen-vs-Splash benchmark (jax 0.12.0.1).

Plain functions over `jax.experimental.pallas.ops.tpu.splash_attention`; nothing here
imports sparsegen, so the benchmark script can set both sides up independently.

    splash_masks(S, block, kind)          Splash mask objects for causal/local/chunked/document
    time_mask_info(mask, bq, bkv)         host time of building MaskInfo (best of a few, s)
    splash_grid_steps(info, heads)        grid steps, computed blocks, K/V (or Q) block copies
    splash_kernel(H, S, D, block, kind)   callable (q, k, v[, seg_q, seg_kv]) -> o
    splash_arg_shapes / splash_inputs     its argument shapes / random arguments
    fwd_bwd(fn)                           (q, k, v, ...) -> (dq, dk, dv) of sum(o)
    aot_compile(fn, shapes, chip)         compile for v5e/v6e with no TPU present, memory + VMEM
    splash_time(fn, args)                 on-device time; None when there is no TPU

Run it to print the CPU-side numbers (MaskInfo build times, grids, AOT compiles):

    TPU_SKIP_MDS_QUERY=1 ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv/bin/python bench/splash_side.py
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import statistics
import time
from typing import Any, Callable, NamedTuple

# libtpu, loaded for ahead-of-time compiles, otherwise queries GCE metadata and takes a
# process-wide lock; neither is wanted on a CPU-only machine or beside another process.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas.ops.tpu import splash_attention as sa  # noqa: E402
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib  # noqa: E402
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info_lib  # noqa: E402

WINDOW = 1024  # "local": query i sees keys i-1023 .. i
CHUNK = 2048  # "chunked": same 2048-token chunk, causal inside it
N_DOCS = 8  # "document": about this many packed documents
KINDS = ("causal", "local", "chunked", "document", "document_dense", "numpy_causal")


# ------------------------------------------------------------------ masks


class SplashMask(NamedTuple):
    """What Splash needs for one attention pattern.

    mask: the static MultiHeadMask; Splash derives its block grid (MaskInfo) from it alone.
    segment_ids: int32[S] document ids, or None. Splash takes them as runtime arrays
      (SegmentIds(q, kv)) and applies them elementwise inside every computed block: they
      never remove a block from the grid.
    """

    mask: mask_lib.MultiHeadMask
    segment_ids: np.ndarray | None = None


def document_ids(S: int, n_docs: int = N_DOCS, seed: int = 0) -> np.ndarray:
    """Sorted int32 segment ids for `n_docs` packed documents of random lengths (not block-aligned)."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, S), size=n_docs - 1, replace=False))
    ids = np.zeros(S, np.int32)
    ids[cuts] = 1
    return np.cumsum(ids, dtype=np.int32)


def dense_mask(S: int, kind: str, *, n_docs: int = N_DOCS, seed: int = 0) -> np.ndarray:
    """bool[S, S], True where query i may attend to key j: the reference for every kind."""
    i = np.arange(S)[:, None]
    j = np.arange(S)[None, :]
    causal = i >= j
    if kind in ("causal", "numpy_causal"):
        return causal
    if kind == "local":
        return causal & (j > i - WINDOW)
    if kind == "chunked":
        return causal & (i // CHUNK == j // CHUNK)
    if kind in ("document", "document_dense"):
        ids = document_ids(S, n_docs, seed)
        return causal & (ids[:, None] == ids[None, :])
    raise ValueError(f"unknown mask kind {kind!r}; one of {KINDS}")


def splash_masks(S: int, block: int, kind: str, *, H: int = 8, n_docs: int = N_DOCS, seed: int = 0) -> SplashMask:
    """The Splash mask for `kind`, one head mask repeated over H heads.

    causal, local, chunked: lazy masks whose mask_function the kernel evaluates from iotas
      (no mask blocks are read from HBM).
    document: CausalMask + runtime SegmentIds, the way Splash models packed documents;
      the grid is the causal one (no block skipping across documents).
    document_dense: the same pattern as a NumpyMask (causal & same document). Splash then
      skips blocks between documents but reads partial mask blocks from HBM, and the ids
      must be known when the kernel is built.
    numpy_causal: causal as a NumpyMask, the slow-to-build dense path.

    Repeating one head-mask object matters: MaskInfo is built once per *unique* mask and
    shared by all heads (first dimension 1), so H costs nothing beyond hashing.
    """
    if S % block:
        raise ValueError(f"block {block} must divide S={S}")  # Splash's MaskInfo demands it
    shape = (S, S)
    segment_ids = None
    if kind in ("causal", "document"):
        head = sa.CausalMask(shape)
        if kind == "document":
            segment_ids = document_ids(S, n_docs, seed)
    elif kind == "local":
        # LocalMask keeps q - left <= kv <= q + right: left = W-1 gives i-W < j, right = 0 causal.
        head = sa.LocalMask(shape, window_size=(WINDOW - 1, 0), offset=0)
    elif kind == "chunked":
        head = mask_lib.ChunkedCausalMask(shape, chunk_size=CHUNK)  # not re-exported by the package
    elif kind in ("document_dense", "numpy_causal"):
        head = sa.NumpyMask(dense_mask(S, kind, n_docs=n_docs, seed=seed))
    else:
        raise ValueError(f"unknown mask kind {kind!r}; one of {KINDS}")
    return SplashMask(sa.MultiHeadMask([head] * H), segment_ids)


# ------------------------------------------------------------------ MaskInfo


def mask_info(mask: mask_lib.MultiHeadMask, block_q: int, block_kv: int, *, dkv: bool = False) -> info_lib.MaskInfo:
    """The MaskInfo make_splash_mha builds (fwd/dq: process_mask; dkv: process_mask_dkv).

    Same call as the kernel builder: single device (head_shards=q_seq_shards=1),
    downcast_smem_data=True, shrink_grid=True (the default when the bwd is not fused).
    """
    process = info_lib.process_mask_dkv if dkv else info_lib.process_mask
    info, _mask_function = process(mask, (block_q, block_kv), head_shards=1, q_seq_shards=1)
    return info


def time_mask_info(
    mask: mask_lib.MultiHeadMask, block_q: int, block_kv: int, *, repeats: int = 3, dkv: bool = False
) -> float:
    """Best-of-`repeats` host seconds to build MaskInfo, cold each time.

    process_mask sits behind functools.lru_cache(maxsize=12) keyed on the mask's hash, so
    the cache is cleared before each run (otherwise runs 2..n take ~0 s). The time includes
    hashing the mask, as a cold make_splash_mha pays it; for a NumpyMask that is a
    tobytes() of the whole S x S array per head.
    """
    best = float("inf")
    for _ in range(repeats):
        info_lib._process_mask.cache_clear()
        start = time.perf_counter()
        mask_info(mask, block_q, block_kv, dkv=dkv)
        best = min(best, time.perf_counter() - start)
    return best


def time_kernel_build(H: int, S: int, block: int, mask_kind: str, *, fused_bwd: bool = False) -> float:
    """Host seconds of one cold make_splash_mha_single_device with backward blocks: MaskInfo for
    fwd, dq (a cache hit: same block shape as fwd) and dkv, plus moving them to jax arrays."""
    m = splash_masks(S, block, mask_kind, H=H).mask
    info_lib._process_mask.cache_clear()
    start = time.perf_counter()
    sa.make_splash_mha_single_device(m, block_sizes=block_sizes(block, fused_bwd=fused_bwd))
    return time.perf_counter() - start


def splash_grid_steps(
    info: info_lib.MaskInfo, heads: int, *, dkv: bool = False, kv_heads: int | None = None
) -> dict[str, Any]:
    """Grid of the Splash kernel that runs on `info`, and what its steps do.

    fwd and dq (splash_attention_kernel._splash_attention_forward/_bwd_dq):
      grid = (heads, q_blocks, data_next.shape[-1]); at step (h, i, j) K and V blocks
      (h // (heads/kv_heads), data_next[h', i, j]) are fetched, h' = 0 when MaskInfo has one
      head row; the body runs when block_mask[h', i, j] > 0.
    dkv (_bwd_dkv): grid = (kv_blocks, heads, data_next.shape[-2]); step (kv, h, i) fetches
      Q/dO/lse/di blocks (h, data_next[h', i, kv]) and runs when block_mask[h', i, kv] > 0.

    data_next.shape[-1] (fwd) / [-2] (dkv) is the shrunk grid width: with shrink_grid the
    empty columns are squeezed out to the widest row, padding entries have block_mask 0 and
    data_next 0. Empty steps in the unshrunk part point data_next at the *next* non-empty
    block, so they prefetch rather than fetch garbage.

    Copies follow the Pallas TPU pipeline rule: a block is DMA'd when its index differs from
    the previous grid step's (the first step always copies). `streamed_copies` counts the
    K (fwd/dq) or Q (dkv) block fetches; each one moves K and V (or Q, dO, lse, di) tiles.
    `partial` counts computed blocks with block_mask 1 (mask not all ones); for lazy masks
    the mask_function is evaluated on every computed block anyway (mask_next is None).
    """
    data_next = np.asarray(info.data_next).astype(np.int64)
    block_mask = np.asarray(info.block_mask).astype(np.int64)
    mask_next = None if info.mask_next is None else np.asarray(info.mask_next).astype(np.int64)
    kv_heads = heads if kv_heads is None else kv_heads
    per_kv = heads // kv_heads
    rows = np.arange(heads) if data_next.shape[0] > 1 else np.zeros(heads, np.int64)

    if dkv:
        _, width, kv_blocks = data_next.shape
        grid = (kv_blocks, heads, width)
        # (kv, h, i) order: move kv to the front, then head, then the q steps.
        nxt = data_next[rows].transpose(2, 0, 1)  # [kv, h, i]
        run = block_mask[rows].transpose(2, 0, 1) > 0
        head_of = np.broadcast_to(np.arange(heads)[None, :, None], nxt.shape)  # Q is per q-head
        mnext = None if mask_next is None else mask_next[rows].transpose(2, 0, 1)
    else:
        _, q_blocks, width = data_next.shape
        grid = (heads, q_blocks, width)
        nxt = data_next[rows]  # [h, i, j]
        run = block_mask[rows] > 0
        head_of = np.broadcast_to((np.arange(heads) // per_kv)[:, None, None], nxt.shape)  # K/V per kv-head
        mnext = None if mask_next is None else mask_next[rows]

    def copies(*index: np.ndarray) -> int:
        flat = np.stack([a.reshape(-1) for a in index], axis=1)
        return int(1 + np.count_nonzero(np.any(flat[1:] != flat[:-1], axis=1)))

    result = {
        "grid": grid,
        "steps": int(np.prod(grid)),
        "computed": int(run.sum()),
        "partial": int((block_mask[rows] == 1).sum()),
        "streamed_copies": copies(head_of, nxt),
        "mask_block_copies": None,
        "partial_mask_blocks": None if info.partial_mask_blocks is None else int(np.shape(info.partial_mask_blocks)[0]),
        "smem_bytes": sum(
            np.asarray(a).nbytes for a in (info.data_next, info.block_mask, info.mask_next) if a is not None
        ),
    }
    if mnext is not None:  # dense (NumpyMask) path: mask tiles streamed from HBM, indexed by mask_next
        result["mask_block_copies"] = copies(mnext)
    return result


# ------------------------------------------------------------------ kernels


def block_sizes(block: int, *, fused_bwd: bool = False) -> sa.BlockSizes:
    """One square tile everywhere. Splash demands: block divides S, block_kv(_compute) a multiple
    of 128 (lanes), block_kv % block_kv_compute == 0; with segment ids the dkv kernel also needs
    block_q % 128 == 0. Backward blocks must all be given or jax.grad fails."""
    bwd = dict(block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block)
    if not fused_bwd:
        bwd.update(block_q_dq=block, block_kv_dq=block)
    return sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, use_fused_bwd_kernel=fused_bwd, **bwd)


def splash_kernel(
    H: int,
    S: int,
    D: int,
    block: int,
    mask_kind: str,
    dtype=jnp.bfloat16,
    *,
    fused_bwd: bool = False,
    seed: int = 0,
    interpret: bool = False,
) -> Callable[..., jax.Array]:
    """Splash MHA over q, k, v of shape [H, S, D] (no batch axis: vmap for one).

    Returns fn(q, k, v) -> o, or for "document" fn(q, k, v, seg_q, seg_kv) -> o with int32[S]
    segment ids (Splash's only way to mask documents at runtime). The MaskInfo arrays are
    captured in the closure and become constants of the jitted program. `dtype` only
    documents the intended inputs: the kernel takes whatever q/k/v dtype it is given.
    interpret=True runs the Pallas kernels in the interpreter (CPU; slow, for checking).
    """
    del dtype
    m = splash_masks(S, block, mask_kind, H=H, seed=seed)
    kernel = sa.make_splash_mha_single_device(
        m.mask, block_sizes=block_sizes(block, fused_bwd=fused_bwd), interpret=interpret
    )
    if m.segment_ids is None:

        def fn(q, k, v):
            return kernel(q, k, v)

    else:

        def fn(q, k, v, seg_q, seg_kv):
            return kernel(q, k, v, segment_ids=sa.SegmentIds(q=seg_q, kv=seg_kv))

    fn.kernel = kernel  # for splash_grid_steps(fn.kernel.fwd_mask_info, H) etc.
    fn.segment_ids = m.segment_ids
    return fn


def splash_arg_shapes(H: int, S: int, D: int, mask_kind: str, dtype=jnp.bfloat16) -> list[jax.ShapeDtypeStruct]:
    """Argument shapes of splash_kernel(...)'s callable."""
    qkv = [jax.ShapeDtypeStruct((H, S, D), dtype)] * 3
    seg = [jax.ShapeDtypeStruct((S,), jnp.int32)] * 2 if mask_kind == "document" else []
    return qkv + seg


def splash_inputs(H: int, S: int, D: int, mask_kind: str, dtype=jnp.bfloat16, *, seed: int = 0) -> list[jax.Array]:
    """Random q, k, v (and the document ids twice) matching splash_arg_shapes."""
    keys = jax.random.split(jax.random.key(seed), 3)
    qkv = [jax.random.normal(key, (H, S, D), dtype) for key in keys]
    if mask_kind == "document":
        ids = jnp.asarray(document_ids(S, seed=seed))
        return qkv + [ids, ids]
    return qkv


def fwd_bwd(fn: Callable[..., jax.Array]) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array]]:
    """(q, k, v, *rest) -> (dq, dk, dv) of sum(o): runs Splash's fwd (with residuals), dkv and dq kernels."""

    def loss(q, k, v, *rest):
        return fn(q, k, v, *rest).astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


# ------------------------------------------------------------------ ahead-of-time compile


@functools.cache
def _topology_device(chip: str):
    from jax.experimental import topologies

    topology = chip if ":" in chip else f"{chip}:2x2"
    return topologies.get_topology_desc(topology, "tpu").devices[0]


@dataclasses.dataclass
class AotReport:
    chip: str
    compile_s: float
    argument_bytes: int  # memory_analysis(): HBM
    output_bytes: int
    temp_bytes: int  # HBM temporaries; 0 when XLA puts them in VMEM (S(1) in the HLO), as at S=4096
    code_bytes: int
    kernel_vmem: dict[str, int]  # Splash kernel (tpu_custom_call) -> scoped VMEM bytes it uses
    compiled: Any = dataclasses.field(default=None, repr=False)

    @property
    def vmem_bytes(self) -> int:
        """The largest scoped VMEM of the program's Splash kernels."""
        return max(self.kernel_vmem.values(), default=0)


def _lower(fn, args_shapes, chip: str):
    device = _topology_device(chip)
    sharding = jax.sharding.SingleDeviceSharding(device)
    structs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in args_shapes]
    # Some Mosaic lowerings ask the default device which TPU they target (sparsegen's
    # tests/aot.py does the same); Splash happens to compile without it.
    with jax.default_device(device):
        return jax.jit(fn).trace(*structs).lower()


_CUSTOM_CALL = re.compile(r"%(\S+) = [^\n]*custom_call_target=\"tpu_custom_call\"")
_USED_SCOPED = re.compile(r'"used_scoped_memory_configs":\[([^\]]*)\]')


def kernel_vmem(hlo_text: str) -> dict[str, int]:
    """Scoped VMEM per Mosaic kernel, read from the compiled HLO.

    memory_analysis() only covers HBM, and the custom call's *input* backend_config has
    scoped_memory_configs [] (Splash sets no vmem_limit_bytes; the body is serialized Mosaic
    bytecode). After compilation each tpu_custom_call's backend_config carries
    used_scoped_memory_configs [{"memory_space":"1","size":N}]: the scoped VMEM it was
    given, which equals the smallest xla_tpu_scoped_vmem_limit_kib it compiles under
    (probe_vmem). The kernel-metadata JSON spans lines, so search past the instruction head.
    """
    out = {}
    for m in _CUSTOM_CALL.finditer(hlo_text):
        used = _USED_SCOPED.search(hlo_text, m.end())
        out[m.group(1)] = sum(int(x) for x in re.findall(r'"size":"(\d+)"', used.group(1))) if used else 0
    return out


_UNITS = {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_VMEM_OOM = re.compile(r"allocating on stack for %(\S+) .*?exceeded scoped vmem limit by ([\d.]+)([BKMG])", re.S)


def probe_vmem(lowered, *, start_kib: int = 256, tolerance_kib: int = 16) -> tuple[int | None, str | None]:
    """Smallest scoped VMEM limit (bytes, to `tolerance_kib`) the program compiles under, and the
    kernel that bound it: a cross-check of kernel_vmem, by compiling.

    Splash's kernels run under XLA's default scoped limit, which the compile option
    xla_tpu_scoped_vmem_limit_kib sets. Too low a limit fails with "exceeded scoped vmem limit
    by X" naming the kernel; grow by X until it compiles, then bisect the last gap. Only the
    first kernel to overflow is named, so this gives the program's maximum, not each kernel's.
    """
    low, high, kernel = 0, None, None
    limit = start_kib
    for _ in range(24):
        try:
            lowered.compile(compiler_options={"xla_tpu_scoped_vmem_limit_kib": limit})
        except Exception as exc:  # the compiler says by how much, and for which kernel
            m = _VMEM_OOM.search(str(exc))
            if not m:
                return None, None
            kernel, low = m.group(1), limit
            limit += max(int(float(m.group(2)) * _UNITS[m.group(3)] / 1024) + 1, 1)
            continue
        high = limit
        break
    if high is None:
        return None, kernel
    while high - low > tolerance_kib:
        mid = (low + high) // 2
        try:
            lowered.compile(compiler_options={"xla_tpu_scoped_vmem_limit_kib": mid})
            high = mid
        except Exception as exc:
            m = _VMEM_OOM.search(str(exc))
            if not m:
                break
            low, kernel = mid, m.group(1)
    return high * 1024, kernel


def aot_compile(fn, args_shapes, chip: str = "v5e") -> AotReport:
    """Compile fn for `chip` ("v5e", "v6e", or a topology such as "v5e:2x2") with no TPU here.

    get_topology_desc(topology, "tpu").devices[0], ShapeDtypeStructs carrying its
    SingleDeviceSharding, jax.jit(fn).trace(*structs).lower().compile(); args_shapes are
    anything with .shape and .dtype (splash_arg_shapes gives them).
    """
    lowered = _lower(fn, args_shapes, chip)
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    return AotReport(
        chip=chip,
        compile_s=seconds,
        argument_bytes=mem.argument_size_in_bytes,
        output_bytes=mem.output_size_in_bytes,
        temp_bytes=mem.temp_size_in_bytes,
        code_bytes=mem.generated_code_size_in_bytes,
        kernel_vmem=kernel_vmem(compiled.as_text()),
        compiled=compiled,
    )


# ------------------------------------------------------------------ on-device timing


def tpu_present() -> bool:
    try:
        return any(d.platform == "tpu" for d in jax.devices())
    except RuntimeError:
        return False


def splash_time(fn, args, *, warmup: int = 2, iters: int = 10) -> float | None:
    """Median seconds per call of jit(fn)(*args) on the first TPU, or None without one."""
    if not tpu_present():
        return None
    device = next(d for d in jax.devices() if d.platform == "tpu")
    args = [jax.device_put(a, device) for a in args]
    jitted = jax.jit(fn)
    for _ in range(warmup):  # compile + first-run effects
        jax.block_until_ready(jitted(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------ CPU-side report


def _check_masks(S: int = 4096, block: int = 512) -> None:
    """Each lazy/dense Splash mask equals dense_mask, the pattern the benchmark means."""
    for kind in KINDS:
        m = splash_masks(S, block, kind, H=1)
        got = m.mask.masks[0][(slice(0, S), slice(0, S))]
        if m.segment_ids is not None:
            got = got & (m.segment_ids[:, None] == m.segment_ids[None, :])
        assert np.array_equal(got, dense_mask(S, kind)), kind


def main() -> None:
    _check_masks()
    print("masks equal their dense definitions (S=4096)")

    S, B = 32768, 512
    print(f"\nMaskInfo build at S={S}, blocks {B}x{B}, H=8 (numpy_causal: H=1), best of 2; grids for H=8:")
    for kind in ("causal", "local", "chunked", "document", "numpy_causal"):
        m = splash_masks(S, B, kind, H=1 if kind == "numpy_causal" else 8).mask
        fwd = time_mask_info(m, B, B, repeats=2)
        dkv = time_mask_info(m, B, B, repeats=2, dkv=True)
        g = splash_grid_steps(mask_info(m, B, B), 8)
        gd = splash_grid_steps(mask_info(m, B, B, dkv=True), 8, dkv=True)
        print(f"  {kind:13s} fwd {fwd:5.2f} s  dkv {dkv:5.2f} s")
        print(f"      fwd {g}\n      dkv {gd}")
    print(f"  make_splash_mha_single_device(causal, S={S}) cold: {time_kernel_build(8, S, B, 'causal'):.2f} s")

    print("\nAhead-of-time compiles, H=8 D=128 bf16, blocks 512:")
    for kind, S in (("causal", 4096), ("local", 8192), ("document", 4096)):
        fn = splash_kernel(8, S, 128, 512, kind)
        shapes = splash_arg_shapes(8, S, 128, kind)
        for chip in ("v5e", "v6e"):
            for label, f in (("fwd", fn), ("fwd+bwd", fwd_bwd(fn))):
                r = aot_compile(f, shapes, chip)
                vmem = ", ".join(f"{k.split('.')[0]} {v / 2**20:.2f} MiB" for k, v in r.kernel_vmem.items())
                print(
                    f"  {kind:8s} S={S} {chip} {label:7s}: compile {r.compile_s:.2f} s, HBM args {r.argument_bytes / 2**20:.0f} MiB "
                    f"out {r.output_bytes / 2**20:.0f} MiB temp {r.temp_bytes / 2**20:.0f} MiB; scoped VMEM {vmem}"
                )
    fn = splash_kernel(8, 4096, 128, 512, "causal")
    limit, kernel = probe_vmem(_lower(fn, splash_arg_shapes(8, 4096, 128, "causal"), "v5e"))
    print(
        f"  cross-check, causal fwd v5e: smallest xla_tpu_scoped_vmem_limit_kib that compiles: {limit / 2**20:.2f} MiB ({kernel})"
    )


if __name__ == "__main__":
    main()
