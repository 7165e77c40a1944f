"""sparsegen's GPU kernels side by side with cuBLAS and jax.experimental.sparse, in one run.

    python bench/bench_gpu.py [--suite matmul|attention|all] [--size 8192] [--blocks 128,256]
                              [--seq 8192,16384,32768] [--json FILE]                # on a GPU
    python bench/bench_gpu.py --smoke                                          # anywhere: the same code, tiny, interpreted

1. DSD: a bf16 8192 x 8192 matrix with 10% of its blocks stored (random positions), times a
   dense 8192 x 8192 one; against `jnp.dot` on the dense matrix (cuBLAS) and against
   `jax.experimental.sparse.BCSR` at the same density (cuSPARSE, element-level).
2. SDD: the causal (lower-triangular) blocks of a dense x dense product, bf16, 8192^3;
   against the full `jnp.dot`, and `jax.experimental.sparse.bcoo_dot_general_sampled`
   (SDDMM at the same topology, element level).
3. DSD with every block stored: the kernel against cuBLAS on the same work, which says how
   much of the speed-up is the kernel and how much the sparsity.
3b. A masked product's backward, dx = (g * keep) @ y^T, keep causal (lower-triangular
   element mask: its blocks empty, all ones, or partial on the diagonal), bf16, 8192^3: the
   kernel multiplies keep's partial blocks into g's tiles itself; against `jnp.dot` of the
   product XLA forms (what the kernel's wrapper did before it fused the mask).
Blocks of 128 and 256 (the spec's tiles; the kernels' CTA tiles are 128 x 128 inside them).
4. Attention (`--suite attention`): causal, local (a causal window of 1024 keys) and
   document (packed sequences: a query sees its own document's keys, causally) masks, bf16,
   one batch, H = 16 heads, D = 128, S = 8192, 16384 and 32768; the forward and the forward
   with the backward (one `jax.vjp`: forward, dq, dk and dv), against tokamax's Mosaic GPU
   flash attention (`implementation="mosaic"`; documents as its own k-range mask) and cuDNN
   (`jax.nn.dot_product_attention(implementation="cudnn")`; documents as a dense boolean
   mask, all jax.nn takes). Each is laid out as it takes its arrays (sparsegen (B, H, S, D),
   the others (B, S, H, D)), outside the timed call. The forward is checked against an f32
   reference on a slice of query rows; the gradients against cuDNN's (or tokamax's).
   TFLOP/s counts the visible (query, key) pairs only: 4 x D flops a pair forward, 3.5 times
   that forward and backward (FlashAttention-2's count: seven products of which two forward).
   tokamax is optional (a benchmark-only package: `pip install tokamax`); without it its
   column says so.

Each variant is checked against the dense product first, then timed: median of repeated
calls after warm-up, side by side in one process. Ratios are "time of the other / time of
sparsegen" (> 1: sparsegen is faster). Where there is no GPU, `--smoke` runs the same code
at a tiny size in the Mosaic GPU interpreter (correctness only; no timing is meaningful;
tokamax and cuDNN need a GPU and are left out). Without a GPU and without `--smoke` it says
so and exits (status 2) before any work. No timed assertion anywhere: this prints tables.
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


MASKED_DX = """
kernel bench_masked_dx {{
    in  g: bf16[M, N]
    in  keep: bf16[M, N] mask
    in  y: bf16[K, N]
    out dx: bf16[M, K]
    dx[m, k] = g[m, n] * keep[m, n] * y[k, n]
    tile m = {b}, n = {b}, k = 512
    accumulate f32
}}
"""


def masked_dx_case(size: int, b: int, smoke: bool, repeats: int) -> dict:
    rng = np.random.default_rng(2)
    g = jnp.asarray(rng.standard_normal((size, size)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((size, size)), jnp.bfloat16)
    keep = jnp.tril(jnp.ones((size, size), jnp.bfloat16))
    kernel = load(MASKED_DX.format(b=b))
    ours = jax.jit(lambda *a: kernel(*a, interpret=smoke))
    xla = jax.jit(lambda a, mk, c: jnp.dot(a * mk, c.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    got = np.asarray(ours(g, keep, y), np.float32)
    want = np.asarray(xla(g, keep, y), np.float32)
    err = float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))
    grid = size // b
    row = {"case": f"masked dx {size}^3, blocks {b}, causal keep", "stored blocks": grid * (grid + 1) // 2, "max rel err": err}
    if not smoke:
        t_ours = timed(ours, g, keep, y, repeats=repeats)
        t_dense = timed(xla, g, keep, y, repeats=repeats)
        flops = 2.0 * (grid * (grid + 1) // 2) * b * b * size
        row.update({"sparsegen ms": t_ours * 1e3, "jnp.dot ms": t_dense * 1e3, "vs dense": t_dense / t_ours,
                    "TFLOP/s": flops / t_ours / 1e12})
    return row


ATTENTION = """
kernel bench_{name} {{
    in  q: bf16[B, H, S, D]
    in  k: bf16[B, H, S, D]
    in  v: bf16[B, H, S, D]{extra}
    out o: bf16[B, H, S, D]

    s[b, h, i, j] = q[b, h, i, d] * k[b, h, j, d] * {scale!r} where {condition}
    o[b, h, i, e] = softmax(s[b, h, i, j], j) * v[b, h, j, e]

    tile b = 1, h = 1, i = 128, j = 128, d = {d}, e = {d}
}}
"""

MASKS = ("causal", "local", "document")


def attention_spec(mask: str, d: int, window: int) -> str:
    condition = {"causal": "i >= j", "local": f"i >= j and i - j < {window}", "document": "seg[b, i] == seg[b, j] and i >= j"}[mask]
    extra = "\n    in  seg: i32[B, S]" if mask == "document" else ""
    return ATTENTION.format(name=mask, extra=extra, scale=d ** -0.5, condition=condition, d=d)


def documents(size: int, rng, mean: int) -> np.ndarray:
    """Segment ids of packed documents, `mean` positions each on average, cut at random
    positions (not at block edges: partial blocks on both sides of each cut)."""
    cuts = np.sort(rng.choice(np.arange(1, size), max(1, size // mean) - 1, replace=False))
    return np.searchsorted(cuts, np.arange(size), side="right").astype(np.int32)


def visible(mask: str, size: int, window: int, seg: np.ndarray | None) -> int:
    """How many (query, key) pairs the mask keeps."""
    rows = np.arange(size, dtype=np.int64)
    if mask == "causal":
        return int((rows + 1).sum())
    if mask == "local":
        return int(np.minimum(rows + 1, window).sum())
    starts = np.r_[0, np.flatnonzero(np.diff(seg)) + 1]
    return int((rows - starts[seg] + 1).sum())


def reference_rows(q, k, v, rows, mask: str, window: int, seg):
    """f32 attention for some query rows (B, S, H, D layout), from the definition."""
    qr = q[:, rows].astype(jnp.float32)
    s = jnp.einsum("bihd,bjhd->bhij", qr, k.astype(jnp.float32)) * q.shape[-1] ** -0.5
    i, j = jnp.asarray(rows)[:, None], jnp.arange(k.shape[1])[None, :]
    keep = i >= j
    if mask == "local":
        keep &= i - j < window
    if mask == "document":
        keep = keep & (jnp.asarray(seg)[rows][:, None] == jnp.asarray(seg)[None, :])
    s = jnp.where(keep, s, -jnp.inf)
    return jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))


def attention_rivals(mask: str, window: int, seg) -> dict:
    """tokamax's and cuDNN's attention for the mask, on (B, S, H, D) arrays; a rival that
    cannot be had is a string saying why."""
    rivals: dict = {}
    try:
        import tokamax
        from tokamax._src.ops.attention import base as tk_base
        from tokamax._src.ops.attention import pallas_mosaic_gpu as tk_gpu
    except ImportError as exc:
        rivals["tokamax"] = f"not installed ({exc})"
    else:
        if mask == "document":
            # Packed documents as tokamax itself takes them (base.Mask's docstring): each
            # query's first key (its document's start) with the causal mask, which its kernel
            # turns into per-tile key ranges; its public API takes only a dense (S, S) mask.
            starts = np.r_[0, np.flatnonzero(np.diff(seg)) + 1][seg].astype(np.int32)
            k_start = jnp.asarray(starts)[None, None, :]
            op = tk_gpu.PallasMosaicGpuFlashAttention()
            rivals["tokamax"] = lambda q, k, v: op(q, k, v, mask=tk_base.Mask(k_start=k_start, is_causal=True))
        else:
            lw = (window - 1, 0) if mask == "local" else None
            rivals["tokamax"] = lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True, local_window_size=lw,
                                                                              implementation="mosaic")
    if mask == "document":
        dense = jnp.asarray(seg[:, None] == seg[None, :])[None, None]  # (1, 1, S, S): what jax.nn takes
        rivals["cuDNN"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=dense, is_causal=True, implementation="cudnn")
    else:
        lw = (window - 1, 0) if mask == "local" else None
        rivals["cuDNN"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=lw,
                                                                       implementation="cudnn")
    return rivals


def attention_case(mask: str, size: int, heads: int, d: int, window: int, smoke: bool, repeats: int) -> list[dict]:
    """One mask at one length: the forward, then the forward with the backward."""
    rng = np.random.default_rng(2)
    seg = documents(size, rng, 96 if smoke else 2048) if mask == "document" else None
    q, k, v, do = (jnp.asarray(rng.standard_normal((1, size, heads, d)), jnp.bfloat16) for _ in range(4))
    to_bhsd = jax.jit(lambda x: jnp.swapaxes(x, 1, 2))
    kernel = load(attention_spec(mask, d, window).replace("bench_", "bench_attention_"))
    extra = (jnp.asarray(seg)[None],) if seg is not None else ()

    def ours(q_, k_, v_):  # (B, H, S, D) arrays
        return kernel(q_, k_, v_, *extra, interpret=smoke)

    fns = {"sparsegen": ours}
    if not smoke:
        fns.update(attention_rivals(mask, window, seg))
    native = {"sparsegen": tuple(to_bhsd(x) for x in (q, k, v, do))}
    pairs = visible(mask, size, window, seg)
    fwd_flops = 4.0 * heads * d * pairs
    label = f"{mask} S={size}" + (f" (window {window})" if mask == "local" else f" ({int(seg.max()) + 1} documents)" if seg is not None else "")
    rows_checked = np.r_[0:64, size // 2 - 32:size // 2 + 32, size - 64:size] if not smoke else np.arange(size)
    want = np.asarray(reference_rows(q, k, v, rows_checked, mask, window, seg))
    fwd, both, grads = {}, {}, {}
    for name, fn in fns.items():
        if isinstance(fn, str):
            fwd[name] = both[name] = fn
            continue
        args = native.get(name, (q, k, v, do))
        back = (lambda x: jnp.swapaxes(x, 1, 2)) if name == "sparsegen" else (lambda x: x)
        f = jax.jit(fn)
        g = jax.jit(lambda q_, k_, v_, do_, fn=fn: jax.vjp(fn, q_, k_, v_)[1](do_))
        try:
            got = np.asarray(back(f(*args[:3]))[:, rows_checked], np.float32)
            dq, dk, dv = (back(x) for x in g(*args))
        except Exception as exc:  # a rival that refuses these shapes or this mask is reported, not fatal
            fwd[name] = both[name] = f"failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ''}"
            continue
        fwd[name] = {"err": float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))}
        grads[name] = (dq, dk, dv)
        if not smoke:
            fwd[name]["ms"] = timed(f, *args[:3], repeats=repeats) * 1e3
            both[name] = {"ms": timed(g, *args, repeats=repeats) * 1e3}
    if smoke:  # no rival without a GPU: the gradients against jax.grad of the XLA definition
        dense = None if seg is None else jnp.asarray(seg[:, None] == seg[None, :])[None, None]
        lw = (window - 1, 0) if mask == "local" else None
        grads["XLA"] = jax.vjp(lambda *a: jax.nn.dot_product_attention(*a, mask=dense, is_causal=True, local_window_size=lw),
                               q, k, v)[1](do)
    against = next((n for n in ("cuDNN", "tokamax", "XLA") if n in grads), None)
    rows = []
    for what, results in (("forward", fwd), ("forward+backward", both)):
        row = {"case": label, "pass": what}
        ok = results.get("sparsegen")
        if what == "forward":
            row["max rel err"] = ok["err"] if isinstance(ok, dict) else None
            for name in fns:  # the rivals against the same reference: the same mask, said their way
                if name != "sparsegen" and isinstance(results.get(name), dict):
                    row[f"{name} err"] = results[name]["err"]
        elif against and "sparsegen" in grads:
            ref = [np.asarray(x, np.float32) for x in grads[against]]
            mine = [np.asarray(x, np.float32) for x in grads["sparsegen"]]
            row["max rel err"] = max(float(np.abs(a - b).max() / max(1.0, np.abs(b).max())) for a, b in zip(mine, ref))
            row["grads vs"] = against
        for name in fns:
            r = results.get(name)
            if isinstance(r, str):
                row[f"{name} ms"] = r
            elif r is not None and "ms" in r:
                row[f"{name} ms"] = r["ms"]
        t = row.get("sparsegen ms")
        if isinstance(t, float):
            for name in fns:
                if name != "sparsegen" and isinstance(row.get(f"{name} ms"), float):
                    row[f"vs {name}"] = row[f"{name} ms"] / t
            row["TFLOP/s"] = fwd_flops * (1.0 if what == "forward" else 3.5) / (t * 1e-3) / 1e12
        rows.append(row)
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(title)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(f"{row[c]:.3g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("matmul", "attention", "all"), default="all")
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--blocks", default="128,256")
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--seq", default="8192,16384,32768", help="attention: sequence lengths")
    parser.add_argument("--masks", default=",".join(MASKS), help="attention: " + ", ".join(MASKS))
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=1024, help="attention: the local mask's keys")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny, in the Mosaic GPU interpreter (no GPU needed; no timing)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    gpu = any(d.platform == "gpu" for d in jax.devices())
    if not gpu and not args.smoke:
        print("bench_gpu: no GPU here (jax sees only " + ", ".join(sorted({d.platform for d in jax.devices()})) +
              "); run it on a machine with one, or with --smoke to check the code paths in the interpreter", file=sys.stderr)
        return 2
    device = jax.devices()[0].device_kind
    print(f"device: {device}; jax {jax.__version__}; median of {args.repeats} after warm-up" if not args.smoke else f"smoke run on {device} (interpreter)")
    tables = {}
    if args.suite in ("matmul", "all"):
        size = 512 if args.smoke else args.size
        blocks = [int(b) for b in args.blocks.split(",")]
        rows = []
        for b in blocks:
            rows.append(dsd_case(size, b, args.density, args.smoke, args.repeats))
            rows.append(sdd_case(size, b, args.smoke, args.repeats))
        # Every block stored: the kernel's own efficiency against cuBLAS, apart from what sparsity saves.
        rows.append(dsd_case(size, blocks[-1], 1.0, args.smoke, args.repeats))
        rows.append(masked_dx_case(size, blocks[-1], args.smoke, args.repeats))
        tables["matmul"] = rows
        print_table("block-sparse products", rows)
    if args.suite in ("attention", "all"):
        # Smoke: one short sequence, two heads, the window shorter than it (the interpreter is slow).
        seqs = [384] if args.smoke else [int(n) for n in args.seq.split(",")]
        heads, window = (2, 100) if args.smoke else (args.heads, args.window)
        rows = []
        for size in seqs:
            for mask in args.masks.split(","):
                rows += attention_case(mask, size, heads, args.head_dim, window, args.smoke, args.repeats)
        tables["attention"] = rows
        print_table(f"attention, bf16, H = {heads}, D = {args.head_dim} (ms; vs X: X's time / sparsegen's)", rows)
    bad = [f"{row['case']} {row.get('pass', '')}".strip() for rows in tables.values() for row in rows
           if row.get("max rel err") is not None and row["max rel err"] > 0.02]
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "jax": jax.__version__, **tables}, indent=2))
    if bad:
        print("wrong results: " + ", ".join(bad), file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
