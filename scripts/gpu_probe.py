"""CPU-only probe of the Pallas Mosaic GPU idioms a sparsegen GPU backend needs.

Run:  .venv/bin/python scripts/gpu_probe.py [--skip-interpret] [--stage3-venv]

Stages (each prints one line: ok / failed + reason):
  interpret  run the kernel with plgpu.InterpretGPUParams() on CPU, compare numerics
  lower      jax.jit(f).trace(...).lower() under an AbstractMesh whose
             abstract_device is an "NVIDIA H200" (platform="cuda"); this runs the
             full Pallas -> Mosaic GPU MLIR lowering (WGMMA/TMA/SMEM checks).
  reject     lowering of deliberately bad tile shapes; prints the error text.
  stage3     (only if jax-cuda13-plugin is importable, e.g. run with
             /tmp/gpuvenv/bin/python) full XLA:GPU compile against a compile-only
             H200 topology; this runs Mosaic GPU -> PTX -> ptxas (sm_90a) on the
             CPU host, and we parse ptxas's register/spill report.
No GPU is needed. See docs/gpu-notes.md.
"""

import functools
import os
import sys
import tempfile

# No GPU here: keep jax on CPU even when the CUDA plugin is installed.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Makes the Mosaic GPU compiler print ptxas -v output (to the C-level stdout).
os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")
import time
import traceback

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import AbstractDevice, AbstractMesh

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
# GpuTargetConfigProto (text) for stage 3; numbers are H100-SXM/H200-like
# (sm_90, 132 SMs, 227 KiB opt-in SMEM). Only used with --stage3.
H200_TARGET_CONFIG = """gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info {
  major: 9
  minor: 8
}
device_description_str: "NVIDIA H200"
"""
WG = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)

RESULTS = []


def report(name, fn):
  t0 = time.perf_counter()
  try:
    extra = fn()
    msg = f"ok     {name} ({time.perf_counter() - t0:.1f}s)"
    if extra:
      msg += f" {extra}"
    RESULTS.append(True)
  except Exception as e:  # pylint: disable=broad-except
    first = (str(e).strip().splitlines() or [repr(e)])[0]
    msg = f"FAILED {name} ({time.perf_counter() - t0:.1f}s): {type(e).__name__}: {first[:400]}"
    if "-v" in sys.argv:
      traceback.print_exc()
    RESULTS.append(False)
  print(msg, flush=True)


