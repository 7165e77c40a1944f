"""Absent terms never reach a result on the row walk and the paged walk (issue 37, item 4;
language v3, section 0): a NaN or Inf that a factor holds where the condition makes a term
absent (a causal key above the diagonal, a cache slot past `lens` or before a window) stays
out of the outputs, the logsumexp and the gradients of the present entries, in the kernel
(CPU interpreter and TPU simulator; the Mosaic GPU interpreter for GPU modules) and in
`reference`. Oracles: numpy in float64 term by term (absent terms replaced by 0 with
`np.where`), and `jax.grad` of plain jnp that selects every factor of a term before it
multiplies them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SWEEP, both_modes, build, spec_text, with_tiles

S, D = 256, 128
SCALE = 0.125
CAUSAL = f"""kernel ca {{
    in  q: f32[B, H, S, D]
    in  k: f32[B, H, S, D]
    in  v: f32[B, H, S, D]
    out o: f32[B, H, S, D]
    out lse: f32[B, H, S]
    s[b, h, i, j] = q[b, h, i, d] * k[b, h, j, d] * {SCALE} where i >= j
    o[b, h, i, e] = softmax(s[b, h, i, j], j) * v[b, h, j, e]
    lse[b, h, i] = logsumexp(s[b, h, i, j], j)
    tile b = 1, h = 1, i = 128, j = 128, d = 128, e = 128
}}
"""


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 1, S, D)).astype(np.float32) for _ in range(3)]


def causal_oracle(q, k, v):
    """o and lse term by term in float64: a row's softmax over its present keys (j <= i);
    an absent term (j > i) is replaced by 0 before the sum, whatever its factors hold."""
    q, k, v = (np.asarray(a, np.float64)[0, 0] for a in (q, k, v))
    present = np.arange(S)[:, None] >= np.arange(S)[None, :]
    with np.errstate(invalid="ignore", over="ignore"):
        terms = np.where(present[:, :, None], q[:, None, :] * k[None, :, :], 0.0)
        s = np.where(present, terms.sum(-1) * SCALE, -np.inf)
        m = s.max(-1, keepdims=True)
        w = np.where(present, np.exp(s - m), 0.0)
        total = w.sum(-1, keepdims=True)
        p = w / total
        o = np.where(present[:, :, None], p[:, :, None] * v[None, :, :], 0.0).sum(1)
        lse = (m + np.log(total))[:, 0]
    return o[None, None], lse[None, None]


def causal_math(q, k, v):
    """The same in plain jnp, every factor of a term selected before the products (so that
    `jax.grad` of it has no 0 x NaN either): the gradients' oracle."""
    present = jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]
    pm = present[None, None, :, :, None]
    qb = jnp.where(pm, q[:, :, :, None, :], 0.0)
    kb = jnp.where(pm, k[:, :, None, :, :], 0.0)
    s = jnp.where(present, jnp.sum(qb * kb, -1) * SCALE, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.sum(jnp.where(pm, p[..., None], 0.0) * jnp.where(pm, v[:, :, None, :, :], 0.0), axis=3)
    return o, jax.nn.logsumexp(s, axis=-1)


def close(got, want, what, rtol=2e-5, atol=2e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    # NaN and infinities where the math has them, the values elsewhere.
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN where the math has none, or none where it has")
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


PLANTS = {
    # A value row above the diagonal of the rows before it (the diagonal block 128..255
    # is partial): rows 0..199 must not see it.
    "v_nan": ("v", 200, np.nan),
    "v_inf": ("v", 200, np.inf),
    "k_nan": ("k", 200, np.nan),
    # A query row: its own outputs are NaN, the keys after it (absent for it) are not.
    "q_nan": ("q", 140, np.nan),
}


def planted(name):
    q, k, v = arrays()
    operand, row, value = PLANTS[name]
    a = {"q": q, "k": k, "v": v}[operand]
    a[0, 0, row, :: 3] = value
    return q, k, v


@both_modes
@pytest.mark.parametrize("plant", ["v_nan", "v_inf"] + (["k_nan", "q_nan"] if SWEEP else []))
def test_causal_attention_forward_keeps_absent_values_out(plant, interpret):
    _, mod = build(CAUSAL)
    q, k, v = planted(plant)
    o_want, lse_want = causal_oracle(q, k, v)
    o, lse = mod.ca(q, k, v, interpret=interpret)
    close(o, o_want, "o")
    close(lse, lse_want, "lse")
    if interpret is True:
        o_ref, lse_ref = mod.reference(q, k, v)
        close(o_ref, o_want, "reference o")
        close(lse_ref, lse_want, "reference lse")


@both_modes
@pytest.mark.parametrize("plant,walk", [("q_nan", "fused"), ("k_nan", "two")] + ([("k_nan", "fused"), ("q_nan", "two"), ("v_nan", "fused")] if SWEEP else []))
def test_causal_attention_gradients_keep_absent_terms_out(plant, walk, interpret, monkeypatch):
    _, mod = build(CAUSAL)
    if walk == "two":  # the backward's two walks (dq, then dk and dv) instead of the fused one
        monkeypatch.setattr(mod, "_FUSED_MAX_ROWS", 0)
    q, k, v = planted(plant)
    rng = np.random.default_rng(1)
    g_o = rng.standard_normal(q.shape).astype(np.float32)
    g_lse = rng.standard_normal(q.shape[:3]).astype(np.float32)
    got = jax.vjp(lambda q, k, v: mod.ca(q, k, v, interpret=interpret), q, k, v)[1]((g_o, g_lse))
    want = jax.vjp(causal_math, q, k, v)[1]((g_o, g_lse))
    for name, a, b in zip("qkv", got, want):
        close(a, b, f"d{name}", rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ the paged walk

PAGED = """kernel pd {
    in  q: bf16[B, H, D]
    in  kc: bf16[G, P, T, D]
    in  vc: bf16[G, P, T, D]
    in  pages: index[B, NP]
    in  lens: index[B]
    out o: bf16[B, H, D]
    s[b, h, j] = q[b, h, d] * kc[h // 8, pages[b, j // T], j % T, d] * 0.125 where CONDITION
    o[b, h, e] = softmax(s[b, h, j], j) * vc[h // 8, pages[b, j // T], j % T, e]
    tile b = 1, h = 8, j = 128, d = 128, e = 128
}
"""
WINDOW = 40  # keys lens - WINDOW <= j < lens


def paged_case(window: bool, value):
    """Two sequences whose last page is partly written (lengths 100 and 37, pages of 16):
    its unwritten slots hold `value` in both caches, and with `window` the slots before it too."""
    rng = np.random.default_rng(3)
    B, H, D, T, NP, P = 2, 8, 128, 16, 8, 20
    lens = np.array([100, 37], np.int32)
    q = rng.standard_normal((B, H, D)).astype(np.float32)
    kc = rng.standard_normal((1, P, T, D)).astype(np.float32)
    vc = rng.standard_normal((1, P, T, D)).astype(np.float32)
    pages = rng.permutation(P)[: B * NP].reshape(B, NP).astype(np.int32)
    for b, n in enumerate(lens):
        lo = n - WINDOW if window else 0
        for j in list(range(n, -(-n // T) * T)) + list(range(lo)):
            kc[0, pages[b, j // T], j % T, :: 5] = value
            vc[0, pages[b, j // T], j % T, :: 3] = value
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    return bf(q), bf(kc), bf(vc), pages, lens


def paged_oracle(q, kc, vc, pages, lens, window: bool):
    """Each sequence's heads over its present keys only, in float64."""
    out = np.zeros(q.shape)
    T = kc.shape[2]
    for b, n in enumerate(lens):
        toks = np.arange(max(n - WINDOW, 0) if window else 0, n)
        k = kc[0, pages[b, toks // T], toks % T].astype(np.float64)
        v = vc[0, pages[b, toks // T], toks % T].astype(np.float64)
        s = q[b].astype(np.float64) @ k.T * 0.125
        w = np.exp(s - s.max(-1, keepdims=True))
        out[b] = (w / w.sum(-1, keepdims=True)) @ v
    return out


@both_modes
@pytest.mark.parametrize("window,value", [(False, np.nan), (True, np.inf)] + ([(False, np.inf), (True, np.nan)] if SWEEP else []))
def test_paged_decode_keeps_unwritten_slots_out(window, value, interpret):
    cond = f"j < lens[b] and j >= lens[b] - {WINDOW}" if window else "j < lens[b]"
    _, mod = build(PAGED.replace("CONDITION", cond))
    q, kc, vc, pages, lens = paged_case(window, value)
    args = [jnp.asarray(a, jnp.bfloat16) for a in (q, kc, vc)] + [pages, lens]
    want = paged_oracle(q, kc, vc, pages, lens, window)
    got = np.asarray(mod.pd(*args, interpret=interpret), np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
    if interpret is True:
        np.testing.assert_allclose(np.asarray(mod.reference(*args), np.float64), want, atol=2e-2, rtol=2e-2)



# ------------------------------------- a score of minus infinity on a full block

BIASED = f"""kernel cb {{
    in  q: f32[B, H, S, D]
    in  k: f32[B, H, S, D]
    in  v: f32[B, H, S, D]
    in  bias: f32[H, S, S]
    out o: f32[B, H, S, D]
    raw[b, h, i, j] = q[b, h, i, d] * k[b, h, j, d] * {SCALE}
    s[b, h, i, j] = raw[b, h, i, j] + bias[h, i, j] where i >= j
    o[b, h, i, e] = softmax(s[b, h, i, j], j) * v[b, h, j, e]
    tile b = 1, h = 1, i = 128, j = 128, d = 128, e = 128
}}
"""
MASKED_KEY, NAN_KEY = 5, 130  # a key every row masks by its bias; a value row seen by rows >= 130


def biased_math(q, k, v, bias):
    """BIASED in plain jnp, a term present where i >= j and its score is not minus infinity,
    every factor of an absent term selected before the products (the gradients' oracle)."""
    present = (jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]) & ~jnp.isneginf(bias[0])
    pm = present[None, None, :, :, None]
    qb = jnp.where(pm, q[:, :, :, None, :], 0.0)
    kb = jnp.where(pm, k[:, :, None, :, :], 0.0)
    s = jnp.where(present, jnp.sum(qb * kb, -1) * SCALE + jnp.where(present, bias[0], 0.0), -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.sum(jnp.where(pm, p[..., None], 0.0) * jnp.where(pm, v[:, :, None, :, :], 0.0), axis=3)


@both_modes
@pytest.mark.parametrize("walk", ["fused", "two"] if SWEEP else ["fused"])
def test_a_key_masked_by_its_score_gets_no_gradient_from_a_nan_row(walk, interpret, monkeypatch):
    """An additive mask (`bias` minus infinity at key 5 for every row) makes key 5 absent on
    the full block (rows 128..255, keys 0..127), where no condition is evaluated: the
    elementwise chain's gradient there must be selected out, not just multiplied by the
    weight 0. Rows >= 130 see a NaN value row (key 130, present for them), so their
    statistics (delta = do . o) are NaN, and 0 x NaN would carry it into dk[5], which no
    present term reaches: it must stay exactly the oracle's (finite)."""
    _, mod = build(BIASED)
    if walk == "two":
        monkeypatch.setattr(mod, "_FUSED_MAX_ROWS", 0)
    q, k, v = arrays(2)
    bias = np.random.default_rng(3).standard_normal((1, S, S)).astype(np.float32)
    bias[0, :, MASKED_KEY] = -np.inf
    v[0, 0, NAN_KEY, ::3] = np.nan
    g_o = np.random.default_rng(4).standard_normal(q.shape).astype(np.float32)
    o, pull = jax.vjp(lambda q, k, v: mod.cb(q, k, v, bias, interpret=interpret), q, k, v)
    want_o, pull_want = jax.vjp(lambda q, k, v: biased_math(q, k, v, bias), q, k, v)
    close(o, want_o, "o")
    got, want = pull(g_o), pull_want(g_o)
    assert np.isfinite(np.asarray(want[1])[0, 0, MASKED_KEY]).all()  # the case is what it says
    for name, a, b in zip("qkv", got, want):
        close(a, b, f"d{name}", rtol=1e-4, atol=1e-4)


def biased_case(masked: bool, nan_key: int):
    """BIASED's operands: a NaN value row at `nan_key`, and with `masked` the bias minus
    infinity at MASKED_KEY for every row (an absent key on the full block of rows 128..255)."""
    q, k, v = arrays(2)
    bias = np.random.default_rng(3).standard_normal((1, S, S)).astype(np.float32)
    if masked:
        bias[0, :, MASKED_KEY] = -np.inf
    v[0, 0, nan_key, ::3] = np.nan
    return q, k, v, bias


@both_modes
def test_a_value_masked_by_its_score_on_a_full_block_stays_out(interpret):
    """A NaN value row at the key every row masks by its bias (minus infinity): its weight is
    0 on every row, so no row sees it. Rows 128..255 meet it on a full block (keys 0..127,
    no condition evaluated), where the step's product p @ v must still leave it out."""
    _, mod = build(BIASED)
    q, k, v, bias = biased_case(True, MASKED_KEY)
    want = biased_math(q, k, v, bias)
    assert np.isfinite(np.asarray(want)).all()  # the case is what it says
    close(mod.cb(q, k, v, bias, interpret=interpret), want, "o")
    if interpret is True:
        close(mod.reference(q, k, v, bias), want, "reference o")


@both_modes
@pytest.mark.parametrize("masked", [True, False])
def test_the_bias_gradient_is_zero_at_absent_elements_of_a_nan_row(masked, interpret):
    """Rows >= 130 see a NaN value row (key 130, present for them): their statistics are NaN,
    and so is the bias gradient at their present elements. At their absent ones (j > i by
    the condition; key 5 by its score with `masked`) the gradient is 0, not 0 x NaN; in
    `reference` too, whose rows < 130 must not meet the NaN row through the derivative of a
    product they leave it out of."""
    _, mod = build(BIASED)
    q, k, v, bias = biased_case(masked, NAN_KEY)
    g_o = np.random.default_rng(4).standard_normal(q.shape).astype(np.float32)
    (got,) = jax.vjp(lambda b: mod.cb(q, k, v, b, interpret=interpret), bias)[1](g_o)
    (want,) = jax.vjp(lambda b: biased_math(q, k, v, b), bias)[1](g_o)
    assert np.isfinite(np.asarray(want)[0, NAN_KEY, NAN_KEY + 1 :]).all() and np.isnan(np.asarray(want)[0, NAN_KEY, NAN_KEY])  # the case is what it says
    close(got, want, "dbias", rtol=1e-4, atol=1e-4)
    if interpret is True:
        (ref,) = jax.vjp(lambda b: mod.reference(q, k, v, b), bias)[1](g_o)
        close(ref, want, "reference dbias", rtol=1e-4, atol=1e-4)
