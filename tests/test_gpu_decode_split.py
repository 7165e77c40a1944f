"""Flash decoding on Mosaic GPU (issue 21): a paged walk's row block walks its keys in parts,
a CTA each, where the row blocks alone would leave SMs idle; the parts' outputs are merged
by their rows' logsumexps (`_merge_splits`). Values in the Mosaic GPU interpreter against
the float64 oracle of tests/test_paged.py; the kernel at verify's sizes (two parts: 64 row
blocks on 132 SMs) is lowered and compiled by tests/test_gpu_decode.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_gpu_decode import _close, _module
from test_paged import _cache, _oracle


def test_the_parts_fill_the_sms_once_and_walk_four_steps_or_more():
    kernel, mod = _module("paged_decode.spk")
    assert mod._SMS == 132  # the H200's
    assert mod._key_splits(64, 32) == 2  # verify's sizes: 8 x 64 heads, 4096 keys
    assert mod._key_splits(2, 11) == 2  # eleven steps: two parts of at least four
    assert mod._key_splits(1, 1000) == 132
    assert mod._key_splits(132, 1000) == 1 and mod._key_splits(200, 1000) == 1
    assert mod._key_splits(4, 3) == 1  # too few steps to share


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_key_parts_merge_to_the_softmax_over_every_key(splits):
    """Lengths 0, 5, 200 and the whole 384 keys (three steps of 128): with five parts of one
    step, some parts of a row block see nothing (minus infinity, weighed 0) and a length-0
    row stays 0; pages past the lengths hold NaN, never read."""
    kernel, mod = _module("paged_decode.spk")
    lens = [0, 5, 200, 384]
    q, kc, vc, pages, lens = _cache(np.random.default_rng(splits), len(lens), 8, 1, 128, 16, 24, 120, lens, poison=True)
    *args, sizes = mod._prepare(q, kc, vc, pages, lens, *(None for _ in mod._MESH_SIZES))
    got = mod._impl(*args, sizes, True, splits=splits)
    _close(got, _oracle(q, kc, vc, pages, lens))
    assert not np.asarray(got[0], np.float32).any()


def test_parts_with_logits_past_the_exponents_range_merge():
    """Scores near 1,000 (queries times 300): every part's logsumexp is past where f32's
    exp overflows (88), so the merge weighs the parts from their largest logsumexp
    (`_lse_weights`), not from 0: exp(1,000) would be infinite and every weight 0 or NaN."""
    kernel, mod = _module("paged_decode.spk")
    lens = [5, 200, 384]
    q, kc, vc, pages, lens = _cache(np.random.default_rng(7), len(lens), 8, 1, 128, 16, 24, 120, lens, poison=True)
    q = jnp.asarray(np.asarray(q, np.float32) * 300, jnp.bfloat16)
    *args, sizes = mod._prepare(q, kc, vc, pages, lens, *(None for _ in mod._MESH_SIZES))
    got = mod._impl(*args, sizes, True, splits=2)
    _close(got, _oracle(q, kc, vc, pages, lens))


def test_a_lone_sequence_is_split_by_default():
    """One sequence of 8 heads (a CTA alone) over 1024 keys: the module walks it in two parts
    (eight steps), and the public call matches the oracle."""
    kernel, mod = _module("paged_decode.spk")
    assert mod._key_splits(1, 8) == 2
    q, kc, vc, pages, lens = _cache(np.random.default_rng(3), 1, 8, 1, 128, 16, 64, 80, [1000], poison=True)
    _close(mod.paged_decode(q, kc, vc, pages, lens, interpret=True), _oracle(q, kc, vc, pages, lens))
