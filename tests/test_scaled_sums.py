"""Factors after an integer sum (language v3, section 1): `o[m, n] = xq[m, k] * wq[k, n] * sx[m]
* sw[n]` with `accumulate i32` runs its product on int8 tiles into an exact 32-bit sum, and the
float scales multiply that sum once, in f32 (`dtypes.after_sum_dtype`): on TPU (CPU interpreter,
simulator, AOT), on GPU (Mosaic GPU interpreter, lowering), and in `reference`, which the kernels
equal bit for bit. A float factor *inside* the sum still needs a float accumulator.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, build, in_both_modes, with_tiles

from sparsegen.compiler import lower_source
from sparsegen.source import SourceFile, SpecError

SPEC = ROOT / "specs" / "w8a8_matmul.spk"
SHARED = Path("/work/shared/specs-v3/w8a8_matmul.spk")


def small(out: str = "bf16") -> str:
    """The example at small tiles (the simulator runs every op), its output in `out`."""
    text = with_tiles(SPEC.read_text(), m=128, n=128, k=256)
    return text.replace("out o: bf16[M, N]", f"out o: {out}[M, N]")


def data(rng, M=256, K=640, N=384):
    """int8 data whose sums pass 2^24 (an f32 sum would round them); scales of order 0.01."""
    xq = rng.integers(-128, 128, (M, K), dtype=np.int8)
    wq = rng.integers(-128, 128, (K, N), dtype=np.int8)
    xq[:8], wq[:, :8] = 127, 127  # rows and columns of the largest sums
    sx = rng.uniform(0.001, 0.01, M).astype(np.float32)
    sw = rng.uniform(0.001, 0.01, N).astype(np.float32)
    return xq, sx, wq, sw


def scaled_exactly(xq, sx, wq, sw):
    """The i32 sum (exact in int64), converted once to f32, times sx then sw, in f32."""
    total = (xq.astype(np.int64) @ wq.astype(np.int64)).astype(np.int32)
    return total.astype(np.float32) * sx[:, None] * sw[None, :]


def test_the_shared_example_is_the_spec_built_here():
    if SHARED.exists():
        assert SPEC.read_bytes() == SHARED.read_bytes()
    (plan,) = lower_source(SourceFile.read(SPEC), "v5e")
    assert plan.kernel.accumulate.name == "i32"


@pytest.mark.parametrize(*in_both_modes(["f32", "bf16"], ["f32"]), indirect=["interpret"])
def test_the_sum_is_exact_and_scaled_once_in_f32(case, interpret):
    kernel, mod = build(small(case))
    xq, sx, wq, sw = data(np.random.default_rng(0), K=128 * 5 + 64)  # a partial last k block
    got = np.asarray(mod.w8a8_matmul(xq, sx, wq, sw, interpret=interpret))
    want = scaled_exactly(xq, sx, wq, sw)
    assert np.abs(xq.astype(np.int64) @ wq.astype(np.int64)).max() > 2**21
    if case == "f32":
        # Bit for bit: an f32 accumulator would round sums past 2^24 at every step; scaling
        # each term, or the scales rounded to integers, would be far off.
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_array_equal(got, want.astype(got.dtype))
    np.testing.assert_array_equal(got, np.asarray(mod.reference(xq, sx, wq, sw)))


def test_the_flush_converts_the_sum_once_and_the_dot_stays_int8():
    # (AOT compiles of the example at its own tiles: tests/test_verify.py, test_shipped_tiles.py.)
    _, mod = build(SPEC.read_text(), formatted=True)
    code = Path(mod.__file__).read_text()
    assert "preferred_element_type=jnp.int32" in code  # the MXU's int8 product, an i32 sum
    assert "acc_ref[...].astype(jnp.float32)" in code
    assert ".astype(jnp.int32)\n" not in code.split("def _flush")[1].split("def ")[0]  # no scale cast to int


def test_on_gpu_in_the_interpreter_equal_to_reference():
    kernel, mod = build(small("f32"), "h200")
    xq, sx, wq, sw = data(np.random.default_rng(1), M=200, K=384, N=256)
    got = np.asarray(mod.w8a8_matmul(xq, sx, wq, sw, interpret=True))
    np.testing.assert_array_equal(got, scaled_exactly(xq, sx, wq, sw))
    np.testing.assert_array_equal(got, np.asarray(mod.reference(xq, sx, wq, sw)))


def test_on_gpu_pieces_of_a_shared_block_carry_the_scaled_sum():
    # One output block over many k steps: CTAs share it in pieces, each piece's scaled sum
    # (f32) added by the wrapper; the pieces' buffers are f32, not the accumulator's i32.
    kernel, mod = build(with_tiles(SPEC.read_text(), m=128, n=128, k=128).replace("bf16[M, N]", "f32[M, N]"), "h200")
    xq, sx, wq, sw = data(np.random.default_rng(2), M=128, K=128 * 40, N=128)
    got = np.asarray(mod.w8a8_matmul(xq, sx, wq, sw, interpret=True))
    want = scaled_exactly(xq, sx, wq, sw)
    # Each piece rounded to f32 once scaled: within f32's rounding of the largest piece.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    assert "pieces" in Path(mod.__file__).read_text()


@pytest.mark.parametrize("statement,needle", [
    # A float vector along the summed index: inside the sum.
    ("o[m, n] = xq[m, k] * wq[k, n] * sk[k] * sx[m] * sw[n]", "'sk'"),
    # A float factor holding the summed index with another factor's: covered, inside the sum.
    ("o[m, n] = xq[m, k] * wq[k, n] * smk[m, k] * sx[m] * sw[n]", "'smk'"),
])
def test_a_float_inside_the_sum_still_needs_a_float_accumulator(statement, needle):
    text = SPEC.read_text().replace("    in  sw: f32[N]\n", "    in  sw: f32[N]\n    in  sk: f32[K]\n    in  smk: f32[M, K]\n")
    text = text.replace("o[m, n] = xq[m, k] * wq[k, n] * sx[m] * sw[n]", statement)
    if "smk" not in statement:
        text = text.replace("    in  smk: f32[M, K]\n", "")
    if "sk[" not in statement:
        text = text.replace("    in  sk: f32[K]\n", "")
    with pytest.raises(SpecError) as e:
        lower_source(SourceFile("w8.spk", text), "v5e")
    message = str(e.value)
    assert "accumulate i32 cannot hold a sum of float operands" in message and needle in message
    assert "'sx'" not in message.split("\n")[0]


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_the_matrix_unit_takes_int8_at_the_shipped_tiles(topology):
    """Read back from the lowered Mosaic: every matmul multiplies i8 by i8 (the scales never
    reach the terms), and the module compiles ahead of time at the example's own tiles."""
    from aot import compile_for, lower_for, mosaic_matmuls

    _, mod = build(SPEC.read_text())
    args = data(np.random.default_rng(3), M=1024, K=2048, N=1024)
    lowered = lower_for(mod.w8a8_matmul, args, topology)
    matmuls = mosaic_matmuls(lowered)
    assert matmuls and all("xi8>" in lhs and "xi8>" in rhs for _, lhs, rhs, _ in matmuls), matmuls
    assert "tpu_custom_call" in compile_for(mod.w8a8_matmul, args, topology).as_text()
