"""Factors after the sum along the output's rows or columns alone on GPUs (issue 21): a
per-row scale `r[m] * x[m, k] * y[k, n]`, a per-column `c[n]`, one with batch coordinates
`r[b, m]`. None depends on the summed index, so each leaves the sum: a CTA copies its tile's
rows (tm elements) or columns (tn) of the vector into shared memory and multiplies the f32
(s32 for i8 factors) accumulator by it, broadcast, before the cast and the store, where main
refused them ("lacks n ... broadcast it to [m, n] first"). The wrapper pads the vector (not
a matrix) to whole blocks and forms no product with it. The backward's statements take the
same path where the factor stays outside their sum (dx[m, k] = g[m, n] * r[m] * y[k, n]);
where the sum runs over its index (dy sums m) it is covered, multiplied in by the wrapper.

In the Mosaic GPU interpreter against `reference`: values and gradients, ragged rows, a
warp-specialized CTA, with a mask after the sum, i8 into s32; lowered under an abstract
H200 with shared memory exactly as `rules.smem_bytes` says; one kernel through ptxas.

The factor after the sum with the output's rows and columns (a tile) is no padded copy
either: read by TMA as A and B are (`_matrix(..., clip=True, lead=..)`), its batch a
leading dimension, a mask's block kinds classified on whole blocks by `_block_kinds`.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches, build
from test_gpu import refused
from test_gpu_ragged import edits

from sparsegen.compiler import lower_source
from sparsegen.gpu.rules import WARPGROUPS
from sparsegen.source import SourceFile
from sparsegen.testing import example_args, resolve_sizes

ROW = """kernel row_scaled {
    in  r: bf16[M]
    in  x: bf16[M, K]
    in  y: bf16[K, N]
    out o: bf16[M, N]
    o[m, n] = r[m] * x[m, k] * y[k, n]
    tile m = 64, n = 128, k = 64
}"""

COL = """kernel col_scaled {
    in  x: bf16[M, K]
    in  y: bf16[K, N]
    in  c: f32[N]
    out o: bf16[M, N]
    o[m, n] = x[m, k] * y[k, n] * c[n]
    tile m = 64, n = 128, k = 64
}"""

# Batched, ragged rows per batch (M = 200), a row vector per batch and a column vector the
# same for every batch; a 64 x 256 block: two consumer warpgroups, each reading its own.
BATCHED = """kernel batched_scaled {
    in  r: f32[B, M]
    in  c: bf16[N]
    in  x: bf16[B, M, K]
    in  y: bf16[B, K, N]
    out o: bf16[B, M, N]
    o[b, m, n] = r[b, m] * c[n] * x[b, m, k] * y[b, k, n]
    tile b = 1, m = 64, n = 256, k = 64
}"""

MASKED = """kernel masked_scaled {
    in  x: bf16[M, K]
    in  y: bf16[K, N]
    in  mask: i32[M, N] mask
    in  r: f32[M]
    out o: bf16[M, N]
    o[m, n] = mask[m, n] * r[m] * x[m, k] * y[k, n]
    tile m = 64, n = 128, k = 64
}"""

INT8 = """kernel int8_scaled {
    in  s: i8[M]
    in  c: i32[N]
    in  x: i8[M, K]
    in  y: i8[K, N]
    out o: i32[M, N]
    o[m, n] = s[m] * x[m, k] * y[k, n] * c[n]
    tile m = 128, n = 128, k = 128
    accumulate i32
}"""


# A tile factor after the sum, ragged rows per batch (M = 200).
TILE_AFTER = """kernel tile_after {
    in  w: f32[B, M, N]
    in  x: bf16[B, M, K]
    in  y: bf16[B, K, N]
    out o: bf16[B, M, N]
    o[b, m, n] = w[b, m, n] * x[b, m, k] * y[b, k, n]
    tile b = 1, m = 64, n = 128, k = 64
}"""


def run(text, sizes, pattern="random", seed=0):
    kernel, mod = build(text, "h200")
    args, keywords = example_args(kernel, sizes, pattern, np.random.default_rng(seed))
    return kernel, mod, args, keywords


def grads_match(mod, name, args, keywords, argnums, out_shape, seed=1):
    """The kernel's gradients (the backward's passes) against JAX's of `reference`."""
    weight = np.random.default_rng(seed).standard_normal(out_shape).astype(np.float32)

    def loss(fn):
        def value(*wrt):
            full = list(args)
            for n, w in zip(argnums, wrt):
                full[n] = w
            return (fn(*full, **keywords).astype(jnp.float32) * weight).sum()

        return value

    kernel_fn = lambda *a, **k: getattr(mod, name)(*a, **k, interpret=True)  # noqa: E731
    wrt = [args[n] for n in argnums]
    got = jax.grad(loss(kernel_fn), argnums=tuple(range(len(argnums))))(*wrt)
    want = jax.grad(loss(mod.reference), argnums=tuple(range(len(argnums))))(*wrt)
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = np.abs(w).max()
        assert scale > 0
        np.testing.assert_allclose(g, w, rtol=2**-6, atol=2**-6 * scale)


