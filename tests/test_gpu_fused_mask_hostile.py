"""A hostile review of the covered mask fused into GPU products (tests/test_gpu_fused_mask.py):
`dx[m, k] = g[m, n] * keep[m, n] * y[k, n]`, the mask multiplied into g's tile in shared
memory at its partial blocks (`ProductLowering.fused_selection`).

Each case is one a kernel author would try to break it with: operands stored transposed
(bf16 read MN-major; f32 and i8 copied transposed), ragged sizes (the mask padded to whole
blocks, g clipped by TMA), masks of another dtype than g's holding values other than 0 and 1,
a mask laid out transposed or lacking a batch index in another position than g's, the mask
on B's side warp-specialized, a mask beside a second covered factor (the XLA pass keeps
forming that product), a masked input of a forward product, gradients. Each is checked
against `reference` and an independent float32 numpy einsum of the same (rounded) inputs.

The cases marked xfail(strict=True) are bugs this review found (see each reason); a fix,
either computing the right result or refusing the spec with a clear error, makes them pass,
and strict xfail then asks for the marker to be removed.
"""

from __future__ import annotations

import itertools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches, build

from sparsegen.compiler import lower_source
from sparsegen.gpu.plan import GpuError
from sparsegen.source import SourceFile, SpecError
from sparsegen.testing import dims, resolve_sizes

SWEEP = os.environ.get("SPARSEGEN_SWEEP") == "1"
# The cases run by default (one of each kind: A's side, B's warp-specialized, a batched mask,
# the fallback, a forward); every case with SPARSEGEN_SWEEP=1.
DEFAULT = {"dx-g-and-y-transposed-ragged", "dy-ws-f32-mask-bf16", "batched-mask-transposed-lacks-b-h",
           "mask-and-dense-factor-fall-back", "forward-masked-y-ws", "dx-g-transposed-sum-tile-32",
           "dy-g-transposed-n-192", "dy-ws-batched-keep-transposed"}


def chosen(cases):
    return [c for c in cases if SWEEP or c[0] in DEFAULT]


DT = {"bf16": jnp.bfloat16, "f32": jnp.float32, "i8": jnp.int8, "i32": jnp.int32}
FRACTIONS = (0.0, 1.0, 2.0, 0.5)
INTEGERS = (0, 1, 2, 3)


def spec(decls: list[str], stmt: str, tiles: str = "m = 64, n = 64, k = 64") -> str:
    body = "\n".join("    " + d for d in decls)
    return f"kernel k {{\n{body}\n\n    {stmt}\n\n    tile {tiles}\n}}\n"


