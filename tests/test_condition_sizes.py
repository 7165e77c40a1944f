"""A size that no operand has, named in a condition (the prefix length of a prefix-LM), is a
keyword of the generated kernel, like `M=` (issue 22, item 9)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_matches, build

PREFIX_LM = """kernel prefix_lm {
    in  q: f32[S, D]
    in  k: f32[S, D]
    in  v: f32[S, D]
    out o: f32[S, D]

    s[i, j] = q[i, d] * k[j, d] * 0.125 where j < P or i >= j
    o[i, e] = softmax(s[i, j], j) * v[j, e]

    tile i = 128, j = 128, d = 64, e = 64
}
"""


def inputs(n=384):
    rng = np.random.default_rng(1)
    return tuple(rng.standard_normal((n, 64), dtype=np.float32) for _ in range(3))


def test_the_size_is_a_keyword_of_the_kernel_and_reference():
    kernel, mod = build(PREFIX_LM)
    assert ("P", None) in kernel.symbols
    q, k, v = inputs()
    with pytest.raises(ValueError, match=r"size P .*P=\.\.\."):
        mod.prefix_lm(q, k, v, interpret=True)
    with pytest.raises(ValueError, match="size P must be an integer"):
        mod.reference(q, k, v, P=1.5)


@pytest.mark.parametrize("prefix", [1, 127, 128, 200, 384])
def test_kernel_matches_reference_and_the_mask(prefix):
    kernel, mod = build(PREFIX_LM)
    q, k, v = inputs()
    out, ref = mod.prefix_lm(q, k, v, P=prefix, interpret=True), mod.reference(q, k, v, P=prefix)
    assert_matches(kernel, out, ref)
    n = q.shape[0]
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    present = (j < prefix) | (i >= j)
    scores = np.where(present, (q.astype(np.float64) @ k.T.astype(np.float64)) * 0.125, -np.inf)
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    np.testing.assert_allclose(np.asarray(ref), (probs / probs.sum(axis=1, keepdims=True)) @ v, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prefix", [1, 128, 200])
def test_the_classification_uses_the_size(prefix):
    """No block the kernel skips holds a present element, none it calls full an absent one."""
    _, mod = build(PREFIX_LM)
    q, k, v = inputs()
    kinds = np.asarray(mod.block_kinds(q, k, v, P=prefix))
    n, t = q.shape[0], 128
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    present = ((j < prefix) | (i >= j)).reshape(n // t, t, n // t, t).transpose(0, 2, 1, 3)
    assert not (present.any(axis=(2, 3)) & (kinds == 0)).any()
    assert not (~present.all(axis=(2, 3)) & (kinds == 2)).any()
    # The prefix's key blocks are visited above the diagonal too: exactly the non-empty ones.
    assert ((kinds != 0) == present.any(axis=(2, 3))).all()


def test_kernel_in_the_simulator_and_its_gradient(interpret):
    """The keyword size in both interpreters, values and jax.grad against `reference`'s."""
    import jax
    import jax.numpy as jnp

    kernel, mod = build(PREFIX_LM)
    q, k, v = inputs(256)
    assert_matches(kernel, mod.prefix_lm(q, k, v, P=200, interpret=interpret), mod.reference(q, k, v, P=200))
    got = jax.grad(lambda q: jnp.sum(mod.prefix_lm(q, k, v, P=200, interpret=interpret) ** 2))(q)
    want = jax.grad(lambda q: jnp.sum(mod.reference(q, k, v, P=200) ** 2))(q)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_compiles_for_tpu_forward_and_backward():
    import jax
    import jax.numpy as jnp
    from aot import compile_for

    _, mod = build(PREFIX_LM)
    args = [np.zeros((1024, 64), np.float32)] * 3
    assert compile_for(lambda q, k, v: mod.prefix_lm(q, k, v, P=300), args, "v5e:2x2") is not None
    grad = jax.grad(lambda q, k, v: jnp.sum(mod.prefix_lm(q, k, v, P=300)), argnums=(0, 1, 2))
    assert compile_for(grad, args, "v5e:2x2") is not None
