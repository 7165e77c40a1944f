"""Attention-like kernels on Mosaic GPU (issue 21): the row walk lowered for H200, forward
and backward (dq over the rows walk, dk/dv over the transposed classification).

Three stages, none needs a GPU (as tests/test_gpu.py for the einsum kernels):
1. the four attention examples in the Mosaic GPU interpreter against `reference`: values,
   and jax.grad against jax.grad of `reference`;
2. lowering (the gradient too) under an abstract H200, each kernel's shared memory measured
   against the rules' estimate;
3. ptxas for sm_90a in the plugin's venv (`make gpu-venv`): registers and spills per kernel.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SWEEP, assert_matches, build, spec_text, with_tiles

from sparsegen.compiler import lower_source
from sparsegen.source import SourceFile, SpecError
from sparsegen.testing import example_args, resolve_sizes

# The examples retiled to GPU-sized blocks (several CTAs per row block, several pipeline
# steps per key block where the tiles allow), with ragged sizes where they are symbolic.
# local_gqa_attention's window narrowed so that it cuts blocks at these sizes.
SMALL = {
    "causal_attention": (dict(b=1, h=1, i=128, j=256, d=64, e=64), dict(B=1, H=2, S=300, D=64)),
    "local_gqa_attention": (dict(b=1, h=1, i=64, j=128, d=64, e=64), dict(B=1, H=4, G=1, S=256, D=64)),
    "document_attention": (dict(b=1, h=1, i=64, j=64, d=64, e=64), dict(B=2, H=1, S=200, D=64)),
    "masked_attention": (dict(h=1, i=64, j=64, d=64, e=64), dict(H=2, S=128, T=150, D=64)),
}


def example(name: str) -> str:
    text = with_tiles(spec_text(name), **SMALL[name][0])
    return text.replace("i - j < 1024", "i - j < 100")


@functools.cache
def run(name: str, seed: int = 0):
    """The example interpreted against `reference`, once per process (tests reuse the run)."""
    kernel, mod = build(example(name), "h200")
    sizes = SMALL[name][1]
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(seed))
    out = getattr(mod, kernel.name)(*args, **keywords, interpret=True)
    ref = mod.reference(*args, **keywords)
    assert_matches(kernel, out, ref, resolve_sizes(kernel, sizes))
    return kernel, mod, args, keywords, out


# ------------------------------------------------------------------ stage 1: numerics

@pytest.mark.parametrize("name", sorted(SMALL))
def test_example_matches_reference_in_the_gpu_interpreter(name):
    kernel, mod, args, keywords, out = run(name)
    kinds = np.asarray(mod.block_kinds(*args, **keywords))
    # The walk skips blocks: every example's condition empties some at these sizes.
    assert (kinds == 0).any() and (kinds != 0).any(), kinds


def test_the_walk_skips_what_the_classification_empties():
    """A NaN in a key block no row of a row block reaches stays out of that row block's
    outputs: the walk never reads it (causal: row block 0 reaches key block 0 only)."""
    kernel, mod = build(example("causal_attention"), "h200")
    args, keywords = example_args(kernel, SMALL["causal_attention"][1], "random", np.random.default_rng(1))
    q, k, v = (np.asarray(a, np.float32) for a in args)
    k[:, :, 256:] = np.nan
    v[:, :, 256:] = np.nan
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    o, lse = mod.causal_attention(*args, **keywords, interpret=True)
    assert np.isfinite(np.asarray(o[:, :, :128], np.float32)).all() and np.isfinite(np.asarray(lse[:, :, :128])).all()
    ref_o, ref_lse = mod.reference(*args, **keywords)
    np.testing.assert_allclose(np.asarray(o[:, :, :128], np.float32), np.asarray(ref_o[:, :, :128], np.float32), atol=0.02)


def test_segment_ids_traced_under_jit():
    """The classification reads the segment ids: under jit it is traced, and the walk's
    tables are computed on the device; the result equals the eager call's."""
    kernel, mod, args, keywords, eager = run("document_attention")  # test_example_matches_reference_in_the_gpu_interpreter's
    jitted = jax.jit(mod.document_attention, static_argnames=("interpret",))(*args, interpret=True)
    np.testing.assert_array_equal(np.asarray(jitted, np.float32), np.asarray(eager, np.float32))
    kinds = jax.jit(mod.block_kinds)(*args)
    np.testing.assert_array_equal(np.asarray(kinds), np.asarray(mod.block_kinds(*args, **keywords)))


