"""Warp-specialized GPU attention (issue 21, FlashAttention-3's shape): where a row block has
128 rows, a CTA's producer warpgroup issues the TMA copies of the key-side tiles while two
consumer warpgroups (64 rows each) compute: `plgpu.kernel(num_threads=3, thread_name="wg")`
around `plgpu.emit_pipeline_warp_specialized`. A 64-row block keeps one warpgroup per CTA
(the same step and consumer code, driven by `plgpu.emit_pipeline`). The backward's kernels
likewise (tokamax's sm90 vjp): dq where the row block has 128 rows, dk/dv where the key block
has 128 keys (the transposed walk), each consumer 64 rows (keys), a step 64 keys (rows).

The Mosaic GPU interpreter of jax 0.12 runs a warp-specialized kernel as it is: one CPU
thread per warpgroup, the barriers between them honoured (docs/gpu-notes.md). So the kernel
is proven in the three stages as every GPU kernel: the interpreter against `reference`
(values and gradients; a where-condition, ragged sizes, per-row segment ids, a mask tile and
a bias tile split between the consumers), a negative control showing the interpreter tells
the consumers apart, lowering under an abstract H200 (shared memory to the byte), and ptxas
for sm_90a (registers, spills).
"""

from __future__ import annotations

import re
import types

import jax
import numpy as np
import pytest
from conftest import SWEEP, assert_matches, build, spec_text, with_tiles
from test_gpu_attention import BIASED, floats, weighted_sum

from sparsegen.compiler import lower_source
from sparsegen.source import SourceFile
from sparsegen.testing import example_args, resolve_sizes

# 128-row blocks: two consumer warpgroups share each CTA's walk. Ragged sizes (S, T) where the
# spec has them; a where-condition (causal), per-row segment ids (document), a mask tile that
# each consumer reads half of (masked). 128-key blocks: dk/dv warp-specialized too (its
# consumers read their halves of the mask tile, along the keys). The f32 mask's forward does
# not fit 128 keys a step: there dk/dv keeps one warpgroup; its bf16 twin takes two.
TWO = {
    "causal_attention": (dict(b=1, h=1, i=128, j=128, d=64, e=64), dict(B=1, H=1, S=300, D=64)),
    "document_attention": (dict(b=1, h=1, i=128, j=128, d=64, e=64), dict(B=1, H=1, S=200, D=64)),
    "masked_attention": (dict(h=1, i=128, j=64, d=64, e=64), dict(H=1, S=256, T=150, D=64)),
    "masked_attention_bf16": (dict(h=1, i=128, j=128, d=64, e=64), dict(H=1, S=256, T=150, D=64)),
}


def example(name: str, tiles: dict) -> str:
    """An example spec with these tiles (`NAME_bf16`: its f32 operands declared bf16)."""
    if name.endswith("_bf16"):
        return with_tiles(spec_text(name.removesuffix("_bf16")).replace("f32[", "bf16["), **tiles)
    return with_tiles(spec_text(name), **tiles)


def warpgroups(m) -> tuple[int, int, int]:
    """Consumer warpgroups of the forward's, dq's and dk/dv's CTA."""
    return m.warpgroups, m.backward.dq.warpgroups, m.backward.dkv.warpgroups


def source_of(mod) -> str:
    with open(mod.__file__) as f:
        return f.read()


def kernel_call(text: str) -> str:
    """The forward's `plgpu.kernel(...)` call in a module's `_impl`."""
    impl = text[text.index("def _impl("):]
    return impl[impl.index("plgpu.kernel("):impl.index("interpret=_gpu_interpret")]


