"""Transposed operands in every walk: a read whose subscripts run against its dimensions
(`x[k, m]` of `x: [K, M]`, `y[n, k]`, `keep[n, m]`) must fetch block (k, m), not (m, k).

Grids are not square (M, K and N have 2, 3 and 4 blocks, or tiles differ), so swapped
index-map coordinates read the wrong block or leave the array (the TPU simulator raises),
and `reference` reading a transposed operand untransposed gets a wrong shape or wrong
values: both are compared with the independent numpy oracle.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from conftest import assert_matches, build, in_both_modes
from oracle import oracle

from sparsegen.testing import example_args

SIZES = dict(M=256, K=384, N=512)

# walk -> spec with transposed operands
SPECS = {
    "dense": """
kernel t_dense {
    in  x: f32[K, M]
    in  y: f32[N, K]
    out o: f32[M, N]
    o[m, n] = x[k, m] * y[n, k]
    tile m = 128, n = 256, k = 128
}
""",
    "coo_input_x": """
kernel t_dsd {
    in  x: bf16[K, M] coo
    in  y: bf16[N, K]
    out o: bf16[M, N]
    o[m, n] = x[k, m] * y[n, k]
    tile m = 128, n = 256, k = 128
}
""",
    "coo_input_y": """
kernel t_dds {
    in  x: bf16[K, M]
    in  y: bf16[N, K] coo
    out o: bf16[M, N]
    o[m, n] = x[k, m] * y[n, k]
    tile m = 128, n = 256, k = 128
}
""",
    "mask": """
kernel t_masked {
    in  x: f32[K, M]
    in  y: f32[N, K]
    in  keep: i32[N, M] mask
    out o: f32[M, N]
    o[m, n] = keep[n, m] * x[k, m] * y[n, k]
    tile m = 128, n = 128, k = 128
}
""",
    "mask_on_summed_factor": """
kernel t_xmask {
    in  x: f32[K, M] mask
    in  y: f32[N, K]
    out o: f32[M, N]
    o[m, n] = x[k, m] * y[n, k]
    tile m = 128, n = 256, k = 128
}
""",
    "coo_output": """
kernel t_sdd {
    in  x: f32[K, M]
    in  y: f32[N, K]
    out o: f32[M, N] coo
    o[m, n] = x[k, m] * y[n, k]
    tile m = 128, n = 128, k = 128
}
""",
    "masked_coo_output": """
kernel t_msdd {
    in  x: bf16[K, M]
    in  y: bf16[N, K]
    in  keep: i32[N, M] mask
    out o: f32[M, N] coo
    o[m, n] = keep[n, m] * x[k, m] * y[n, k]
    tile m = 128, n = 128, k = 128
}
""",
}

PATTERNS = ("random", "empty_lines", "duplicates")


# Every walk on the random pattern in the simulator (which raises on a read that leaves the
# array), on the others in the CPU interpreter; every pair in both under SPARSEGEN_SWEEP=1.
@pytest.mark.parametrize(*in_both_modes([(w, p) for w in sorted(SPECS) for p in PATTERNS], lambda case: case[1] == "random",
                                        "walk,pattern", alone=True), indirect=["interpret"])
def test_transposed_operands(walk, pattern, interpret):
    kernel, mod = build(SPECS[walk])
    rng = np.random.default_rng(zlib.crc32(f"{walk}{pattern}".encode()))
    args, keywords = example_args(kernel, SIZES, pattern, rng)
    out = getattr(mod, kernel.name)(*args, **keywords, interpret=interpret)
    assert_matches(kernel, out, oracle(kernel, args, keywords))


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(
    "walk", sorted(SPECS)
)
def test_reference_reads_transposed_operands(walk, pattern):
    kernel, mod = build(SPECS[walk])
    rng = np.random.default_rng(zlib.crc32(f"{walk}{pattern}".encode()))
    args, keywords = example_args(kernel, SIZES, pattern, rng)
    assert_matches(kernel, mod.reference(*args, **keywords), oracle(kernel, args, keywords))


def test_the_transposed_specs_really_are_transposed():
    """Guard against the specs drifting into the untransposed form: at least one 2-D input
    read per spec runs its subscripts against the matmul chain (m, k, n)."""
    for walk, text in SPECS.items():
        kernel, _ = build(text)
        (st,) = kernel.statements
        chain = (st.out_indices[0], *st.summed, *st.out_indices[1:])
        transposed = [
            r.operand
            for r in st.factors
            if len(r.indices) == 2 and chain.index(r.indices[0]) > chain.index(r.indices[1])
        ]
        assert transposed, walk
    assert len(set(SIZES.values())) == len(SIZES)  # not a square problem
