"""Integer kernels (i8, i16, u8, u16, u32 inputs, `accumulate i32`) in every walk: exact
equality with the numpy oracle in the CPU interpreter and the TPU simulator; what compiles
ahead of time for v5e and v6e; v4 (no int8 matmul) refuses 8-bit matmul factors at build."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from aot import compile_for
from aot import across_targets
from conftest import assert_matches, build, in_both_modes
from oracle import oracle

from sparsegen.compiler import compile_source
from sparsegen.source import SourceFile, SpecError
from sparsegen.testing import example_args, tolerance

SIZES = dict(M=256, K=384, N=256)

SPECS = {
    "dense_i8": """
kernel int_dense {
    in  x: i8[M, K]
    in  y: i8[K, N]
    out o: i32[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
    accumulate i32
}
""",
    "coo_input_i16": """
kernel int_dsd {
    in  x: i16[M, K] coo
    in  y: i16[K, N]
    out o: i16[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
    accumulate i32
}
""",
    "coo_input_u8": """
kernel int_dds {
    in  x: u8[M, K]
    in  y: u8[K, N] coo
    out o: i32[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
    accumulate i32
}
""",
    "mask_u32_i8": """
kernel int_masked {
    in  x: i8[M, K]
    in  y: i8[K, N]
    in  keep: u32[M, N] mask
    out o: i32[M, N]
    o[m, n] = keep[m, n] * x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
    accumulate i32
}
""",
    "mask_u32_u16": """
kernel int_masked16 {
    in  x: u16[M, K]
    in  y: u16[K, N]
    in  keep: u32[M, N] mask
    out o: i32[M, N]
    o[m, n] = keep[m, n] * x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
    accumulate i32
}
""",
    "mask_on_summed_i8": """
kernel int_xmask {
    in  x: i8[M, K] mask
    in  y: i8[K, N]
    out o: i32[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
    accumulate i32
}
""",
    "coo_output_i16": """
kernel int_sdd {
    in  x: i16[M, K]
    in  y: i16[K, N]
    out o: i32[M, N] coo
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
    accumulate i32
}
""",
    "dense_u32": """
kernel int_dense32 {
    in  x: u32[M, K]
    in  y: u32[K, N]
    out o: i32[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
    accumulate i32
}
""",
    "elementwise_u16_i16": """
kernel int_product {
    in  x: u16[M, N]
    in  y: i16[M, N] mask
    out o: i32[M, N]
    o[m, n] = x[m, n] * y[m, n] * 3
    tile m = 128, n = 128
    accumulate i32
}
""",
    "stored_u32": """
kernel int_stored {
    in  x: u32[M, K] coo
    out o: i32[M, K]
    o[m, k] = x[m, k]
    tile m = 128, k = 128
    accumulate i32
}
""",
}
# The MXU multiplies i8 blocks only: these matrix products are refused at build, at the operand.
REFUSED = {name: SPECS.pop(name) for name in ("coo_input_i16", "coo_input_u8", "mask_u32_u16", "coo_output_i16", "dense_u32")}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_integer_matmuls_the_mxu_cannot_take_are_refused_at_the_operand(name):
    with pytest.raises(SpecError, match="the TPU's matrix unit multiplies f32, bf16 or i8 blocks"):
        build(REFUSED[name])


# The random pattern in the simulator, empty lines in the CPU interpreter (both in both under
# SPARSEGEN_SWEEP=1).
@pytest.mark.parametrize(*in_both_modes([(n, p) for n in sorted(SPECS) for p in ("random", "empty_lines")], lambda case: case[1] == "random",
                                        "name,pattern", alone=True), indirect=["interpret"])
def test_integer_kernel_is_exact(name, pattern, interpret):
    kernel, mod = build(SPECS[name])
    assert kernel.accumulate.name == "i32"
    rng = np.random.default_rng(zlib.crc32(f"{name}{pattern}".encode()))
    args, keywords = example_args(kernel, SIZES, pattern, rng)
    expected = oracle(kernel, args, keywords)
    out = getattr(mod, kernel.name)(*args, **keywords, interpret=interpret)
    (o,) = kernel.outputs
    assert out.dtype == o.dtype.np_dtype
    assert tolerance(kernel, o.name) == (0.0, 0.0)  # assert_matches compares exactly
    assert np.abs(expected).max() > 0  # not a vacuous all-zero comparison
    assert_matches(kernel, out, expected)
    assert_matches(kernel, mod.reference(*args, **keywords), expected)


def test_integer_comparison_is_exact():
    """An off-by-one in a single element fails the comparison."""
    kernel, mod = build(SPECS["dense_i8"])
    args, keywords = example_args(kernel, SIZES, "random", np.random.default_rng(0))
    expected = oracle(kernel, args, keywords)
    wrong = np.array(expected).astype(np.int32)
    wrong[3, 5] += 1
    with pytest.raises(AssertionError):
        assert_matches(kernel, wrong, expected)


# Mosaic has no unsigned matmul (dot_general reads integers as signed) and no i16 x i16
# matmul; sparsegen builds such kernels anyway.

# Each kernel for one of v5e and v6e in turn (both under SPARSEGEN_SWEEP=1: `across_targets`).
AOT_CASES = [pytest.param(name, target, id=f"{name}-{target}") for name, target in across_targets(sorted(SPECS), ["v5e", "v6e"])]


@pytest.mark.parametrize("name,target", AOT_CASES)
def test_integer_kernel_compiles_for_tpu(name, target):
    kernel, mod = build(SPECS[name], target)
    args, keywords = example_args(kernel, dict(M=1024, K=1024, N=1024), "random", np.random.default_rng(0))
    fn = getattr(mod, kernel.name)
    compiled = compile_for(lambda *a: fn(*a, **keywords), args, f"{target}:2x2")
    assert "tpu_custom_call" in compiled.as_text()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_v4_refuses_8_bit_matmul_factors_only(name):
    """v4 has no int8 matmul: a spec whose matmul reads an 8-bit operand is a build error
    there, at that operand's dtype; 16- and 32-bit integer kernels build."""
    text = SPECS[name]
    eight_bit = {"dense_i8": "x", "coo_input_u8": "x", "mask_u32_i8": "x", "mask_on_summed_i8": "x"}
    compile_source(SourceFile("int.spk", text), "v5e")
    if name not in eight_bit:
        compile_source(SourceFile("int.spk", text), "v4")
        return
    with pytest.raises(SpecError) as info:
        compile_source(SourceFile("int.spk", text), "v4")
    operand = eight_bit[name]
    line = next(n for n, t in enumerate(text.splitlines(), 1) if t.strip().startswith(f"in  {operand}:"))
    rendered = info.value.render()
    assert f"int.spk:{line}:" in rendered and f"v4 has no int8 matmul: '{operand}' is" in rendered, rendered
