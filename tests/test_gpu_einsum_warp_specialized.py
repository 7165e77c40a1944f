"""Warp-specialized GPU products (issue 21, item 2): where a spec's output block holds two
consumer tiles side by side along n (tile n a multiple of 2 x tn), a product CTA is a
producer warpgroup issuing the TMA copies (`emit_pipeline_warp_specialized`, its buffers
allocated once for all of the CTA's chunks) and two consumer warpgroups, each multiplying
its own tm x tn tile into its own accumulator and storing it through shared memory in
epilogue tiles. The CPU interpreter runs the three warpgroups as threads; the same kernels
lower for an abstract H200, their shared memory exactly as `rules.smem_bytes` says, and
compile through ptxas without spills.

The GPU suites' small tiles (64 or 128 wide) keep one warpgroup; the verbatim examples (512
blocks) are warp-specialized and are lowered and compiled in tests/test_gpu.py.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches, build, with_tiles
from test_gpu import example_text

from sparsegen.compiler import lower_source
from sparsegen.gpu.rules import WARPGROUPS
from sparsegen.source import SourceFile
from sparsegen.testing import example_args, resolve_sizes

SWEEP = os.environ.get("SPARSEGEN_SWEEP") == "1"
WS = dict(m=64, n=256, k=64)  # two consumer tiles of 64 x 128 in a 64 x 256 block

# A transposed B, a constant factor and a dense factor after the sum (read per epilogue tile).
AFTER_SUM = """
kernel scaled_nt {
    in  x: bf16[M, K]
    in  y: bf16[N, K]
    in  s: f32[M, N]
    out o: f32[M, N]

    o[m, n] = 0.5 * s[m, n] * x[m, k] * y[n, k]

    tile m = 64, n = 256, k = 64
    accumulate f32
}
"""
INT8 = """
kernel int8_product {
    in  x: i8[M, K]
    in  y: i8[K, N]
    out o: i32[M, N]

    o[m, n] = x[m, k] * y[k, n]

    tile m = 64, n = 256, k = 128
    accumulate i32
}
"""


def product_tiles(text: str):
    (m,) = lower_source(SourceFile("ws.spk", text), "h200")
    return [p.tiles for p in m.passes]


def run(text, sizes, pattern, seed=0):
    kernel, mod = build(text, "h200")
    args, keywords = example_args(kernel, sizes, pattern, np.random.default_rng(seed))
    out = getattr(mod, kernel.name)(*args, **keywords, interpret=True)
    assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, sizes))
    return kernel, mod, args, keywords


# The walks differ in their index maps only, which the one-warpgroup kernels share (tests/test_gpu.py):
# the rows walk and the mask after the sum by default, every walk with SPARSEGEN_SWEEP=1.
WALKS = [
    ("dsd_matmul", dict(M=150, K=192, N=256)),  # the rows walk over stored blocks; ragged M
    ("masked_matmul", dict(M=128, K=100, N=300)),  # a mask after the sum: empty, partial and full blocks
] + ([
    ("dds_matmul", dict(M=128, K=128, N=300)),  # the cols walk, a stored B; ragged N
    ("sdd_matmul", dict(M=128, K=100, N=256)),  # a coo output
] if SWEEP else [])


@pytest.mark.parametrize("name,sizes", WALKS)
def test_walks_match_reference_in_the_interpreter(name, sizes):
    text = with_tiles(example_text(name), **WS)
    assert all(t.wgs == WARPGROUPS for t in product_tiles(text))
    run(text, sizes, "random")


def test_transposed_b_a_scale_and_a_factor_after_the_sum():
    (t,) = product_tiles(AFTER_SUM)
    assert (t.wgs, t.tm, t.tn) == (WARPGROUPS, 64, 128)
    run(AFTER_SUM, dict(M=128, K=128, N=256), "random")


def test_a_block_shared_by_several_ctas_adds_the_consumers_pieces():
    """One output block of 16 steps and 4 CTAs (runs of the pipeline's depth): the block is
    cut into pieces, each consumer storing its tile's partial sum in its slot."""
    text = with_tiles(example_text("dsd_matmul"), **WS)
    kernel, mod = build(text, "h200")
    rng = np.random.default_rng(5)
    blocks = jnp.asarray(rng.standard_normal((16, 64, 64)), jnp.bfloat16)
    rows, cols = np.zeros(16, np.int32), np.arange(16, dtype=np.int32)
    y = jnp.asarray(rng.standard_normal((16 * 64, 256)), jnp.bfloat16)
    out = mod.dsd_matmul(blocks, rows, cols, y, M=64, interpret=True)
    ref = mod.reference(blocks, rows, cols, y, M=64)
    assert_matches(kernel, out, ref, dict(M=64, K=1024, N=256))


def test_gradients_through_warp_specialized_passes():
    text = with_tiles(example_text("dsd_matmul"), **WS)
    kernel, mod, args, keywords = run(text, dict(M=128, K=128, N=256), "random", seed=2)
    blocks, rows, cols, y = args

    def loss(f):
        return lambda b, yy: jnp.sum(f(b, rows, cols, yy, **keywords).astype(jnp.float32) ** 2)

    got = jax.grad(loss(lambda *a, **kw: mod.dsd_matmul(*a, **kw, interpret=True)), argnums=(0, 1))(blocks, y)
    want = jax.grad(loss(mod.reference), argnums=(0, 1))(blocks, y)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=5e-2, atol=5e-1)


def test_lowers_with_the_shared_memory_the_rules_say_and_compiles_without_spills():
    from sparsegen.verify import verify_gpu_modules

    texts = {"bf16 out": with_tiles(example_text("dsd_matmul"), **WS), "after the sum": AFTER_SUM, "int8": INT8}
    items = []
    for name, text in texts.items():
        source = SourceFile(f"{name}.spk", text)
        (m,) = lower_source(source, "h200")
        assert all(p.tiles.wgs == WARPGROUPS for p in m.passes), name
        items.append((m, source, "h200"))
    results = verify_gpu_modules(items)
    for name, r in zip(texts, results):
        assert r.lowered, (name, r.raw_error)
        assert r.smem_used == r.smem_estimate, (name, r.smem_used, r.smem_estimate)
    if results[0].compiled is None:
        pytest.skip(f"stage 3 (ptxas for sm_90a) not run: {results[0].stage3}")
    for name, r in zip(texts, results):
        assert r.compiled, (name, r.raw_error)
        assert r.spill_bytes == 0, (name, r.registers, r.spill_bytes)


def test_the_deepest_pipeline_that_fits_then_the_widest_epilogue():
    """The verbatim dsd_matmul (512 blocks, bf16): four stages of 128x64 and 64x256 tiles
    leave room for 16-column epilogue tiles; an f32 output with an f32 factor after the sum at
    64-row tiles, for 32 (12 bytes an element: the output's, the piece's and the factor's)."""
    (t,) = product_tiles(example_text("dsd_matmul"))
    assert (t.wgs, t.tm, t.tn, t.stages, t.epi) == (WARPGROUPS, 128, 128, 4, 16)
    (t,) = product_tiles(AFTER_SUM)
    assert (t.wgs, t.stages, t.epi) == (WARPGROUPS, 4, 32)
    # A 128-wide block has room for one consumer tile only: one warpgroup copies and computes.
    (t,) = product_tiles(with_tiles(example_text("dsd_matmul"), m=128, n=128, k=128))
    assert t.wgs == 1
