"""NaN and Inf (issue 12, item 15): skipping is by block, in the kernel and in `reference`.

A block the sparse operand leaves out (a coo input's unstored block, a mask's all-zero
block) is never multiplied, so a NaN it would meet does not reach the output; inside a
block that is computed, values are values (0 x NaN = NaN), as IEEE says. The kernel and
`reference` agree on both, NaN for NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from conftest import both_modes, build

COO = """
kernel nan_coo {
    in  x: f32[M, K] coo
    in  y: f32[K, N]
    out o: f32[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 8, n = 128, k = 128
}
"""

MASK_AFTER_SUM = """
kernel nan_mask_after {
    in  x: f32[M, K]
    in  y: f32[K, N]
    in  keep: i32[M, N] mask
    out o: f32[M, N]
    o[m, n] = keep[m, n] * x[m, k] * y[k, n]
    tile m = 8, n = 128, k = 128
}
"""

MASK_IN_SUM = """
kernel nan_mask_in {
    in  g: f32[M, N]
    in  keep: i32[M, N] mask
    in  y: f32[K, N]
    out dx: f32[M, K]
    dx[m, k] = g[m, n] * keep[m, n] * y[k, n]
    tile m = 8, n = 128, k = 128
}
"""


def assert_same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=1e-5, atol=1e-4)


@both_modes  # the interpreter's memory holds no NaN of its own: what reaches an output is the operands'
def test_a_nan_no_stored_block_meets_stays_out(interpret):
    _, mod = build(COO)
    rng = np.random.default_rng(0)
    blocks = jnp.asarray(rng.standard_normal((2, 8, 128)), jnp.float32)
    rows, cols = jnp.array([0, 1], jnp.int32), jnp.array([0, 0], jnp.int32)  # k-block 1 is not stored
    y = rng.standard_normal((256, 128)).astype(np.float32)
    y[128:] = np.nan
    out = mod.nan_coo(blocks, rows, cols, jnp.asarray(y), M=16, interpret=interpret)
    ref = mod.reference(blocks, rows, cols, jnp.asarray(y), M=16)
    want = np.concatenate([np.asarray(blocks[0]), np.asarray(blocks[1])]) @ y[:128]
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(ref)).all()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
    assert_same(out, ref)


@both_modes  # the interpreter's memory holds no NaN of its own: what reaches an output is the operands'
def test_a_nan_in_a_stored_block_reaches_its_output_block(interpret):
    _, mod = build(COO)
    rng = np.random.default_rng(1)
    blocks = rng.standard_normal((2, 8, 128)).astype(np.float32)
    blocks[1, 2, 5] = np.nan  # output rows 8..15: row 10 meets it
    rows, cols = jnp.array([0, 1], jnp.int32), jnp.array([0, 1], jnp.int32)
    y = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)
    out = mod.nan_coo(jnp.asarray(blocks), rows, cols, y, M=16, interpret=interpret)
    ref = mod.reference(jnp.asarray(blocks), rows, cols, y, M=16)
    assert np.isnan(np.asarray(out)[10]).all() and not np.isnan(np.asarray(out)[:10]).any()
    assert_same(out, ref)


@both_modes  # the interpreter's memory holds no NaN of its own: what reaches an output is the operands'
def test_a_mask_after_the_sum_skips_its_empty_blocks_and_multiplies_its_zeros(interpret):
    _, mod = build(MASK_AFTER_SUM)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 128)).astype(np.float32)
    x[3] = np.nan  # output row 3 is NaN wherever it is computed
    y = jnp.asarray(rng.standard_normal((128, 256)), jnp.float32)
    keep = np.ones((16, 256), np.int32)
    keep[0:8, 128:] = 0  # an empty block: skipped
    keep[3, 0:64] = 0  # zeros inside a computed block: values
    out = np.asarray(mod.nan_mask_after(jnp.asarray(x), y, jnp.asarray(keep), interpret=interpret))
    ref = mod.reference(jnp.asarray(x), y, jnp.asarray(keep))
    assert (out[3, 128:] == 0).all() and np.isnan(out[3, :128]).all()
    assert np.isfinite(np.delete(out, 3, axis=0)).all()
    assert_same(out, ref)


@both_modes  # the interpreter's memory holds no NaN of its own: what reaches an output is the operands'
def test_a_mask_in_the_sum_skips_its_empty_blocks(interpret):
    _, mod = build(MASK_IN_SUM)
    rng = np.random.default_rng(3)
    g = jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)
    keep = np.ones((16, 256), np.int32)
    keep[:, 128:] = 0  # n-block 1 is empty for every m: y's columns there are never read
    y = rng.standard_normal((128, 256)).astype(np.float32)
    y[:, 128:] = np.inf
    out = mod.nan_mask_in(g, jnp.asarray(keep), jnp.asarray(y), interpret=interpret)
    ref = mod.reference(g, jnp.asarray(keep), jnp.asarray(y))
    want = np.asarray(g)[:, :128] @ y[:, :128].T
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
    assert_same(out, ref)