def test_a_row_with_nothing_present_outputs_zeros_and_minus_infinity():
    """A key-padding mask that leaves some rows nothing: o is 0 there, lse minus infinity
    (as on the TPU and in `reference`)."""
    text = """
kernel padded {
    in  q: bf16[H, S, D]
    in  k: bf16[H, S, D]
    in  v: bf16[H, S, D]
    in  ok: i32[S]
    out o: bf16[H, S, D]
    out lse: f32[H, S]
    out top: f32[H, S]
    s[h, i, j] = q[h, i, d] * k[h, j, d] * 0.125 where ok[i] != 0 and ok[j] != 0
    o[h, i, e] = softmax(s[h, i, j], j) * v[h, j, e]
    lse[h, i] = logsumexp(s[h, i, j], j)
    top[h, i] = max(s[h, i, j], j)
    tile h = 1, i = 64, j = 64, d = 64, e = 64
}
"""
    kernel, mod = build(text, "h200")
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 192, 64)), jnp.bfloat16) for _ in range(3))
    ok = np.ones(192, np.int32)
    ok[64:128] = 0  # rows 64..127 see nothing; keys 64..127 are absent for every row
    o, lse, top = (np.asarray(x, np.float32) for x in mod.padded(q, k, v, ok, interpret=True))
    ref_o, ref_lse, ref_top = (np.asarray(x, np.float32) for x in mod.reference(q, k, v, ok))
    assert not o[:, 64:128].any() and np.isneginf(lse[:, 64:128]).all() and np.isneginf(top[:, 64:128]).all()
    seen = np.r_[0:64, 128:192]  # minus infinity elsewhere: compared apart (a tolerance relative to it is none)
    assert np.isfinite(lse[:, seen]).all() and np.isfinite(top[:, seen]).all()
    np.testing.assert_allclose(o, ref_o, atol=0.02)
    np.testing.assert_allclose(lse[:, seen], ref_lse[:, seen], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(top[:, seen], ref_top[:, seen], rtol=1e-5, atol=1e-5)


BIASED = """
kernel biased {
    in  q: bf16[H, S, D]
    in  k: bf16[H, S, D]
    in  v: bf16[H, S, D]
    in  bias: bf16[H, S, S]
    in  slope: f32[H]
    in  kb: f32[S]
    out o: bf16[H, S, D]
    raw[h, i, j] = q[h, i, d] * k[h, j, d] * 0.125
    s[h, i, j] = raw[h, i, j] + bias[h, i, j] - slope[h] * (i - j) + kb[j] where i >= j
    o[h, i, e] = softmax(s[h, i, j], j) * v[h, j, e]
    tile h = 1, i = 64, j = 64, d = 64, e = 64
}
"""


def test_biases_slopes_and_per_key_terms_in_the_chain():
    """Float operands the chain reads: a bias tile per step, a slope per head (a scalar read
    from GMEM), a per-key term (a vector per step); interpreted, and lowered for H200."""
    from sparsegen.verify import verify_gpu_modules

    kernel, mod = build(BIASED, "h200")
    rng = np.random.default_rng(5)
    args = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in [(2, 128, 64)] * 3 + [(2, 128, 128)]]
    args += [jnp.asarray(rng.random(2), jnp.float32), jnp.asarray(rng.standard_normal(128), jnp.float32)]
    assert_matches(kernel, mod.biased(*args, interpret=True), mod.reference(*args), {"H": 2, "S": 128, "D": 64})
    (m,) = lower_source(SourceFile("biased.spk", BIASED), "h200")
    (r,) = verify_gpu_modules([(m, SourceFile("biased.spk", BIASED), "h200")], stage3=False)
    assert r.lowered and r.smem_used == r.smem_estimate, (r.raw_error, r.smem_used, r.smem_estimate)


# ------------------------------------------------------------------ gradients

