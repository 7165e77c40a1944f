"""Absent terms never reach a result (issue 37, items 1 and 4; language v3, section 0).

A condition on a statement's terms selects them out, whatever any factor of an absent term
holds (NaN, Inf), in the kernel (CPU interpreter and TPU simulator) and in `reference`:
both are compared with an oracle that forms every term of the statement (one value of each
index), replaces the absent ones by 0 (`np.where`, not a product) and sums, in float64.
Where the condition reads a summed index walked one value at a time (`g`, `b`), each step
selects with its own value of it (item 1: the flush selected with the last step's).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import both_modes, build, spec_text, with_tiles

GROUPED = with_tiles(spec_text("grouped_matmul"), m=128, k=128, n=128, g=1)
TRIL = with_tiles(spec_text("tril_matmul"), m=128, k=128, n=128)

WIDTHS = """kernel gw {
    in  x: f32[M, K]
    in  w: f32[E, K, N]
    in  gid: i32[M]
    in  width: i32[E]
    out o: f32[M, N]
    o[m, n] = x[m, k] * w[g, k, n] where gid[m] == g and n < width[g]
    tile m = 128, k = 128, n = 128, g = 1
}
"""

RAGGED_BATCH = """kernel rb {
    in  x: f32[B, M, K]
    in  y: f32[B, K, N]
    in  rows: i32[B]
    in  cols: i32[B]
    out o: f32[M, N]
    o[m, n] = x[b, m, k] * y[b, k, n] where m < rows[b] and n < cols[b]
    tile b = 1, m = 8, k = 128, n = 128
}
"""

GROUPED_K = """kernel gk {
    in  x: f32[M, K]
    in  w: f32[E, K, N]
    in  gid: i32[M]
    out o: f32[M, N]
    o[m, n] = x[m, k] * w[g, k, n] where gid[m] == g and k < 100
    tile m = 128, k = 128, n = 128, g = 1
}
"""

OFFSETS = """kernel go {
    in  x: bf16[M, K]
    in  w: bf16[E, K, N]
    in  lo: i32[E1]
    out o: bf16[M, N]
    o[m, n] = x[m, k] * w[g, k, n] where lo[g] <= m < lo[g + 1]
    tile m = 128, k = 128, n = 128, g = 1
}
"""


def termwise(spec: str, *arrays, present, **sizes):
    """The statement `spec` ("mk,gkn->mn") term by term: every term (one value of each index)
    formed in float64, those where `present(**positions)` is false replaced by 0, summed.
    `sizes`: those of indices no factor has (an output's group)."""
    ins, out = spec.split("->")
    ins = ins.split(",")
    letters = list(out) + [c for s in ins for c in s if c not in out]
    letters = list(dict.fromkeys(letters))
    size = {c: np.shape(a)[s.index(c)] for s, a in zip(ins, arrays) for c in s} | sizes
    grid = {c: np.arange(size[c]).reshape([-1 if d == c else 1 for d in letters]) for c in letters}
    terms = np.ones([size[c] for c in letters])
    with np.errstate(invalid="ignore", over="ignore"):
        for s, a in zip(ins, arrays):
            a = np.asarray(a, np.float64).transpose([s.index(c) for c in letters if c in s])
            terms = terms * a.reshape([size[c] if c in s else 1 for c in letters])
        keep = np.broadcast_to(present(**grid), terms.shape)
        return np.where(keep, terms, 0.0).sum(axis=tuple(range(len(out), len(letters))))


def assert_termwise(got, want, rtol=2e-2, atol=5e-2):
    """NaN and infinities where the oracle has them (with their signs), the rest close."""
    got = np.asarray(got, np.float64)
    for kind in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(kind(got), kind(want), err_msg=kind.__name__)
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=atol)


def bf16(rng, shape):
    return np.array(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16).astype(jnp.float32))


def as_bf16(x):
    return jnp.asarray(x, jnp.bfloat16)


# ------------------------------------------------------------------ item 1: per-step selection


@both_modes
def test_widths_of_experts_select_each_step_with_its_own_expert(interpret):
    """`n < width[g]` beside `gid[m] == g`: rows of expert 0 use its full width, rows of
    expert 1 its first 60 columns (the flush selected every row with the last expert's)."""
    _, mod = build(WIDTHS)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 128)).astype(np.float32)
    w = rng.standard_normal((2, 128, 128)).astype(np.float32)
    gid = np.array([0] * 64 + [1] * 64, np.int32)
    width = np.array([128, 60], np.int32)
    want = termwise("mk,gkn->mn", x, w, present=lambda m, n, k, g: (gid[m] == g) & (n < width[g]))
    assert_termwise(mod.gw(x, w, gid, width, interpret=interpret), want, 1e-5, 1e-4)
    assert_termwise(mod.reference(x, w, gid, width), want, 1e-5, 1e-4)


