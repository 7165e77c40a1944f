"""Absent terms never reach a result on the GPU walks either (issue 37, item 4; language v3,
section 0), in the Mosaic GPU interpreter: a NaN or Inf that a value holds where the
condition makes a term absent (a causal key above the diagonal of a partial block, a cache
slot past `lens` or before a window) stays out of the outputs, the logsumexp and the
gradients; a row that sees it (a present term) still gets it.

How the kernels do it (docs/gpu.md): a walk's partial steps multiply whole tiles; a NaN or Inf
an absent element's weight 0 met there reaches every row of that step's product and stays in
the accumulator, so the walk checks its first row once at its end and, where it is not
finite, walks the row block again with its partial steps over the present elements alone
(`_present_values`). The backward selects ds where the weight is 0.

Oracles: numpy in float64 term by term, and `jax.vjp` of plain jnp that selects every factor
of a term before it multiplies them (tests/test_absent_attention.py). bf16 inputs (the GPU's
WGMMA types), shapes of one or two row blocks: a few seconds a case.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SWEEP, build
from test_absent_attention import PAGED, WINDOW, paged_case, paged_oracle

S, D = 256, 64
SCALE = 0.125


def causal(tiles: int) -> str:
    """Causal attention, bf16; row and key blocks of `tiles`: 64 runs one warpgroup a CTA,
    128 two consumer warpgroups and a producer (docs/gpu.md)."""
    return f"""kernel ca {{
    in  q: bf16[B, H, S, D]
    in  k: bf16[B, H, S, D]
    in  v: bf16[B, H, S, D]
    out o: bf16[B, H, S, D]
    out lse: f32[B, H, S]
    s[b, h, i, j] = q[b, h, i, d] * k[b, h, j, d] * {SCALE} where i >= j
    o[b, h, i, e] = softmax(s[b, h, i, j], j) * v[b, h, j, e]
    lse[b, h, i] = logsumexp(s[b, h, i, j], j)
    tile b = 1, h = 1, i = {tiles}, j = {tiles}, d = {D}, e = {D}
}}
"""


TILES = [64, 128]  # one warpgroup; two consumers


def bf16(x):
    return np.array(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # a writable copy


def planted(plant: str, seed=0):
    """q, k, v (bf16 values) with NaN or Inf in rows of v: row 200 is absent for rows
    128..199 of its diagonal block (partial) and present for rows 200 up."""
    rng = np.random.default_rng(seed)
    q, k, v = (bf16(rng.standard_normal((1, 1, S, D))) for _ in range(3))
    if plant == "v_nan":
        v[0, 0, 200, ::3] = np.nan
    elif plant == "v_inf":
        v[0, 0, 200, ::3] = np.inf
    elif plant == "v_signs":  # infinities of both signs in column 5 (NaN from row 151), -Inf alone in 6
        v[0, 0, 150, 5], v[0, 0, 151, 5], v[0, 0, 140, 6] = np.inf, -np.inf, -np.inf
        v[0, 0, 255, ::7] = np.nan  # only the last row sees it
    return q, k, v


def oracle(q, k, v):
    """o and lse term by term in float64: a row's softmax over its present keys (j <= i),
    each absent term replaced by 0 whatever its factors hold."""
    q, k, v = (np.asarray(a, np.float64)[0, 0] for a in (q, k, v))
    present = np.arange(S)[:, None] >= np.arange(S)[None, :]
    s = np.where(present, q @ k.T * SCALE, -np.inf)
    m = s.max(-1, keepdims=True)
    w = np.where(present, np.exp(s - m), 0.0)
    with np.errstate(invalid="ignore"):
        o = np.where(present[:, :, None], (w / w.sum(-1, keepdims=True))[:, :, None] * v[None], 0.0).sum(1)
    return o[None, None], (m + np.log(w.sum(-1, keepdims=True)))[None, None, :, 0]


def math(q, k, v):
    """The same in plain jnp, every factor of a term selected before the products (so that
    `jax.vjp` of it has no 0 x NaN either): the gradients' oracle."""
    present = jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]
    pm = present[None, None, :, :, None]
    s = jnp.where(present, jnp.einsum("bhid,bhjd->bhij", q, k) * SCALE, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.sum(jnp.where(pm, p[..., None], 0.0) * jnp.where(pm, v[:, :, None, :, :], 0.0), axis=3)
    return o, jax.nn.logsumexp(s, axis=-1)


def close(got, want, what, tol=3e-2):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    # NaN and infinities where the math has them (and only there), the values elsewhere.
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN where the math has none, or none where it has")
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg=f"{what}: +Inf")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"{what}: -Inf")
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("plant", ["v_nan", "v_signs"] + (["v_inf"] if SWEEP else []))
def test_causal_forward_keeps_absent_values_out(tiles, plant):
    _, mod = build(causal(tiles), "h200")
    q, k, v = planted(plant)
    o_want, lse_want = oracle(q, k, v)
    assert np.isnan(o_want).any() and np.isfinite(o_want[0, 0, :128]).all()  # rows that see the key get it
    o, lse = mod.ca(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)), interpret=True)
    close(o, o_want, "o")
    close(lse, lse_want, "lse")


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("plant", ["v_nan"] + (["v_inf", "v_signs"] if SWEEP else []))
def test_causal_gradients_keep_absent_values_out(tiles, plant):
    """dq of rows 128..199 (their diagonal block partial, key 200 absent for them) finite,
    as `jax.vjp` of the math has them; rows that see key 200 NaN."""
    _, mod = build(causal(tiles), "h200")
    q, k, v = planted(plant)
    rng = np.random.default_rng(1)
    g_o, g_lse = bf16(rng.standard_normal(q.shape)), bf16(rng.standard_normal(q.shape[:3]))
    args = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)]
    got = jax.vjp(lambda q, k, v: mod.ca(q, k, v, interpret=True), *args)[1]((jnp.asarray(g_o, jnp.bfloat16), jnp.asarray(g_lse)))
    want = jax.vjp(math, *(jnp.asarray(a) for a in (q, k, v)))[1]((jnp.asarray(g_o), jnp.asarray(g_lse)))
    assert np.isfinite(np.asarray(want[0])[0, 0, :200]).all() and np.isnan(np.asarray(want[0])[0, 0, 200:]).any()
    for name, a, b in zip("qkv", got, want):
        close(np.asarray(a.astype(jnp.float32)), b, f"d{name}", tol=6e-2)


@pytest.mark.parametrize("window,value", [(False, np.nan), (True, np.inf)] + ([(False, np.inf), (True, np.nan)] if SWEEP else []))
def test_paged_decode_keeps_unwritten_slots_out(window, value):
    """The h200 module: NaN or Inf in the unwritten slots of each sequence's last page (past
    `lens`), and with a window in the slots before it, in both caches."""
    cond = f"j < lens[b] and j >= lens[b] - {WINDOW}" if window else "j < lens[b]"
    _, mod = build(PAGED.replace("CONDITION", cond), "h200")
    q, kc, vc, pages, lens = paged_case(window, value)
    args = [jnp.asarray(a, jnp.bfloat16) for a in (q, kc, vc)] + [pages, lens]
    got = np.asarray(mod.pd(*args, interpret=True), np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, paged_oracle(q, kc, vc, pages, lens, window), atol=2e-2, rtol=2e-2)
