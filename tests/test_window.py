"""Offsets on the left side (`o[at[0] + m, at[1] + n] = ...`): the statement writes its
window of the output, the rest is zeros; against the oracle in both interpreters."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_matches, build, in_both_modes
from oracle import oracle

from sparsegen.testing import example_args

LITERAL = """
kernel window_sum {
    in  x: f32[256, 384]
    in  y: f32[384, 128]
    in  at: index[2]
    out o: f32[512, 384]
    o[at[0] + m, at[1] + n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}
"""

SYMBOLIC = {
    "sum": """
kernel window_sym {
    in  x: f32[M, K]
    in  y: f32[K, N]
    in  at: index[2]
    out o: f32[P, Q]
    o[at[0] + m, at[1] + n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}
""",
    "copy": """
kernel window_copy {
    in  g: f32[M, N]
    in  at: index[2]
    out o: f32[P, Q]
    o[at[0] + m, at[1] + n] = g[m, n]
    tile m = 128, n = 128
}
""",
}


# Three draws in the CPU interpreter, one in the simulator (three under SPARSEGEN_SWEEP=1).
@pytest.mark.parametrize(*in_both_modes([0, 1, 2], [0], "seed"), indirect=["interpret"])
def test_window_with_literal_sizes(seed, interpret):
    kernel, mod = build(LITERAL)
    args, keywords = example_args(kernel, {}, "random", np.random.default_rng(seed))
    expected = oracle(kernel, args, keywords)
    out = mod.window_sum(*args, **keywords, interpret=interpret)
    assert_matches(kernel, out, expected)
    assert_matches(kernel, mod.reference(*args, **keywords), expected)
    # Outside the window: zeros.
    r, c = (int(v) for v in args[2])
    outside = np.array(out, np.float64)
    outside[r : r + 256, c : c + 128] = 0
    assert not outside.any()


@pytest.mark.parametrize("which", sorted(SYMBOLIC))
def test_window_with_symbolic_sizes(which):
    kernel, mod = build(SYMBOLIC[which])
    args, keywords = example_args(kernel, dict(M=256, K=384, N=128, P=512, Q=384), "random", np.random.default_rng(0))
    out = getattr(mod, kernel.name)(*args, **keywords, interpret=True)
    assert_matches(kernel, out, oracle(kernel, args, keywords))
