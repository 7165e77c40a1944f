"""Attention-like kernels (issue 22): integer operands of a softmax product are computed in
f32, as `reference` computes them; `reference` skips by block as the kernel does, so a NaN
in a skipped block stays out of both and a NaN in a computed block reaches both; every f32
product of the kernels is lowered at full precision."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import run
from conftest import build, in_both_modes
from test_attention import F32_TOL, TOPOLOGIES, assert_gradients_match, gradients, sizes_of


def softmax_spec(q="f32", k="f32", v="f32", o="f32", cond="i >= j", name="dtypes_attention") -> str:
    return f"""kernel {name} {{
    in  q: {q}[S, D]
    in  k: {k}[S, D]
    in  v: {v}[S, D]
    out o: {o}[S, D]

    s[i, j] = q[i, d] * k[j, d] where {cond}
    o[i, e] = softmax(s[i, j], j) * v[j, e]

    tile i = 128, j = 128, d = 128, e = 128
}}
"""


def data(rng, dtype: str, shape):
    if dtype.startswith("i"):  # small integers: scores of a few tens
        return jnp.asarray(rng.integers(-3, 4, shape).astype({"i8": np.int8, "i16": np.int16}[dtype]))
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype({"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype])


# ------------------------------------------------------------ integer operands


def int8_case(S: int):
    kernel, mod = build(softmax_spec("i8", "i8", "i8", "i8"))
    rng = np.random.default_rng(S)
    q, k = data(rng, "i8", (S, 128)), data(rng, "i8", (S, 128))
    v = jnp.asarray(rng.integers(-100, 100, (S, 128)).astype(np.int8))
    exact = run(kernel, [np.asarray(q), np.asarray(k), np.asarray(v)], {"S": S, "D": 128})[0]
    return mod, (q, k, v), exact


def assert_cast_once(got, ref, exact):
    """The f32 result cast toward zero, as `reference` casts its own: the two sum in
    different orders, so where a result lies within rounding of an integer they may differ
    by one; both lie within one of the exact (f64) average."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.dtype == ref.dtype == np.int8
    got, ref = got.astype(np.int64), ref.astype(np.int64)
    assert np.abs(exact).max() > 20  # not a kernel of zeros
    assert np.abs(got - exact).max() < 1 + 1e-3 and np.abs(ref - exact).max() < 1 + 1e-3
    assert np.abs(got - ref).max() <= 1 and (got == ref).mean() > 0.98


def test_int8_attention_is_not_zero():
    """The issue's kernel on four rows: it gave zeros (probabilities cast to int8)."""
    mod, args, exact = int8_case(4)
    got = mod.dtypes_attention(*args, interpret=True)
    assert_cast_once(got, mod.reference(*args), exact)


def test_int8_attention_over_several_blocks(interpret):
    mod, args, exact = int8_case(300)
    assert_cast_once(mod.dtypes_attention(*args, interpret=interpret), mod.reference(*args), exact)


# Every mix in the CPU interpreter; in the simulator one with two integer dtypes (every mix
# under SPARSEGEN_SWEEP=1).
DTYPE_MIXES = ["f32-f32-i8", "i8-f32-i16", "bf16-i8-f32", "i16-i16-f32"]  # q, k and v's


@pytest.mark.parametrize(*in_both_modes(DTYPE_MIXES, ["i8-f32-i16"], "mix"), indirect=["interpret"])
def test_integer_operands_are_widened(mix, interpret):
    """An integer value (quantised) or score factor by float ones: f32 outputs as the f64
    oracle's, and the gradients of the float factors as `reference`'s."""
    dtypes = mix.split("-")
    kernel, mod = build(softmax_spec(*dtypes))
    rng = np.random.default_rng(2)
    S = 260
    args = [data(rng, dt, (S, 128)) for dt in dtypes]
    got = mod.dtypes_attention(*args, interpret=interpret)
    want = run(kernel, [np.asarray(a, np.float32) if a.dtype == jnp.bfloat16 else np.asarray(a) for a in args], {"S": S, "D": 128})[0]
    scale = max(1.0, float(np.abs(want).max()))
    tol = 3e-2 if "bf16" in dtypes else F32_TOL["rtol"]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol * scale)
    floats = [n for n, dt in enumerate(dtypes) if not dt.startswith("i")]
    if interpret is True and floats == [0, 1]:  # q and k float: their gradients go through the integer value

        def fn(*a):
            return mod.dtypes_attention(*a, interpret=True)

        assert_gradients_match(gradients(fn, args, 2), gradients(mod.reference, args, 2), bf16=False)


@pytest.mark.parametrize("target", sorted(TOPOLOGIES))
def test_int8_attention_compiles_for_tpu(target):
    """Mosaic multiplies no integer block into a float sum (and v4 has no int8 MXU): the
    widened forms compile on every generation."""
    from aot import compile_for

    kernel, mod = build(softmax_spec("i8", "i8", "i8", "i8"))
    args = [np.zeros((1024, 128), np.int8)] * 3
    assert "tpu_custom_call" in compile_for(lambda *a: mod.dtypes_attention(*a), args, TOPOLOGIES[target]).as_text()


# ------------------------------------------------------------- NaN, by block


def nan_case(pos: int, cond: str = "i >= j"):
    kernel, mod = build(softmax_spec(cond=cond, name="nan_attention"))
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((256, 128)).astype(np.float32) for _ in range(3))
    v[pos, 0] = np.nan
    return mod, (q, k, v)


