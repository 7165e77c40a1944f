"""The GPU row walk at ragged sizes without padded copies (issue 21): q, k and v are passed
as they are (TMA fills the rows and keys past an array's end with zeros; the kernel's
ragged-key condition masks those keys) and the outputs are stored at their own size (TMA
drops a store's rows past the end). Mosaic GPU tiles swizzled shared memory in 8-row atoms:
a length that is not a multiple of 8 is padded to one, no further (docs/gpu-notes.md,
"Attention: ragged sizes").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches, build, spec_text, with_tiles

from sparsegen.compiler import lower_source
from sparsegen.source import SourceFile
from sparsegen.testing import example_args, resolve_sizes

# tests/test_gpu_attention.py's GPU tiles: row blocks of 128 (two consumer warpgroups of 64
# rows and a producer), key blocks of 256 (two 128-key steps).
TILES = dict(b=1, h=1, i=128, j=256, d=64, e=64)
# 64-row blocks (one warpgroup), 64-key blocks.
TILES_64 = dict(b=1, h=1, i=64, j=64, d=64, e=64)


def causal(tiles: dict) -> str:
    return with_tiles(spec_text("causal_attention"), **tiles)


def traced(mod, S: int):
    """What the gradient of the causal example (forward and backward) runs around its three
    kernels at sequence length S, traced for the GPU (not compiled): the pads, slices and
    dynamic slices (a pad by its widths) in order, and each kernel as ("kernel", its arrays'
    shapes, its results' shapes)."""
    q = jax.ShapeDtypeStruct((1, 2, S, 64), jnp.bfloat16)

    def loss(q, k, v):
        return sum(jnp.sum(o.astype(jnp.float32)) for o in mod.causal_attention(q, k, v, interpret=False))

    steps = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "custom_vmap_call":  # plgpu.kernel
                steps.append(("kernel", [v.aval.shape for v in e.invars if len(v.aval.shape) >= 3],
                              [v.aval.shape for v in e.outvars]))
                continue
            inner = [getattr(x, "jaxpr", x) for x in e.params.values() if hasattr(x, "eqns") or hasattr(x, "jaxpr")]
            for j in inner:
                walk(j)
            if e.primitive.name == "pad":
                steps.append([tuple(int(x) for x in c) for c in e.params["padding_config"]])
            elif e.primitive.name in ("slice", "dynamic_slice"):
                steps.append(e.primitive.name)

    walk(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q).jaxpr)
    return steps


@pytest.mark.parametrize("S", [200, 256])
def test_q_k_v_and_cotangents_reach_the_kernels_unpadded_and_results_unsliced(S):
    """At S a multiple of 8 the gradient runs no pad and no slice: the forward takes q, k
    and v at (1, 2, S, 64) and returns o, lse and the rows' logsumexps at S rows; dq's kernel
    takes q, do, the logsumexps, delta, k and v at S and returns dq at S; dk/dv's returns dk
    and dv at S. (Before this change, S = 200 gave 15 pads to 256 rows and 6 slices.)"""
    _, mod = build(causal(TILES), "h200")
    four, three = (1, 2, S, 64), (1, 2, S)
    assert traced(mod, S) == [
        ("kernel", [four] * 3, [four, three, three]),
        ("kernel", [four, four, three, three, four, four], [four]),
        ("kernel", [four, four, four, four, three, three], [four, four]),
    ]


def test_a_length_not_a_multiple_of_8_is_padded_to_one_only():
    """S = 197: every array a kernel reads padded by 3 rows (to 200, not to 256), every
    result sliced from 200. Mosaic GPU refuses 197 rows ("When no rounding mode is
    specified, dimension 2 must have size smaller or a multiple of its tiling 8, but got
    197"; the rows' logsumexps and delta: "Async copies require all GMEM strides except the
    last one to be a multiple of 16 bytes"). The backward pads each of q, k, v, the
    cotangent, the logsumexps and delta once, before both its kernels (dq's and dk/dv's
    read the same padded arrays: 6 pads, not 12)."""
    _, mod = build(causal(TILES), "h200")
    four, three = (1, 2, 200, 64), (1, 2, 200)
    by4, by3 = [(0, 0, 0), (0, 0, 0), (0, 3, 0), (0, 0, 0)], [(0, 0, 0), (0, 0, 0), (0, 3, 0)]
    assert traced(mod, 197) == (
        [by4] * 3 + [("kernel", [four] * 3, [four, three, three])] + ["slice"] * 3
        + [by4, by4, by3, by3, by4, by4] + [("kernel", [four, four, three, three, four, four], [four])] + ["slice"]
        + [("kernel", [four, four, four, four, three, three], [four, four])] + ["slice"] * 2)


