"""int8 factors on GPUs (issue 21, item 3): Hopper's WGMMA multiplies s8 tiles into an s32
accumulator, and Mosaic GPU lowers it (K-major tiles only, as tf32: a matrix stored the
other way is copied transposed; no 32-byte swizzle). `accumulate i32`, outputs i32 (or a
float, rounded once). Exact in the Mosaic GPU interpreter, dense and coo, ragged sizes,
split over CTAs; lowered under an abstract H200 and compiled by ptxas where the plugin's
environment is (`make gpu-venv`); what is not lowered says so at the spec.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import build
from test_gpu import refused

from sparsegen.compiler import lower_source
from sparsegen.source import SourceFile
from sparsegen.testing import example_args

DENSE = """kernel int8_mm {
    in  x: i8[M, K]
    in  y: i8[K, N]
    out o: i32[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
    accumulate i32
}"""

# x's stored blocks walked by rows; y read K-major as B: (n, k), a transposed copy.
COO = """kernel int8_dsd {
    in  x: i8[M, K] coo
    in  y: i8[K, N]
    out o: i32[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
    accumulate i32
}"""


def integers(rng, shape):
    return rng.integers(-128, 128, shape).astype(np.int8)


def test_dense_int8_is_exact_with_ragged_sizes():
    kernel, mod = build(DENSE, "h200")
    rng = np.random.default_rng(0)
    x, y = integers(rng, (200, 300)), integers(rng, (300, 136))
    got = np.asarray(mod.int8_mm(x, y, interpret=True))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, x.astype(np.int64) @ y.astype(np.int64))


def test_coo_int8_is_exact():
    kernel, mod = build(COO, "h200")
    args, keywords = example_args(kernel, dict(M=384, K=512, N=256), "random", np.random.default_rng(1))
    got = np.asarray(mod.int8_dsd(*args, **keywords, interpret=True))
    np.testing.assert_array_equal(got, np.asarray(mod.reference(*args, **keywords)))
    assert np.abs(got).max() > 127  # sums past what an i8 holds: accumulated in s32


def test_lowered_and_compiled_for_an_h200():
    from sparsegen.verify import verify_gpu_modules

    items = []
    for text in (DENSE, COO):
        source = SourceFile("int8.spk", text)
        items += [(m, source, "h200") for m in lower_source(source, "h200")]
    results = verify_gpu_modules(items)
    for r in results:
        assert r.lowered, r.raw_error
        assert r.smem_used == r.smem_estimate, (r.kernel, r.smem_used, r.smem_estimate)
    if results[0].compiled is None:
        pytest.skip(f"stage 3 (ptxas for sm_90a) not run: {results[0].stage3}")
    for r in results:
        assert r.compiled and r.spill_bytes == 0, (r.kernel, r.registers, r.spill_bytes)


@pytest.mark.parametrize("change,message", [
    (("accumulate i32", "accumulate f32"), "accumulate f32: WGMMA accumulates i8 products in i32"),
    (("tile m = 128, n = 128, k = 128", "tile m = 128, n = 128, k = 32"), "s8 takes no 32-byte swizzle"),
    (("o[m, n] = x[m, k] * y[k, n]", "o[m, n] = x[m, k] * y[k, n] * 2"), "a constant factor on an i8 product"),
    (("out o: i32[M, N]", "out o: i16[M, N]"), "or i32 for i8 factors"),
])  # fmt: skip
def test_what_is_not_lowered_says_so(change, message):
    rendered = refused(DENSE.replace(*change))
    assert message in rendered and "error:" in rendered
