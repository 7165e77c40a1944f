"""Flash decoding on the GPU row walk (issue 21): a decode kernel's row block (a group's heads
packed into the rows, under WGMMA's 64) walks its non-empty key blocks in parts, a CTA
each, where the row blocks alone would leave SMs idle; each part stores its rows' outputs
and logsumexps, merged on the host (`_merge_splits`, `_split_lse`: `_lse_weights`, the
paged walk's and the ring's merge too). Values in the Mosaic GPU interpreter against a
float64 oracle and `reference`; stage 2 (lowering under an abstract H200) with the key
split forced, shared memory measured = the rules' estimate. tests/test_gpu_decode.py
compiles the same kernel at verify's sizes (stage 3: ptxas registers and spills).
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build
from test_gpu_decode import DECODE, _close, _decode_args

from sparsegen.compiler import lower_source
from sparsegen.source import SourceFile

# A grouped decode with a per-row condition and four reductions: a row whose `ok` is 0
# sees nothing in any part (output 0, logsumexp and max minus infinity, sum 0).
STATS = """
kernel stats {
    in  q: bf16[B, H, D]
    in  k: bf16[B, G, S, D]
    in  v: bf16[B, G, S, D]
    in  lens: index[B]
    in  ok: i32[H]
    out o: bf16[B, H, D]
    out lse: f32[B, H]
    out top: f32[B, H]
    out tot: f32[B, H]
    s[b, h, j] = q[b, h, d] * k[b, h // 8, j, d] * 0.125 where j < lens[b] and ok[h] != 0
    o[b, h, e] = softmax(s[b, h, j], j) * v[b, h // 8, j, e]
    lse[b, h] = logsumexp(s[b, h, j], j)
    top[b, h] = max(s[b, h, j], j)
    tot[b, h] = sum(s[b, h, j], j)
    tile b = 1, h = 8, j = 128, d = 64, e = 64
}
"""

TRAINED = """
kernel full {
    in  q: bf16[H, S, D]
    in  k: bf16[H, S, D]
    in  v: bf16[H, S, D]
    out o: bf16[H, S, D]
    s[h, i, j] = q[h, i, d] * k[h, j, d] * 0.125 where j <= i
    o[h, i, e] = softmax(s[h, i, j], j) * v[h, j, e]
    tile h = 1, i = 64, j = 64, d = 64, e = 64
}
"""


def _oracle(q, k, v, lens, scale, ok=None):
    """float64: per (batch, head) the softmax over the keys under its length (and `ok`), the
    output, logsumexp, max and sum of the scores (0, -inf, -inf, 0 where nothing is present)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, H, _ = q.shape
    group = H // k.shape[1]
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("bhd,bhjd->bhj", q, kk) * scale
    present = np.arange(k.shape[2])[None, None, :] < np.asarray(lens)[:, None, None]
    if ok is not None:
        present = present & (np.asarray(ok) != 0)[None, :, None]
    s = np.where(present, s, -np.inf)
    top = s.max(axis=-1)
    e = np.where(present, np.exp(s - np.where(np.isneginf(top), 0.0, top)[..., None]), 0.0)
    total = e.sum(axis=-1)
    o = np.einsum("bhj,bhje->bhe", e / np.where(total == 0, 1.0, total)[..., None], vv)
    lse = np.where(total == 0, -np.inf, np.log(np.where(total == 0, 1.0, total)) + np.where(np.isneginf(top), 0.0, top))
    return o, lse, top, np.where(present, s, 0.0).sum(axis=-1)


def _parts(mod, splits, *args):
    *prepared, sizes = mod._prepare(*args, *(None for _ in mod._MESH_SIZES))
    return mod._impl(*prepared, sizes, True, splits=splits)


def test_decode_kernels_split_their_keys_and_the_rule_is_the_paged_walks():
    """The grouped decode walks key parts (a static `splits` of `_impl`, default by
    `_key_splits`); a kernel with a backward (64-row blocks) keeps its walk whole; the rule
    is one function, the paged walk's."""
    (dec,) = lower_source(SourceFile("dec.spk", DECODE), "h200")
    (full,) = lower_source(SourceFile("full.spk", TRAINED), "h200")
    assert dec.splits and dec.backward is None
    assert not full.splits and full.backward is not None
    kernel, mod = build(DECODE, "h200")
    _, whole = build(TRAINED, "h200")
    _, paged = build((__import__("test_paged").SPECS / "paged_decode.spk").read_text(), "h200")
    assert "splits" in inspect.signature(mod._impl).parameters
    assert "splits" not in inspect.signature(whole._impl).parameters and not hasattr(whole, "_key_splits")
    assert inspect.getsource(mod._key_splits) == inspect.getsource(paged._key_splits)
    assert inspect.getsource(mod._lse_weights) == inspect.getsource(paged._lse_weights)
    assert mod._SMS == 132
    assert mod._key_splits(2, 64) == 16 and mod._key_splits(2, 7) == 1 and mod._key_splits(132, 64) == 1


@pytest.mark.parametrize("splits, tile", [(1, 128), (2, 128), (3, 128), (7, 128), (2, 256)])
def test_key_parts_merge_to_the_softmax_over_every_key(splits, tile):
    """Lengths 0 (every part empty), 129 (two key blocks: with 3 or 7 parts some are
    empty) and the whole 640 (five blocks: 3 parts of 2, 2, 1). Key blocks of 256 (two
    steps of 128 each): parts of whole blocks, 2 and 1 of the three."""
    kernel, mod = build(DECODE.replace("j = 128", f"j = {tile}"), "h200")
    q, k, v, lens = _decode_args(np.random.default_rng(splits), B=3, H=8, G=1, S=640, lens=(0, 129, 640))
    got = _parts(mod, splits, q, k, v, lens)
    want = _oracle(q, k, v, lens, 0.08838834764831845)[0]
    _close(got, want)
    _close(got, mod.reference(q, k, v, lens))
    assert not np.asarray(got[0], np.float32).any()  # length 0: zeros


def test_merge_replaced_by_part_zero_fails(monkeypatch):
    """A mutation: the merge replaced by the first part's outputs is caught."""
    kernel, mod = build(DECODE, "h200")
    q, k, v, lens = _decode_args(np.random.default_rng(4), B=2, H=8, G=1, S=640, lens=(300, 640))
    monkeypatch.setattr(mod, "_merge_splits", lambda parts, lse, axis: parts[0])
    mod._impl.clear_cache()
    try:
        got = _parts(mod, 3, q, k, v, lens)
    finally:
        mod._impl.clear_cache()
    with pytest.raises(AssertionError):
        _close(got, _oracle(q, k, v, lens, 0.08838834764831845)[0])


@pytest.mark.parametrize("splits", [2, 5])
def test_logsumexp_max_and_sum_merge_across_parts_with_a_masked_row(splits):
    """o, lse, top and tot of each part merged: logsumexp over the parts' logsumexps, the
    max of their maxima, the sum of their sums; head 3 (ok = 0) is masked in every part, as
    are the rows of length 0."""
    kernel, mod = build(STATS, "h200")
    rng = np.random.default_rng(10 + splits)
    q, k, v, lens = _decode_args(rng, B=2, H=8, G=1, S=640, D=64, lens=(0, 600))
    ok = np.ones(8, np.int32)
    ok[3] = 0
    o, lse, top, tot = (np.asarray(x, np.float64) for x in _parts(mod, splits, q, k, v, lens, ok))
    want_o, want_lse, want_top, want_tot = _oracle(q, k, v, lens, 0.125, ok)
    _close(o, want_o)
    assert not o[0].any() and not o[1, 3].any()
    seen = np.isfinite(want_lse)
    assert (np.isneginf(lse) == ~seen).all() and (np.isneginf(top) == ~seen).all()
    np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(top[seen], want_top[seen], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(tot, want_tot, rtol=1e-3, atol=1e-2)
    assert not tot[0].any() and tot[1, 3] == 0
    whole = _parts(mod, 1, q, k, v, lens, ok)
    np.testing.assert_allclose(lse[seen], np.asarray(whole[1], np.float64)[seen], rtol=1e-5, atol=1e-5)


def test_split_decode_under_jit_default_rule():
    """The public call (splits by the rule: one part at these sizes) under jax.jit."""
    kernel, mod = build(DECODE, "h200")
    q, k, v, lens = _decode_args(np.random.default_rng(6), B=2, H=8, G=1, S=256, lens=(77, 256))
    got = jax.jit(lambda *a: mod.dec(*a, interpret=True))(q, k, v, lens)
    _close(got, _oracle(q, k, v, lens, 0.08838834764831845)[0])


def test_split_kernel_lowers_for_h200_with_shared_memory_as_estimated():
    """Stage 2 with three parts forced: one kernel launch of the estimated shared memory
    (the rows' logsumexps' tile included)."""
    from sparsegen.gpu.verify import _lower, launch_smem

    (m,) = lower_source(SourceFile("dec.spk", DECODE), "h200")
    kernel, mod = build(DECODE, "h200")

    def call(q, k, v, lens):
        return _parts_compiled(mod, 3, q, k, v, lens)

    structs = [jax.ShapeDtypeStruct((2, 16, 128), jnp.bfloat16), jax.ShapeDtypeStruct((2, 2, 1024, 128), jnp.bfloat16),
               jax.ShapeDtypeStruct((2, 2, 1024, 128), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32)]
    launched = launch_smem(lambda: _lower(call, structs, {}, "h200"))
    assert launched == [m.smem_bytes], (launched, m.smem_bytes)


def _parts_compiled(mod, splits, *args):
    *prepared, sizes = mod._prepare(*args, *(None for _ in mod._MESH_SIZES))
    return mod._impl(*prepared, sizes, False, splits=splits)


def test_two_consumer_warpgroups_split_their_keys_too():
    """128 heads a key/value head (`h // 128`, a row block of 128: two consumer warpgroups
    and a producer) in three parts, one of them empty for the shorter sequence."""
    text = DECODE.replace("h // 8", "h // 128").replace("h = 8", "h = 128")
    (m,) = lower_source(SourceFile("ws.spk", text), "h200")
    assert m.splits and m.warpgroups == 2
    kernel, mod = build(text, "h200")
    q, k, v, lens = _decode_args(np.random.default_rng(8), B=2, H=128, G=1, S=640, lens=(129, 640))
    _close(_parts(mod, 3, q, k, v, lens), _oracle(q, k, v, lens, 0.08838834764831845)[0])


def test_a_decode_whose_shape_the_logsumexp_tile_would_change_keeps_its_walk_whole(monkeypatch):
    """On a GPU whose shared memory holds the grouped decode's CTA (128 keys a step, 175,128
    bytes, 9,216 of them the exact walk's tile and row sums that keep an absent slot's NaN out)
    but not with the parts' logsumexp tile (1,024 bytes more: 64 keys a step), the
    decode keeps its walk whole, as before: nothing that built is refused or reshaped."""
    import dataclasses

    from sparsegen.gpu import targets

    (m,) = lower_source(SourceFile("dec.spk", DECODE), "h200")
    assert (m.tk, m.smem_bytes, m.splits) == (128, 176152, True)
    monkeypatch.setitem(targets.GPU_TARGETS, "h200", dataclasses.replace(targets.GPU_TARGETS["h200"], smem_bytes=176151))
    (m,) = lower_source(SourceFile("dec.spk", DECODE), "h200")
    assert (m.tk, m.smem_bytes, m.splits) == (128, 175128, False)
    from sparsegen.backends import emit_module

    code = emit_module(m, "dec.spk")
    assert "_key_splits" not in code and "row_lse" not in code
    compile(code, "dec.py", "exec")
