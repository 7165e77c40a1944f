"""A mask multiplied inside the sum, fused into the GPU kernel (issue 21: "covered factors
fused into the product"). In `dx[m, k] = g[m, n] * keep[m, n] * y[k, n]` (masked_matmul's
backward) the wrapper used to form `g * keep` over the whole operand in an XLA pass before
the kernel ran. Now the kernel walks keep's non-empty blocks as before, and at a step whose
block is partial copies keep's tile into shared memory and multiplies it into g's tile
before the WGMMA; an all-ones block's steps read no mask. Warp-specialized on A's side the
consumers share the pipeline's tile, so each multiplies into its own copy; on B's side each
consumer multiplies its own columns in place.

The masks here hold empty, all-ones and partial blocks, and values other than 0 and 1 (a
mask multiplies by its value, as `reference` does), so a kernel that skipped the multiply,
multiplied at all-ones blocks only, or multiplied the wrong tile would fail.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches, build, with_tiles
from test_gpu import example_text

from sparsegen.compiler import lower_source
from sparsegen.gpu.rules import WARPGROUPS
from sparsegen.source import SourceFile

SWEEP = os.environ.get("SPARSEGEN_SWEEP") == "1"
DX, DY = "masked_backward:masked_matmul_dx", "masked_backward:masked_matmul_dy"
# (example, tiles, sizes, warpgroups): one warpgroup, and warp-specialized (two 128-wide
# consumer tiles in a 256-wide block) with the mask on A's side (dx) and on B's (dy).
CASES = [
    (DX, dict(m=64, n=64, k=64), dict(M=192, K=128, N=256), 1),
    (DY, dict(m=64, n=64, k=64), dict(M=256, K=128, N=192), 1),
    (DX, dict(m=128, n=64, k=128), dict(M=256, K=128, N=192), 1),
    (DY, dict(m=64, n=256, k=64), dict(M=256, K=64, N=256), WARPGROUPS),
]


def keep_mask(rows: int, cols: int, tile_r: int, tile_c: int, seed: int) -> np.ndarray:
    """A mask whose (tile_r x tile_c) blocks are, in turn, empty, all ones, and partial
    (random zeros, ones, twos and halves)."""
    rng = np.random.default_rng(seed)
    keep = np.zeros((rows, cols), np.float32)
    for bi in range(-(-rows // tile_r)):
        for bj in range(-(-cols // tile_c)):
            kind = (bi + 2 * bj) % 3
            block = (slice(bi * tile_r, (bi + 1) * tile_r), slice(bj * tile_c, (bj + 1) * tile_c))
            if kind == 1:
                keep[block] = 1
            elif kind == 2:
                shape = keep[block].shape
                keep[block] = rng.choice([0.0, 1.0, 2.0, 0.5], size=shape)
    return keep


def product_pass(text: str):
    (m,) = lower_source(SourceFile("fused.spk", text), "h200")
    (p,) = m.passes
    return p


@pytest.mark.parametrize("name,tiles,sizes,wgs", CASES, ids=["dx", "dy", "dx-ws", "dy-ws"])
def test_a_partial_block_of_the_mask_is_multiplied_in_the_kernel(name, tiles, sizes, wgs):
    text = with_tiles(example_text(name), **tiles)
    p = product_pass(text)
    assert p.tiles.wgs == wgs
    assert p.selection is not None and p.selection.on == ("a" if name == DX else "b")
    # The wrapper forms no product of the operand and the mask.
    assert not any("einsum" in line for line in p.host), p.host
    kernel, mod = build(text, "h200")
    M, K, N = sizes["M"], sizes["K"], sizes["N"]
    rng = np.random.default_rng(7)
    keep = keep_mask(M, N, tiles["m"], tiles["n"], seed=8)
    g = rng.standard_normal((M, N)).astype(np.float32)
    if name == DX:
        y = rng.standard_normal((K, N)).astype(np.float32)
        args = [jnp.asarray(a, jnp.bfloat16) for a in (g, keep, y)]
        out = mod.masked_matmul_dx(*args, interpret=True)
        want = (g * keep) @ y.T
    else:
        x = rng.standard_normal((M, K)).astype(np.float32)
        args = [jnp.asarray(a, jnp.bfloat16) for a in (x, g, keep)]
        out = mod.masked_matmul_dy(*args, interpret=True)
        want = x.T @ (g * keep)
    assert_matches(kernel, out, mod.reference(*args), sizes)
    # Against a float32 product of the bf16 inputs too: the halves and twos are exact in bf16.
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)  # noqa: E731
    want = (bf(g) * keep) @ bf(y).T if name == DX else bf(x).T @ (bf(g) * keep)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2e-2, atol=0.1 * max(1.0, np.abs(want).std()))


def test_nan_outside_the_walked_blocks_stays_out():
    """The operand's values in the mask's empty blocks are never read (as `reference`, which
    skips them); in its all-ones blocks the mask is not read."""
    text = with_tiles(example_text(DX), m=64, n=64, k=64)
    kernel, mod = build(text, "h200")
    rng = np.random.default_rng(3)
    keep = keep_mask(128, 192, 64, 64, seed=4)
    g = rng.standard_normal((128, 192)).astype(np.float32)
    empty = np.zeros_like(keep, bool)
    for bi in range(2):
        for bj in range(3):
            if (bi + 2 * bj) % 3 == 0:
                empty[bi * 64:(bi + 1) * 64, bj * 64:(bj + 1) * 64] = True
    g[empty] = np.nan
    y = rng.standard_normal((128, 192)).astype(np.float32)
    args = [jnp.asarray(a, jnp.bfloat16) for a in (g, keep, y)]
    out = np.asarray(mod.masked_matmul_dx(*args, interpret=True), np.float32)
    assert np.isfinite(out).all()
    assert_matches(kernel, out, mod.reference(*args), dict(M=128, K=128, N=192))


def modules(texts):
    items = []
    for text in texts:
        source = SourceFile("fused.spk", text)
        (m,) = lower_source(source, "h200")
        items.append((m, source, "h200"))
    return items


def test_lowers_with_the_shared_memory_the_rules_say():
    """Stage 2 under an abstract H200: the mask's tiles take what `rules.smem_bytes` counts,
    at every case's tiles and with a mask lacking b."""
    from sparsegen.verify import verify_gpu_modules

    texts = [with_tiles(example_text(name), **tiles) for name, tiles, _, _ in CASES] + list(BATCHED.values())
    for r in verify_gpu_modules(modules(texts), stage3=SWEEP):
        assert r.lowered, r.raw_error
        assert r.smem_used == r.smem_estimate, (r.kernel, r.smem_used, r.smem_estimate)
        assert r.compiled is not False and not r.spill_bytes, (r.kernel, r.raw_error, r.registers, r.spill_bytes)


