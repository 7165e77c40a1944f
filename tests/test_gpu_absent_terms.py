"""Absent terms never reach a result on the GPU einsums either (issue 37, item 4; language v3,
section 0), in the Mosaic GPU interpreter, against the term-by-term oracle of
tests/test_absent_terms.py (every term formed in float64, the absent ones replaced by 0):

- `gid[m] == g` spans the output's m beside the walked g: each step's product is selected
  (`Selection` "step"), so an Inf in a used expert's matrix reaches its own rows only (x's
  tile selected left 0 * Inf in the other expert's rows of the block);
- its d_w sums over m, which x and the cotangent both hold: both tiles are selected, so NaN
  in rows of no group stays out of d_w (the cotangent's tile alone was selected);
- `k <= m`: y[k, n] lacks m, so it cannot be selected; a result that is not finite is
  recomputed by the wrapper over the present terms (`exposed`): NaN in y[100] reaches rows
  100.. only, forward and d_y.

Gradients against jax.vjp of plain jnp. Tiles of 64, one or two row blocks: a few seconds each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SWEEP, build, spec_text, with_tiles
from test_absent_terms import as_bf16, assert_termwise, bf16, termwise

from sparsegen.compiler import lower_source
from sparsegen.source import SourceFile

GROUPED = with_tiles(spec_text("grouped_matmul"), m=64, k=64, n=64, g=1)
TRIL = with_tiles(spec_text("tril_matmul"), m=64, k=64, n=64)
SEEDS = range(4) if SWEEP else range(1)


def passes(text: str):
    (m,) = lower_source(SourceFile("t.spk", text), "h200")
    return m


def test_the_rule_each_pass_follows():
    """Which selection each pass takes (schedule.condition.selection, one source of truth)."""
    g = passes(GROUPED)
    (o,) = g.passes
    by = {p.output: p for p in g.backward_module.passes}
    assert (o.selection.on, o.exposed) == ("step", False)
    assert (by["d_x"].selection.on, by["d_x"].exposed) == ("step", False)
    assert "both" in by["d_w"].selection.about and not by["d_w"].exposed
    t = passes(TRIL)
    by = {p.output: p for p in t.backward_module.passes}
    assert t.passes[0].selection.on == "a" and t.passes[0].exposed
    assert by["d_y"].exposed and by["d_x"].selection.on == "out" and not by["d_x"].exposed


@pytest.mark.parametrize("seed", SEEDS)
def test_inf_in_a_used_experts_matrix_reaches_its_rows_only(seed):
    _, mod = build(GROUPED, "h200")
    rng = np.random.default_rng(40 + seed)
    gid = np.array([0] * 32 + [1] * 32, np.int32)
    x, w = bf16(rng, (64, 64)), bf16(rng, (2, 64, 64))
    w[0, 5, 7] = np.inf
    x[3, 5] = 0.0  # 0 * Inf at a present term: NaN at (3, 7)
    want = termwise("mk,gkn->mn", x, w, present=lambda m, n, k, g: gid[m] == g)
    assert np.isnan(want[3, 7]) and np.isinf(want[:32, 7]).sum() == 31 and np.isfinite(want[32:]).all()
    assert_termwise(mod.grouped_matmul(as_bf16(x), as_bf16(w), gid, interpret=True), want)
    # d_x[m, k] = g_o[m, n] * w[g, k, n] where gid[m] == g: the Inf reaches rows of expert 0 only.
    g_o = bf16(rng, (64, 64))
    d_x = jax.vjp(lambda x: mod.grouped_matmul(x, as_bf16(w), gid, interpret=True), as_bf16(x))[1](as_bf16(g_o))[0]
    assert_termwise(d_x, termwise("mn,gkn->mk", g_o, w, present=lambda m, k, n, g: gid[m] == g))


@pytest.mark.parametrize("seed", SEEDS)
def test_nan_in_rows_of_no_group_stays_out_of_d_w(seed):
    """Padding rows (gid -1) hold NaN in x and Inf in the cotangent: the forward and d_w are
    clean, as jax.grad of the math is."""
    _, mod = build(GROUPED, "h200")
    rng = np.random.default_rng(50 + seed)
    gid = np.array([0] * 25 + [1] * 25 + [-1] * 14, np.int32)
    x, w = bf16(rng, (64, 64)), bf16(rng, (2, 64, 64))
    x[50:] = np.nan
    want = termwise("mk,gkn->mn", x, w, present=lambda m, n, k, g: gid[m] == g)
    assert np.isfinite(want).all()
    assert_termwise(mod.grouped_matmul(as_bf16(x), as_bf16(w), gid, interpret=True), want)
    g_o = bf16(rng, (64, 64))
    g_o[60:] = np.inf

    def math(w):  # plain jnp: each row times its expert's matrix, rows of no group none
        rows = jnp.where((gid >= 0)[:, None, None], w.astype(jnp.float32)[np.maximum(gid, 0)], 0.0)
        return jnp.einsum("mk,mkn->mn", jnp.where((gid >= 0)[:, None], as_bf16(x).astype(jnp.float32), 0.0), rows)

    want_w = jax.vjp(math, as_bf16(w))[1](as_bf16(g_o).astype(jnp.float32))[0]
    assert np.isfinite(np.asarray(want_w)).all()
    d_w = jax.vjp(lambda w: mod.grouped_matmul(as_bf16(x), w, gid, interpret=True), as_bf16(w))[1](as_bf16(g_o))[0]
    assert_termwise(d_w, np.asarray(want_w, np.float64))
    assert_termwise(d_w, termwise("mn,mk->gkn", g_o, x, present=lambda g, k, n, m: gid[m] == g, g=2))


@pytest.mark.parametrize("seed", SEEDS)
def test_tril_nan_in_y_reaches_the_rows_that_read_it(seed):
    """y[100] is NaN: rows 100..127 read it (k <= m), rows 64..99 of the same block do not;
    infinities of both signs meet in column 3; 0 * Inf at a present term gives NaN."""
    _, mod = build(TRIL, "h200")
    rng = np.random.default_rng(70 + seed)
    x, y = bf16(rng, (128, 128)), bf16(rng, (128, 64))
    y[100] = np.nan
    y[70, 3], y[71, 3], y[80, 9] = np.inf, -np.inf, np.inf
    x[90, 80] = 0.0
    want = termwise("mk,kn->mn", x, y, present=lambda m, n, k: k <= m)
    assert np.isfinite(want[:70]).all() and np.isfinite(want[72:100, 0]).all() and np.isnan(want[100:]).all()
    assert_termwise(mod.tril_matmul(as_bf16(x), as_bf16(y), interpret=True), want)


@pytest.mark.parametrize("seed", SEEDS)
def test_tril_d_y_with_nan_in_the_cotangent(seed):
    """d_y[k, n] = x[m, k] * g_o[m, n] where k <= m: g_o lacks k; NaN in g_o[50] reaches
    d_y[0..50] only (d_y's rows 51..63 share its block)."""
    _, mod = build(TRIL, "h200")
    rng = np.random.default_rng(80 + seed)
    x, y, g_o = bf16(rng, (128, 128)), bf16(rng, (128, 64)), bf16(rng, (128, 64))
    g_o[50] = np.nan
    g_o[20, 5] = -np.inf

    def math(y):  # plain jnp, term by term: an absent term's cotangent is selected out, not multiplied
        terms = as_bf16(x).astype(jnp.float32)[:, :, None] * y[None, :, :]
        return jnp.where(np.tril(np.ones((128, 128), bool))[:, :, None], terms, 0.0).sum(axis=1)

    d_y = jax.vjp(lambda y: mod.tril_matmul(as_bf16(x), y, interpret=True), as_bf16(y))[1](as_bf16(g_o))[0]
    want = termwise("mk,mn->kn", x, g_o, present=lambda k, n, m: k <= m)
    assert np.isnan(want[:51]).all() and np.isfinite(want[51:]).all()
    assert_termwise(d_y, want)
    want_math = jax.vjp(math, as_bf16(y).astype(jnp.float32))[1](as_bf16(g_o).astype(jnp.float32))[0]
    assert_termwise(d_y, np.asarray(want_math, np.float64))