# ---------------------------------------------------------------------------
# 1. Dense matmul: grid over (M/tm, N/tn) CTAs, emit_pipeline over K, WGMMA.
# ---------------------------------------------------------------------------
def dense_matmul(a, b, *, tm=64, tn=128, tk=64, steps=2, interpret=None):
  m, k = a.shape
  _, n = b.shape
  out_dtype = jnp.bfloat16

  def body(a_gmem, b_gmem, o_gmem):
    mi = lax.axis_index("m")
    ni = lax.axis_index("n")

    def acc_scope(acc_ref):
      plgpu.emit_pipeline(
          lambda _, a_smem, b_smem: plgpu.wgmma(acc_ref, a_smem, b_smem),
          grid=(k // tk,),
          in_specs=[
              plgpu.BlockSpec((tm, tk), lambda kk: (mi, kk)),
              plgpu.BlockSpec((tk, tn), lambda kk: (kk, ni)),
          ],
          max_concurrent_steps=steps,
      )(a_gmem, b_gmem)
      return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((tm, tn), jnp.float32))

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((tm, tn), out_dtype))
    def _store(o_smem):
      o_smem[...] = acc.astype(out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          o_smem, o_gmem.at[pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(m // tm, n // tn),
      grid_names=("m", "n"),
      compiler_params=WG,
      interpret=interpret,
  )(a, b)


# ---------------------------------------------------------------------------
# 2. Block-sparse (BSR) A @ dense B. A is stored as
#      row_ptr (M/bm + 1,) int32, col_idx (nnzb,) int32,
#      a_blocks (nnzb * bm, bk) bf16   (block s occupies rows s*bm:(s+1)*bm)
#    Each CTA (mi, ni) walks row_ptr[mi]..row_ptr[mi+1]: a *dynamic-length*
#    emit_pipeline whose index maps close over values loaded from GMEM.
# ---------------------------------------------------------------------------
def bsr_matmul(row_ptr, col_idx, a_blocks, b, *, bm=64, bk=64, tn=128,
               steps=2, interpret=None):
  mb = row_ptr.shape[0] - 1
  m = mb * bm
  _, n = b.shape
  out_dtype = jnp.bfloat16

  def body(row_ptr_gmem, col_idx_gmem, a_gmem, b_gmem, o_gmem):
    mi = lax.axis_index("m")
    ni = lax.axis_index("n")
    start = row_ptr_gmem[mi]          # scalar loads straight from GMEM
    nnz = row_ptr_gmem[mi + 1] - start

    def acc_scope(acc_ref):
      plgpu.emit_pipeline(
          lambda _, a_smem, b_smem: plgpu.wgmma(acc_ref, a_smem, b_smem),
          grid=(nnz,),                # dynamic grid (traced int32)
          in_specs=[
              plgpu.BlockSpec((bm, bk), lambda s: (start + s, 0)),
              plgpu.BlockSpec((bk, tn), lambda s: (col_idx_gmem[start + s], ni)),
          ],
          max_concurrent_steps=steps,
      )(a_gmem, b_gmem)
      return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, tn), jnp.float32))

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, tn), out_dtype))
    def _store(o_smem):
      o_smem[...] = acc.astype(out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          o_smem, o_gmem.at[pl.ds(mi * bm, bm), pl.ds(ni * tn, tn)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(mb, n // tn),
      grid_names=("m", "n"),
      compiler_params=WG,
      interpret=interpret,
  )(row_ptr, col_idx, a_blocks, b)


def make_bsr(mb, kb, bm, bk, seed=0):
  """Random BSR with varying nnz per block row, including an empty row."""
  rng = np.random.default_rng(seed)
  counts = [0, 1, kb, 2] + list(rng.integers(0, kb + 1, size=max(0, mb - 4)))
  counts = counts[:mb]
  row_ptr = np.zeros(mb + 1, np.int32)
  cols, blocks = [], []
  for r, c in enumerate(counts):
    cc = np.sort(rng.choice(kb, size=c, replace=False)).astype(np.int32)
    cols.extend(cc)
    for _ in cc:
      blocks.append(rng.standard_normal((bm, bk)).astype(np.float32))
    row_ptr[r + 1] = row_ptr[r] + c
  col_idx = np.array(cols, np.int32)
  a_blocks = np.concatenate(blocks, 0)
  dense = np.zeros((mb * bm, kb * bk), np.float32)
  for r in range(mb):
    for s in range(row_ptr[r], row_ptr[r + 1]):
      dense[r * bm:(r + 1) * bm, col_idx[s] * bk:(col_idx[s] + 1) * bk] = \
          a_blocks[s * bm:(s + 1) * bm]
  return row_ptr, col_idx, a_blocks, dense


def lower_h200(f, *args):
  """Trace + lower under an abstract H200; returns the StableHLO text."""
  mesh = AbstractMesh((1,), ("x",), abstract_device=H200)
  with jax.sharding.use_abstract_mesh(mesh):
    lowered = jax.jit(f).trace(*args).lower()
  txt = lowered.as_text()
  assert "mosaic_gpu" in txt, "no mosaic_gpu custom call in lowered module"
  return txt


def sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def capture_fd_output(fn):
  """Runs fn() with C-level stdout/stderr redirected; returns (result, text)."""
  sys.stdout.flush()
  sys.stderr.flush()
  with tempfile.TemporaryFile(mode="w+b") as tmp:
    saved = os.dup(1), os.dup(2)
    os.dup2(tmp.fileno(), 1)
    os.dup2(tmp.fileno(), 2)
    try:
      res = fn()
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      os.close(saved[0])
      os.close(saved[1])
    tmp.seek(0)
    return res, tmp.read().decode(errors="replace")


def stage3(M, N, K, row_ptr, col_idx, a_blocks, kb, bk, NS, bm):
  import re  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  topo = topologies.get_topology_desc(
      platform="cuda", target_config=H200_TARGET_CONFIG, topology="1x1x1")
  sh = NamedSharding(Mesh(np.array(topo.devices), ("x",)), P())
  sd = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)

  def compile_and_report(f, *args, allow_spill=False):
    def run():
      _, log = capture_fd_output(lambda: jax.jit(f).lower(*args).compile())
      regs = re.findall(r"Used (\d+) registers", log)
      spill = re.findall(r"(\d+) bytes spill stores", log)
      assert regs, "no ptxas report captured (MOSAIC_GPU_DUMP_PTXAS unset?)"
      spilled = any(int(x) for x in spill)
      assert allow_spill or not spilled, f"ptxas spilled: {spill}"
      return f"sm_90a ptxas: {regs[-1]} regs, spill stores={spill[-1] if spill else '?'} bytes"
    return run

  report("stage3 dense tm=64 tn=128 compile@H200 topology",
         compile_and_report(dense_matmul, sd((M, K), jnp.bfloat16),
                            sd((K, N), jnp.bfloat16)))
  report("stage3 bsr compile@H200 topology",
         compile_and_report(functools.partial(bsr_matmul, bm=bm, bk=bk),
                            sd(row_ptr.shape, jnp.int32),
                            sd(col_idx.shape, jnp.int32),
                            sd(a_blocks.shape, jnp.bfloat16),
                            sd((kb * bk, NS), jnp.bfloat16)))
  report("stage3 dense tm=256 tn=256 compiles but ptxas spills (expected)",
         compile_and_report(functools.partial(dense_matmul, tm=256, tn=256),
                            sd((512, 512), jnp.bfloat16),
                            sd((512, 512), jnp.bfloat16), allow_spill=True))


def main():
  do_interp = "--skip-interpret" not in sys.argv
  print(f"jax {jax.__version__}, backend {jax.default_backend()}", flush=True)

  # ---- 1. dense ----
  M = N = K = 256
  ka, kb_ = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (M, K), jnp.bfloat16)
  b = jax.random.normal(kb_, (K, N), jnp.bfloat16)
  ref = jnp.dot(a, b, preferred_element_type=jnp.float32)

  def dense_interp():
    out = dense_matmul(a, b, interpret=plgpu.InterpretGPUParams())
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref),
                               atol=0.5, rtol=2e-2)
    return f"max|err|={err:.3g}"

  if do_interp:
    report("dense 256^3 bf16 tm=64 tn=128 tk=64 interpret vs jnp.dot", dense_interp)
  for tm, tn in [(64, 128), (128, 128), (128, 256)]:
    report(f"dense 256^3 tm={tm} tn={tn} tk=64 lower@H200",
           lambda tm=tm, tn=tn: lower_h200(
               functools.partial(dense_matmul, tm=tm, tn=tn),
               sds((M, K), jnp.bfloat16), sds((K, N), jnp.bfloat16)) and None)

  # ---- 2. block-sparse walk ----
  bm = bk = 64
  mb, kb = 4, 4                     # A is 256x256 in 64x64 blocks
  NS = 256
  row_ptr, col_idx, a_blocks, dense_a = make_bsr(mb, kb, bm, bk)
  bb = np.random.default_rng(1).standard_normal((kb * bk, NS)).astype(np.float32)
  a_blocks_bf = jnp.asarray(a_blocks, jnp.bfloat16)
  b_bf = jnp.asarray(bb, jnp.bfloat16)
  dense_a_bf = np.asarray(jnp.asarray(dense_a, jnp.bfloat16), np.float32)
  ref_s = dense_a_bf @ np.asarray(b_bf, np.float32)

  def bsr_interp():
    out = bsr_matmul(jnp.asarray(row_ptr), jnp.asarray(col_idx), a_blocks_bf,
                     b_bf, bm=bm, bk=bk, interpret=plgpu.InterpretGPUParams())
    out = np.asarray(out, np.float32)
    np.testing.assert_allclose(out, ref_s, atol=0.5, rtol=2e-2)
    return (f"nnz/row={np.diff(row_ptr).tolist()} "
            f"max|err|={np.abs(out - ref_s).max():.3g}")

  def bsr_negative_control():
    # Corrupt one column index: the interpreter result must then disagree.
    bad_cols = col_idx.copy()
    bad_cols[row_ptr[2]] = (bad_cols[row_ptr[2]] + 1) % kb
    out = bsr_matmul(jnp.asarray(row_ptr), jnp.asarray(bad_cols), a_blocks_bf,
                     b_bf, bm=bm, bk=bk, interpret=plgpu.InterpretGPUParams())
    diff = np.abs(np.asarray(out, np.float32) - ref_s).max()
    assert diff > 1.0, f"corrupted col_idx not detected (max diff {diff})"
    return f"corrupted col_idx detected, max|diff|={diff:.3g}"

  if do_interp:
    report("bsr 256x256(64x64 blocks)@256x256 interpret vs numpy", bsr_interp)
    report("bsr interpret negative control", bsr_negative_control)
  report("bsr lower@H200", lambda: lower_h200(
      functools.partial(bsr_matmul, bm=bm, bk=bk),
      sds(row_ptr.shape, jnp.int32), sds(col_idx.shape, jnp.int32),
      sds(a_blocks.shape, jnp.bfloat16), sds((kb * bk, NS), jnp.bfloat16))
      and None)

  # ---- 3. what the lowering rejects (expected to FAIL; we print the text) ----
  def expect_reject(name, f, *args):
    def run():
      try:
        lower_h200(f, *args)
      except Exception as e:  # pylint: disable=broad-except
        lines = [l for l in str(e).strip().splitlines() if l.strip()]
        return f"rejected as expected: {type(e).__name__}: {lines[0][:300] if lines else ''}"
      raise AssertionError("lowering unexpectedly succeeded")
    report(name, run)

  bad = [  # (label, tile kwargs, (M, K, N))
      ("tm=32 (WGMMA acc rows not multiple of 64)", dict(tm=32, tn=128, tk=64), (256, 256, 256)),
      ("tn=512 (WGMMA N > 256)", dict(tm=64, tn=512, tk=64), (256, 256, 512)),
      ("tn=8 (no SMEM tiling fits)", dict(tm=64, tn=8, tk=64), (256, 256, 64)),
      ("tk=8 (layout inference fails)", dict(tm=64, tn=128, tk=8), (256, 256, 256)),
      ("M=250 (not multiple of 8)", dict(tm=64, tn=128, tk=64), (250, 256, 256)),
      ("tm=128 tn=256 tk=64 steps=6 (SMEM over budget)",
       dict(tm=128, tn=256, tk=64, steps=6), (512, 512, 512)),
  ]
  for name, kw, (m_, k_, n_) in bad:
    expect_reject(f"reject {name}", functools.partial(dense_matmul, **kw),
                  sds((m_, k_), jnp.bfloat16), sds((k_, n_), jnp.bfloat16))

  # ---- stage 3: XLA:GPU compile for a compile-only H200 topology ----
  try:
    import jax_plugins.xla_cuda13  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    have_plugin = True
  except ImportError:
    have_plugin = False
  if not have_plugin:
    print("skip   stage3 (no jax-cuda13-plugin here; run with /tmp/gpuvenv/bin/python)")
  else:
    stage3(M, N, K, row_ptr, col_idx, a_blocks, kb, bk, NS, bm)

  print(f"{sum(RESULTS)}/{len(RESULTS)} checks ok", flush=True)
  return 0 if all(RESULTS) else 1


if __name__ == "__main__":
  sys.exit(main())