def test_the_examples_as_written_compile_without_spills():
    """The verbatim masked_backward, through ptxas for sm_90a: dx (one warpgroup, a 128x128
    accumulator beside the multiply) and dy (warp-specialized, 64x128 a consumer: 128x128
    spilled) keep every register."""
    from sparsegen.verify import verify_gpu_modules

    results = verify_gpu_modules(modules([example_text(DX), example_text(DY)]))
    for r in results:
        assert r.lowered, r.raw_error
        assert r.smem_used == r.smem_estimate, (r.kernel, r.smem_used, r.smem_estimate)
    if results[0].compiled is None:
        pytest.skip(f"stage 3 (ptxas for sm_90a) not run: {results[0].stage3}")
    for r in results:
        assert r.compiled, r.raw_error
        assert r.spill_bytes == 0, (r.kernel, r.registers, r.spill_bytes)


BATCHED = {
    "batched_dx": """
kernel batched_dx {
    in  g: bf16[B, M, N]
    in  keep: bf16[M, N] mask
    in  y: bf16[B, K, N]
    out dx: bf16[B, M, K]

    dx[b, m, k] = g[b, m, n] * keep[m, n] * y[b, k, n]

    tile b = 1, m = 64, n = 64, k = 64
}
""",
    "batched_dy": """
kernel batched_dy {
    in  x: bf16[B, M, K]
    in  g: bf16[B, M, N]
    in  keep: bf16[M, N] mask
    out dy: bf16[B, K, N]

    dy[b, k, n] = x[b, m, k] * g[b, m, n] * keep[m, n]

    tile b = 1, m = 64, n = 256, k = 64
}
""",
}


@pytest.mark.parametrize("which", sorted(BATCHED))
def test_a_mask_lacking_the_batch_index_is_read_once_per_batch(which):
    """keep[m, n] multiplies g[b, m, n]: each batch's steps read the same mask tiles; only its
    block kinds (one per block) are broadcast over b, not the mask (the wrapper used to
    broadcast it to g's shape and multiply). Batch 1's blocks differ from batch 0's values."""
    text = BATCHED[which]
    p = product_pass(text)
    assert p.selection is not None and not any("broadcast_to(_expand" in line or "einsum" in line for line in p.host), p.host
    assert p.tiles.wgs == (1 if which == "batched_dx" else WARPGROUPS)
    kernel, mod = build(text, "h200")
    B, M, K, N = 2, 128, 128, 256
    rng = np.random.default_rng(11)
    keep = keep_mask(M, N, 64, 64 if which == "batched_dx" else 256, seed=12)
    g = rng.standard_normal((B, M, N)).astype(np.float32)
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)  # noqa: E731
    if which == "batched_dx":
        y = rng.standard_normal((B, K, N)).astype(np.float32)
        args = [jnp.asarray(a, jnp.bfloat16) for a in (g, keep, y)]
        want = np.einsum("bmn,mn,bkn->bmk", bf(g), keep, bf(y))
    else:
        x = rng.standard_normal((B, M, K)).astype(np.float32)
        args = [jnp.asarray(a, jnp.bfloat16) for a in (x, g, keep)]
        want = np.einsum("bmk,bmn,mn->bkn", bf(x), bf(g), keep)
    out = getattr(mod, which)(*args, interpret=True)
    assert_matches(kernel, out, mod.reference(*args), dict(B=B, M=M, K=K, N=N))
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2e-2, atol=0.1 * max(1.0, np.abs(want).std()))