@both_modes
def test_a_sum_of_ragged_products_selects_each_batch_with_its_own_sizes(interpret):
    """`m < rows[b] and n < cols[b]` with b summed one value at a time."""
    _, mod = build(RAGGED_BATCH)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 16, 128)).astype(np.float32)
    y = rng.standard_normal((3, 128, 256)).astype(np.float32)
    rows, cols = np.array([5, 16, 0], np.int32), np.array([256, 100, 3], np.int32)
    want = termwise("bmk,bkn->mn", x, y, present=lambda m, n, b, k: (m < rows[b]) & (n < cols[b]))
    assert_termwise(mod.rb(x, y, rows, cols, interpret=interpret), want, 1e-5, 1e-4)
    assert_termwise(mod.reference(x, y, rows, cols), want, 1e-5, 1e-4)


@both_modes
def test_the_derived_gradient_of_a_condition_on_a_summed_index_and_the_output(interpret):
    """`gid[m] == g and k < 100`: d_x[m, k] = g_o[m, n] * w[g, k, n] where ... selects per step
    (it selected at the flush with the last expert)."""
    _, mod = build(GROUPED_K)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 256, 128)), jnp.float32)
    gid = jnp.asarray([0] * 100 + [1] * 156, jnp.int32)
    g_o = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)

    def math(x):
        wk = jnp.where(jnp.arange(256)[:, None] < 100, 1.0, 0.0) * w[gid]  # [m, k, n]
        return jnp.einsum("mk,mkn->mn", x, wk, precision=jax.lax.Precision.HIGHEST)

    want = jax.vjp(math, x)[1](g_o)[0]
    got = jax.vjp(lambda x: mod.gk(x, w, gid, interpret=interpret), x)[1](g_o)[0]
    assert_termwise(got, np.asarray(want, np.float64), 1e-5, 1e-4)
    assert_termwise(mod.gk(x, w, gid, interpret=interpret), np.asarray(math(x), np.float64), 1e-5, 1e-4)


# ------------------------------------------------------------------ item 4: NaN and Inf in absent terms


def grouped_case(rng, gid, e):
    x, w = bf16(rng, (len(gid), 128)), bf16(rng, (e, 128, 128))
    return x, w


@both_modes
def test_nan_in_an_empty_experts_matrix_stays_out_forward_and_in_d_x(interpret):
    """Expert 1 has no row, but its id lies inside the row block's range (0..2): the block
    visits it as partial. Its NaN matrix reached every row of the block (reference: every row)."""
    _, mod = build(GROUPED)
    rng = np.random.default_rng(3)
    gid = np.array([0] * 64 + [2] * 64, np.int32)
    x, w = grouped_case(rng, gid, 3)
    w[1] = np.nan
    present = lambda m, n, k, g: gid[m] == g  # noqa: E731
    want = termwise("mk,gkn->mn", x, w, present=present)
    assert np.isfinite(want).all()
    assert_termwise(mod.grouped_matmul(as_bf16(x), as_bf16(w), gid, interpret=interpret), want)
    assert_termwise(mod.reference(as_bf16(x), as_bf16(w), gid), want)
    g_o = bf16(rng, (128, 128))
    d_x = jax.vjp(lambda x: mod.grouped_matmul(x, as_bf16(w), gid, interpret=interpret), as_bf16(x))[1](as_bf16(g_o))[0]
    assert_termwise(d_x, termwise("mn,gkn->mk", g_o, w, present=lambda m, k, n, g: gid[m] == g))


@both_modes
def test_inf_in_a_used_experts_matrix_reaches_its_rows_only(interpret):
    _, mod = build(GROUPED)
    rng = np.random.default_rng(4)
    gid = np.array([0] * 64 + [1] * 64, np.int32)
    x, w = grouped_case(rng, gid, 2)
    w[0, 5, 7] = np.inf
    x[3, 5] = 0.0  # 0 * Inf: NaN at (3, 7), a present term
    want = termwise("mk,gkn->mn", x, w, present=lambda m, n, k, g: gid[m] == g)
    assert np.isnan(want[3, 7]) and np.isinf(want[:64, 7]).sum() == 63 and np.isfinite(want[64:]).all()
    assert_termwise(mod.grouped_matmul(as_bf16(x), as_bf16(w), gid, interpret=interpret), want)
    assert_termwise(mod.reference(as_bf16(x), as_bf16(w), gid), want)


@both_modes
def test_nan_in_rows_of_no_group_stays_out_of_d_w(interpret):
    """Padding rows (gid -1) hold NaN in x and Inf in the cotangent: the forward is clean, and
    d_w (which selected the cotangent, not x) too, as jax.grad of the math is."""
    _, mod = build(GROUPED)
    rng = np.random.default_rng(5)
    gid = np.array([0] * 50 + [1] * 50 + [-1] * 28, np.int32)
    x, w = grouped_case(rng, gid, 2)
    x[100:] = np.nan
    present = lambda m, n, k, g: gid[m] == g  # noqa: E731
    want = termwise("mk,gkn->mn", x, w, present=present)
    assert np.isfinite(want).all()
    assert_termwise(mod.grouped_matmul(as_bf16(x), as_bf16(w), gid, interpret=interpret), want)
    assert_termwise(mod.reference(as_bf16(x), as_bf16(w), gid), want)
    g_o = bf16(rng, (128, 128))
    g_o[120:] = np.inf  # the cotangent of padding rows too (selected: the other factor is checked)
    d_w = jax.vjp(lambda w: mod.grouped_matmul(as_bf16(x), w, gid, interpret=interpret), as_bf16(w))[1](as_bf16(g_o))[0]
    assert_termwise(d_w, termwise("mn,mk->gkn", g_o, x, present=lambda g, k, n, m: gid[m] == g, g=2))


