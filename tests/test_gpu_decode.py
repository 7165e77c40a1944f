"""Decoding on Mosaic GPU (issue 21; language v2, section 3): row blocks under 64 rows (the
heads of a group packed into the rows, padded to WGMMA's M = 64 in shared memory), and the
paged walk (keys and values read through a page table, `specs/paged_*decode.spk`).

Three stages, none needs a GPU (as tests/test_gpu_attention.py):
1. values in the Mosaic GPU interpreter against the module's `reference` (and the float64
   oracle of tests/test_paged.py), ragged lengths, under jax.jit;
2. lowering under an abstract H200, shared memory measured against the rules' estimate;
3. ptxas for sm_90a (`.venv-gpu`): registers and spills.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build
from test_paged import SPECS, _cache, _mqa_oracle, _oracle

from sparsegen.compiler import lower_source
from sparsegen.source import SourceFile, SpecError

# A grouped-query decode, not paged: eight query heads (a row block) per key/value head.
DECODE = """
kernel dec {
    in  q: bf16[B, H, D]
    in  k: bf16[B, G, S, D]
    in  v: bf16[B, G, S, D]
    in  lens: index[B]
    out o: bf16[B, H, D]
    s[b, h, j] = q[b, h, d] * k[b, h // 8, j, d] * 0.08838834764831845 where j < lens[b]
    o[b, h, e] = softmax(s[b, h, j], j) * v[b, h // 8, j, e]
    tile b = 1, h = 8, j = 128, d = 128, e = 128
}
"""


def _decode_args(rng, B=3, H=16, G=2, S=300, D=128, lens=(0, 129, 300)):
    q = jnp.asarray(rng.normal(size=(B, H, D)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(B, G, S, D)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(B, G, S, D)), jnp.bfloat16)
    return q, k, v, np.asarray(lens, np.int32)


def _close(got, want, atol=2e-2):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=atol, rtol=atol)


# ------------------------------------------------------------------ row blocks under 64 rows

def test_decode_rows_padded_to_wgmma_match_reference_in_the_gpu_interpreter():
    """Row blocks of 8 heads (one key/value head each), lengths 0, 129 (one past a step) and
    the whole 300 (ragged: not a multiple of the 128-key step)."""
    kernel, mod = build(DECODE, "h200")
    q, k, v, lens = _decode_args(np.random.default_rng(0))
    got = mod.dec(q, k, v, lens, interpret=True)
    _close(got, mod.reference(q, k, v, lens))
    assert not np.asarray(got[0], np.float32).any()  # length 0: nothing attended, zeros
    # Each row block reads its own group's keys: swapping the groups' keys changes the output.
    swapped = mod.dec(q, k[:, ::-1], v[:, ::-1], lens, interpret=True)
    assert np.abs(np.asarray(swapped, np.float32) - np.asarray(got, np.float32))[1:].max() > 0.1


def test_decode_under_jit_and_gradients_refused():
    kernel, mod = build(DECODE, "h200")
    q, k, v, lens = _decode_args(np.random.default_rng(1), B=2, lens=(77, 256))
    run = jax.jit(lambda *a: mod.dec(*a, interpret=True))
    _close(run(q, k, v, lens), mod.reference(q, k, v, lens))
    loss = lambda q: mod.dec(q, k, v, lens, interpret=True).astype(jnp.float32).sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match=r"row block of 8 rows padded to WGMMA's 64: it is not differentiated on h200"):
        jax.eval_shape(jax.grad(loss), q)


def _refused(text: str) -> str:
    with pytest.raises(SpecError) as info:
        lower_source(SourceFile("bad.spk", text), "h200")
    return info.value.render()


@pytest.mark.parametrize("tile, col, message", [
    ("h = 12", 21, "tile h = 12: a CTA takes 64 rows (one warpgroup's WGMMA); on h200 the row block is a multiple of 64, "
                   "or a multiple of 8 under 64 (padded to 64)"),
    ("h = 16", None, "a row block of 16 'h' must read one 'k' head: h // 8 needs h's tile to divide 8"),
])  # fmt: skip
def test_row_blocks_the_gpu_cannot_take_are_refused(tile, col, message):
    text = DECODE.replace("h = 8", tile)
    rendered = _refused(text)
    lines = text.splitlines()
    if col is None:  # at the key factor's read
        line = next(n for n, t in enumerate(lines, 1) if t.strip().startswith("s[b, h, j]"))
        col = lines[line - 1].index("k[b, h // 8") + 1
    else:
        line = next(n for n, t in enumerate(lines, 1) if t.strip().startswith("tile "))
    assert f"bad.spk:{line}:{col}: error: {message}" in rendered, rendered


# ------------------------------------------------------------------ the paged walk

def _module(spec: str):
    """The verbatim spec built for h200 (once per process)."""
    return build((SPECS / spec).read_text(), "h200")


@pytest.mark.parametrize("page, poison", [(16, True), (256, False)])
def test_paged_decode_in_the_gpu_interpreter(page, poison):
    """Pages of 16 (a 128-key step gathers 8, one TMA copy each per operand) and of 256 (a step
    is half a page); lengths 0, 1, 100 (not a multiple of a page or a step), 257 and the
    whole table. Entries past a length hold -1, or point at a page of NaN: neither is read."""
    kernel, mod = _module("paged_decode.spk")
    NP = 3 if page == 256 else 24
    lens = [0, 1, 100, 257, NP * page]
    rng = np.random.default_rng(page)
    q, kc, vc, pages, lens = _cache(rng, len(lens), 16, 2, 128, page, NP, 6 * NP, lens, poison=poison)
    if not poison:
        assert (pages == -1).any()
    got = mod.paged_decode(q, kc, vc, pages, lens, interpret=True)
    _close(got, _oracle(q, kc, vc, pages, lens))
    _close(got, mod.reference(q, kc, vc, pages, lens))
    assert not np.asarray(got[0], np.float32).any()  # length 0: zeros


def test_paged_decode_under_jit_tables_traced_without_recompiling():
    kernel, mod = _module("paged_decode.spk")
    rng = np.random.default_rng(11)
    traces = []

    def step(*a):
        traces.append(1)
        return mod.paged_decode(*a, interpret=True)

    run = jax.jit(step)
    for lens in ([3, 300], [129, 17]):
        q, kc, vc, pages, lens = _cache(rng, 2, 8, 1, 128, 64, 6, 20, lens)
        _close(run(q, kc, vc, pages, lens), _oracle(q, kc, vc, pages, lens))
    assert len(traces) == 1


@pytest.mark.parametrize("spec, oracle, new", [
    ("paged_mqa_decode.spk", _mqa_oracle, None),
    ("paged_softcap_decode.spk", lambda *a: _oracle(*a, cap=50.0), None),
    ("paged_window_decode.spk", lambda *a: _oracle(*a, window=1024), None),
    ("paged_speculative_decode.spk", lambda *a: _oracle(*a, new=8), 8),
])  # fmt: skip
def test_serving_examples_in_the_gpu_interpreter(spec, oracle, new):
    """Pages of 64, NaN past the lengths; the window's row block starts past pages before it."""
    kernel, mod = _module(spec)
    rng = np.random.default_rng(12)
    lens = [1100, 1283] if "window" in spec else [70, 9]
    q, kc, vc, pages, lens = _cache(rng, 2, 8, 1, 128, 64, 21, 50, lens, poison=True)
    if "mqa" in spec:
        kc, vc = kc[0], vc[0]
    if new:
        q = jnp.asarray(rng.normal(size=(2, 8, new, 128)), jnp.bfloat16)
    got = getattr(mod, kernel.name)(q, kc, vc, pages, lens, interpret=True)
    _close(got, oracle(q, kc, vc, pages, lens))


def test_paged_gradients_refused_saying_so():
    kernel, mod = _module("paged_decode.spk")
    q, kc, vc, pages, lens = _cache(np.random.default_rng(4), 1, 8, 1, 128, 16, 4, 8, [30])
    loss = lambda kc: mod.paged_decode(q, kc, vc, pages, lens, interpret=True).astype(jnp.float32).sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match=r"read through a table .* not derived on GPU targets"):
        jax.eval_shape(jax.grad(loss), kc)


def test_a_page_the_gpu_cannot_copy_is_a_value_error():
    kernel, mod = _module("paged_decode.spk")
    q, kc, vc, pages, lens = _cache(np.random.default_rng(3), 1, 8, 1, 128, 4, 8, 8, [30])
    with pytest.raises(ValueError, match=r"kc dim 2 \(T\) is 4: on a GPU pages are a multiple of 8 that divides the step of 128 keys"):
        mod.paged_decode(q, kc, vc, pages, lens, interpret=True)


def test_heads_packed_with_new_tokens_in_the_gpu_interpreter():
    """paged_gqa_speculative_decode: 8 heads x 4 new tokens in one block of 32 rows (merged
    into one dimension of rows on the host), padded to 64."""
    kernel, mod = _module("paged_gqa_speculative_decode.spk")
    rng = np.random.default_rng(9)
    q, kc, vc, pages, lens = _cache(rng, 2, 16, 2, 128, 64, 12, 40, [530, 9], poison=True)
    q = jnp.asarray(rng.normal(size=(2, 16, 4, 128)), jnp.bfloat16)
    got = mod.paged_gqa_speculative_decode(q, kc, vc, pages, lens, interpret=True)
    _close(got, _oracle(q, kc, vc, pages, lens, new=4))


@pytest.mark.parametrize("tiles, needle, message", [
    ("h = 8, i = 2", "h = 8", "not lowered for GPUs yet: 'h' packed into the rows with 'i' on h200 takes one packed index just before "
                              "'i' in the query and the outputs, and 'i' whole (tile i = its literal size); build for a TPU target"),
    ("h = 32, i = 4", "i = 4", "tile i = 4: a paged row block on h200 is a multiple of 8 up to 64 rows (one warpgroup's WGMMA, "
                               "padded to 64); here 32 'h' x 4 'i' = 128"),
])  # fmt: skip
def test_paged_row_blocks_the_gpu_cannot_take_are_refused_at_the_tile_line(tiles, needle, message):
    text = (SPECS / "paged_gqa_speculative_decode.spk").read_text().replace("h = 8, i = 4", tiles).replace("h // 8", "h // 32")
    rendered = _refused(text)
    lines = text.splitlines()
    line = next(n for n, t in enumerate(lines, 1) if t.strip().startswith("tile "))
    col = lines[line - 1].index(needle) + len(needle.split(" = ")[0]) + 4
    assert f"bad.spk:{line}:{col}: error: {message}" in rendered, rendered



def test_a_key_block_the_gpu_cannot_step_is_refused_with_pages_of_a_literal_size():
    """Key blocks of 32 over pages of 16 (a literal): the step rule's refusal at the tile line
    (the page check waits for a step: it compared the page with none, a TypeError)."""
    text = (SPECS / "paged_decode.spk").read_text().replace("j // T", "j // 16").replace("j % T", "j % 16").replace("T, D]", "16, D]")
    text = text.replace("j = 512", "j = 32")
    rendered = _refused(text)
    lines = text.splitlines()
    line = next(n for n, t in enumerate(lines, 1) if t.strip().startswith("tile "))
    col = lines[line - 1].index("j = 32") + 5  # at the tile's value
    message = "tile j = 32: a step reads 64 or 128 keys (WGMMA's N, then P.V's K); on h200 the key block is a multiple of 64"
    assert f"bad.spk:{line}:{col}: error: {message}" in rendered, rendered
    assert "pages of 16" not in rendered, rendered


# ------------------------------------------------------------------ stages 2 and 3

def _verified(sources: list[SourceFile]):
    """Stage 2 (shared memory measured = estimated) and, where `.venv-gpu` is, stage 3 for
    every kernel of the sources, in one process; the results by kernel."""
    from sparsegen.verify import verify_gpu_modules

    items = [(m, s, "h200") for s in sources for m in lower_source(s, "h200")]
    results = {r.kernel: r for r in verify_gpu_modules(items)}
    for r in results.values():
        assert r.lowered, (r.kernel, r.raw_error)
        assert r.smem_used == r.smem_estimate <= r.smem_limit, (r.kernel, r.smem_used, r.smem_estimate)
        assert r.backward.startswith("not derived"), (r.kernel, r.backward)
        if r.compiled is not None:
            assert r.compiled, (r.kernel, r.raw_error)
            (kk,) = r.kernels
            assert kk["registers"] <= 255 and kk["spill_bytes"] == 0, (r.kernel, kk)
    return results


PAGED = ["paged_decode", "paged_mqa_decode", "paged_softcap_decode", "paged_window_decode", "paged_speculative_decode",
         "paged_gqa_speculative_decode"]


def test_decoding_kernels_lower_and_compile_for_h200():
    """The grouped decode and the paged examples at verify's sizes (pages of 16: a step
    gathers 8): shared memory measured = estimated; ptxas: no spills."""
    sources = [SourceFile("dec.spk", DECODE)] + [SourceFile(f"{n}.spk", (SPECS / f"{n}.spk").read_text()) for n in PAGED]
    results = _verified(sources)
    assert sorted(results) == sorted(["dec"] + PAGED)
    if results["dec"].compiled is None:
        pytest.skip(f"stage 3 (ptxas for sm_90a) not run: {results['dec'].stage3}")


def test_pages_larger_than_a_step_lower_for_h200():
    """Pages of 256 (a 128-key step copies half a page): stage 2, shared memory as estimated."""
    from sparsegen.verify import verify_gpu_modules

    source = SourceFile("paged_decode.spk", (SPECS / "paged_decode.spk").read_text())
    (r,) = verify_gpu_modules([(m, source, "h200") for m in lower_source(source, "h200")], shapes={"T": 256, "NP": 16}, stage3=False)
    assert r.lowered and r.shapes["T"] == 256 and r.smem_used == r.smem_estimate, (r.raw_error, r.smem_used, r.smem_estimate)


def test_a_paged_walk_whose_128_key_steps_overflow_shared_memory_steps_64_keys():
    """d = e = 256 (bf16): steps of 128 keys would need 314,392 bytes of shared memory per
    CTA (h200: 232,448); the CTA's shape is the row walk's rule (`cta_shape`: the widest
    that fits), 64 keys a step. Stage 2: it lowers, shared memory as estimated; in the
    interpreter (pages of 16: a step gathers 4) it matches the oracle."""
    from sparsegen.verify import verify_gpu_modules

    text = (SPECS / "paged_decode.spk").read_text().replace("d = 128, e = 128", "d = 256, e = 256")
    source = SourceFile("wide.spk", text)
    (m,) = lower_source(source, "h200")
    # With the rows' logsumexps (the key parts' merge), and the walk taken again where an absent
    # slot's NaN or Inf met a weight 0: a 64 x 64 tile of values and the row sums (9,216 bytes).
    assert (m.tk, m.smem_bytes) == (64, 184344), (m.tk, m.smem_bytes)
    (r,) = verify_gpu_modules([(m, source, "h200")], shapes={"D": 256}, stage3=False)
    assert r.lowered and r.smem_used == r.smem_estimate <= r.smem_limit, (r.raw_error, r.smem_used, r.smem_estimate)
    kernel, mod = build(text, "h200")
    rng = np.random.default_rng(5)
    q, kc, vc, pages, lens = _cache(rng, 3, 8, 1, 256, 16, 20, 64, [0, 100, 320], poison=True)
    got = mod.paged_decode(q, kc, vc, pages, lens, interpret=True)
    _close(got, _oracle(q, kc, vc, pages, lens))
    assert not np.asarray(got[0], np.float32).any()  # length 0: zeros
