"""Scores read from stored operands (issue 22, item 13): a masked softmax of logits the
caller has, a plain row maximum, and variants (batch and head indices in front, ragged
sizes, a mask operand, logsumexp and sum, a softmax product), against the float64 numpy
oracle and the module's `reference`, in the CPU interpreter and the TPU simulator;
gradients against JAX's gradient of `reference`; AOT compiles for v5e."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import run
from conftest import build, spec_text

F32 = dict(rtol=2e-5, atol=2e-5)


def rand(rng, shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def outputs(out):
    return out if isinstance(out, tuple) else (out,)


def check(kernel, mod, args, sizes, interpret):
    """The kernel against the oracle and against `reference`; returns its outputs."""
    got = outputs(getattr(mod, kernel.name)(*args, interpret=interpret))
    want = run(kernel, [np.asarray(a) for a in args], sizes)
    ref = outputs(mod.reference(*args))
    for op, g, w, r in zip(kernel.outputs, got, want, ref):
        g = np.asarray(g, np.float64)
        assert g.shape == w.shape, op.name
        np.testing.assert_allclose(g, w, err_msg=op.name, **F32)
        np.testing.assert_allclose(np.asarray(r, np.float64), w, err_msg=op.name, **F32)
    return got


def gradients(fn, args, n_float):
    def loss(*xs):
        total = 0.0
        for n, o in enumerate(outputs(fn(*xs, *args[n_float:]))):
            w = jnp.asarray(np.random.default_rng(n).standard_normal(o.shape).astype(np.float32))
            total = total + jnp.sum(jnp.where(jnp.isfinite(o), o, 0.0) * w)
        return total

    return jax.grad(loss, argnums=tuple(range(n_float)))(*args[:n_float])


def test_masked_softmax_example(interpret):
    """The spec of specs/: p is the causal softmax of x (zeros above the diagonal), r each
    row's maximum over every key; S and T ragged."""
    kernel, mod = build(spec_text("masked_softmax"))
    rng = np.random.default_rng(0)
    S, T = 300, 260
    x = rand(rng, (S, T))
    p, r = check(kernel, mod, [x], {"S": S, "T": T}, interpret)
    xs = np.asarray(x, np.float64)
    np.testing.assert_array_equal(np.asarray(r), np.asarray(x).max(axis=1))
    assert not np.triu(np.asarray(p)[:T, :T], 1).any()  # above the diagonal: absent, zeros
    np.testing.assert_allclose(np.asarray(p).sum(axis=1), 1.0, rtol=1e-5)
    lower = np.where(np.arange(S)[:, None] >= np.arange(T)[None, :], xs, -np.inf)
    e = np.exp(lower - lower.max(axis=1, keepdims=True))
    np.testing.assert_allclose(np.asarray(p), e / e.sum(axis=1, keepdims=True), **F32)


def test_masked_softmax_gradient_is_refused_by_name():
    kernel, mod = build(spec_text("masked_softmax"))
    x = rand(np.random.default_rng(1), (256, 256))
    with pytest.raises(NotImplementedError, match=r"reduce different scores \('lower', 'x'\)"):
        jax.grad(lambda x: jnp.sum(mod.masked_softmax(x, interpret=True)[0]))(x)


def test_row_max_alone():
    """`r[i] = max(x[i, j], j)`: a plain row maximum, every block full but the ragged tail."""
    kernel, mod = build("""kernel row_max {
    in  x: f32[S, T]
    out r: f32[S]
    r[i] = max(x[i, j], j)
    tile i = 128, j = 128
}
""")
    x = rand(np.random.default_rng(2), (200, 300)) - 50.0  # all negative: the ragged tail must not give 0
    (r,) = check(kernel, mod, [x], {"S": 200, "T": 300}, True)
    np.testing.assert_array_equal(np.asarray(r), np.asarray(x).max(axis=1))
    assert np.asarray(mod.block_kinds(x)).tolist() == [[2, 2, 1], [1, 1, 1]]


