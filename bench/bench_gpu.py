"""sparsegen's GPU kernels side by side with cuBLAS and jax.experimental.sparse, in one run.

    python bench/bench_gpu.py [--size 8192] [--blocks 128,256] [--json FILE]   # on a GPU
    python bench/bench_gpu.py --smoke                                          # anywhere: the same code, tiny, interpreted

1. DSD: a bf16 8192 x 8192 matrix with 10% of its blocks stored (random positions), times a
   dense 8192 x 8192 one; against `jnp.dot` on the dense matrix (cuBLAS) and against
   `jax.experimental.sparse.BCSR` at the same density (cuSPARSE, element-level).
2. SDD: the causal (lower-triangular) blocks of a dense x dense product, bf16, 8192^3;
   against the full `jnp.dot`, and `jax.experimental.sparse.bcoo_dot_general_sampled`
   (SDDMM at the same topology, element level).
3. DSD with every block stored: the kernel against cuBLAS on the same work, which says how
   much of the speed-up is the kernel and how much the sparsity.
Blocks of 128 and 256 (the spec's tiles; the kernels' CTA tiles are 128 x 128 inside them).

Each variant is checked against the dense product first, then timed: median of repeated
calls after warm-up, side by side in one process. Ratios are "time of the other / time of
sparsegen" (> 1: sparsegen is faster). Where there is no GPU, `--smoke` runs the same code
at a tiny size in the Mosaic GPU interpreter (correctness only; no timing is meaningful).
No timed assertion anywhere: this prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sparsegen.compiler import compile_source  # noqa: E402
from sparsegen.source import SourceFile  # noqa: E402

DSD = """
kernel bench_dsd {{
    in  x: bf16[M, K] coo
    in  y: bf16[K, N]
    out o: bf16[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = {b}, n = 256, k = {b}
    accumulate f32
}}
"""

SDD = """
kernel bench_sdd {{
    in  x: bf16[M, K]
    in  y: bf16[K, N]
    out o: bf16[M, N] coo
    o[m, n] = x[m, k] * y[k, n]
    tile m = {b}, n = {b}, k = 64
    accumulate f32
}}
"""


def load(text: str, target: str = "h200"):
    (module,) = compile_source(SourceFile("bench.spk", text), target)
    path = Path(tempfile.mkdtemp(prefix="sparsegen-bench-")) / f"{module.kernel}.py"
    path.write_text(module.code)
    spec = importlib.util.spec_from_file_location(module.kernel, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, module.kernel)


def timed(fn, *args, repeats: int) -> float:
    """Median seconds of `fn(*args)` after two warm-up calls (compiles included there)."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def dsd_case(size: int, b: int, density: float, smoke: bool, repeats: int) -> dict:
    from jax.experimental import sparse

    rng = np.random.default_rng(0)
    grid = size // b
    stored = max(1, round(density * grid * grid))
    cells = rng.choice(grid * grid, stored, replace=False)
    rows, cols = (cells // grid).astype(np.int32), (cells % grid).astype(np.int32)
    blocks = jnp.asarray(rng.standard_normal((stored, b, b)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((size, size)), jnp.bfloat16)
    dense = np.zeros((size, size), np.float32)
    for s, (r, c) in enumerate(zip(rows, cols)):
        dense[r * b:(r + 1) * b, c * b:(c + 1) * b] = np.asarray(blocks[s], np.float32)
    x = jnp.asarray(dense, jnp.bfloat16)
    kernel = load(DSD.format(b=b))
    ours = jax.jit(lambda *a: kernel(*a, M=size, interpret=smoke))
    cublas = jax.jit(lambda a, c: jnp.dot(a, c, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    bcsr = sparse.BCSR.fromdense(x)
    cusparse = jax.jit(lambda a, c: (a @ c).astype(jnp.bfloat16))
    rows, cols = jnp.asarray(rows), jnp.asarray(cols)
    got = np.asarray(ours(blocks, rows, cols, y), np.float32)
    want = np.asarray(cublas(x, y), np.float32)
    err = float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))
    row = {"case": f"DSD {size}^3, blocks {b}, density {density}", "stored blocks": stored, "max rel err": err}
    if not smoke:
        t_ours = timed(ours, blocks, rows, cols, y, repeats=repeats)
        t_dense = timed(cublas, x, y, repeats=repeats)
        t_sparse = timed(cusparse, bcsr, y, repeats=repeats)
        flops = 2.0 * stored * b * b * size
        row.update({"sparsegen ms": t_ours * 1e3, "jnp.dot ms": t_dense * 1e3, "BCSR ms": t_sparse * 1e3,
                    "vs dense": t_dense / t_ours, "vs BCSR": t_sparse / t_ours, "TFLOP/s": flops / t_ours / 1e12})
    return row


def sdd_case(size: int, b: int, smoke: bool, repeats: int) -> dict:
    from jax.experimental import sparse

    rng = np.random.default_rng(1)
    grid = size // b
    r, c = np.tril_indices(grid)
    rows, cols = jnp.asarray(r, jnp.int32), jnp.asarray(c, jnp.int32)
    x = jnp.asarray(rng.standard_normal((size, size)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((size, size)), jnp.bfloat16)
    kernel = load(SDD.format(b=b))
    ours = jax.jit(lambda *a: kernel(*a, interpret=smoke))
    cublas = jax.jit(lambda a, c: jnp.dot(a, c, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    got = np.asarray(ours(x, y, rows, cols), np.float32)
    full = np.asarray(cublas(x, y), np.float32).reshape(grid, b, grid, b).transpose(0, 2, 1, 3)
    want = full[r, c]
    err = float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))
    row = {"case": f"SDD {size}^3, blocks {b}, causal", "stored blocks": int(len(r)), "max rel err": err}
    if not smoke:
        # SDDMM at the same topology, element level: the causal pattern's nonzeros.
        pattern = sparse.BCOO.fromdense(jnp.tril(jnp.ones((size, size), jnp.bfloat16)))
        sampled = jax.jit(lambda a, c, p: sparse.bcoo_dot_general_sampled(
            a, c, p.indices, dimension_numbers=(([1], [0]), ([], []))))
        t_ours = timed(ours, x, y, rows, cols, repeats=repeats)
        t_dense = timed(cublas, x, y, repeats=repeats)
        t_sampled = timed(sampled, x, y, pattern, repeats=repeats)
        flops = 2.0 * len(r) * b * b * size
        row.update({"sparsegen ms": t_ours * 1e3, "jnp.dot ms": t_dense * 1e3, "BCOO sampled ms": t_sampled * 1e3,
                    "vs dense": t_dense / t_ours, "vs sampled": t_sampled / t_ours, "TFLOP/s": flops / t_ours / 1e12})
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--blocks", default="128,256")
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny, in the Mosaic GPU interpreter (no GPU needed; no timing)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    gpu = any(d.platform == "gpu" for d in jax.devices())
    if not gpu and not args.smoke:
        print("bench_gpu: no GPU here; run with --smoke to check the code path in the interpreter", file=sys.stderr)
        return 2
    size = 512 if args.smoke else args.size
    blocks = [int(b) for b in args.blocks.split(",")]
    rows = []
    for b in blocks:
        rows.append(dsd_case(size, b, args.density, args.smoke, args.repeats))
        rows.append(sdd_case(size, b, args.smoke, args.repeats))
    # Every block stored: the kernel's own efficiency against cuBLAS, apart from what sparsity saves.
    rows.append(dsd_case(size, blocks[-1], 1.0, args.smoke, args.repeats))
    device = jax.devices()[0].device_kind
    print(f"device: {device}; jax {jax.__version__}; median of {args.repeats} after warm-up" if not args.smoke else f"smoke run on {device} (interpreter)")
    columns = list(dict.fromkeys(key for row in rows for key in row))
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(f"{row[c]:.3g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns))
    bad = [row["case"] for row in rows if row["max rel err"] > 0.02]
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "rows": rows}, indent=2))
    if bad:
        print("wrong results: " + ", ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