def weighted_sum(f, keywords):
    """A loss of every output: each weighted by a fixed random array (minus infinity, where an
    lse holds it, left out), so every cotangent is a different non-zero array."""
    def loss(*args):
        outs = f(*args, **keywords)
        total = 0.0
        for n, o in enumerate(outs if isinstance(outs, tuple) else (outs,)):
            o = o.astype(jnp.float32)
            w = jnp.asarray(np.random.default_rng(100 + n).standard_normal(o.shape), jnp.float32)
            total = total + jnp.sum(jnp.where(jnp.isfinite(o), o, 0.0) * w)
        return total
    return loss


def floats(args) -> tuple[int, ...]:
    return tuple(n for n, a in enumerate(args) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating))


@functools.cache
def gradients(name: str):
    """jax.grad of every float argument through the kernel (interpreted) and through
    `reference`, built and run once per example for the tests below."""
    kernel, mod = build(example(name), "h200")
    args, keywords = example_args(kernel, SMALL[name][1], "random", np.random.default_rng(0))
    run_ = lambda *a, **k: getattr(mod, kernel.name)(*a, **k, interpret=True)  # noqa: E731
    got = jax.grad(weighted_sum(run_, keywords), argnums=floats(args))(*args)
    want = jax.grad(weighted_sum(mod.reference, keywords), argnums=floats(args))(*args)
    return kernel, args, got, want


# The one-warpgroup walks (64-row blocks: the window with grouped heads, the mask); causal's
# and document_attention's backward with two consumers run in
# tests/test_gpu_warp_specialized.py (test_two_consumers_match_reference_...); all four
# under SPARSEGEN_SWEEP=1.
@pytest.mark.parametrize("name", sorted(SMALL) if SWEEP else ["local_gqa_attention", "masked_attention"])
def test_gradients_match_those_of_reference_in_the_gpu_interpreter(name):
    """dq, dk and dv (GQA: summed over each group; causal: through o and lse) against JAX's
    gradient of `reference`, within bf16 rounding of the kernels' own products."""
    kernel, args, got, want = gradients(name)
    assert len(got) == 3  # q, k, v
    for g, w, n in zip(got, want, floats(args)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert g.shape == np.shape(args[n]) and np.isfinite(g).all(), (name, n)
        scale = np.abs(w).max()
        assert scale > 0.1, (name, n, scale)  # a gradient that can fail
        bf16 = jnp.asarray(args[n]).dtype == jnp.bfloat16
        np.testing.assert_allclose(g, w, atol=scale * (0.015 if bf16 else 1e-4), err_msg=f"{name}: argument {n}")


def test_nan_in_skipped_blocks_stays_out_of_gradients():
    """Causal, 64-row and 128-key blocks: rows 0..127 see key block 0 only, and key block 1
    (keys 128..255) only rows 128..255. NaN in k and v past key 127 leaves dq of rows 0..127
    as it was; NaN in q of rows 0..127 leaves dk and dv of keys 128..255 as they were."""
    text = with_tiles(spec_text("causal_attention"), b=1, h=1, i=64, j=128, d=64, e=64)
    kernel, mod = build(text, "h200")
    keywords = dict(B=1, H=1, S=256, D=64)
    args, _ = example_args(kernel, keywords, "random", np.random.default_rng(7))
    run_ = lambda *a, **k: mod.causal_attention(*a, **k, interpret=True)  # noqa: E731
    grad = jax.grad(weighted_sum(run_, {}), argnums=(0, 1, 2))
    clean = [np.asarray(g, np.float32) for g in grad(*args)]
    q, k, v = (np.asarray(a, np.float32) for a in args)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 128:] = np.nan
    v2[:, :, 128:] = np.nan
    dq = np.asarray(grad(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k2, v2)))[0], np.float32)
    assert np.isnan(dq[:, :, 128:]).any()  # the NaN does reach the rows that see it
    np.testing.assert_array_equal(dq[:, :, :128], clean[0][:, :, :128])
    q2 = q.copy()
    q2[:, :, :128] = np.nan
    _, dk, dv = (np.asarray(g, np.float32) for g in grad(*(jnp.asarray(x, jnp.bfloat16) for x in (q2, k, v))))
    assert np.isnan(dk[:, :, :128]).any()
    np.testing.assert_array_equal(dk[:, :, 128:], clean[1][:, :, 128:])
    np.testing.assert_array_equal(dv[:, :, 128:], clean[2][:, :, 128:])