VARIANTS = {
    # Batch and head indices in front; queries at the end of a longer key sequence (a size
    # in the condition); logsumexp and sum of scaled logits.
    "heads": ("""kernel heads {
    in  x: f32[B, H, S, T]
    out lse: f32[B, H, S]
    out total: f32[B, H, S]
    s[b, h, i, j] = x[b, h, i, j] * 0.5 where i + T - S >= j
    lse[b, h, i] = logsumexp(s[b, h, i, j], j)
    total[b, h, i] = sum(s[b, h, i, j], j)
    tile b = 1, h = 1, i = 128, j = 128
}
""", lambda rng: [rand(rng, (2, 2, 200, 330))], {"B": 2, "H": 2, "S": 200, "T": 330}),
    # A mask operand as the condition (traced classification), a stored softmax and an
    # elementwise chain after the read.
    "mask": ("""kernel masked_logits {
    in  x: f32[S, T]
    in  keep: i8[S, T] mask
    out p: f32[S, T]
    out lse: f32[S]
    capped[i, j] = 30.0 * tanh(x[i, j] / 30.0) where keep[i, j]
    p[i, j] = softmax(capped[i, j], j)
    lse[i] = logsumexp(capped[i, j], j)
    tile i = 128, j = 128
}
""", None, {"S": 384, "T": 256}),
    # A per-key bias on stored logits, a softmax product: the values' and the bias'
    # gradients over the key-side walk, the logits' per block.
    "product": ("""kernel logits_times_v {
    in  x: f32[H, S, T]
    in  bias: f32[H, T]
    in  v: f32[H, T, E]
    out o: f32[H, S, E]
    s[h, i, j] = x[h, i, j] + bias[h, j] where i >= j and i - j < 255
    o[h, i, e] = softmax(s[h, i, j], j) * v[h, j, e]
    tile h = 1, i = 128, j = 128, e = 128
}
""", lambda rng: [rand(rng, (2, 300, 300)), rand(rng, (2, 300)), rand(rng, (2, 300, 128))], {"H": 2, "S": 300, "T": 300, "E": 128}),
}


def mask_args(rng):
    blocks = rng.random((3, 2)) < 0.6
    blocks[1] = False  # a row block with nothing present: zeros and minus infinity
    keep = np.repeat(np.repeat(blocks, 128, 0), 128, 1) & (rng.random((384, 256)) < 0.7)
    return [rand(rng, (384, 256)) * 10.0, jnp.asarray(keep.astype(np.int8))]


@pytest.mark.parametrize("which", sorted(VARIANTS))
def test_variant(which, interpret):
    text, make, sizes = VARIANTS[which]
    kernel, mod = build(text)
    rng = np.random.default_rng(3)
    args = make(rng) if make else mask_args(rng)
    got = check(kernel, mod, args, sizes, interpret)
    if which == "mask":
        assert np.isneginf(np.asarray(got[1])[128:256]).all() and not np.asarray(got[0])[128:256].any()
        return  # a stored softmax: its gradient is not derived (checked below)
    n_float = len([a for a in args if a.dtype == jnp.float32])
    fn = getattr(mod, kernel.name)
    got_g = gradients(lambda *a: fn(*a, interpret=interpret), args, n_float)
    want_g = gradients(mod.reference, args, n_float)
    for g, w in zip(got_g, want_g):
        assert not np.isnan(np.asarray(g)).any()
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(w).max())))


def test_stored_softmax_gradient_is_refused():
    """Through the stored softmax `p` (output 0) the gradient is refused; through `lse` alone
    it is derived (p's cotangent is a symbolic zero) and equals `reference`'s."""
    kernel, mod = build(VARIANTS["mask"][0])
    args = mask_args(np.random.default_rng(4))
    with pytest.raises(NotImplementedError, match="stored softmax"):
        jax.grad(lambda x: jnp.sum(mod.masked_logits(x, args[1], interpret=True)[0]))(args[0])

    def lse_loss(fn):
        lse = fn(jnp.asarray(args[0]), args[1])[1]
        return jnp.sum(jnp.where(jnp.isneginf(lse), 0.0, lse))  # rows with nothing present: -inf

    got = jax.grad(lambda x: lse_loss(lambda *a: mod.masked_logits(x, a[1], interpret=True)))(args[0])
    want = jax.grad(lambda x: lse_loss(lambda *a: mod.reference(x, a[1])))(args[0])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_empty_blocks_are_not_computed():
    """The forward walk of a stored score visits only the non-empty blocks: NaN in x where
    no row can see it (an empty block) does not reach any output."""
    kernel, mod = build(VARIANTS["heads"][0])
    x = np.array(rand(np.random.default_rng(5), (2, 2, 256, 256)))
    x[:, :, :128, 128:] = np.nan  # above the diagonal, block-aligned: every such block empty
    lse, total = mod.heads(jnp.asarray(x), interpret=True)
    assert np.isfinite(np.asarray(lse)).all() and np.isfinite(np.asarray(total)).all()
    kinds = np.asarray(mod.block_kinds(jnp.asarray(x)))
    assert kinds.tolist() == [[1, 0], [2, 1]]


@pytest.mark.parametrize("name", ["masked_softmax", "heads"])
def test_compiles_for_v5e(name):
    """Forward (and, where derived, the backward) through libtpu for v5e."""
    from aot import compile_for

    if name == "masked_softmax":
        kernel, mod = build(spec_text(name))
        compiled = compile_for(lambda x: mod.masked_softmax(x), [np.zeros((1024, 1024), np.float32)], "v5e:2x2")
        assert compiled.as_text().count("tpu_custom_call") >= 2  # the statistics, then every block
    else:
        kernel, mod = build(VARIANTS[name][0])
        compiled = compile_for(lambda x: gradients(mod.heads, [x], 1), [np.zeros((1, 2, 512, 640), np.float32)], "v5e:2x2")
        assert compiled.as_text().count("tpu_custom_call") >= 2  # forward, gradient