def test_the_backward_pads_each_array_once_for_both_kernels():
    """The generated `_backward` at a symbolic S: one `_pad_to` of each of q, k, v, the
    cotangent, the rows' logsumexps and delta, bound to a name both kernel calls pass."""
    _, mod = build(causal(TILES), "h200")
    import inspect

    source = inspect.getsource(mod._backward)
    for x in ("q", "k", "v", "g_o", "row_lse", "delta"):
        assert source.count(f"_pad_to({x}, ") == 1, (x, source)
        assert source.count(f"{x}_rows") == 3, (x, source)  # made once, passed to both kernels


def test_the_source_pads_no_operand_to_whole_blocks():
    """The generated wrapper (forward and backward): no `jnp.pad` to whole blocks."""
    _, mod = build(causal(TILES), "h200")
    import inspect

    for fn in (mod._impl, mod._backward):
        source = inspect.getsource(fn)
        assert "jnp.pad" not in source and "% 128" not in source and "% 256" not in source, source


@pytest.mark.parametrize("tiles,S", [(TILES, 200), (TILES, 197), (TILES_64, 200)])
def test_ragged_causal_matches_reference_in_the_gpu_interpreter(tiles, S):
    """Values at a ragged S: the last row block's rows and the last key block's keys past S
    are TMA's zeros, masked by the ragged-key condition (unmasked, a zero key scores 0 and
    takes a share of every row's softmax: lse and o would differ). With 128-row blocks at
    S = 200 the second consumer's 64 rows of row block 1 start at 192: 8 in the array."""
    kernel, mod = build(causal(tiles), "h200")
    sizes = dict(B=1, H=2, S=S, D=64)
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(S))
    out = mod.causal_attention(*args, **keywords, interpret=True)
    assert [o.shape for o in out] == [(1, 2, S, 64), (1, 2, S)]
    ref = mod.reference(*args, **keywords)
    assert_matches(kernel, out, ref, resolve_sizes(kernel, sizes))


# Every key present (no condition): only the ragged-key condition keeps the keys past T out.
FULL = """
kernel full_attention {
    in  q: bf16[H, S, D]
    in  k: bf16[H, T, D]
    in  v: bf16[H, T, D]
    out o: bf16[H, S, D]
    out lse: f32[H, S]

    s[h, i, j] = q[h, i, d] * k[h, j, d] * 0.125
    o[h, i, e] = softmax(s[h, i, j], j) * v[h, j, e]
    lse[h, i] = logsumexp(s[h, i, j], j)

    tile h = 1, i = 64, j = 128, d = 64, e = 64
}
"""


def test_keys_past_the_end_are_masked_not_only_zero():
    """Without a condition, the last key block (T = 150: keys 128 to 255, 22 in the array)
    is partial only by its ragged end: TMA's zero keys past T score 0, and only the
    ragged-key condition keeps them out of every row's softmax (dropping it fails this:
    each row's sum gains 106 terms of exp(-m))."""
    kernel, mod = build(FULL, "h200")
    sizes = dict(H=2, S=100, T=150, D=64)
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(3))
    assert (np.asarray(mod.block_kinds(*args, **keywords))[..., 1] == 1).all()  # the last key block: partial
    out = mod.full_attention(*args, **keywords, interpret=True)
    assert [o.shape for o in out] == [(2, 100, 64), (2, 100)]
    assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, sizes))


@pytest.mark.parametrize("tiles,S", [(TILES_64, 200), (TILES, 197)])
def test_gradients_at_a_ragged_size_match_those_of_reference(tiles, S):
    """jax.grad through the unpadded forward (its rows' logsumexps stored at their own
    size) and the backward kernels (q, k, v, the cotangent, the logsumexps and delta read
    unpadded; dq, dk and dv stored at their own size), against jax.grad of `reference`."""
    kernel, mod = build(causal(tiles), "h200")
    args, keywords = example_args(kernel, dict(B=1, H=1, S=S, D=64), "random", np.random.default_rng(7))
    w = [jnp.asarray(np.random.default_rng(8).standard_normal(s), jnp.float32) for s in ((1, 1, S, 64), (1, 1, S))]

    def loss(f):
        return lambda *a: sum(jnp.sum(o.astype(jnp.float32) * x) for o, x in zip(f(*a), w))

    got = jax.grad(loss(lambda *a: mod.causal_attention(*a, **keywords, interpret=True)), argnums=(0, 1, 2))(*args)
    want = jax.grad(loss(lambda *a: mod.reference(*a, **keywords)), argnums=(0, 1, 2))(*args)
    for g, r in zip(got, want):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert g.shape == r.shape == (1, 1, S, 64)
        np.testing.assert_allclose(g, r, atol=0.05 * np.abs(r).max() + 0.02)