def test_chain_operands_are_refused_by_name_the_rest_differentiated():
    """The biased kernel's bias, slope and per-key term (read by the chain) get no gradient on
    GPUs yet: asking for one raises naming it; q's, k's and v's are derived, the chain's
    operands read in both backward kernels (a tile, a scalar per head, a vector per key)."""
    kernel, mod = build(BIASED, "h200")
    rng = np.random.default_rng(5)
    args = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in [(2, 128, 64)] * 3 + [(2, 128, 128)]]
    args += [jnp.asarray(rng.random(2), jnp.float32), jnp.asarray(rng.standard_normal(128), jnp.float32)]
    run_ = lambda *a: mod.biased(*a, interpret=True)  # noqa: E731
    got = jax.grad(weighted_sum(run_, {}), argnums=(0, 1, 2))(*args)
    want = jax.grad(weighted_sum(mod.reference, {}), argnums=(0, 1, 2))(*args)
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, atol=0.015 * np.abs(w).max())
    for n, name in ((3, "bias"), (4, "slope"), (5, "kb")):
        with pytest.raises(NotImplementedError, match=rf"biased: the gradient of '{name}' \(read by the scores' elementwise steps as "
                                                      rf"{name}\[[^]]*\]\) is not lowered for GPUs yet"):
            jax.grad(weighted_sum(run_, {}), argnums=n)(*args)


def test_backward_refused_where_its_shared_memory_exceeds_the_chip():
    """A forward that fits with a backward that does not (f32, d = e = 128: tf32 WGMMA reads
    K-major tiles only, so dq reads k in both orientations): jax.grad raises naming the kernel."""
    text = with_tiles(spec_text("masked_attention"), h=1, i=64, j=64, d=128, e=128)
    (m,) = lower_source(SourceFile("wide.spk", text), "h200")
    assert m.backward is None and m.smem <= m.target.smem_bytes
    assert re.fullmatch(r"the backward's dq kernel needs \d+ bytes of shared memory per CTA on h200 \(limit 232448\): "
                        r"use smaller tiles of d or the values' columns to differentiate 'masked_attention'", m.backward_error), m.backward_error
    assert any(r.operand == "q" and r.output is None and r.reason == m.backward_error for r in m.refused)


def test_masked_attention_verbatim_takes_the_shape_that_fits():
    """The v1 example as written (f32, 128 x 128 blocks, d = e = 128): two consumers at 128
    keys a step need 428,080 bytes, 64 keys still 247,856; one warpgroup a CTA of 64 rows at
    64 keys a step fits (the widest shape that does). Its values in the interpreter, its
    shared memory measured under an abstract H200, and ptxas; the backward is refused by
    name (dq alone needs more than the chip has)."""
    from sparsegen.verify import verify_gpu_modules

    text = spec_text("masked_attention")
    (m,) = lower_source(SourceFile("masked_attention.spk", text), "h200")
    assert (m.warpgroups, m.tk) == (1, 64) and m.smem <= m.target.smem_bytes, (m.warpgroups, m.tk, m.smem)
    assert m.backward is None and "to differentiate 'masked_attention'" in m.backward_error
    kernel, mod = build(text, "h200")
    sizes = dict(H=1, S=200, T=150, D=128)
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(3))
    out = mod.masked_attention(*args, **keywords, interpret=True)
    assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, sizes))
    (r,) = verify_gpu_modules([(m, SourceFile("masked_attention.spk", text), "h200")])
    assert r.lowered and r.smem_used == r.smem_estimate == m.smem, (r.raw_error, r.smem_used, r.smem_estimate)
    if r.compiled is None:
        pytest.skip(f"stage 3 (ptxas for sm_90a) not run: {r.stage3}")
    (kk,) = r.kernels
    assert kk["registers"] <= 255 and kk["spill_bytes"] == 0, kk


# ------------------------------------------------------------------ stages 2 and 3

# Tiles that fill a CTA as the examples would on an H200 (128-row blocks of 64-row CTAs,
# 128 keys a step, the full head dimension).
LOWERED = {
    "causal_attention": dict(b=1, h=1, i=128, j=128, d=128, e=128),
    "local_gqa_attention": dict(b=1, h=1, i=64, j=128, d=128, e=128),
    "document_attention": dict(b=1, h=1, i=64, j=64, d=64, e=64),
    "masked_attention": dict(h=1, i=64, j=64, d=64, e=64),
}