@both_modes
def test_nan_in_rows_past_the_last_offset_stays_out_of_d_w(interpret):
    _, mod = build(OFFSETS)
    rng = np.random.default_rng(6)
    lo = np.array([0, 40, 90], np.int32)  # rows 90..127 belong to no group
    x, w = bf16(rng, (128, 128)), bf16(rng, (2, 128, 128))
    x[90:] = np.nan
    gid = np.searchsorted(lo, np.arange(128), side="right") - 1
    gid[90:] = -1
    want = termwise("mk,gkn->mn", x, w, present=lambda m, n, k, g: gid[m] == g)
    assert np.isfinite(want).all()
    assert_termwise(mod.go(as_bf16(x), as_bf16(w), lo, interpret=interpret), want)
    assert_termwise(mod.reference(as_bf16(x), as_bf16(w), lo), want)
    g_o = bf16(rng, (128, 128))
    d_w = jax.vjp(lambda w: mod.go(as_bf16(x), w, lo, interpret=interpret), as_bf16(w))[1](as_bf16(g_o))[0]
    assert_termwise(d_w, termwise("mn,mk->gkn", g_o, x, present=lambda g, k, n, m: gid[m] == g, g=2))


@both_modes
def test_tril_nan_in_y_reaches_the_rows_that_read_it(interpret):
    """y[200] is NaN: rows 200..255 read it (k <= m), rows 128..199 of the same block do not.
    y lacks m, so selecting x's absent terms left 0 * NaN: the step is recomputed."""
    _, mod = build(TRIL)
    rng = np.random.default_rng(7)
    x, y = bf16(rng, (256, 256)), bf16(rng, (256, 128))
    y[200] = np.nan
    y[150, 3], y[151, 3], y[160, 9] = np.inf, -np.inf, np.inf  # both signs meet in column 3
    x[170, 160] = 0.0  # 0 * Inf at a present term: NaN at (170, 9)
    want = termwise("mk,kn->mn", x, y, present=lambda m, n, k: k <= m)
    assert np.isfinite(want[:150]).all() and np.isnan(want[200:]).all() and np.isnan(want[170, 9])
    assert_termwise(mod.tril_matmul(as_bf16(x), as_bf16(y), interpret=interpret), want)
    assert_termwise(mod.reference(as_bf16(x), as_bf16(y)), want)


@both_modes
def test_tril_d_y_with_nan_in_the_cotangent(interpret):
    """d_y[k, n] = x[m, k] * g_o[m, n] where k <= m: g_o lacks k; a NaN in g_o[100] reaches
    d_y[0..100] only."""
    _, mod = build(TRIL)
    rng = np.random.default_rng(8)
    x, y, g_o = bf16(rng, (256, 256)), bf16(rng, (256, 128)), bf16(rng, (256, 128))
    g_o[100] = np.nan
    g_o[20, 5] = -np.inf
    d_y = jax.vjp(lambda y: mod.tril_matmul(as_bf16(x), y, interpret=interpret), as_bf16(y))[1](as_bf16(g_o))[0]
    want = termwise("mk,mn->kn", x, g_o, present=lambda k, n, m: k <= m)
    assert np.isnan(want[:101]).all() and np.isfinite(want[101:]).all()
    assert_termwise(d_y, want)


def test_present_dot_counts_every_kind_of_non_finite_term():
    """The recomputation itself (`_present_dot`, the kernel's and reference's), on random
    terms: zeros in x, NaN and infinities of both signs in y, a random present set; x finite
    (where x is infinite too, see docs/limits.md)."""
    _, mod = build(TRIL)
    rng = np.random.default_rng(9)
    for _ in range(20):
        x = rng.standard_normal((8, 16)) * (rng.random((8, 16)) < 0.7)
        y = rng.standard_normal((16, 8))
        special = rng.random((16, 8))
        y[special < 0.05], y[(special >= 0.05) & (special < 0.1)], y[(special >= 0.1) & (special < 0.15)] = np.nan, np.inf, -np.inf
        keep = rng.random((8, 16)) < 0.5
        xs = np.where(keep, x, 0.0)

        def dot(a, b):
            return jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)

        got = mod._present_dot(dot, jnp.asarray(xs, jnp.float32), jnp.asarray(xs, jnp.float32), jnp.asarray(keep), jnp.asarray(y, jnp.float32))
        want = termwise("mk,kn->mn", x, y, present=lambda m, n, k: keep[m, k])
        assert_termwise(got, want, 1e-5, 1e-5)