# Both in the CPU interpreter; in the simulator the NaN in the off-diagonal block (both under
# SPARSEGEN_SWEEP=1).
@pytest.mark.parametrize(*in_both_modes([200, 100], lambda pos: pos == 200, "pos"), indirect=["interpret"])
def test_a_nan_in_v_reaches_only_the_rows_that_see_its_key(pos, interpret):
    """Causal, tiles of 128: a NaN in v at key `pos` reaches exactly the rows i >= pos, in the
    kernel and in `reference`. Key 200 lies in key block 1, which row block 0 never visits,
    and rows 128-199 meet it in a partial block with probability 0; key 100 lies in the
    diagonal block of rows 0-127, where rows 0-99 cannot see it. An absent term never reaches
    a result (language v3), even where its block is computed."""
    mod, args = nan_case(pos)
    got = np.asarray(mod.nan_attention(*args, interpret=interpret))
    ref = np.asarray(mod.reference(*args))
    rows = np.arange(256) >= pos
    for out in (got, ref):
        np.testing.assert_array_equal(np.isnan(out).any(axis=1), rows)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_allclose(got[~rows], ref[~rows], **F32_TOL)


def test_reference_skips_by_block_with_traced_kinds():
    """Segment ids (kinds classified from operands): a NaN in another document's key block
    stays out of `reference` too, and the gradient of `reference` is still the kernel's."""
    kernel, mod = build(softmax_spec(cond="seg[i] == seg[j]", name="seg_attention").replace("in  v: f32[S, D]", "in  v: f32[S, D]\n    in  seg: i32[S]"))
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((384, 128)).astype(np.float32) for _ in range(3))
    seg = np.repeat(np.arange(3, dtype=np.int32), 128)
    v_nan = v.copy()
    v_nan[300, 5] = np.nan  # document 2: rows 256-383 only
    got = np.asarray(jax.jit(lambda *a: mod.seg_attention(*a, interpret=True))(q, k, v_nan, seg))
    ref = np.asarray(mod.reference(q, k, v_nan, seg))
    for out in (got, ref):
        assert not np.isnan(out[:256]).any() and np.isnan(out[256:]).any(axis=1).all()
    np.testing.assert_allclose(got[:256], ref[:256], **F32_TOL)
    args = [jnp.asarray(x) for x in (q, k, v, seg)]
    want = gradients(mod.reference, args, 3)
    assert_gradients_match(gradients(lambda *a: mod.seg_attention(*a, interpret=True), args, 3), want, bf16=False)
    check = run(kernel, [q, k, v, seg], sizes_of(kernel, [q, k, v, seg]))[0]
    np.testing.assert_allclose(np.asarray(mod.reference(q, k, v, seg)), check, **F32_TOL)


# ------------------------------------------------------------------ precision
# The CPU interpreter and the simulator multiply f32 exactly whatever the precision; on a
# TPU the MXU rounds f32 operands to bf16 unless the matmul asks for fp32. What the
# generated code asks for is observable in the lowered Mosaic kernels.

F32_EINSUM = """kernel f32_masked {
    in  x: f32[M, K]
    in  y: f32[K, N]
    in  mask: i32[M, N] mask
    out o: f32[M, N]

    o[m, n] = mask[m, n] * x[m, k] * y[k, n]

    tile m = 128, n = 128, k = 256
}
"""


def assert_f32_matmuls_at_full_precision(matmuls, at_least: int):
    f32 = [m for m in matmuls if "xf32>" in m[1] or "xf32>" in m[2]]
    assert len(f32) >= at_least, matmuls
    rounded = [m for m in f32 if m[3] != "fp32"]
    assert not rounded, f"f32 matmuls the MXU would round to bf16: {rounded}"


def test_einsum_f32_products_are_lowered_at_full_precision():
    """The forward and both gradient kernels of an f32 einsum (tpu/body.py)."""
    from aot import lower_for, mosaic_matmuls

    from sparsegen.testing import example_args

    kernel, mod = build(F32_EINSUM)
    args, keywords = example_args(kernel, {"M": 512, "N": 512, "K": 512}, "random", np.random.default_rng(0))

    def loss(x, y, mask):
        return jnp.sum(mod.f32_masked(x, y, mask, **keywords))

    lowered = lower_for(lambda *a: jax.value_and_grad(loss, argnums=(0, 1))(*a), args)
    matmuls = mosaic_matmuls(lowered)
    assert len({m[0] for m in matmuls}) >= 3, matmuls  # the forward, dx and dy kernels
    assert_f32_matmuls_at_full_precision(matmuls, 3)


@pytest.mark.parametrize("dtypes", [("f32", "f32", "f32", "f32"), ("bf16", "bf16", "f32", "f32"), ("f32", "f32", "i8", "f32"), ("i8", "i8", "i8", "i8")])
def test_attention_f32_products_are_lowered_at_full_precision(dtypes):
    """Every product of the forward and the fused backward (dk, dv and dq in one walk) that
    multiplies f32 (an f32 operand, or one widened from integers) asks for fp32: bf16 queries
    with f32 values too."""
    from aot import lower_for, mosaic_matmuls

    kernel, mod = build(softmax_spec(*dtypes))
    rng = np.random.default_rng(5)
    args = [np.asarray(data(rng, dt, (512, 128))) for dt in dtypes[:3]]
    n_float = sum(not dt.startswith("i") for dt in dtypes[:3])  # the float operands lead

    def fn(*a):
        if not n_float:
            return mod.dtypes_attention(*a)

        def loss(*f):
            return jnp.sum(mod.dtypes_attention(*f, *a[n_float:]))

        return jax.value_and_grad(loss, argnums=tuple(range(n_float)))(*a[:n_float])

    matmuls = mosaic_matmuls(lower_for(fn, args))
    kernels = {m[0] for m in matmuls}
    assert len(kernels) == (2 if n_float else 1), kernels  # the forward and the fused backward
    assert_f32_matmuls_at_full_precision(matmuls, 1 if dtypes[0] == "bf16" else len(kernels))