# ptxas spills of the dk/dv kernel at d = e = 128, bytes at most: since dk and dv accumulate
# in place (`_mma_add`, docs/gpu-notes.md) causal has none (396 before; warp-specialized
# since, still none); the local window's (one warpgroup: its f32 dk and dv tiles would not
# fit two consumers) spilled 208, 36 since ds reads p back from its 16-bit tile.
DKV_SPILLS = {"local_gqa_attention": 40}
# Stage 3 (ptxas, about 10 CPU-seconds an example): causal (two consumers, d = 128) and the
# local window (one warpgroup); document_attention's and masked_attention's walks compile in
# tests/test_gpu_warp_specialized.py at their GPU tiles; all four under SPARSEGEN_SWEEP=1.
COMPILED = set(LOWERED) if SWEEP else {"causal_attention", "local_gqa_attention"}


def test_examples_lower_and_compile_for_h200():
    """Stage 2 for each example and its gradient (shared memory measured per kernel: the
    rules' estimates are what Mosaic GPU allocates), then stage 3 for all in one process:
    registers and spills per kernel (the forward, dq, dk/dv) of COMPILED."""
    from sparsegen.verify import verify_gpu_modules

    items = []
    for name, tiles in LOWERED.items():
        source = SourceFile(f"{name}.spk", with_tiles(spec_text(name), **tiles))
        items += [(m, source, "h200") for m in lower_source(source, "h200")]
    results = verify_gpu_modules(items, stage3=COMPILED)
    assert [r.kernel for r in results] == list(LOWERED)
    for r in results:
        assert r.lowered, (r.kernel, r.raw_error)
        assert r.smem_used == r.smem_estimate <= r.smem_limit, (r.kernel, r.smem_used, r.smem_estimate)
        assert r.backward == "lowers", (r.kernel, r.backward)
        assert r.backward_smem_used == r.backward_smem_estimate and max(r.backward_smem_used) <= r.smem_limit, (
            r.kernel, r.backward_smem_used, r.backward_smem_estimate)
    if results[0].compiled is None:
        pytest.skip(f"stage 3 (ptxas for sm_90a) not run: {results[0].stage3}")
    assert {r.kernel for r in results if r.compiled is not None} == COMPILED
    for r in (r for r in results if r.kernel in COMPILED):
        assert r.compiled, (r.kernel, r.raw_error)
        by_name = {kk["name"].removesuffix("_mosaic_gpu_kernel"): kk for kk in r.kernels}
        assert sorted(by_name) == ["attention_dkv_kernel", "attention_dq_kernel", "attention_kernel"], (r.kernel, r.kernels)
        for name, kk in by_name.items():
            limit = DKV_SPILLS.get(r.kernel, 0) if name == "attention_dkv_kernel" else 0
            assert kk["registers"] <= 255 and kk["spill_bytes"] <= limit, (r.kernel, name, kk)


# ------------------------------------------------------------------ rules at the spec

def refused(text: str) -> str:
    with pytest.raises(SpecError) as info:
        lower_source(SourceFile("bad.spk", text), "h200")
    return info.value.render()


@pytest.mark.parametrize("tile,needle,message", [
    ("i = 36", "i = 36", "a CTA takes 64 rows"),
    ("j = 96", "j = 96", "64 or 128 keys"),
    ("d = 24", "d = 24", "WGMMA's K steps"),
    ("e = 300", "e = 300", "multiple of 16 up to 256"),
])  # fmt: skip
def test_tiles_a_cta_cannot_take_are_refused_at_the_tile_line(tile, needle, message):
    tiles = dict(SMALL["causal_attention"][0])
    tiles[tile.split(" = ")[0]] = int(tile.split(" = ")[1])
    text = with_tiles(spec_text("causal_attention"), **tiles)
    rendered = refused(text)
    line = next(n for n, t in enumerate(text.splitlines(), 1) if t.strip().startswith("tile "))
    col = text.splitlines()[line - 1].index(needle) + 1 + len(needle.split(" = ")[0]) + 3
    assert f"bad.spk:{line}:{col}: error:" in rendered and message in rendered, rendered