def test_a_row_scale_with_ragged_rows_values_and_gradients():
    sizes = dict(M=200, K=128, N=256)
    kernel, mod, args, keywords = run(ROW, sizes)
    out = mod.row_scaled(*args, **keywords, interpret=True)
    assert out.shape == (200, 256)
    assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, sizes))
    # The scale is applied: with r = 1 the result differs.
    ones = mod.row_scaled(jnp.ones_like(args[0]), *args[1:], **keywords, interpret=True)
    assert not np.allclose(np.asarray(ones, np.float32), np.asarray(out, np.float32))
    # dx (r[m] after its sum over n: the same epilogue) and dy (r covered in its sum over m);
    # r's own gradient multiplies three groups in one sum, which no target derives.
    grads_match(mod, "row_scaled", args, keywords, (1, 2), (200, 256))


def test_the_wrapper_forms_no_product_with_the_vector():
    """The forward's and dx's calls pad r (a vector) and hand it to the kernel, which reads
    it in the epilogue: no `jnp.einsum` over x there. dy sums over m, r's index, so r is
    covered in that sum and still formed with the cotangent by the wrapper."""
    _, mod = build(ROW, "h200")
    for call in (mod._o_call, mod._d_x_call):
        source = inspect.getsource(call)
        assert "jnp.einsum" not in source and "r_vector = jnp.pad(r, ((0, -M % 64),)).reshape(-1)" in source, source
    kernel = inspect.getsource(mod._o_kernel)
    assert "lax.broadcast_in_dim(" in kernel and "r_smem[...].astype(jnp.float32), (64, 128), [0]" in kernel
    assert "jnp.einsum" in inspect.getsource(mod._d_y_call)


def test_a_column_scale_of_f32():
    sizes = dict(M=128, K=128, N=320)  # N ragged: c padded, the output's last column tile clipped
    kernel, mod, args, keywords = run(COL, sizes, seed=2)
    out = mod.col_scaled(*args, **keywords, interpret=True)
    assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, sizes))
    grads_match(mod, "col_scaled", args, keywords, (0, 1), (128, 320), seed=3)


def test_batched_rows_and_columns_warp_specialized_values_and_gradients():
    (m,) = lower_source(SourceFile("batched.spk", BATCHED), "h200")
    (p,) = m.passes
    assert p.tiles.wgs == WARPGROUPS and [(v.operand, v.axis) for v in p.vectors] == [("r", "rows"), ("c", "cols")]
    sizes = dict(B=2, M=200, K=128, N=256)
    kernel, mod, args, keywords = run(BATCHED, sizes, seed=4)
    out = mod.batched_scaled(*args, **keywords, interpret=True)
    ref = mod.reference(*args, **keywords)
    assert_matches(kernel, out, ref, resolve_sizes(kernel, sizes))
    # Batch 1's rows are scaled by r[1], not r[0] (the vector's rows are padded per batch).
    swapped = mod.batched_scaled(args[0][::-1], *args[1:], **keywords, interpret=True)
    assert not np.allclose(np.asarray(swapped, np.float32)[1], np.asarray(out, np.float32)[1])
    # dx: r[b, m] a row vector of dx (c covered); dy: c[n] a column vector of dy (r covered).
    grads_match(mod, "batched_scaled", args, keywords, (2, 3), (2, 200, 256), seed=5)


def test_with_a_mask_after_the_sum():
    """The row scale and the mask both after the sum: the mask's empty blocks run no step and
    store zeros, whatever r holds there (a NaN in r, as `reference` skips the block); its full
    blocks take r alone, its partial ones r and the mask."""
    sizes = dict(M=128, K=128, N=384)
    kernel, mod, args, keywords = run(MASKED, sizes, seed=6)
    x, y, mask, r = args
    mask = np.ones((128, 384), np.int32)
    mask[:64, 256:] = 0  # block (0, 2): empty
    mask[64:, 128:256] = np.tril(np.ones((64, 128), np.int32))  # block (1, 1): partial
    r = np.array(r)
    r[3] = np.nan
    out = np.asarray(mod.masked_scaled(x, y, mask, r, **keywords, interpret=True), np.float64)
    ref = np.asarray(mod.reference(x, y, mask, r, **keywords), np.float64)
    assert (out[:64, 256:] == 0).all() and np.isnan(out[3, :256]).all()
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(out), finite)
    assert_matches(kernel, jnp.asarray(np.where(finite, out, 0), jnp.float32), jnp.asarray(np.where(finite, ref, 0), jnp.float32),
                   resolve_sizes(kernel, sizes))
    grads_match(mod, "masked_scaled", args, keywords, (0, 1), (128, 384), seed=7)


