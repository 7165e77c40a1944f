"""Attention-like kernels at the edges the planted bugs of issue 22 live on: bounds one less
than a multiple of the tile (and the multiple itself), a key-side walk longer than the
forward one under `max_steps`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import brute_kinds
from conftest import build
from test_attention import assert_gradients_match, check_outputs, condition_spec, gradients, rand, sizes_of

from sparsegen.schedule.attention import row_plan

# Bounds where a block's extreme value of the form lies (tiles of 128: i - j spans
# 128 n - 127 ... 128 n + 127 over a block), and one past it: a strict bound read as
# non-strict (or the reverse) moves a block between full and partial, or partial and
# empty, exactly there.
BOUNDARY = [
    "i >= j and i - j < 255",
    "i >= j and i - j < 256",
    "i >= j and i - j <= 255",
    "i >= j and i - j <= 256",
    "j - i > 127",
    "j - i >= 128",
    "j - i > 128 or i - j > 255",
    "i - j < 127",
    "i < 255",
    "j > 255",
    "i - j == 255",
    "i - j > 129",
    "i - j >= 130",
]


@pytest.mark.parametrize("cond", BOUNDARY)
def test_classification_at_multiples_of_the_tile(cond):
    kernel, mod = build(condition_spec(cond))
    for S, T in ((640, 640), (700, 900)):
        args = [np.zeros((S, 128), np.float32), np.zeros((T, 128), np.float32), np.zeros((T, 128), np.float32)]
        got = np.asarray(mod.block_kinds(*args))
        want = brute_kinds(kernel, row_plan(kernel), args, {"S": S, "T": T, "D": 128})
        np.testing.assert_array_equal(got, want, err_msg=f"{cond} at S={S}, T={T}")


@pytest.mark.parametrize("cond", ["i >= j and i - j < 255", "i - j > 129"])
def test_kernel_at_multiples_of_the_tile(cond):
    """The kernel against the f64 oracle: a block taken as full computes its absent elements
    (small scores: a near-uniform softmax, where one element more shows)."""
    kernel, mod = build(condition_spec(cond))
    rng = np.random.default_rng(21)
    args = [rand(rng, (512, 128), jnp.float32) * 0.05] + [rand(rng, (512, 128), jnp.float32) for _ in range(2)]
    check_outputs(kernel, mod.cond_attention(*args, interpret=True), args, sizes_of(kernel, args))


def test_max_steps_covers_a_key_side_walk_longer_than_the_forward_one():
    """A mask where each row block attends one key block and no row attends three of the
    seven: the forward walk has 4 steps, the key-side walk (dk, dv) 7. `max_steps` is
    checked against both: 4 is refused on concrete operands (the gradient of k would be
    cut short), 7 gives the forward and every gradient of `reference`."""
    import jax

    kernel, mod = build(condition_spec("keep[i, j]", mask=True).replace("\n    in  seg: i32[S]", "").replace("\n    in  kseg: i32[T]", ""))
    rng = np.random.default_rng(22)
    S, T = 512, 896
    blocks = np.zeros((4, 7), bool)
    blocks[np.arange(4), [0, 2, 4, 6]] = True
    keep = np.repeat(np.repeat(blocks, 128, 0), 128, 1) & (rng.random((S, T)) < 0.7)
    args = [rand(rng, (S, 128), jnp.float32), rand(rng, (T, 128), jnp.float32), rand(rng, (T, 128), jnp.float32), jnp.asarray(keep.astype(np.int8))]
    kinds = np.asarray(mod.block_kinds(*args)).reshape(1, 4, 7)
    assert mod._row_walk(np, kinds)[1] == 4 and mod._row_walk(np, kinds.transpose(0, 2, 1))[1] == 7
    with pytest.raises(ValueError, match="below the 7 steps"):
        mod.cond_attention(*args, max_steps=4, interpret=True)
    check_outputs(kernel, mod.cond_attention(*args, max_steps=7, interpret=True), args, sizes_of(kernel, args))
    got = gradients(lambda *a: mod.cond_attention(*a, max_steps=7, interpret=True), args, 3)
    assert_gradients_match(got, gradients(mod.reference, args, 3), bf16=False)
    # Under jit the operands are traced: a walk cut short makes what it feeds NaN, never wrong.
    cut = jax.jit(lambda *a: gradients(lambda *x: mod.cond_attention(*x, max_steps=4, interpret=True), list(a), 3))(*args)
    assert np.isnan(np.asarray(cut[1])).all()


PER_HEAD_MASK = """kernel bh_attention {{
    in  q: f32[B, {H}, S, D]
    in  k: f32[B, {H}, T, D]
    in  v: f32[B, {H}, T, D]
    in  keep: i8[B, {H}, S, T] mask
    out o: f32[B, {H}, S, D]

    s[b, h, i, j] = q[b, h, i, d] * k[b, h, j, d] where keep[b, h, i, j]
    o[b, h, i, e] = softmax(s[b, h, i, j], j) * v[b, h, j, e]

    tile b = 1, h = 1, i = 128, j = 128, d = 128, e = 128
}}
"""


@pytest.mark.parametrize("heads", ["H", "3"])
def test_a_condition_over_two_lead_indices(interpret, heads):
    """The walk's tables hold a group of steps per (b, h): a step's entry is
    `(b * H + h) * steps + t`. It was written `(b) * H + h * steps + t` (a wrong entry: a
    silent wrong answer with H = 3, a NameError with a symbolic H, which the index maps were
    not passed)."""
    _, mod = build(PER_HEAD_MASK.format(H=heads))
    rng = np.random.default_rng(0)
    B, H, S, T = 2, 3, 256, 384
    q, k, v = (rng.standard_normal((B, H, n, 128)).astype(np.float32) for n in (S, T, T))
    blocks = rng.random((B, H, S // 128, T // 128)) < 0.6
    blocks[..., 0] = True
    keep = np.repeat(np.repeat(blocks, 128, 2), 128, 3).astype(np.int8)
    s = np.where(keep != 0, np.einsum("bhid,bhjd->bhij", q, k), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhij,bhje->bhie", p / p.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(np.asarray(mod.bh_attention(q, k, v, keep, interpret=interpret)), want, atol=2e-3, rtol=2e-3)
    if heads == "3":  # the backward's walks (dq over rows, dk/dv over keys) read the same slots
        args = [jnp.asarray(x) for x in (q, k, v, keep)]
        got = gradients(lambda *a: mod.bh_attention(*a, interpret=interpret), args, 3)
        assert_gradients_match(got, gradients(mod.reference, args, 3), bf16=False)