def test_shared_memory_beyond_the_chip_is_refused_at_the_tile_line():
    # f32 at d = e = 256: not even one warpgroup at 64 keys a step fits (causal's bf16 does).
    text = with_tiles(spec_text("masked_attention"), h=1, i=128, j=128, d=256, e=256)
    rendered = refused(text)
    assert "bytes of shared memory per CTA on h200 (limit 232448)" in rendered and re.search(r"bad.spk:\d+:5: error", rendered), rendered


WIDTHS = """
kernel widths {
    in  q: bf16[H, S, D]
    in  k: bf16[H, S, D]
    in  v: bf16[H, S, E]
    out o: bf16[H, S, E]
    s[h, i, j] = q[h, i, d] * k[h, j, d] where i >= j
    o[h, i, e] = softmax(s[h, i, j], j) * v[h, j, e]
    tile h = 1, i = 64, j = 64, d = 64, e = 32
}
"""


@pytest.mark.parametrize("d,e,message", [
    (128, 32, "q dim 2 (D) is 128, but the spec's tile of 64 must span it"),
    (32, 32, "q dim 2 (D) is 32, but the spec's tile of 64 must span it"),
    (64, 64, "v dim 2 (E) is 64, but the spec's tile of 32 must span it"),
])  # fmt: skip
def test_a_dimension_a_block_spans_must_be_its_tile(d, e, message):
    """The summed index and the values' columns are spanned by one block (the CTA's query
    tile, WGMMA's K and N): any other size is refused by name before the kernel runs, not
    read out of bounds (or in part) inside it."""
    kernel, mod = build(WIDTHS, "h200")
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((1, 64, d)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, 64, e)), jnp.bfloat16)
    with pytest.raises(ValueError, match=re.escape(f"widths: {message}")):
        mod.widths(q, k, v, interpret=True)
    with pytest.raises(ValueError, match=re.escape(message)):
        mod.reference(q, k, v)


def test_the_spanned_dimensions_at_their_tiles_run():
    kernel, mod = build(WIDTHS, "h200")
    args, keywords = example_args(kernel, {"H": 1, "S": 64, "D": 64, "E": 32}, "random", np.random.default_rng(0))
    assert_matches(kernel, mod.widths(*args, **keywords, interpret=True), mod.reference(*args, **keywords), {"H": 1, "S": 64, "D": 64, "E": 32})


def test_what_the_gpu_walk_does_not_take_yet_is_refused_at_the_statement():
    rendered = refused(spec_text("masked_softmax"))
    assert "not lowered for GPUs yet: scores read from stored operands" in rendered and "for a TPU target" in rendered
    integers = example("causal_attention").replace("in  k: bf16", "in  k: i8")
    assert "WGMMA multiplies bf16, f16 or f32" in refused(integers)


def test_spec_names_that_are_the_kernels_own_stay_apart():
    """Operands and sizes named like the GPU module's locals and tables (`cell`, `count`,
    `t`, `barrier`, `row_tile`, `kinds`, `sizes`, a kernel named `tables`)."""
    text = """
kernel tables {
    in  cell: bf16[sizes, slot, D]
    in  count: bf16[sizes, slot, D]
    in  t: bf16[sizes, slot, D]
    in  barrier: i32[slot]
    out row_tile: bf16[sizes, slot, D]
    out kinds: f32[sizes, slot]
    s[h, i, j] = cell[h, i, d] * count[h, j, d] where barrier[i] == barrier[j]
    row_tile[h, i, e] = softmax(s[h, i, j], j) * t[h, j, e]
    kinds[h, i] = logsumexp(s[h, i, j], j)
    tile h = 1, i = 64, j = 64, d = 64, e = 64
}
"""
    kernel, mod = build(text, "h200")
    rng = np.random.default_rng(6)
    args = [jnp.asarray(rng.standard_normal((2, 128, 64)), jnp.bfloat16) for _ in range(3)]
    args.append(np.sort(rng.integers(0, 3, 128)).astype(np.int32))
    out, ref = mod.tables(*args, interpret=True), mod.reference(*args)
    np.testing.assert_allclose(np.asarray(out[0], np.float32), np.asarray(ref[0], np.float32), atol=0.02)
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(ref[1]), rtol=1e-5, atol=1e-5)


