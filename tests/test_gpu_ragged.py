"""Ragged sizes on GPUs without padded copies (issue 21): an operand only TMA reads is handed
to the kernel at its own size along its 2-D view's edges (`_matrix(..., clip=True)`); a TMA
copy fills what lies past them with zeros (the Mosaic GPU interpreter models it: zeros on a
read past the end, a store clipped). The kernel writes its output the same way: at the
output's own rows and columns, TMA clipping the last tiles' stores, so the wrapper slices
nothing. What Mosaic GPU's lowering requires of a GMEM array TMA copies through swizzled
shared memory (checked here at stage 2): rows a multiple of 8 (`_rows`), columns a multiple
of the swizzle width (`_width`: 128 bytes, or the tile copied where narrower, the epilogue's
store tile for the output); anything else is padded to that, and no further. A batch index
before the ragged rows stays a leading dimension, copied by N-D TMA copies that squeeze it,
so rows clip per batch."""

from __future__ import annotations

import os

import jax
import numpy as np
from conftest import assert_matches, build, spec_text, with_tiles

from sparsegen.compiler import lower_source
from sparsegen.source import SourceFile
from sparsegen.testing import example_args, resolve_sizes

SWEEP = os.environ.get("SPARSEGEN_SWEEP") == "1"
# Rows ragged (200: no multiple of 64), columns multiples of the swizzle width (64 bf16
# elements) but not of the tiles (128): neither is padded, the output neither. K = 384 is
# three k blocks (six steps a block, runs of four): blocks are shared by CTAs (seed 0: one on
# the column edge), their pieces added by the wrapper into the unpadded output; the empty
# blocks of the last row store zeros through clipped stores.
TEXT = with_tiles(spec_text("masked_matmul"), m=64, n=128, k=128)
SIZES = dict(M=200, K=384, N=320)


def edits(fn, *args, **keywords) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """The pads and slices in `fn`'s trace, anywhere in it: (primitive, from shape, to shape)."""

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name in ("pad", "slice"):
                yield e.primitive.name, tuple(e.invars[0].aval.shape), tuple(e.outvars[0].aval.shape)
            for p in e.params.values():
                for sub in p if isinstance(p, (list, tuple)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from walk(inner)

    return list(walk(jax.make_jaxpr(lambda *a: fn(*a, **keywords))(*args).jaxpr))


def test_ragged_operands_and_output_without_padded_copies_match_reference():
    kernel, mod = build(TEXT, "h200")
    args, keywords = example_args(kernel, SIZES, "random", np.random.default_rng(0))
    found = edits(mod.masked_matmul, *args, **keywords, interpret=True)
    x, y = args[0], args[1]
    assert x.shape == (200, 384) and y.shape == (384, 320)
    padded = [a for p, a, _ in found if p == "pad"]
    assert x.shape not in padded and y.shape not in padded, found
    assert tuple(args[2].shape) in padded  # the mask's blocks are classified on whole blocks
    # The output (200, 320) is the kernel's, not cut out of a padded one.
    assert not [e for e in found if e[0] == "slice" and e[2] == (200, 320)], found
    out = mod.masked_matmul(*args, **keywords, interpret=True)
    assert out.shape == (200, 320)
    assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, SIZES))


def test_edges_off_the_tiling_are_padded_to_it_only():
    """M = 132, K = 100: x (132, 100) is padded to (136, 128) (rows to 8, columns to the
    swizzle width), y's rows to 104, and the output is written (136, 320) and cut to 132 rows."""
    kernel, mod = build(TEXT, "h200")
    sizes = dict(M=132, K=100, N=320)
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(1))
    found = edits(mod.masked_matmul, *args, **keywords, interpret=True)
    assert ("pad", (132, 100), (136, 128)) in found and ("pad", (100, 320), (104, 320)) in found, found
    assert ("slice", (136, 320), (132, 320)) in found, found
    out = mod.masked_matmul(*args, **keywords, interpret=True)
    assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, sizes))