def keep_mask(shape, tiles, rng, values) -> np.ndarray:
    """A mask whose blocks are, in turn along every dimension, empty, all ones, and partial
    (random `values`); the last blocks of a ragged size are cut short."""
    keep = np.zeros(shape, np.float32)
    grid = [-(-s // t) for s, t in zip(shape, tiles)]
    for block in itertools.product(*map(range, grid)):
        kind = sum((d + 1) * b for d, b in enumerate(block)) % 3
        at = tuple(slice(b * t, (b + 1) * t) for b, t in zip(block, tiles))
        if kind == 1:
            keep[at] = 1
        elif kind == 2:
            keep[at] = rng.choice(values, size=keep[at].shape)
    return keep


def arguments(text: str, kernel, env, values, seed: int):
    """The kernel's inputs (bf16/f32 normal, i8 in -4..4, masks by `keep_mask`), and each as
    float32 for the numpy oracle."""
    tile = {i.name: i.tile for i in kernel.indices}
    rng = np.random.default_rng(seed)
    args, f32 = [], {}
    for op in kernel.inputs:
        shape = dims(op, env)
        if op.sparsity == "mask":
            indices = re.search(rf"\b{op.name}\[([^\]]*)\]", text.split("\n\n")[1]).group(1).replace(" ", "").split(",")
            value = keep_mask(shape, [tile[i] for i in indices], rng, values)
        elif op.dtype.name == "i8":
            value = rng.integers(-4, 5, shape).astype(np.float32)
        else:
            value = rng.standard_normal(shape).astype(np.float32)
        arg = jnp.asarray(value, DT[op.dtype.name])
        args.append(arg)
        f32[op.name] = np.asarray(arg.astype(jnp.float32))
    return args, f32


def fused_pass(text: str):
    (m,) = lower_source(SourceFile("hostile.spk", text), "h200")
    (p,) = m.passes
    return p


def check(text: str, sizes: dict, equation: str, values=FRACTIONS, fused: str | None = "a", seed: int = 0):
    """The kernel (interpreted) against `reference` and against numpy's float32 einsum of the
    same inputs; `fused`: the side the mask is multiplied into in the kernel (None: the
    wrapper forms the product)."""
    p = fused_pass(text)
    assert (p.selection.on if p.selection is not None else None) == fused, p.selection
    assert any("einsum" in line for line in p.host) == (fused is None), p.host
    kernel, mod = build(text, "h200")
    env = resolve_sizes(kernel, sizes)
    args, f32 = arguments(text, kernel, env, values, seed)
    out = getattr(mod, kernel.name)(*args, interpret=True)
    assert_matches(kernel, out, mod.reference(*args), env)
    want = np.einsum(equation, *(f32[op.name] for op in kernel.inputs))
    got = np.asarray(out, np.float32)
    # bf16 products round g * keep (and the output) to bf16; f32 is tf32; i8 is exact.
    atol = 0.05 * max(1.0, np.abs(want).std())
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=atol)


def dx_text(gd="bf16", kd="bf16", g="m, n", keep="m, n", y="k, n", tiles="m = 64, n = 64, k = 64"):
    od = "i32" if gd == "i8" else gd
    return spec(
        [
            f"in  g: {gd}[{g.upper()}]",
            f"in  keep: {kd}[{keep.upper()}] mask",
            f"in  y: {gd}[{y.upper()}]",
            f"out dx: {od}[M, K]",
        ],
        f"dx[m, k] = g[{g}] * keep[{keep}] * y[{y}]",
        tiles,
    )


def dy_text(gd="bf16", kd="bf16", g="m, n", keep="m, n", tiles="m = 64, n = 256, k = 64"):
    od = "i32" if gd == "i8" else gd
    return spec(
        [
            f"in  x: {gd}[M, K]",
            f"in  g: {gd}[{g.upper()}]",
            f"in  keep: {kd}[{keep.upper()}] mask",
            f"out dy: {od}[K, N]",
        ],
        f"dy[k, n] = x[m, k] * g[{g}] * keep[{keep}]",
        tiles,
    )


def eq(*operands: str, out: str) -> str:
    return ",".join(o.replace(", ", "") for o in operands) + "->" + out


RAGGED = dict(M=100, K=72, N=150)

# (id, spec, sizes, einsum, mask values, side fused)
PASSING = [
    (
        "dx-g-and-y-transposed-ragged",
        dx_text(g="n, m", keep="n, m", y="n, k"),
        RAGGED,
        eq("n, m", "n, m", "n, k", out="mk"),
        FRACTIONS,
        "a",
    ),
    ("dx-keep-transposed-to-g", dx_text(keep="n, m"), RAGGED, eq("m, n", "n, m", "k, n", out="mk"), FRACTIONS, "a"),
    (
        "dx-f32-g-transposed-ragged",
        dx_text("f32", "f32", g="n, m", keep="n, m"),
        RAGGED,
        eq("n, m", "n, m", "k, n", out="mk"),
        FRACTIONS,
        "a",
    ),
    ("dx-bf16-mask-i32", dx_text(kd="i32"), RAGGED, eq("m, n", "m, n", "k, n", out="mk"), (0, 1, 3, -2), "a"),
    (
        "dx-big-blocks-ragged",
        dx_text(tiles="m = 256, n = 128, k = 64"),
        dict(M=300, K=64, N=200),
        eq("m, n", "m, n", "k, n", out="mk"),
        FRACTIONS,
        "a",
    ),
    (
        "dy-ws-g-transposed-ragged",
        dy_text(g="n, m", keep="n, m"),
        dict(M=100, K=72, N=300),
        eq("m, k", "n, m", "n, m", out="kn"),
        FRACTIONS,
        "b",
    ),
    (
        "dy-ws-f32-mask-bf16",
        dy_text("f32", "bf16"),
        dict(M=100, K=72, N=300),
        eq("m, k", "m, n", "m, n", out="kn"),
        FRACTIONS,
        "b",
    ),
    (
        "batched-mask-lacks-b-not-h",
        spec(
            [
                "in  g: bf16[B, H, M, N]",
                "in  keep: bf16[H, M, N] mask",
                "in  y: bf16[B, H, K, N]",
                "out dx: bf16[B, H, M, K]",
            ],
            "dx[b, h, m, k] = g[b, h, m, n] * keep[h, m, n] * y[b, h, k, n]",
            "b = 1, h = 1, m = 64, n = 64, k = 64",
        ),
        dict(B=2, H=2, M=100, K=64, N=150),
        "bhmn,hmn,bhkn->bhmk",
        FRACTIONS,
        "a",
    ),
    (
        "batched-mask-transposed-lacks-b-h",
        spec(
            [
                "in  g: bf16[B, H, M, N]",
                "in  keep: bf16[N, M] mask",
                "in  y: bf16[B, H, K, N]",
                "out dx: bf16[B, H, M, K]",
            ],
            "dx[b, h, m, k] = g[b, h, m, n] * keep[n, m] * y[b, h, k, n]",
            "b = 1, h = 1, m = 64, n = 64, k = 64",
        ),
        dict(B=2, H=2, M=100, K=64, N=150),
        "bhmn,nm,bhkn->bhmk",
        FRACTIONS,
        "a",
    ),
    (
        "batched-dy-ws-keep-transposed",
        spec(
            ["in  x: bf16[B, M, K]", "in  g: bf16[B, M, N]", "in  keep: bf16[N, M] mask", "out dy: bf16[B, K, N]"],
            "dy[b, k, n] = x[b, m, k] * g[b, m, n] * keep[n, m]",
            "b = 1, m = 64, n = 256, k = 64",
        ),
        dict(B=2, M=100, K=72, N=300),
        "bmk,bmn,nm->bkn",
        FRACTIONS,
        "b",
    ),
    # A second covered factor beside the mask: the wrapper's XLA pass forms the product.
    (
        "mask-and-dense-factor-fall-back",
        spec(
            [
                "in  g: bf16[M, N]",
                "in  keep: bf16[M, N] mask",
                "in  s: bf16[M, N]",
                "in  y: bf16[K, N]",
                "out dx: bf16[M, K]",
            ],
            "dx[m, k] = g[m, n] * keep[m, n] * s[m, n] * y[k, n]",
        ),
        RAGGED,
        "mn,mn,mn,kn->mk",
        FRACTIONS,
        None,
    ),
    (
        "mask-and-factor-after-the-sum",
        spec(
            [
                "in  s: bf16[M, K]",
                "in  g: bf16[M, N]",
                "in  keep: bf16[M, N] mask",
                "in  y: bf16[K, N]",
                "out dx: bf16[M, K]",
            ],
            "dx[m, k] = s[m, k] * g[m, n] * keep[m, n] * y[k, n]",
        ),
        RAGGED,
        "mk,mn,mn,kn->mk",
        FRACTIONS,
        "a",
    ),
    # The forward product with a masked input (masked_matmul's mask moved inside the sum).
    (
        "forward-masked-x",
        spec(
            ["in  x: bf16[M, K]", "in  keep: bf16[M, K] mask", "in  y: bf16[K, N]", "out o: bf16[M, N]"],
            "o[m, n] = keep[m, k] * x[m, k] * y[k, n]",
        ),
        dict(M=100, K=150, N=72),
        "mk,mk,kn->mn",
        FRACTIONS,
        "a",
    ),
    (
        "forward-masked-y-ws",
        spec(
            ["in  x: bf16[M, K]", "in  keep: bf16[K, N] mask", "in  y: bf16[K, N]", "out o: bf16[M, N]"],
            "o[m, n] = x[m, k] * keep[k, n] * y[k, n]",
            "m = 64, n = 256, k = 64",
        ),
        dict(M=100, K=150, N=300),
        "mk,kn,kn->mn",
        FRACTIONS,
        "b",
    ),
]

# The chunked multiply: `fused_selection` multiplies the tile in slices of
# `chunk = max(64, min(d0, 8192 // d1))` rows, `for r in range(0, d0, chunk)`, each slice
# `pl.ds(r, chunk)`. Where the tile has fewer than 64 rows (the sum's tile 32 on the rows of
# the shared-memory tile: A stored (k, m), or B (k, n)), or `chunk` does not divide them
# (192), the slice runs past the tile: at the call, `ValueError: Out of bound slice`
# (interpreter) and the same under stage 2's lowering. The XLA pass (before 42950ac) was right.
SLICED = [
    (
        "dx-g-transposed-sum-tile-32",
        dx_text(g="n, m", tiles="m = 64, n = 32, k = 64"),
        dict(M=128, K=64, N=96),
        eq("n, m", "m, n", "k, n", out="mk"),
        "a",
    ),
    (
        "dy-sum-tile-32",
        dy_text(tiles="m = 32, n = 64, k = 64"),
        dict(M=96, K=64, N=128),
        eq("m, k", "m, n", "m, n", out="kn"),
        "b",
    ),
    (
        "dy-ws-sum-tile-32",
        dy_text(tiles="m = 32, n = 256, k = 64"),
        dict(M=96, K=64, N=256),
        eq("m, k", "m, n", "m, n", out="kn"),
        "b",
    ),
    (
        "dy-g-transposed-n-192",
        dy_text(g="n, m", tiles="m = 64, n = 192, k = 64"),
        dict(M=128, K=64, N=384),
        eq("m, k", "n, m", "m, n", out="kn"),
        "b",
    ),
]


@pytest.mark.parametrize("text,sizes,equation,values,fused", [c[1:] for c in chosen(PASSING)], ids=[c[0] for c in chosen(PASSING)])
def test_a_covered_mask_multiplies_right(text, sizes, equation, values, fused):
    check(text, sizes, equation, values, fused)


def test_an_i8_product_with_a_small_integer_mask_is_exact():
    """i8 factors, an i8 mask of 0..3, ragged and transposed: exact in the interpreter. An i8
    mask can take g past i8 (`covered_dtype`), so the wrapper forms the product in f32 (not
    fused); a `bool` mask is fused (tests/test_covered_product_dtype.py)."""
    check(dx_text("i8", "i8", g="n, m", keep="n, m"), RAGGED, eq("n, m", "n, m", "k, n", out="mk"), INTEGERS, None)


# A tile of 32 rows is multiplied in by the wrapper (Mosaic GPU lays out no slice of fewer
# than 64 rows); 192 rows in chunks of 64 (the chunks divide the tile).
@pytest.mark.parametrize("text,sizes,equation", [c[1:4] for c in chosen(SLICED)], ids=[c[0] for c in chosen(SLICED)])
def test_a_tile_the_chunks_do_not_divide_is_multiplied_whole_or_refused(text, sizes, equation):
    try:
        p = fused_pass(text)
    except (SpecError, GpuError):
        return  # refused clearly: fine
    check(text, sizes, equation, FRACTIONS, p.selection.on if p.selection is not None else None)


# Mosaic GPU has no pointwise 8-bit arithmetic ('Pointwise operations on 8-bit types are
# unsupported'; the interpreter runs it): the kernel multiplies an i8 tile in int32.
@pytest.mark.parametrize(
    "text",
    [dx_text("i8", "i8", tiles="m = 128, n = 128, k = 128"), dy_text("i8", "i8", tiles="m = 128, n = 512, k = 128")],
    ids=["dx", "dy-ws"],
)
def test_an_i8_factor_with_a_covered_mask_lowers_for_the_gpu(text):
    """Stage 2 (lowering under an abstract H200, no ptxas): the kernel lowers, or the spec is refused clearly."""
    from sparsegen.verify import verify_gpu_modules

    source = SourceFile("hostile.spk", text)
    try:
        (m,) = lower_source(source, "h200")
    except (SpecError, GpuError):
        return
    (r,) = verify_gpu_modules([(m, source, "h200")], stage3=False)
    assert r.lowered, r.raw_error


def test_an_i8_factor_times_a_mask_past_i8_is_not_wrapped():
    """keep of i32 holding 100 and 300 times an i8 g: the math (`reference`, numpy) multiplies
    in i32. The product can leave i8, so it is formed wider (`covered_dtype`: f32, by the
    wrapper, both sides tf32 into an f32 sum) instead of wrapping in i8 (the kernel was off by
    hundreds). Values here stay within tf32's exact integers (|g * keep| <= 1200)."""
    check(dx_text("i8", "i32"), dict(M=128, K=64, N=128), eq("m, n", "m, n", "k, n", out="mk"), (0, 1, 100, 300), None)


@pytest.mark.parametrize(
    "decls,stmt,words",
    [
        (
            [
                "in  g: bf16[M, N]",
                "in  keep: bf16[M, N] mask",
                "in  keep2: bf16[M, N] mask",
                "in  y: bf16[K, N]",
                "out dx: bf16[M, K]",
            ],
            "dx[m, k] = g[m, n] * keep[m, n] * keep2[m, n] * y[k, n]",
            "second sparse input",
        ),
        (
            ["in  g: bf16[M, N]", "in  keep: bf16[M, N] mask", "in  y: bf16[K, N]", "out dx: bf16[M, K] coo"],
            "dx[m, k] = g[m, n] * keep[m, n] * y[k, n]",
            "one sparse operand per statement",
        ),
        (
            ["in  g: bf16[M, N]", "in  keep: bf16[M, N] mask", "in  y: bf16[K, N]", "out dx: bf16[M, K]"],
            "dx[m, k] = g[m, n] * keep[m, n] * y[k, n] where n <= m",
            "not lowered for GPUs",
        ),
    ],
    ids=["two-masks", "coo-output", "where"],
)
def test_what_the_fused_path_cannot_meet_is_refused_clearly(decls, stmt, words):
    with pytest.raises(SpecError, match=words):
        lower_source(SourceFile("hostile.spk", spec(decls, stmt)), "h200")


GRADS = [
    ("dx-f32-transposed", dx_text("f32", "f32", g="n, m", y="n, k"), RAGGED),
    (
        "dy-ws-batched-keep-transposed",
        spec(
            ["in  x: bf16[B, M, K]", "in  g: bf16[B, M, N]", "in  keep: bf16[N, M] mask", "out dy: bf16[B, K, N]"],
            "dy[b, k, n] = x[b, m, k] * g[b, m, n] * keep[n, m]",
            "b = 1, m = 64, n = 256, k = 64",
        ),
        dict(B=2, M=100, K=72, N=300),
    ),
    ("forward-masked-x", PASSING[-2][1], PASSING[-2][2]),
]


@pytest.mark.parametrize("text,sizes", [c[1:] for c in chosen(GRADS)], ids=[c[0] for c in chosen(GRADS)])
def test_gradients_through_a_fused_mask_kernel(text, sizes):
    """jax.grad through the kernel (its backward kernels: the mask covered on A's or B's
    side, or outside the sum) against jax.grad of `reference`."""
    kernel, mod = build(text, "h200")
    env = resolve_sizes(kernel, sizes)
    args, _ = arguments(text, kernel, env, FRACTIONS, seed=1)
    floats = tuple(i for i, op in enumerate(kernel.inputs) if op.sparsity != "mask")
    w = jnp.asarray(np.random.default_rng(2).standard_normal(dims(kernel.outputs[0], env)), jnp.float32)
    run = getattr(mod, kernel.name)
    got = jax.grad(lambda *a: jnp.sum(run(*a, interpret=True).astype(jnp.float32) * w), floats)(*args)
    want = jax.grad(lambda *a: jnp.sum(mod.reference(*a).astype(jnp.float32) * w), floats)(*args)
    for i, a, b in zip(floats, got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(b).max() > 0, kernel.inputs[i].name
        np.testing.assert_allclose(
            a, b, rtol=2e-2, atol=0.02 * max(1.0, np.abs(b).std()), err_msg=kernel.inputs[i].name
        )