PADDED_SUM = """
kernel padded_sum {
    in  q: bf16[H, S, D]
    in  k: bf16[H, S, D]
    in  v: bf16[H, S, D]
    in  ok: i32[S]
    out o: bf16[H, S, D]
    out lse: f32[H, S]
    out tot: f32[H, S]
    out top: f32[H, S]
    s[h, i, j] = q[h, i, d] * k[h, j, d] * 0.125 where ok[i] != 0 and ok[j] != 0
    o[h, i, e] = softmax(s[h, i, j], j) * v[h, j, e]
    lse[h, i] = logsumexp(s[h, i, j], j)
    tot[h, i] = sum(s[h, i, j], j)
    top[h, i] = max(s[h, i, j], j)
    tile h = 1, i = 64, j = 64, d = 64, e = 64
}
"""


def test_gradients_through_lse_and_sum_with_empty_rows_and_max_refused():
    """Cotangents of a softmax product, a logsumexp and a sum in one backward (delta less the
    lse's cotangent; the sum's added where present); rows that see nothing get no gradient;
    through the max it is refused by name, only where asked for."""
    kernel, mod = build(PADDED_SUM, "h200")
    rng = np.random.default_rng(8)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 192, 64)), jnp.bfloat16) for _ in range(3))
    ok = np.ones(192, np.int32)
    ok[64:128] = 0
    tot, ref_tot = mod.padded_sum(q, k, v, ok, interpret=True)[2], mod.reference(q, k, v, ok)[2]
    np.testing.assert_allclose(np.asarray(tot), np.asarray(ref_tot), rtol=1e-4, atol=1e-3)  # the forward's sum (a fixed bug)
    run_ = lambda *a: mod.padded_sum(*a, ok, interpret=True)[:3]  # noqa: E731
    ref = lambda *a: mod.reference(*a, ok)[:3]  # noqa: E731
    got = [np.asarray(g, np.float32) for g in jax.grad(weighted_sum(run_, {}), argnums=(0, 1, 2))(q, k, v)]
    want = [np.asarray(g, np.float32) for g in jax.grad(weighted_sum(ref, {}), argnums=(0, 1, 2))(q, k, v)]
    for g, w in zip(got, want):
        assert np.isfinite(g).all() and not g[:, 64:128].any()  # nothing present there: no gradient
        np.testing.assert_allclose(g, w, atol=0.015 * np.abs(w).max())
    with pytest.raises(NotImplementedError, match=r"padded_sum: the gradient of 'q' through 'top' \(a max reduction\) is not derived yet"):
        jax.grad(weighted_sum(lambda *a: mod.padded_sum(*a, ok, interpret=True), {}))(q, k, v)


def test_spec_names_that_are_the_backwards_own_stay_apart():
    """Operands and outputs named like the backward's locals and arrays (`delta`, `row_lse`,
    `do`, `ds_smem`, `lse`, `dq_full`, `g_dq_full`): jax.grad still equals reference's."""
    text = """
kernel delta {
    in  row_lse: bf16[sizes, slot, D]
    in  do: bf16[sizes, slot, D]
    in  ds_smem: bf16[sizes, slot, D]
    in  lse: i32[slot]
    out dq_full: bf16[sizes, slot, D]
    out g_dq_full: f32[sizes, slot]
    s[h, i, j] = row_lse[h, i, d] * do[h, j, d] where lse[i] == lse[j]
    dq_full[h, i, e] = softmax(s[h, i, j], j) * ds_smem[h, j, e]
    g_dq_full[h, i] = logsumexp(s[h, i, j], j)
    tile h = 1, i = 64, j = 64, d = 64, e = 64
}
"""
    kernel, mod = build(text, "h200")
    rng = np.random.default_rng(6)
    args = [jnp.asarray(rng.standard_normal((2, 128, 64)), jnp.bfloat16) for _ in range(3)]
    seg = np.sort(rng.integers(0, 3, 128)).astype(np.int32)
    got = jax.grad(weighted_sum(lambda *a: mod.delta(*a, seg, interpret=True), {}), argnums=(0, 1, 2))(*args)
    want = jax.grad(weighted_sum(lambda *a: mod.reference(*a, seg), {}), argnums=(0, 1, 2))(*args)
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, atol=0.015 * np.abs(w).max())
