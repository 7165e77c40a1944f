"""What lies past the end of a ragged stored block is absent, in `reference` as in the kernel
(issue 44, the fresh planted bugs: `reference-cut-one-past`).

A coo input's last blocks along a ragged dimension hold memory past the array's end; the
caller may leave anything there. Here it is NaN, right at the end (the first element past
it) and beyond, so that keeping even one element too many reaches a result: the other
factor is zero-padded there, and 0 * NaN is NaN. The kernel masks its tails; `reference`
cuts the stored blocks (`_cut_blocks`). Both must equal the numpy oracle, which scatters
the blocks into a dense array and slices it to the shape.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_matches, build
from oracle import oracle

RAGGED_COO = """
kernel fresh_ragged_coo {
    in  x: f32[M, K] coo
    in  y: f32[K, N]
    out o: f32[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 8, k = 128, n = 128
}
"""
M, K, N = 12, 130, 128  # two row blocks (the last with 4 rows), two k blocks (the last with 2)


def _args():
    rng = np.random.default_rng(7)
    coords = [(0, 0), (0, 1), (1, 0), (1, 1)]
    blocks = rng.integers(-3, 4, (len(coords), 8, 128)).astype(np.float32)
    for b, (i, j) in enumerate(coords):
        if i == 1:
            blocks[b, M - 8:, :] = np.nan  # rows M.. of the last row block
        if j == 1:
            blocks[b, :, K - 128:] = np.nan  # columns K.. of the last k block
    rows = np.array([c[0] for c in coords], np.int32)
    cols = np.array([c[1] for c in coords], np.int32)
    y = rng.integers(-3, 4, (K, N)).astype(np.float32)
    return [blocks, rows, cols, y]


@pytest.mark.parametrize("interpret", ["cpu", "sim"], indirect=True)
def test_nan_past_a_ragged_end_of_stored_blocks_is_absent(interpret):
    kernel, mod = build(RAGGED_COO)
    args = _args()
    want = oracle(kernel, args, {"M": M})
    ref = mod.reference(*args, M=M)
    assert np.isfinite(np.asarray(ref)).all(), "reference kept an element past the end of a stored block"
    assert_matches(kernel, ref, want)
    assert_matches(kernel, mod.fresh_ragged_coo(*args, M=M, interpret=interpret), want)


# A factor read at an offset (`x[s[0] + i, d]`): the offset is given in elements, aligned
# to the tile, and kept in blocks (`_check_offsets`); `reference` must slice at the element
# (blocks times the tile: `reference-offset-no-tile`). An offset of 0 hides the difference.
OFFSET_READ = """
kernel fresh_offset_read {
    in  x: f32[L, D]
    in  s: index[2]
    out o: f32[M, D]
    o[i, d] = x[s[1] + i, d]
    tile i = 8, d = 128
}
"""


@pytest.mark.parametrize("interpret", ["cpu", "sim"], indirect=True)
@pytest.mark.parametrize("start", [8, 24])
def test_a_factor_read_at_an_offset_starts_there(start, interpret):
    kernel, mod = build(OFFSET_READ)
    x = np.random.default_rng(start).integers(-3, 4, (40, 128)).astype(np.float32)
    s = np.array([0, start], np.int32)
    want = x[start:start + 16]
    np.testing.assert_array_equal(np.asarray(mod.reference(x, s, M=16)), want)
    np.testing.assert_array_equal(np.asarray(mod.fresh_offset_read(x, s, M=16, interpret=interpret)), want)