def test_a_tile_after_the_sum_is_clipped_per_batch_not_padded():
    """w (2, 200, 256) reaches the kernel as it is: no pad in the traced wrapper, its rows
    past M = 200 zeros per batch (an infinity in batch 1's first row never meets batch 0's
    last row tile, which it would were the batches flattened unpadded)."""
    sizes = dict(B=2, M=200, K=128, N=256)
    kernel, mod, args, keywords = run(TILE_AFTER, sizes, seed=9)
    w = np.array(args[0])
    w[1, 0, :] = np.inf
    args = [w, *args[1:]]
    found = edits(mod.tile_after, *args, **keywords, interpret=True)
    assert not [e for e in found if e[0] == "pad" and e[1] == w.shape], found
    out = np.asarray(mod.tile_after(*args, **keywords, interpret=True), np.float32)
    ref = np.asarray(mod.reference(*args, **keywords), np.float32)
    assert np.isfinite(out[0]).all() and not np.isfinite(out[1, 0]).all()
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))
    finite = np.isfinite(ref)
    assert_matches(kernel, jnp.asarray(np.where(finite, out, 0), jnp.bfloat16), jnp.asarray(np.where(finite, ref, 0), jnp.bfloat16),
                   resolve_sizes(kernel, sizes))


def test_a_mask_after_the_sum_is_padded_only_to_classify_its_blocks():
    """At ragged sizes the mask is padded once, inside `_block_kinds` (whole blocks), and
    the kernel reads the unpadded one."""
    sizes = dict(M=200, K=128, N=320)
    kernel, mod, args, keywords = run(MASKED, sizes, "tril", seed=10)
    found = edits(mod.masked_scaled, *args, **keywords, interpret=True)
    assert [e for e in found if e[0] == "pad" and e[1] == (200, 320)] == [("pad", (200, 320), (256, 384))], found
    out = mod.masked_scaled(*args, **keywords, interpret=True)
    assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, sizes))


def test_int8_rows_and_columns_are_exact_in_s32():
    kernel, mod = build(INT8, "h200")
    rng = np.random.default_rng(8)
    s = rng.integers(-128, 128, 200).astype(np.int8)
    c = rng.integers(-1000, 1000, 256).astype(np.int32)
    x = rng.integers(-128, 128, (200, 256)).astype(np.int8)
    y = rng.integers(-128, 128, (256, 256)).astype(np.int8)
    got = np.asarray(mod.int8_scaled(s, c, x, y, interpret=True))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(mod.reference(s, c, x, y)))
    assert np.abs(got).max() > 2**24  # past what an f32 multiply keeps exact: multiplied in s32


@pytest.mark.parametrize("text,needle", [
    (ROW.replace("in  r: bf16[M]", "in  r: i32[M] mask"), "'r[m]' after the sum is a mask lacking n, the product's columns"),
    (BATCHED.replace("r: f32[B, M]", "r: f32[B]").replace("r[b, m] *", "r[b] *"),
     "'r[b]' after the sum lacks m and n, the product's rows and columns"),
    (MASKED.replace("in  r: f32[M]", "in  r: f32[M, N]").replace("r[m] *", "r[m, n] *"),
     "at most one factor after the sum with the product's rows and columns; 'mask[m, n]' and 'r[m, n]' both are"),
])  # fmt: skip
def test_what_is_not_lowered_says_why(text, needle):
    assert needle in refused(text)


def test_lowered_for_an_abstract_h200_with_the_shared_memory_the_rules_say():
    """Stage 2 (and the backward), measured shared memory == `rules.smem_bytes`: one
    warpgroup (the vectors in a scope of their own: no more than without them), two (each
    consumer's vectors beside its epilogue tiles, each from a 1,024-byte boundary), with a
    mask, i8. Stage 3 (ptxas for sm_90a) on the warp-specialized one: no spills."""
    from sparsegen.verify import verify_gpu_modules

    texts = {"row": ROW, "batched": BATCHED, "masked": MASKED, "int8": INT8, "tile after": TILE_AFTER}
    items = []
    for name, text in texts.items():
        source = SourceFile(f"{name}.spk", text)
        items += [(m, source, "h200") for m in lower_source(source, "h200")]
    results = verify_gpu_modules(items, stage3={"batched_scaled"})
    for name, r in zip(texts, results):
        assert r.lowered, (name, r.raw_error)
        assert r.smem_used == r.smem_estimate, (name, r.smem_used, r.smem_estimate)
        assert r.backward in ("lowers", "not derived: no input has a gradient"), (name, r.backward)
    batched = results[1]
    if batched.compiled is None:
        pytest.skip(f"stage 3 (ptxas for sm_90a) not run: {batched.stage3}")
    assert batched.compiled and batched.spill_bytes == 0, (batched.registers, batched.spill_bytes, batched.raw_error)
