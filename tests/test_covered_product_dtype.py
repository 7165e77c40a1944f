"""The dtype a covered product is formed in (issue 37, item 5; `sparsegen.dtypes.covered_dtype`).

`dx[m, k] = g[m, n] * keep[m, n] * y[k, n]` with i8 factors: the mask is multiplied into g before
the matrix unit. A mask that can take g past i8 (an i32 mask holding 100 or 300) makes the
product wider (f32 for the matrix unit, the step's sum in f32 added to the i32 accumulator on
the TPU; the wrapper's product, tf32 into f32, on the GPU), so the kernel equals the math (a
numpy int64 einsum) where it wrapped in i8 before. A `bool` mask (0 or 1) keeps the i8 product.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build, in_both_modes

from sparsegen.dtypes import DTYPES, covered_dtype
from sparsegen.source import SourceFile, SpecError
from sparsegen.compiler import lower_source

M, N, K = 256, 384, 128


def text(kd: str, form: str = "dx") -> str:
    if form == "dx":  # the mask on the matrix unit's left side
        decls = ["in  g: i8[M, N]", f"in  keep: {kd}[M, N] mask", "in  y: i8[K, N]", "out dx: i32[M, K]"]
        stmt = "dx[m, k] = g[m, n] * keep[m, n] * y[k, n]"
    else:  # dy: on its right side
        decls = ["in  x: i8[M, K]", "in  g: i8[M, N]", f"in  keep: {kd}[M, N] mask", "out dy: i32[K, N]"]
        stmt = "dy[k, n] = x[m, k] * g[m, n] * keep[m, n]"
    body = "\n".join("    " + d for d in decls)
    return f"kernel c_{form}_{kd} {{\n{body}\n\n    {stmt}\n\n    tile m = 128, n = 128, k = 128\n}}\n"


def inputs(kd: str, form: str, values, seed: int = 0):
    """i8 factors in -4..4; a mask whose 128-blocks are empty, all ones, and partial (`values`)."""
    rng = np.random.default_rng(seed)
    g = rng.integers(-4, 5, (M, N)).astype(np.int8)
    other = rng.integers(-4, 5, (K, N) if form == "dx" else (M, K)).astype(np.int8)
    keep = rng.choice(values, (M, N))
    keep[:128, :128] = 0  # an empty block: skipped
    keep[128:, 128:256] = 1  # all ones: not read
    keep = keep.astype(DTYPES[kd].np_dtype)
    wide = [a.astype(np.int64) for a in (g, keep, other)]
    if form == "dx":
        args, want = (g, keep, other), np.einsum("mn,mn,kn->mk", *wide)
    else:
        args, want = (other, g, keep), np.einsum("mn,mn,mk->kn", *wide)
    return args, want


def run_exact(target: str, kd: str, form: str, values, interpret):
    kernel, mod = build(text(kd, form), target)
    args, want = inputs(kd, form, values)
    got = np.asarray(getattr(mod, kernel.name)(*args, interpret=interpret))
    np.testing.assert_array_equal(np.asarray(mod.reference(*args)), want)
    np.testing.assert_array_equal(got, want)  # exact: no i8 wrap (100 * 4 = 400 wrapped to -112)


WIDE = [("i32", "dx"), ("i32", "dy"), ("i16", "dx")]


@pytest.mark.parametrize(*in_both_modes(WIDE, [("i32", "dx")], "kd,form"), indirect=["interpret"])
def test_a_mask_past_i8_is_multiplied_exactly_on_the_tpu(kd, form, interpret):
    run_exact("v5e", kd, form, (0, 1, 100, 300, -300), interpret)


@pytest.mark.parametrize(*in_both_modes(["dx"], ["dx"], "form"), indirect=["interpret"])
def test_a_bool_mask_keeps_the_i8_product_and_is_exact_on_the_tpu(form, interpret):
    run_exact("v5e", "bool", form, (False, True), interpret)


@pytest.mark.parametrize("kd,form", [("i32", "dx"), ("i32", "dy"), ("bool", "dx")])
def test_the_gpu_kernel_equals_the_math(kd, form):
    """The h200 module in the Mosaic GPU interpreter: the wide forms (the wrapper's f32 product,
    tf32 WGMMA into f32) and the bool mask (fused into g's i8 tile) exact."""
    run_exact("h200", kd, form, (0, 1, 100, 300, -300) if kd != "bool" else (False, True), True)


def test_the_plan_and_the_code_say_the_dtype():
    """TPU: the partial step multiplies g * keep into f32 for the matrix unit (i32 mask) or
    into i8 (bool mask), and the plan (the module's docstring) says which and why; GPU: the same
    line, the wrapper forms the wide product (not fused), the bool mask stays fused."""
    _, wide = build(text("i32"), formatted=True)
    _, narrow = build(text("bool"), formatted=True)
    src = lambda mod: open(mod.__file__).read()  # noqa: E731
    assert "g * keep for the matrix unit: i8 times i32 reaches" in wide.__doc__ and "formed in f32" in wide.__doc__
    assert ".astype(jnp.float32)" in src(wide) and "jnp.int8" not in src(wide).split("def _compute_partial")[1].split("def ")[0]
    assert "g * keep for the matrix unit: i8 times bool stays within i8: formed in i8" in narrow.__doc__
    assert ").astype(\n            jnp.int8\n        )" in src(narrow) or ").astype(jnp.int8)" in src(narrow)
    (gw,) = lower_source(SourceFile("c.spk", text("i32")), "h200")
    (gn,) = lower_source(SourceFile("c.spk", text("bool")), "h200")
    (pw,), (pn,) = gw.passes, gn.passes
    assert pw.selection is None and any("astype(jnp.float32)" in line for line in pw.host), pw.host
    assert pw.in_dtype.name == "f32" and pw.acc_dtype.name == "f32" and pw.out_dtype.name == "i32"
    assert pn.selection is not None and pn.selection.on == "a" and pn.in_dtype.name == "i8"
    assert any("i8 times bool stays within i8" in c for c in pn.covered) and any("formed in f32" in c for c in pw.covered)


def test_the_rule():
    i8, f = DTYPES["i8"], lambda *names: covered_dtype(DTYPES[names[0]], tuple(DTYPES[n] for n in names[1:]))[0].name
    assert f("i8", "bool") == "i8" and f("i8", "bool", "bool") == "i8"
    assert f("i8", "i8") == "f32" and f("i8", "i32") == "f32" and f("i8", "u8") == "f32" and f("i8", "bf16") == "f32"
    assert f("u8", "bool") == "u8" and f("bf16", "f32") == "bf16" and f("i8") == "i8"
    assert covered_dtype(i8, ())[1] is None


def test_a_bool_operand_takes_a_bool_array():
    """A `bool` input is passed as a bool array (0 or 1 by construction, so no value check);
    an int8 one, even of 0s and 1s, is a ValueError naming the operand."""
    kernel, mod = build(text("bool"))
    (g, keep, y), _ = inputs("bool", "dx", (False, True))
    with pytest.raises(ValueError, match="keep has dtype int8, but the spec declares bool"):
        mod.reference(g, keep.astype(np.int8), y)
    with pytest.raises(ValueError, match="keep has dtype int8, but the spec declares bool"):
        getattr(mod, kernel.name)(g, jnp.asarray(keep, jnp.int8), y, interpret=True)


@pytest.mark.parametrize("decl,stmt,words", [
    ("out o: bool[M, K]", "o[m, k] = g[m, n] * y[k, n]", "an output cannot have dtype 'bool'"),
    ("in  keep: bool[M, N] coo\n    out o: i32[M, K]", "o[m, k] = g[m, n] * keep[m, n] * y[k, n]", "a bool operand is dense or a mask"),
])
def test_what_bool_cannot_be_is_refused_at_the_spec(decl, stmt, words):
    spec = f"kernel b {{\n    in  g: i8[M, N]\n    in  y: i8[K, N]\n    {decl}\n\n    {stmt}\n\n    tile m = 128, n = 128, k = 128\n}}\n"
    with pytest.raises(SpecError, match=words) as e:
        lower_source(SourceFile("b.spk", spec), "v5e")
    assert "b.spk:" in str(e.value)


def test_a_sum_is_never_kept_in_bool():
    spec = text("bool").replace("    tile", "    accumulate bool\n    tile")
    with pytest.raises(SpecError, match="unknown accumulate dtype 'bool'"):
        lower_source(SourceFile("b.spk", spec), "v5e")


def test_a_float_mask_times_an_i8_factor_is_not_truncated():
    """A bf16 mask of 0, 0.5, 1.5 times an i8 g (the sum in f32): the product is formed in f32
    (it was cast back to i8, truncating 0.5 * g), in the CPU interpreter, exact here."""
    spec = text("bf16").replace("out dx: i32[M, K]", "out dx: f32[M, K]")
    kernel, mod = build(spec)
    rng = np.random.default_rng(0)
    g, y = rng.integers(-4, 5, (M, N)).astype(np.int8), rng.integers(-4, 5, (K, N)).astype(np.int8)
    keep = rng.choice([0.0, 0.5, 1.5], (M, N)).astype(np.float32)
    keep[:128, :128] = 0
    want = np.einsum("mn,mn,kn->mk", g.astype(np.float64), keep, y.astype(np.float64))
    got = getattr(mod, kernel.name)(g, jnp.asarray(keep, jnp.bfloat16), y, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), want)
