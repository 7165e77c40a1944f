"""Ragged sizes on GPUs without padded copies (issue 21): an operand only TMA reads is handed
to the kernel at its own size along its 2-D view's edges (`_matrix(..., clip=True)`); a TMA
copy fills what lies past them with zeros (the Mosaic GPU interpreter models it: zeros on a
read past the end, a store clipped), and the rows dimension of a kernel's matrix needs no
alignment. The columns are padded only to the 128-byte swizzle width Mosaic GPU requires
(its lowering refuses a wider, unaligned dimension: checked here at stage 2)."""

from __future__ import annotations

import os

import jax
import numpy as np
from conftest import assert_matches, build, spec_text, with_tiles

from sparsegen.compiler import lower_source
from sparsegen.source import SourceFile
from sparsegen.testing import example_args, resolve_sizes

SWEEP = os.environ.get("SPARSEGEN_SWEEP") == "1"
# Rows ragged (200, 136: no multiple of 64), columns multiples of the swizzle width (64
# bf16 elements) but not of the tiles (128): neither is padded.
TEXT = with_tiles(spec_text("masked_matmul"), m=64, n=128, k=128)
SIZES = dict(M=200, K=192, N=320)


def pads(fn, *args, **keywords) -> list[tuple[int, ...]]:
    """The shapes of the arrays `fn`'s trace pads (jnp.pad), anywhere in it."""

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "pad":
                yield tuple(e.invars[0].aval.shape)
            for p in e.params.values():
                for sub in p if isinstance(p, (list, tuple)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from walk(inner)

    return list(walk(jax.make_jaxpr(lambda *a: fn(*a, **keywords))(*args).jaxpr))


def test_ragged_operands_reach_the_kernel_unpadded_and_match_reference():
    kernel, mod = build(TEXT, "h200")
    args, keywords = example_args(kernel, SIZES, "random", np.random.default_rng(0))
    padded = pads(mod.masked_matmul, *args, **keywords, interpret=True)
    x, y = args[0], args[1]
    assert x.shape == (200, 192) and y.shape == (192, 320)
    assert x.shape not in padded and y.shape not in padded, padded
    assert tuple(args[2].shape) in padded  # the mask's blocks are classified on whole blocks
    out = mod.masked_matmul(*args, **keywords, interpret=True)
    assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, SIZES))


def test_a_column_edge_off_the_swizzle_width_is_padded_to_it_only():
    """K = 100: x's columns are padded to 128 (two swizzle widths), y's rows not at all."""
    kernel, mod = build(TEXT, "h200")
    args, keywords = example_args(kernel, dict(M=136, K=100, N=320), "random", np.random.default_rng(1))
    padded = pads(mod.masked_matmul, *args, **keywords, interpret=True)
    assert (136, 100) in padded and (100, 320) not in padded, padded
    out = mod.masked_matmul(*args, **keywords, interpret=True)
    assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, dict(M=136, K=100, N=320)))


def test_unpadded_operands_lower_for_h200():
    """Stage 2 at ragged sizes, the backward too (TMA descriptors over arrays that are not
    whole tiles); stage 3 (ptxas) too under SPARSEGEN_SWEEP=1 (checked by hand at 1000^3 for
    masked_matmul, dds_matmul and batched_dsd: 168 registers, no spill)."""
    from sparsegen.gpu.verify import verify_modules

    source = SourceFile("masked_matmul.spk", spec_text("masked_matmul"))
    items = [(m, source, "h200") for m in lower_source(source, "h200")]
    (result,) = verify_modules(items, shapes=dict(M=1000, K=1088, N=1000), stage3=SWEEP)
    assert result.lowered, result.raw_error
    assert result.backward == "lowers", result.backward
    if SWEEP and result.compiled is not None:
        assert result.compiled and result.spill_bytes == 0, result.raw_error
