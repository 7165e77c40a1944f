"""Condition walks at their boundaries (issue 44, item 3), against numpy oracles written
from the math, in the TPU simulator and the Mosaic GPU interpreter:

- sizes one less and one more than a multiple of the tile (255 and 257 at tiles of 128):
  the last block one row short of whole, or holding one row (the last diagonal block of a
  triangle, a band's last window, a group's last row alone in its block);
- groups: the first and the last group empty, rows that belong to no group at both ends
  (ids -1 before the groups and E after them, sorted; and the other way round, unsorted:
  the dense walk), the same for group offsets (`lo[g] <= m < lo[g + 1]`, lo[0] > 0 and
  lo[E] < M);
- a sliding window on attention's keys (`i >= j and i - j < 100`) at the same sizes.

The products' factors are small nonzero integers (exact in bf16) and their outputs f32: every
product and sum is exact, so the kernel must equal the oracle exactly and a single term
missing or added (one row of a block, one element of a diagonal) fails, where a tolerance
for rounding would let a term of order one through. Gradients of the grouped walk at the
same boundaries: padding rows and empty groups get zero gradients, the others the oracle's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SWEEP, build, spec_text, with_tiles

TILE = 128
SIZES = [2 * TILE - 1, 2 * TILE + 1]
# The examples with f32 outputs (exact sums of the integer factors' products).
TRIL = with_tiles(spec_text("tril_matmul"), m=TILE, k=TILE, n=TILE).replace("out o: bf16", "out o: f32")
GROUPED = with_tiles(spec_text("grouped_matmul"), m=TILE, k=TILE, n=TILE, g=1).replace("out o: bf16", "out o: f32")
BAND = f"""kernel band_matmul {{
    in  x: bf16[M, M]
    in  y: bf16[M, N]
    out o: f32[M, N]
    o[m, n] = x[m, k] * y[k, n] where k <= m and m - k < 100
    tile m = {TILE}, k = {TILE}, n = {TILE}
}}"""
OFFSETS = f"""kernel gmm_offsets {{
    in  x: bf16[M, K]
    in  w: bf16[E, K, N]
    in  lo: i32[E1]
    out o: f32[M, N]
    o[m, n] = x[m, k] * w[g, k, n] where lo[g] <= m < lo[g + 1]
    tile m = {TILE}, k = {TILE}, n = {TILE}, g = 1
}}"""
WINDOW = f"""kernel window_attention {{
    in  q: bf16[H, S, D]
    in  k: bf16[H, S, D]
    in  v: bf16[H, S, D]
    out o: bf16[H, S, D]
    s[h, i, j] = q[h, i, d] * k[h, j, d] * 0.125 where i >= j and i - j < 100
    o[h, i, e] = softmax(s[h, i, j], j) * v[h, j, e]
    tile h = 1, i = {TILE}, j = {TILE}, d = 64, e = 64
}}"""

# Per target: what runs the kernel. The TPU simulator (NaN-filled memory: a block no step
# writes shows) and the CPU interpreter too under SPARSEGEN_SWEEP=1; the GPU interpreter.
TARGETS = ["sim", "gpu"] + (["cpu"] if SWEEP else [])


def pairs(*cases, gpu_at=None):
    """(case..., target) for every target, but the GPU interpreter (seconds a case) at the
    cases `gpu_at` picks only (each at one of the two sizes; every case under
    SPARSEGEN_SWEEP=1)."""
    return [(*c, t) for c in cases for t in TARGETS if t != "gpu" or SWEEP or gpu_at is None or gpu_at(*c)]


def run(text, target, *args, **keywords):
    """(kernel, the kernel's outputs, its module) on `target`."""
    from jax.experimental.pallas import tpu as pltpu

    kernel, mod = build(text, "h200" if target == "gpu" else "v5e")
    if target == "sim":
        interpret = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
    else:
        interpret = True
    try:
        out = jax.block_until_ready(getattr(mod, kernel.name)(*args, **keywords, interpret=interpret))
    finally:
        if target == "sim":
            jax.effects_barrier()
            pltpu.reset_tpu_interpret_mode_state()
    return kernel, out, mod


def bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def ints(rng, shape):
    """Factors in {-2, -1, 1, 2}: exact in bf16, never zero (a missing term always shows)."""
    return jnp.asarray(rng.choice([-2, -1, 1, 2], shape), jnp.bfloat16)


def f64(x):
    return np.asarray(x, np.float64)


def assert_exact(out, want):
    np.testing.assert_array_equal(f64(out), want)


@pytest.mark.parametrize("name,M,target", pairs(*[(n, M) for n in ("tril", "band") for M in SIZES],
                                                 gpu_at=lambda n, M: M == SIZES[n == "tril"]))
def test_triangle_and_band_one_row_off_a_whole_block(name, M, target):
    """The diagonal's last block holds 127 rows, or one; the band (k in (m - 100, m]) cuts
    the blocks below the diagonal too. NaN where the condition is false: never multiplied."""
    rng = np.random.default_rng(M)
    x, y = ints(rng, (M, M)), ints(rng, (M, TILE))
    m, k = np.arange(M)[:, None], np.arange(M)[None, :]
    keep = (k <= m) & ((m - k < 100) if name == "band" else True)
    x_nan = jnp.where(keep, x, jnp.nan).astype(jnp.bfloat16)
    _, out, mod = run(TRIL if name == "tril" else BAND, target, x_nan, y)
    want = (f64(x) * keep) @ f64(y)
    assert_exact(out, want)
    assert_exact(mod.reference(x, y), want)


def offsets(M, before=7):
    """lo for E = 4 groups: rows before lo[0] and from lo[4] on belong to none, groups 0 and 3
    are empty; group 2 starts at the first block's last row and ends at the second block's
    last row (a block whose rows all belong to a group but its last: partial, not full), the
    rows past it (one, or two: at 257 the last block's one row) belong to none."""
    end = 2 * TILE - 1 - (M < 2 * TILE)
    return np.array([before, before, TILE - 1, end, end], np.int32)


def group_ids(M, layout, E=4):
    """Per row, its group, as `offsets` lays them out; the rows of no group are -1 before the
    groups and E after them ("sorted"), or E before and -1 after ("swapped": unsorted)."""
    lo = offsets(M)
    ids = np.full(M, -1 if layout == "sorted" else E, np.int32)
    ids[lo[-1]:] = E if layout == "sorted" else -1
    for g in range(E):
        ids[lo[g] : lo[g + 1]] = g
    return ids


def grouped_oracle(x, w, gid):
    x, w = f64(x), f64(w)
    out = np.zeros((x.shape[0], w.shape[2]))
    for g in range(w.shape[0]):
        rows = gid == g
        out[rows] = x[rows] @ w[g]
    return out


# One less than two blocks with the padding ids sorted, one more with them swapped (every
# pair under SPARSEGEN_SWEEP=1).
GROUP_CASES = [(M, layout) for M in SIZES for layout in ("sorted", "swapped") if SWEEP or (M, layout) in
               [(SIZES[0], "sorted"), (SIZES[1], "swapped")]]


@pytest.mark.parametrize("M,layout,target", pairs(*GROUP_CASES))
def test_grouped_empty_first_and_last_groups_padding_at_both_ends(M, layout, target):
    rng = np.random.default_rng(M)
    gid = group_ids(M, layout)
    x, w = ints(rng, (M, TILE)), ints(rng, (4, TILE, TILE))
    _, out, mod = run(GROUPED, target, x, w, gid)
    want = grouped_oracle(x, w, gid)
    assert_exact(out, want)
    assert_exact(mod.reference(x, w, gid), want)


@pytest.mark.parametrize("M,target", pairs(*[(M,) for M in SIZES], gpu_at=lambda M: M == SIZES[0]))
def test_group_offsets_empty_first_and_last_groups_padding_at_both_ends(M, target):
    rng = np.random.default_rng(M + 1)
    lo = offsets(M)
    gid = group_ids(M, "sorted")
    x, w = ints(rng, (M, TILE)), ints(rng, (4, TILE, TILE))
    _, out, mod = run(OFFSETS, target, x, w, lo)
    want = grouped_oracle(x, w, gid)
    assert_exact(out, want)
    assert_exact(mod.reference(x, w, lo), want)


@pytest.mark.parametrize("S,target", pairs(*[(S,) for S in SIZES], gpu_at=lambda S: S == SIZES[1]))
def test_sliding_window_one_row_off_a_whole_block(S, target):
    """The window (keys i - 99 .. i) at S one less and one more than two blocks: the last
    row block holds 127 rows or one, its window reaches back into the block before."""
    rng = np.random.default_rng(S)
    q, k, v = (bf16(rng, (2, S, 64)) for _ in range(3))
    kernel, out, mod = run(WINDOW, target, q, k, v)
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    keep = (i >= j) & (i - j < 100)
    s = np.where(keep, np.einsum("hid,hjd->hij", f64(q), f64(k)) * 0.125, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hij,hje->hie", p / p.sum(-1, keepdims=True), f64(v))
    np.testing.assert_allclose(f64(out), want, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(f64(mod.reference(q, k, v)), want, rtol=2e-2, atol=2e-2)


# The GPU's under SPARSEGEN_SWEEP=1 (tests/test_shipped_tiles.py runs its grouped gradient
# at 256-row blocks, tests/test_gpu_conditions.py with an empty group).
@pytest.mark.parametrize("target", [t for t in TARGETS if t != "gpu" or SWEEP])
def test_grouped_gradients_with_empty_groups_and_padding_at_both_ends(target):
    """dx of a padding row and dw of an empty group are zero; the rest is the oracle's."""
    M = SIZES[1]
    rng = np.random.default_rng(11)
    gid = group_ids(M, "sorted")
    x, w = bf16(rng, (M, TILE)), bf16(rng, (4, TILE, TILE))
    weight = rng.standard_normal((M, TILE))
    kernel, mod = build(GROUPED, "h200" if target == "gpu" else "v5e")
    from jax.experimental.pallas import tpu as pltpu

    interpret = pltpu.InterpretParams() if target == "sim" else True

    def loss(x, w):
        return jnp.sum(mod.grouped_matmul(x, w, gid, interpret=interpret).astype(jnp.float32) * weight)

    try:
        dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
    finally:
        if target == "sim":
            jax.effects_barrier()
            pltpu.reset_tpu_interpret_mode_state()
    want_dx, want_dw = np.zeros((M, TILE)), np.zeros((4, TILE, TILE))
    for g in range(4):
        rows = gid == g
        want_dx[rows] = weight[rows] @ f64(w[g]).T
        want_dw[g] = f64(x)[rows].T @ weight[rows]
    assert not f64(dx)[(gid < 0) | (gid >= 4)].any() and not f64(dw)[[0, 3]].any()
    for got, want in ((dx, want_dx), (dw, want_dw)):
        scale = np.abs(want).max()
        np.testing.assert_allclose(f64(got), want, rtol=2e-2, atol=2e-2 * scale)