@pytest.mark.parametrize("S", [200, 197])
def test_ragged_causal_lowers_for_h200_with_the_estimated_shared_memory(S):
    """Lowering under an abstract H200 at the ragged S (the forward and its gradient: Mosaic
    GPU takes the unpadded arrays, 200 rows a multiple of 8), each kernel's shared memory as
    Mosaic GPU allocates it equal to the rules' estimate; at S = 197, ptxas for sm_90a."""
    from sparsegen.verify import verify_gpu_modules

    source = SourceFile("causal_attention.spk", causal(TILES))
    (m,) = lower_source(source, "h200")
    compile_ = S == 197  # stage 3 once (about 10 CPU-seconds)
    (r,) = verify_gpu_modules([(m, source, "h200")], shapes=dict(B=1, H=2, S=S, D=64), stage3={"causal_attention"} if compile_ else False)
    assert r.lowered, r.raw_error
    assert r.smem_used == r.smem_estimate <= r.smem_limit, (r.smem_used, r.smem_estimate)
    assert r.backward == "lowers", r.backward
    assert r.backward_smem_used == r.backward_smem_estimate, (r.backward_smem_used, r.backward_smem_estimate)
    if not compile_:
        return
    if r.compiled is None:
        pytest.skip(f"stage 3 (ptxas for sm_90a) not run: {r.stage3}")
    # The forward, dq and dk/dv kernels: no spill (168 registers each at launch, as at S = 256).
    assert r.compiled and len(r.kernels) == 3, (r.raw_error, r.kernels)
    for kk in r.kernels:
        assert kk["registers"] <= 255 and kk["spill_bytes"] == 0, kk


# q, k and v stored (batch, sequence, head, d): the ragged index is not the second-minor
# dimension; TMA clips it as well (the key-side tiles read k[b, j-tile, h, :]).
BSHD = """
kernel bshd_attention {
    in  q: bf16[B, S, H, D]
    in  k: bf16[B, S, H, D]
    in  v: bf16[B, S, H, D]
    out o: bf16[B, H, S, D]

    s[b, h, i, j] = q[b, i, h, d] * k[b, j, h, d] * 0.125 where i >= j
    o[b, h, i, e] = softmax(s[b, h, i, j], j) * v[b, j, h, e]

    tile b = 1, h = 1, i = 64, j = 64, d = 64, e = 64
}
"""


def test_a_ragged_index_outside_the_last_two_dimensions_is_read_unpadded():
    """q, k, v as (B, S, H, D) at S = 200: passed as they are (forward and backward: no
    `jnp.pad` in the wrapper), values and gradients match `reference`'s, and the kernels
    lower under an abstract H200 at S = 197 with the estimated shared memory."""
    import inspect

    from sparsegen.verify import verify_gpu_modules

    kernel, mod = build(BSHD, "h200")
    for fn in (mod._impl, mod._backward):
        assert "jnp.pad" not in inspect.getsource(fn)
    sizes = dict(B=1, H=2, S=200, D=64)
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(5))
    out = mod.bshd_attention(*args, **keywords, interpret=True)
    assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, sizes))
    w = jnp.asarray(np.random.default_rng(6).standard_normal((1, 2, 200, 64)), jnp.float32)

    def loss(f):
        return lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w)

    got = jax.grad(loss(lambda *a: mod.bshd_attention(*a, **keywords, interpret=True)), argnums=(0, 1, 2))(*args)
    want = jax.grad(loss(lambda *a: mod.reference(*a, **keywords)), argnums=(0, 1, 2))(*args)
    for g, r in zip(got, want):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert g.shape == (1, 200, 2, 64)
        np.testing.assert_allclose(g, r, atol=0.05 * np.abs(r).max() + 0.02)
    source = SourceFile("bshd.spk", BSHD)
    (m,) = lower_source(source, "h200")
    (r,) = verify_gpu_modules([(m, source, "h200")], shapes=dict(B=1, H=2, S=197, D=64), stage3=False)
    assert r.lowered and r.backward == "lowers", (r.raw_error, r.backward)
    assert r.smem_used == r.smem_estimate and r.backward_smem_used == r.backward_smem_estimate
