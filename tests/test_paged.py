"""Paged, grouped-query decoding (language v2, sections 2-3; issue 19): `specs/paged_decode.spk`
and its serving relatives, built for TPU, against a numpy oracle in the CPU interpreter and
the TPU simulator (NaN-filled memory: a page copied that should not be, or one missing,
shows), through `jit` with traced tables, and refused where they should be."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from conftest import SWEEP

from sparsegen.compiler import compile_file, compile_source
from sparsegen.source import SourceFile, SpecError

SPECS = Path(__file__).parents[1] / "specs"


_compiled: dict[str, object] = {}


def _load(spec: str, tmp_path):
    """A fresh module (tests may change its constants) of a spec compiled once per session."""
    if spec not in _compiled:
        (_compiled[spec],) = compile_file(SPECS / spec)
    m = _compiled[spec]
    path = tmp_path / f"{m.kernel}.py"
    path.write_text(m.code)
    loader = importlib.util.spec_from_file_location(m.kernel, path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module, m


def _oracle(q, kc, vc, pages, lens, heads_per_kv=8, scale=0.08838834764831845, cap=None, window=None, new=None):
    """Attention of each sequence's query heads over its first lens[b] cached tokens, read
    through the page table, in float64 numpy. `new`: several new tokens (q[b, h, i, d]),
    token i at global position lens[b] - S + i."""
    q = np.asarray(q, np.float64)
    kc, vc = np.asarray(kc, np.float64), np.asarray(vc, np.float64)
    G, P, T, D = kc.shape
    out = np.zeros(q.shape)
    for b in range(q.shape[0]):
        n = int(lens[b])
        toks = np.arange(n)
        k = kc[:, pages[b, toks // T], toks % T]  # (G, n, D)
        v = vc[:, pages[b, toks // T], toks % T]
        for h in range(q.shape[1]):
            g = h // heads_per_kv
            rows = q[b, h][None] if new is None else q[b, h]
            for r, qv in enumerate(rows):
                s = k[g] @ qv * scale
                if cap is not None:
                    s = cap * np.tanh(s / cap)
                keep = np.ones(n, bool)
                pos = n - 1 if new is None else n - new + r
                if new is not None:
                    keep &= toks <= pos
                if window is not None:
                    keep &= toks > pos - window
                if not keep.any():
                    continue
                w = np.exp(s[keep] - s[keep].max())
                val = (w / w.sum()) @ v[g][keep]
                if new is None:
                    out[b, h] = val
                else:
                    out[b, h, r] = val
    return out


def _cache(rng, B, H, G, D, T, NP, P, lens, shared=True, poison=False):
    """Random queries, caches and page tables; entries past each length are -1 (never read),
    or with `poison` (from the second sequence on) the last page, which holds NaN: copied
    and used, it would show."""
    q = jnp.asarray(rng.normal(size=(B, H, D)), jnp.bfloat16)
    kc = rng.normal(size=(G, P, T, D)).astype(np.float32)
    vc = rng.normal(size=(G, P, T, D)).astype(np.float32)
    if poison:
        kc[:, P - 1] = vc[:, P - 1] = np.nan
    pages = rng.permutation(P - 1)[: B * NP].reshape(B, NP) if B * NP < P else rng.integers(0, P - 1, (B, NP))
    pages = np.asarray(pages, np.int32)
    if shared and B > 1:
        pages[1, 0] = pages[0, 0]  # a page shared between sequences (a common prefix)
    for b, n in enumerate(lens):
        pages[b, -(-n // T):] = P - 1 if poison and b else -1  # entries past a length are never read
    return q, jnp.asarray(kc, jnp.bfloat16), jnp.asarray(vc, jnp.bfloat16), pages, np.asarray(lens, np.int32)


MODES = {"interpreter": lambda: True, "simulator": lambda: pltpu.InterpretParams()}
# For a test whose case the simulator runs as the CPU interpreter would, and checks more of
# (NaN-filled memory: a page copied that should not be, or one missing): the simulator, and
# the interpreter too under SPARSEGEN_SWEEP=1. For paged walks the simulator is also the
# cheaper (the interpreter compiles every page's copy: 15 CPU-seconds against 7 for
# paged_decode's lengths). The CPU interpreter runs paged_decode below (jit, out-of-range
# entries, JAX's paged kernel) and every serving example.
SIMULATOR_UNLESS_SWEEP = list(MODES) if SWEEP else ["simulator"]


@pytest.mark.parametrize("mode", SIMULATOR_UNLESS_SWEEP)
def test_paged_decode_against_the_oracle(tmp_path, mode):
    mod, _ = _load("paged_decode.spk", tmp_path)
    rng = np.random.default_rng(0)
    T, NP = 16, 40
    # lengths: none, one token, a page boundary, a key-block boundary plus one, the maximum
    lens = [0, 1, 32, 513, NP * T]
    # Entries past the lengths point at a page of NaN: no page past a length is copied (the
    # simulator fills what is not copied with NaN too: every page used was copied).
    q, kc, vc, pages, lens = _cache(rng, 5, 16, 2, 128, T, NP, 230, lens, poison=True)
    got = mod.paged_decode(q, kc, vc, pages, lens, interpret=MODES[mode]())
    if mode == "simulator":
        pltpu.reset_tpu_interpret_mode_state()
    want = _oracle(q, kc, vc, pages, lens)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-2, rtol=2e-2)
    assert not np.asarray(got[0]).any()  # a sequence of length 0 attends to nothing: zeros
    ref = mod.reference(q, kc, vc, pages, lens)
    np.testing.assert_allclose(np.asarray(ref, np.float64), want, atol=2e-2, rtol=2e-2)


def test_under_jit_tables_and_lengths_are_traced_without_recompiling(tmp_path):
    mod, _ = _load("paged_decode.spk", tmp_path)
    rng = np.random.default_rng(1)
    T, NP = 64, 12  # pages of 64: few copies for the interpreter
    traces = []

    def step(q, kc, vc, pages, lens):
        traces.append(1)
        return mod.paged_decode(q, kc, vc, pages, lens, interpret=True)

    run = jax.jit(step)
    for lens in ([3, 600], [768, 17]):
        q, kc, vc, pages, lens = _cache(rng, 2, 8, 1, 128, T, NP, 100, lens)
        got = run(q, kc, vc, pages, lens)
        np.testing.assert_allclose(np.asarray(got, np.float64), _oracle(q, kc, vc, pages, lens), atol=2e-2, rtol=2e-2)
    assert len(traces) == 1


def test_a_table_entry_out_of_range_is_a_value_error_where_reached(tmp_path):
    mod, _ = _load("paged_decode.spk", tmp_path)
    rng = np.random.default_rng(2)
    q, kc, vc, pages, lens = _cache(rng, 2, 8, 1, 128, 64, 8, 30, [100, 5])
    pages[0, 1] = 30  # reached: tokens 64..99 live on page entry 1
    with pytest.raises(ValueError, match=r"pages entry \(0, 1\) is 30, outside the 30 pages"):
        mod.paged_decode(q, kc, vc, pages, lens, interpret=True)
    pages[0, 1], pages[1, 3] = 2, 999  # not reached: sequence 1 has one page
    mod.paged_decode(q, kc, vc, pages, lens, interpret=True)


def test_a_page_size_that_does_not_divide_the_key_block_is_refused(tmp_path):
    mod, _ = _load("paged_decode.spk", tmp_path)
    rng = np.random.default_rng(3)
    q, kc, vc, pages, lens = _cache(rng, 1, 8, 1, 128, 24, 4, 8, [30])
    with pytest.raises(ValueError, match=r"kc dim 2 \(T\) is 24: pages must divide the key block of 512"):
        mod.paged_decode(q, kc, vc, pages, lens, interpret=True)


def test_gradients_through_the_table_are_refused_saying_so(tmp_path):
    mod, _ = _load("paged_decode.spk", tmp_path)
    rng = np.random.default_rng(4)
    q, kc, vc, pages, lens = _cache(rng, 1, 8, 1, 128, 16, 4, 8, [30])
    loss = lambda kc: mod.paged_decode(q, kc, vc, pages, lens, interpret=True).astype(jnp.float32).sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match=r"read through a table .* not derived yet on TPU"):
        jax.eval_shape(jax.grad(loss), kc)  # raised while tracing: nothing runs


def test_the_plan_says_how_pages_are_copied(tmp_path):
    _, m = _load("paged_decode.spk", tmp_path)
    assert "a block gathers its 512 / T pages, one copy per page and operand" in m.code
    assert "pages outside the bounds are never copied" in m.code


def test_on_gpus_table_reads_are_lowered():
    """paged_decode builds for h200 too (tests/test_gpu_decode.py runs the six examples there)."""
    (m,) = compile_file(SPECS / "paged_decode.spk", "h200")
    assert "plgpu.copy_gmem_to_smem" in m.code and "pages_gmem[base + page]" in m.code


@pytest.mark.parametrize("text, message", [
    ("s[b, h, j] = q[b, h, d] * kc[h // 8, pages[b, j // T], j % T, d] where j < lens[b]\n"
     "    o[b, h, e] = softmax(s[b, h, j], j) * vc[h // 8, pages[b, j // T], j % T, e]\n    tile b = 1, h = 16, j = 512, d = 128, e = 128",
     "a row block of 16 'h' must read one 'kc' head"),
    ("s[b, h, j] = q[b, h, d] * kc[h // 8, pages[b, j // T], j % T, d] where j < lens[b]\n"
     "    o[b, h] = logsumexp(s[b, h, j], j)\n    tile b = 1, h = 8, j = 512, d = 128",
     "a paged walk feeds softmax products only"),
])
def test_paged_forms_it_does_not_walk_are_refused(text, message):
    src = f"""kernel k {{
    in  q: bf16[B, H, D]
    in  kc: bf16[G, P, T, D]
    {'' if 'logsumexp' in text else 'in  vc: bf16[G, P, T, D]'}
    in  pages: index[B, NP]
    in  lens: index[B]
    out o: {'f32[B, H]' if 'logsumexp' in text else 'bf16[B, H, D]'}
    {text}
}}
"""
    with pytest.raises(SpecError, match=message):
        compile_source(SourceFile("k.spk", src))


@pytest.mark.parametrize("target", ["v5e", "h200"])
@pytest.mark.parametrize("condition, lengths, at, message", [
    ("j <= lens[b] - 4 + i - h", "lens: index[B]", "q[b, h, i, d]",
     "not supported yet: a paged walk's condition compares 'h', packed into the rows (tile h = 8): the page bounds are kept "
     "per value of each batch or head index, and a block of rows holds 8 'h'; compare 'i' (its positions), sizes, or "
     "operands at indices walked one at a time"),
    ("j <= hl[b, h] - 4 + i", "hl: index[B, H]", "hl[b, h]",
     "not supported yet: a paged walk's condition reads 'hl[b, h]' at 'h', packed into the rows (tile h = 8): it is read "
     "once per step, and a block of rows holds 8 'h'; compare 'i' (its positions), sizes, or operands at indices walked "
     "one at a time"),
])  # fmt: skip
def test_a_condition_over_heads_packed_into_the_rows_is_refused_saying_why(condition, lengths, at, message, target):
    """paged_gqa_speculative_decode with its condition over the packed heads: the diagnostic
    users see (at the query read, or at the operand read), the same on TPU and GPU."""
    text = (SPECS / "paged_gqa_speculative_decode.spk").read_text()
    text = text.replace("j <= lens[b] - 4 + i", condition).replace("lens: index[B]", lengths)
    with pytest.raises(SpecError) as info:
        compile_source(SourceFile("bad.spk", text), target)
    lines = text.splitlines()
    line = next(n for n, t in enumerate(lines, 1) if condition in t)
    assert info.value.render().splitlines()[0] == f"bad.spk:{line}:{lines[line - 1].index(at) + 1}: error: {message}"


def _mqa_oracle(q, kc, vc, pages, lens):
    return _oracle(q, np.asarray(kc)[None], np.asarray(vc)[None], pages, lens, heads_per_kv=q.shape[1])


# In the CPU interpreter: soft-capping and one shared head (their chains); the window and
# several new tokens run in the simulator below (their walks), in both under SPARSEGEN_SWEEP=1.
SERVING_INTERPRETED = [
    ("paged_mqa_decode.spk", _mqa_oracle, False),
    ("paged_softcap_decode.spk", lambda *a: _oracle(*a, cap=50.0), False),
    ("paged_window_decode.spk", lambda *a: _oracle(*a, window=1024), False),
    ("paged_speculative_decode.spk", lambda *a: _oracle(*a, new=8), True),
]
if not SWEEP:
    SERVING_INTERPRETED = [c for c in SERVING_INTERPRETED if "window" not in c[0] and "speculative" not in c[0]]


@pytest.mark.parametrize("spec, oracle, speculative", SERVING_INTERPRETED)
def test_serving_examples_against_the_oracle(tmp_path, spec, oracle, speculative):
    mod, m = _load(spec, tmp_path)
    rng = np.random.default_rng(5)
    # Pages of 64 (the interpreter copies page by page; paged_decode's tests take pages of
    # 16): the window's case needs more than its 1024 tokens.
    T, NP = 64, 20
    lens = [1100, NP * T] if "window" in spec else [8, 530, NP * T]
    mqa = "mqa" in spec
    q, kc, vc, pages, lens = _cache(rng, len(lens), 8, 1, 128, T, NP, 70, lens)
    if mqa:
        kc, vc = kc[0], vc[0]
    if speculative:
        q = jnp.asarray(rng.normal(size=(len(lens), 8, 8, 128)), jnp.bfloat16)
    got = getattr(mod, m.kernel)(q, kc, vc, pages, lens, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float64), oracle(q, kc, vc, pages, lens), atol=2e-2, rtol=2e-2)


# In the simulator by default the two whose walks differ from paged_decode's (which runs
# there above): a window (row blocks start past pages before it) and several new tokens (a
# causal condition per row); soft-capping and one shared head change the chain only (each
# runs in the interpreter above); all four under SPARSEGEN_SWEEP=1.
SERVING_SIMULATED = [
    ("paged_mqa_decode.spk", _mqa_oracle, None),
    ("paged_softcap_decode.spk", lambda *a: _oracle(*a, cap=50.0), None),
    ("paged_window_decode.spk", lambda *a: _oracle(*a, window=1024), None),
    ("paged_speculative_decode.spk", lambda *a: _oracle(*a, new=8), 8),
]
if not SWEEP:
    SERVING_SIMULATED = [c for c in SERVING_SIMULATED if "window" in c[0] or "speculative" in c[0]]


@pytest.mark.parametrize("spec, oracle, new", SERVING_SIMULATED)
def test_serving_examples_in_the_simulator(tmp_path, spec, oracle, new):
    """Pages of 64 (few copies, the simulator is slow), NaN past the lengths."""
    mod, m = _load(spec, tmp_path)
    rng = np.random.default_rng(8)
    T, NP = 64, 20
    lens = [1100, 70] if "window" in spec else [70, 9]
    q, kc, vc, pages, lens = _cache(rng, 2, 8, 1, 128, T, NP, 60, lens, poison=True)
    if "mqa" in spec:
        kc, vc = kc[0], vc[0]
    if new:
        q = jnp.asarray(rng.normal(size=(2, 8, new, 128)), jnp.bfloat16)
    got = getattr(mod, m.kernel)(q, kc, vc, pages, lens, interpret=pltpu.InterpretParams())
    pltpu.reset_tpu_interpret_mode_state()
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_allclose(np.asarray(got, np.float64), oracle(q, kc, vc, pages, lens), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mode", SIMULATOR_UNLESS_SWEEP)
def test_heads_and_new_tokens_packed_into_the_rows(tmp_path, mode):
    """paged_gqa_speculative_decode: 8 heads x 4 new tokens in one block of 32 rows (v2 section 3)."""
    mod, m = _load("paged_gqa_speculative_decode.spk", tmp_path)
    assert "rows of 's' (8 'h' x 4 'i' at a time, per b)" in m.code
    rng = np.random.default_rng(9)
    q, kc, vc, pages, lens = _cache(rng, 2, 16, 2, 128, 64, 12, 40, [530, 9], poison=True)
    q = jnp.asarray(rng.normal(size=(2, 16, 4, 128)), jnp.bfloat16)
    got = mod.paged_gqa_speculative_decode(q, kc, vc, pages, lens, interpret=MODES[mode]())
    if mode == "simulator":
        pltpu.reset_tpu_interpret_mode_state()
    np.testing.assert_allclose(np.asarray(got, np.float64), _oracle(q, kc, vc, pages, lens, new=4), atol=2e-2, rtol=2e-2)


def test_a_sliding_window_never_copies_pages_before_it(tmp_path):
    """The bounds of the window's row blocks start past the pages before the window."""
    mod, _ = _load("paged_window_decode.spk", tmp_path)
    sizes = (1, 8, 128, 1, 64, 16, 200)  # B, H, D, G, P, T, NP
    kinds = mod._classify_pages(np, np.asarray([3000], np.int32), sizes)
    first, end = (np.asarray(x) for x in mod._page_bounds(kinds))
    assert (first[0, 0], end[0, 0]) == ((3000 - 1024) // 16, -(-3000 // 16))


def _aot(mod, target: str, B=64, H=32, G=4, D=128, T=16, NP=2048, P=8192):
    """Compile paged_decode ahead of time for a TPU with no TPU: the issue's serving shapes."""
    from aot import topology_device
    from jax.sharding import SingleDeviceSharding

    device = topology_device({"v5e": "v5e:2x2", "v6e": "v6e:2x2"}[target])
    at = SingleDeviceSharding(device)
    structs = [jax.ShapeDtypeStruct(s, d, sharding=at) for s, d in (
        ((B, H, D), jnp.bfloat16), ((G, P, T, D), jnp.bfloat16), ((G, P, T, D), jnp.bfloat16), ((B, NP), jnp.int32), ((B,), jnp.int32))]
    with jax.default_device(device):
        return jax.jit(lambda *a: mod.paged_decode(*a)).trace(*structs).lower().compile()


# Each target with one page size by default (both under SPARSEGEN_SWEEP=1).
@pytest.mark.parametrize("target, page", [("v5e", 16), ("v5e", 64), ("v6e", 16), ("v6e", 64)] if SWEEP else [("v5e", 16), ("v6e", 64)])
def test_paged_decode_compiles_at_serving_shapes(tmp_path, target, page):
    """B = 64, H = 32 (G = 4: the spec reads h // 8), D = 128, 2048 pages a sequence: the
    table (512 KiB) fits scalar memory beside the bounds."""
    mod, _ = _load("paged_decode.spk", tmp_path)
    compiled = _aot(mod, target, T=page)
    assert "tpu_custom_call" in compiled.as_text()


@pytest.mark.parametrize("mode", MODES)
def test_a_table_too_large_for_scalar_memory_is_read_a_row_per_step(tmp_path, mode):
    mod, _ = _load("paged_decode.spk", tmp_path)
    mod._TABLE_SMEM_BYTES = 0  # as if the table were larger than scalar memory
    rng = np.random.default_rng(6)
    q, kc, vc, pages, lens = _cache(rng, 2, 8, 1, 128, 64, 12, 40, [300, 700], poison=True)
    got = mod.paged_decode(q, kc, vc, pages, lens, interpret=MODES[mode]())
    if mode == "simulator":
        pltpu.reset_tpu_interpret_mode_state()
    np.testing.assert_allclose(np.asarray(got, np.float64), _oracle(q, kc, vc, pages, lens), atol=2e-2, rtol=2e-2)
    if mode == "interpreter":
        assert "tpu_custom_call" in _aot(mod, "v5e", B=8, NP=512, P=4096).as_text()


def test_paged_decode_equals_jax_paged_attention(tmp_path):
    """The same inputs through JAX's hand-written kernel (its interpreter), whose layout the
    spec's is: q[B, H, D], caches [G, P, T, D], page_indices[B, NP], lengths[B]."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    mod, _ = _load("paged_decode.spk", tmp_path)
    rng = np.random.default_rng(7)
    T, NP = 64, 16  # pages of 64: JAX's kernel then copies blocks of 8 pages
    q, kc, vc, pages, lens = _cache(rng, 3, 16, 2, 128, T, NP, 60, [1, 512, 700])
    pages = np.where(pages < 0, 0, pages)  # JAX's kernel copies whole compute blocks: every entry must address a page
    got = mod.paged_decode(q, kc, vc, pages, lens, interpret=True)
    # paged_attention multiplies by no scale: the spec's 1/sqrt(128) goes into q.
    scaled = (q.astype(jnp.float32) * 0.08838834764831845).astype(jnp.bfloat16)
    with pltpu.force_tpu_interpret_mode():
        want = paged_attention(scaled, kc, vc, jnp.asarray(lens), jnp.asarray(pages), pages_per_compute_block=512 // T)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2)


def test_an_index_operand_takes_any_integer_dtype(tmp_path):
    """`lens: index[B]` takes any integer dtype, as `pages: index[B, NP]` does (int64 was
    refused: "lens has dtype int64, but the spec declares int32")."""
    mod, _ = _load("paged_decode.spk", tmp_path)
    rng = np.random.default_rng(4)
    q, kc, vc, pages, lens = _cache(rng, 2, 8, 1, 128, 64, 4, 12, [100, 5])
    want = np.asarray(mod.paged_decode(q, kc, vc, pages, lens, interpret=True), np.float32)
    for dtype in (np.int64, np.uint8, np.int16):
        got = mod.paged_decode(q, kc, vc, pages.astype(np.int64), lens.astype(dtype), interpret=True)
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    np.testing.assert_array_equal(np.asarray(mod.reference(q, kc, vc, pages, lens.astype(np.int64)), np.float32),
                                  np.asarray(mod.reference(q, kc, vc, pages, lens), np.float32))
    with pytest.raises(ValueError, match="lens must hold integers, got dtype float32"):
        mod.paged_decode(q, kc, vc, pages, lens.astype(np.float32), interpret=True)


def test_heads_that_disagree_with_the_cache_name_both_places(tmp_path):
    """H = 16 query heads over a cache of G = 1 key/value heads read as h // 8: the message
    names q dim 1 (H) and kc dim 0 (G), not kc dim 0 twice."""
    mod, _ = _load("paged_decode.spk", tmp_path)
    q, kc, vc, pages, lens = _cache(np.random.default_rng(5), 2, 16, 1, 128, 64, 4, 12, [100, 5])
    with pytest.raises(ValueError) as info:
        mod.paged_decode(q, kc, vc, pages, lens, interpret=True)
    assert str(info.value) == ("paged_decode: H = 16 from q dim 1 needs G = H / 8 = 2 (kc dim 0, read as h // 8), "
                               "but G = 1 from kc dim 0")