def test_128_row_blocks_run_two_consumers_and_a_producer_64_row_blocks_one_warpgroup():
    """Warp-specialized where the row block holds two consumers' rows; a 64-row block keeps
    one warpgroup that copies and computes (a warp-specialized CTA claims the whole register
    file at launch, so one consumer an SM would compute less than two plain CTAs)."""
    for rows, specialized in ((128, True), (64, False)):
        kernel, mod = build(example("causal_attention", dict(b=1, h=1, i=rows, j=128, d=64, e=64)), "h200")
        text = source_of(mod)
        call = kernel_call(text)
        forward = text[text.index("def _attention_kernel("):text.index("def _attention_dq_kernel(")]
        if specialized:
            assert "num_threads=3," in call and 'thread_name="wg"' in call, call
            assert "plgpu.emit_pipeline_warp_specialized(" in forward and "num_compute_wgs=2," in forward
            assert "memory_registers=40," in forward and 'collective_axes="wg"' in forward
        else:
            assert "num_threads" not in call and "thread_name" not in call, call
            assert "plgpu.emit_pipeline(" in forward and "warp_specialized" not in forward


def backward_calls(text: str) -> dict[str, str]:
    """`_backward`'s two `plgpu.kernel(...)` calls, by kernel."""
    calls = {}
    for which in ("dq", "dkv"):
        at = text.index(f"_attention_{which}_kernel,")  # in functools.partial(...)
        calls[which] = text[at:text.index("interpret=_gpu_interpret", at)]
    return calls


@pytest.mark.parametrize("rows,keys", [(128, 64), (64, 128), (128, 128), (64, 64)])
def test_backward_kernels_are_warp_specialized_where_their_block_holds_two_consumers(rows, keys):
    """dq's CTA takes the row block's 128 rows (two consumers), dk/dv's the key block's 128
    keys; a 64-row (64-key) block keeps one warpgroup that copies and computes. The producer
    keeps 24 registers (FlashAttention-3's backward), the consumers 240."""
    text_ = example("causal_attention", dict(b=1, h=1, i=rows, j=keys, d=64, e=64))
    kernel, mod = build(text_, "h200")
    text = source_of(mod)
    calls = backward_calls(text)
    for which, block in (("dq", rows), ("dkv", keys)):
        fn = text[text.index(f"def _attention_{which}_kernel("):]
        fn = fn[:fn.index("\ndef ", 1)]
        if block == 128:
            assert "num_threads=3," in calls[which] and 'thread_name="wg"' in calls[which], calls[which]
            assert "plgpu.emit_pipeline_warp_specialized(" in fn and "num_compute_wgs=2," in fn and "memory_registers=24," in fn
            assert 'collective_axes="wg"' in fn and "plgpu.emit_pipeline(" not in fn
        else:
            assert "num_threads" not in calls[which], calls[which]
            assert "plgpu.emit_pipeline(" in fn and "warp_specialized" not in fn
    m = lower_source(SourceFile("c.spk", text_), "h200")[0]
    assert (m.backward.dq.warpgroups, m.backward.dkv.warpgroups) == (1 + (rows == 128), 1 + (keys == 128))


