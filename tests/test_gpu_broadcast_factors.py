"""GPU einsums whose mask or dense factor lacks a batch index of what it multiplies (issue
21, item 3): `o[b, s, t] = mask[s, t] * q[b, s, d] * kt[b, t, d]` was refused ("applies a
dense or mask factor with the output's indices only"). Now a factor after the sum may lack
output coordinates (the grid's batch and head indices): its tile is read for every value
of them, and a mask's block kinds (which blocks run no step) are broadcast over them; in
the backward, the same mask multiplies the cotangent inside the sum (a mask read with a
subset of its factor's indices). What it must still have is the product's rows or
columns (a row scale `r[b, s]` is a vector read in the epilogue:
tests/test_gpu_epilogue_factors.py): a factor `w[b]` with neither is refused, saying so.

In the Mosaic GPU interpreter against `reference`, values and gradients; lowered under an
abstract H200 with its backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build
from test_gpu import refused

from sparsegen.compiler import lower_source
from sparsegen.source import SourceFile
from sparsegen.testing import example_args, resolve_sizes, tolerance

MASKED = """kernel masked_scores {
    in  mask: f32[S, T] mask
    in  q: bf16[B, S, D]
    in  kt: bf16[B, T, D]
    out o: bf16[B, S, T]
    o[b, s, t] = mask[s, t] * q[b, s, d] * kt[b, t, d]
    tile b = 1, s = 128, t = 128, d = 128
}"""

SCALED = """kernel scaled_scores {
    in  w: f32[H, S, T]
    in  q: bf16[B, H, S, D]
    in  kt: bf16[B, H, T, D]
    out o: bf16[B, H, S, T]
    o[b, h, s, t] = w[h, s, t] * q[b, h, s, d] * kt[b, h, t, d]
    tile b = 1, h = 1, s = 128, t = 128, d = 128
}"""

CASES = [(MASKED, dict(B=2, S=256, T=384, D=128)), (SCALED, dict(B=2, H=3, S=256, T=256, D=128))]


@pytest.mark.parametrize("pattern", ["tril", "all_empty"])
@pytest.mark.parametrize("text,sizes", CASES, ids=["mask-lacks-b", "dense-lacks-b"])
def test_values_in_the_gpu_interpreter(text, sizes, pattern):
    kernel, mod = build(text, "h200")
    args, keywords = example_args(kernel, sizes, pattern, np.random.default_rng(0))
    got = np.asarray(getattr(mod, kernel.name)(*args, **keywords, interpret=True), np.float64)
    ref = np.asarray(mod.reference(*args, **keywords), np.float64)
    rtol, atol = tolerance(kernel, "o", resolve_sizes(kernel, sizes))
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol * max(1.0, np.abs(ref).max()))
    if pattern == "tril" and text is MASKED:
        # The mask's empty blocks are zeros in every batch: the same blocks, per b.
        empty = np.asarray(args[0]).reshape(2, 128, 3, 128).any(axis=(1, 3)) == 0
        assert empty.any() and (got.reshape(2, 2, 128, 3, 128).transpose(0, 1, 3, 2, 4)[:, empty] == 0).all()


def test_gradients_through_a_mask_lacking_the_batch_index():
    kernel, mod = build(MASKED, "h200")
    sizes = CASES[0][1]
    args, keywords = example_args(kernel, sizes, "tril", np.random.default_rng(0))
    weight = np.random.default_rng(1).standard_normal((2, 256, 384)).astype(np.float32)

    def grads(fn):
        loss = lambda q, kt: (fn(args[0], q, kt, **keywords).astype(jnp.float32) * weight).sum()  # noqa: E731
        return [np.asarray(g, np.float64) for g in jax.grad(loss, argnums=(0, 1))(args[1], args[2])]

    for got, ref in zip(grads(lambda *a, **k: mod.masked_scores(*a, **k, interpret=True)), grads(mod.reference)):
        scale = np.abs(ref).max()
        assert scale > 0
        np.testing.assert_allclose(got, ref, rtol=2**-7, atol=2**-7 * scale)


def test_lowered_for_an_abstract_h200_with_the_backward():
    from sparsegen.verify import verify_gpu_modules

    items = []
    for text, _ in CASES:
        source = SourceFile("broadcast.spk", text)
        items += [(m, source, "h200") for m in lower_source(source, "h200")]
    for result in verify_gpu_modules(items, stage3=False):
        assert result.lowered, result.raw_error
        assert result.backward == "lowers", (result.kernel, result.backward)


@pytest.mark.parametrize("factor,lacking", [("w[b]", "s and t, the product's rows and columns")])
def test_a_factor_after_the_sum_lacking_rows_and_columns_is_refused(factor, lacking):
    name, dims = factor.split("[")
    symbols = {"b": "B", "s": "S", "t": "T"}
    text = f"""kernel scaled {{
    in  {name}: f32[{', '.join(symbols[i] for i in dims.rstrip(']').split(', '))}]
    in  q: bf16[B, S, D]
    in  kt: bf16[B, T, D]
    out o: f32[B, S, T]
    o[b, s, t] = {factor} * q[b, s, d] * kt[b, t, d]
    tile b = 1, s = 128, t = 128, d = 128
}}"""
    rendered = refused(text)
    assert f"'{factor}' after the sum lacks {lacking}" in rendered and "broadcast it to [b, s] first" in rendered
    assert rendered.startswith("bad.spk:6:18: error:")