def test_unpadded_operands_and_outputs_lower_for_h200():
    """Stage 2 at ragged sizes, the backward too (TMA descriptors over arrays that are not
    whole tiles): K = 1004 rows of y padded to 1008 only (main refused 1004: "dimension 0 must
    have size smaller or a multiple of its tiling 8"); the outputs o (1000, 992), dy (1008,
    992) written at their own columns, 992 a multiple of the epilogues' 32- and 16-column
    store tiles. Stage 3 (ptxas) too under SPARSEGEN_SWEEP=1."""
    from sparsegen.verify import verify_gpu_modules

    source = SourceFile("masked_matmul.spk", spec_text("masked_matmul"))
    items = [(m, source, "h200") for m in lower_source(source, "h200")]
    (result,) = verify_gpu_modules(items, shapes=dict(M=1000, K=1004, N=992), stage3=SWEEP)
    assert result.lowered, result.raw_error
    assert result.backward == "lowers", result.backward
    if SWEEP and result.compiled is not None:
        assert result.compiled and result.spill_bytes == 0, result.raw_error


# A batch index before the ragged rows: each operand and the output keep the batch as a
# leading dimension (`_matrix(..., lead=1)`), read and stored by 3-D TMA copies with the batch
# squeezed, so rows are clipped (zero-filled, or dropped) per batch instead of padded.
BATCHED = """
kernel batched {
    in  x: bf16[B, M, K]
    in  y: bf16[B, K, N]
    out o: bf16[B, M, N]
    o[b, m, n] = x[b, m, k] * y[b, k, n]
    tile b = 1, m = 64, n = 128, k = 128
}"""
BATCHED_SIZES = dict(B=2, M=200, K=192, N=320)


def test_rows_ragged_per_batch_are_clipped_per_batch():
    """x (2, 200, 192), y (2, 192, 320) and o (2, 200, 320) are neither padded nor sliced. y's
    rows past K = 192 in batch 0 are zeros, not batch 1's first rows: an infinity there would
    make batch 0's output NaN (0 * inf) were they read."""
    kernel, mod = build(BATCHED, "h200")
    args, keywords = example_args(kernel, BATCHED_SIZES, "random", np.random.default_rng(2))
    x, y = args
    y = np.array(y)
    y[1, 0, :] = np.inf
    found = edits(mod.batched, x, y, **keywords, interpret=True)
    assert not [e for e in found if e[0] == "pad" and e[1] in (x.shape, y.shape)], found
    assert not [e for e in found if e[0] == "slice" and e[2] == (2, 200, 320)], found
    got = np.asarray(mod.batched(x, y, **keywords, interpret=True), np.float32)
    want = np.asarray(mod.reference(x, y, **keywords), np.float32)
    assert np.isfinite(got[0]).all()
    np.testing.assert_allclose(got[0], want[0], rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(np.isfinite(got[1]), np.isfinite(want[1]))


def test_gradients_with_rows_ragged_per_batch():
    """The backward kernels (dx (2, 200, 192), dy (2, 192, 320): N-D outputs too) against
    JAX's gradient of `reference`."""
    import jax.numpy as jnp

    kernel, mod = build(BATCHED, "h200")
    args, keywords = example_args(kernel, BATCHED_SIZES, "random", np.random.default_rng(3))
    weights = np.random.default_rng(4).standard_normal((2, 200, 320)).astype(np.float32)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a, **keywords).astype(jnp.float32) * weights)

    got = jax.grad(loss(lambda *a, **k: mod.batched(*a, **k, interpret=True)), argnums=(0, 1))(*args)
    want = jax.grad(loss(mod.reference), argnums=(0, 1))(*args)
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        np.testing.assert_allclose(g, w, rtol=0.02, atol=0.02 * max(1.0, float(np.sqrt(np.mean(w**2)))))


def test_rows_ragged_per_batch_lower_for_h200():
    """Stage 2 (stage 3 too under SPARSEGEN_SWEEP=1) with 3-D TMA copies at ragged sizes, the
    backward too: batched_dsd (its dense y, the output, the backward's g and y)."""
    from sparsegen.verify import verify_gpu_modules

    source = SourceFile("batched_dsd.spk", spec_text("batched_dsd"))
    items = [(m, source, "h200") for m in lower_source(source, "h200")]
    (result,) = verify_gpu_modules(items, shapes=dict(B=2, M=1000, K=1004, N=992), stage3=SWEEP)
    assert result.lowered, result.raw_error
    assert result.backward == "lowers", result.backward
    if SWEEP and result.compiled is not None:
        assert result.compiled and result.spill_bytes == 0, result.raw_error