# The bf16 mask at 128 keys (dk/dv's consumers reading their halves of a mask tile) under
# SPARSEGEN_SWEEP=1 only: the bias tile's test splits a tile along the keys in `make test`.
@pytest.mark.parametrize("name", [n for n in sorted(TWO) if SWEEP or not n.endswith("_bf16")])
def test_two_consumers_match_reference_in_the_gpu_interpreter(name):
    """Values and jax.grad (the forward's row logsumexp feeds the backward) against `reference`."""
    tiles, sizes = TWO[name]
    kernel, mod = build(example(name, tiles), "h200")
    m = lower_source(SourceFile(f"{name}.spk", example(name, tiles)), "h200")[0]
    assert warpgroups(m) == (2, 2, 1 + (tiles["j"] == 128)), name
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(1))
    run = lambda *a, **k: getattr(mod, kernel.name)(*a, **k, interpret=True)  # noqa: E731
    out = run(*args, **keywords)
    assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, sizes))
    kinds = np.asarray(mod.block_kinds(*args, **keywords))
    assert (kinds == 0).any() and (kinds != 0).any(), kinds  # the walk skips blocks here
    got = jax.grad(weighted_sum(run, keywords), argnums=floats(args))(*args)
    want = jax.grad(weighted_sum(mod.reference, keywords), argnums=floats(args))(*args)
    for g, w, n in zip(got, want, floats(args)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        scale = np.abs(w).max()
        assert scale > 0.1 and np.isfinite(g).all(), (name, n, scale)
        bf16 = np.asarray(args[n]).dtype != np.float32
        np.testing.assert_allclose(g, w, atol=scale * (0.015 if bf16 else 1e-4), err_msg=f"{name}: argument {n}")


def test_two_consumers_read_their_halves_of_a_bias_tile():
    """The chain's operands with two consumers: a bias tile (each consumer its 64 rows of the
    CTA's 128; in dk/dv its 64 keys), a slope per head, a per-key term; the values and the
    gradients of q, k and v (the bias's and slope's are refused on GPUs)."""
    text = BIASED.replace("tile h = 1, i = 64, j = 64,", "tile h = 1, i = 128, j = 128,")
    kernel, mod = build(text, "h200")
    assert source_of(mod).count("num_compute_wgs=2,") == 4  # the forward (its walk and the exact one taken again), dq and dk/dv
    rng = np.random.default_rng(5)
    S = 256  # two row blocks, two key blocks: one of them empty (causal)
    args = [jax.numpy.asarray(rng.standard_normal(s), jax.numpy.bfloat16) for s in [(2, S, 64)] * 3 + [(2, S, S)]]
    args += [jax.numpy.asarray(rng.random(2), jax.numpy.float32), jax.numpy.asarray(rng.standard_normal(S), jax.numpy.float32)]
    assert_matches(kernel, mod.biased(*args, interpret=True), mod.reference(*args), {"H": 2, "S": S, "D": 64})
    run = lambda *a: mod.biased(*a, interpret=True)  # noqa: E731
    got = jax.grad(weighted_sum(run, {}), argnums=(0, 1, 2))(*args)
    want = jax.grad(weighted_sum(mod.reference, {}), argnums=(0, 1, 2))(*args)
    for n, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        scale = np.abs(w).max()
        assert scale > 0.1 and np.isfinite(g).all(), (n, scale)
        np.testing.assert_allclose(g, w, atol=scale * 0.015, err_msg=f"argument {n}")


PADDED = """
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
    tile h = 1, i = 128, j = 128, d = 64, e = 64
}
"""


def test_an_empty_row_block_runs_no_step_and_outputs_zeros_and_minus_infinity():
    """A row block with nothing present: the producer copies nothing and both consumers walk
    zero steps (o 0, lse and max minus infinity); three outputs through the consumers' tiles,
    a per-row and a per-key operand. Its keys are absent too: in the backward, dq's CTA of
    that row block and dk/dv's of that key block walk zero steps and write zeros."""
    kernel, mod = build(PADDED, "h200")
    assert "num_compute_wgs=2," in source_of(mod)
    rng = np.random.default_rng(3)
    q, k, v = (jax.numpy.asarray(rng.standard_normal((2, 384, 64)), jax.numpy.bfloat16) for _ in range(3))
    ok = np.ones(384, np.int32)
    ok[128:256] = 0  # row block 1 sees nothing; its keys are absent for every row
    assert (np.asarray(mod.block_kinds(q, k, v, ok))[1] == 0).all()
    o, lse, top = (np.asarray(x, np.float32) for x in mod.padded(q, k, v, ok, interpret=True))
    ref_o, ref_lse, ref_top = (np.asarray(x, np.float32) for x in mod.reference(q, k, v, ok))
    assert not o[:, 128:256].any() and np.isneginf(lse[:, 128:256]).all() and np.isneginf(top[:, 128:256]).all()
    seen = np.r_[0:128, 256:384]
    np.testing.assert_allclose(o, ref_o, atol=0.02)
    np.testing.assert_allclose(lse[:, seen], ref_lse[:, seen], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(top[:, seen], ref_top[:, seen], rtol=1e-5, atol=1e-5)

    src = source_of(mod)
    assert src.count("num_compute_wgs=2,") == 4 and src.count("memory_registers=24,") == 2  # the forward twice (walk, exact walk), dq, dk/dv; 24: dq and dk/dv
    w = [jax.numpy.asarray(np.random.default_rng(7 + n).standard_normal(s), jax.numpy.float32) for n, s in enumerate([o.shape, (2, 256)])]

    def loss(f):
        def value(q, k, v):
            o, lse, _ = f(q, k, v, ok)
            return (o.astype(jax.numpy.float32) * w[0]).sum() + (lse[:, seen] * w[1]).sum()
        return value

    got = jax.grad(loss(lambda *a: mod.padded(*a, interpret=True)), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(mod.reference), argnums=(0, 1, 2))(q, k, v)
    for n, (g, w_) in enumerate(zip(got, want)):
        g, w_ = np.asarray(g, np.float32), np.asarray(w_, np.float32)
        assert np.isfinite(g).all() and not g[:, 128:256].any(), n  # the empty block's rows (keys): zeros
        scale = np.abs(w_[:, seen]).max()
        assert scale > 0.1, (n, scale)
        np.testing.assert_allclose(g[:, seen], w_[:, seen], atol=scale * 0.015, err_msg=f"argument {n}")


def test_the_interpreter_tells_the_consumers_apart():
    """Negative control: the same module with both consumers scoring warpgroup 0's query tile
    gets consumer 0's rows right and consumer 1's wrong, so the interpreter runs each
    warpgroup with its own index (it does not run one and copy it)."""
    tiles, sizes = TWO["causal_attention"]
    kernel, mod = build(example("causal_attention", tiles), "h200")
    text = source_of(mod)
    assert text.count("plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.T)") == 2  # the walk and the exact one (taken again where not finite)
    broken = types.ModuleType("broken")
    exec(compile(text.replace("plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.T)", "plgpu.wgmma(acc_ref, q_smem.at[0], k_smem.T)"),
                 "broken.py", "exec"), broken.__dict__)
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(2))
    o, _ = broken.causal_attention(*args, **keywords, interpret=True)
    ref, _ = mod.reference(*args, **keywords)
    err = np.abs(np.asarray(o, np.float32) - np.asarray(ref, np.float32)).max(axis=-1)[0, 0]  # per row
    err = np.where(np.isnan(err), np.inf, err)  # consumer 0 also writes its output over that tile: NaN is wrong too
    first, second = (np.arange(300) % 128) < 64, (np.arange(300) % 128) >= 64
    assert err[first].max() < 0.05 and err[second].max() > 0.5, (err[first].max(), err[second].max())


# ------------------------------------------------------------------ stages 2 and 3

LOWERED = {  # GPU-sized, two consumers in the forward and dq; in dk/dv with 128-key blocks (causal at d = 128: test_gpu_attention.py)
    "document_attention": dict(b=1, h=1, i=128, j=128, d=64, e=64),
    "masked_attention": dict(h=1, i=128, j=64, d=64, e=64),
    "masked_attention_bf16": dict(h=1, i=128, j=128, d=64, e=64),
}


# ptxas spills of the forward, bytes at most: the bf16 mask's forward, 128 keys a step (an i8
# mask tile of 64 x 128 per consumer beside the scores), spilled 88, and 128 since the exact
# walk taken again beside the first (language v3 section 0: a NaN of an absent value kept out;
# issue 37); document_attention spills 36 since then (168 registers at launch); measured. The
# backward kernels none.
FORWARD_SPILLS = {"masked_attention_bf16": 128, "document_attention": 40}


def test_two_consumers_lower_and_compile_for_h200():
    """Shared memory to the byte (Mosaic GPU's count against the rules', the forward's and
    each backward kernel's), then ptxas: every kernel without spills (registers at launch; a
    warp-specialized kernel's consumers take more by setmaxnreg)."""
    from sparsegen.verify import verify_gpu_modules

    items = []
    for name, tiles in LOWERED.items():
        source = SourceFile(f"{name}.spk", example(name, tiles))
        items += [(m, source, "h200") for m in lower_source(source, "h200")]
    assert [warpgroups(m) for m, _, _ in items] == [(2, 2, 2), (2, 2, 1), (2, 2, 2)]
    results = verify_gpu_modules(items)
    for r in results:
        assert r.lowered and r.smem_used == r.smem_estimate <= r.smem_limit, (r.kernel, r.raw_error, r.smem_used, r.smem_estimate)
        assert r.backward == "lowers" and r.backward_smem_used == r.backward_smem_estimate, (r.kernel, r.backward)
    if results[0].compiled is None:
        pytest.skip(f"stage 3 (ptxas for sm_90a) not run: {results[0].stage3}")
    for name, r in zip(LOWERED, results):
        assert r.compiled, (name, r.raw_error)
        by_name = {re.sub("_mosaic_gpu_kernel$", "", kk["name"]): kk for kk in r.kernels}
        assert sorted(by_name) == ["attention_dkv_kernel", "attention_dq_kernel", "attention_kernel"], (name, sorted(by_name))
        for kernel, kk in by_name.items():
            limit = FORWARD_SPILLS.get(name, 0) if kernel == "attention_kernel" else 0
            assert kk["spill_bytes"] <= limit and kk["registers"] <= 255, (name, kk)


def test_two_consumers_walk_a_row_block_again_where_an_absent_value_is_nan():
    """document_attention, two consumers and a producer, S ragged (200): NaN in v at key 199,
    absent for rows 128..198 (another document below 150, above the diagonal from 150) and
    present for row 199. The plain walk of row block 1 meets it (0 x NaN) in every row, so the
    CTA's three warpgroups read the verdicts and walk the block again, exact (a second
    warp-specialized pipeline): rows 0..198 finite and as the math has them, row 199 NaN in
    the planted columns only. Against `reference` and numpy in float64, term by term."""
    tiles, sizes = TWO["document_attention"]
    kernel, mod = build(example("document_attention", tiles), "h200")
    S = sizes["S"]
    rng = np.random.default_rng(2)
    q, k, v = (np.asarray(jax.numpy.asarray(rng.standard_normal((1, 1, S, 64)), jax.numpy.bfloat16).astype(np.float32)) for _ in range(3))
    v = v.copy()
    v[0, 0, 199, ::3] = np.nan
    seg = (np.arange(S) >= 150).astype(np.int32)[None]
    args = [jax.numpy.asarray(a, jax.numpy.bfloat16) for a in (q, k, v)] + [seg]
    got = np.asarray(mod.document_attention(*args, interpret=True), np.float64)
    ref = np.asarray(mod.reference(*args), np.float64)
    # The math in float64: a row's softmax over its present keys, an absent term 0 whatever v holds.
    present = (seg[0][:, None] == seg[0][None, :]) & (np.arange(S)[:, None] >= np.arange(S)[None, :])
    s = np.where(present, q[0, 0].astype(np.float64) @ k[0, 0].T * 0.125, -np.inf)
    w = np.where(present, np.exp(s - s.max(-1, keepdims=True)), 0.0)
    with np.errstate(invalid="ignore"):
        want = np.where(present[:, :, None], (w / w.sum(-1, keepdims=True))[:, :, None] * v[0, 0].astype(np.float64)[None], 0.0).sum(1)
    assert np.isfinite(want[:199]).all() and np.isnan(want[199, ::3]).all() and np.isfinite(want[199, 1::3]).all()
    for what, other in (("math", want[None, None]), ("reference", ref)):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(other), err_msg=f"NaN where the {what} has none, or none where it has")
        np.testing.assert_allclose(got, other, rtol=3e-2, atol=3e-2, err_msg=what)
