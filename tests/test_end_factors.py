"""A factor without the summed index (applied once, after the sum) in walks that skip
summed steps: it must be read at the output block being flushed.

When the last summed step of an output block is skipped (an empty block of a mask on a
summed factor, or no stored block of a coo input there), the skipped step's index maps
follow the next step that computes; an end factor read at the flush must not.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_matches, both_modes, build
from oracle import oracle


SPECS = {
    # walk: (x's sparsity, o's sparsity, a block-kind walk where the fetch-ahead once misread s)
    "coo_input": (" coo", "", False),
    "mask_on_summed_factor": (" mask", "", True),
    "mask_on_summed_factor_coo_output": (" mask", " coo", True),
    "coo_join": (" coo", " coo", True),
}


def spec(xs, outs):
    return f"""
kernel endf {{
    in  x: f32[M, K]{xs}
    in  y: f32[K, N]
    in  s: f32[M, N]
    out o: f32[M, N]{outs}
    o[m, n] = s[m, n] * x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}}
"""


def diagonal_args(kernel, xs, outs, rng):
    """x has blocks (0, 0) and (1, 1) only: output row 0's last summed step (k = 1) is empty."""
    M, K, N = 256, 256, 128
    y = rng.standard_normal((K, N)).astype(np.float32)
    s = rng.standard_normal((M, N)).astype(np.float32)
    if xs == " coo":
        xa = [
            rng.standard_normal((2, 128, 128)).astype(np.float32),
            np.array([0, 1], np.int32),
            np.array([0, 1], np.int32),
        ]
    else:
        x = rng.standard_normal((M, K)).astype(np.float32)
        x[:128, 128:] = 0
        x[128:, :128] = 0
        xa = [x]
    args = xa + [y, s] + ([np.array([0, 1], np.int32), np.array([0, 0], np.int32)] if outs else [])
    return args, (dict(M=M) if xs == " coo" else {})


@pytest.mark.parametrize(
    "walk",
    [
        w
        for w in SPECS
    ],
)
@both_modes  # this file's walks in the CPU interpreter too
def test_end_factor_is_read_at_the_flushed_block(walk, interpret):
    xs, outs, _ = SPECS[walk]
    kernel, mod = build(spec(xs, outs))
    args, keywords = diagonal_args(kernel, xs, outs, np.random.default_rng(0))
    expected = oracle(kernel, args, keywords)
    assert_matches(kernel, mod.reference(*args, **keywords), expected)
    assert_matches(kernel, mod.endf(*args, **keywords, interpret=interpret), expected)
