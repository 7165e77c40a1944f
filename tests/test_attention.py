"""Attention-like kernels (issue 10): the four examples of ../shared/specs-v1, copied verbatim
into specs/, against a float64 numpy oracle in the CPU interpreter and the TPU simulator;
the block classification against a brute-force one; the walk's step and copy counts;
random conditions (SPARSEGEN_SWEEP=1 for a long sweep)."""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from aot import across_targets
from attention_oracle import brute_kinds, run
from conftest import SPECS, build, cpu_unless_sweep, in_both_modes, sim_unless_sweep, spec_text

from sparsegen.schedule.attention import row_plan

SWEEP = os.environ.get("SPARSEGEN_SWEEP") == "1"
BF16_TOL = dict(rtol=3e-2, atol=3e-2)
F32_TOL = dict(rtol=2e-4, atol=2e-4)


def rand(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def example(name: str, S: int, rng, **kw):
    """(args, sizes) for an example at sequence length S."""
    if name == "causal_attention":
        return [rand(rng, (1, 2, S, 128), jnp.bfloat16) for _ in range(3)], {}
    if name == "document_attention":
        seg = np.sort(rng.integers(0, kw.get("docs", 4), (2, S))).astype(np.int32)
        return [rand(rng, (2, 1, S, 64), jnp.bfloat16) for _ in range(3)] + [jnp.asarray(seg)], {}
    if name == "local_gqa_attention":
        return [rand(rng, (1, 4, S, 128), jnp.bfloat16), rand(rng, (1, 1, S, 128), jnp.bfloat16), rand(rng, (1, 1, S, 128), jnp.bfloat16)], {}
    T = kw.get("T", S)
    blocks = rng.random((-(-S // 128), -(-T // 128))) < 0.4
    blocks[0] = False  # the first row block sees nothing: its rows are written as zeros
    keep = np.repeat(np.repeat(blocks, 128, 0), 128, 1)[:S, :T] & (rng.random((S, T)) < 0.8)
    return [rand(rng, (2, S, 128), jnp.float32), rand(rng, (2, T, 128), jnp.float32), rand(rng, (2, T, 128), jnp.float32),
            jnp.asarray(keep.astype(np.int8))], {}


def sizes_of(kernel, args):
    out = {}
    for op, a in zip(kernel.inputs, args):
        for d, dim in zip(np.shape(a), op.dims):
            if dim.symbol is not None:
                out[dim.symbol] = d
    for rel in kernel.relations:
        out.setdefault(kernel.index(rel.index).size.symbol, out.get(rel.dim.symbol, 0) * rel.divisor)
    return out


def check_outputs(kernel, got, args, sizes):
    want = run(kernel, [np.asarray(a, np.float32) if a.dtype == jnp.bfloat16 else np.asarray(a) for a in args], sizes)
    got = got if isinstance(got, tuple) else (got,)
    for op, g, w in zip(kernel.outputs, got, want):
        g = np.asarray(g, np.float64)
        assert g.shape == w.shape, op.name
        assert not np.isnan(g).any(), f"NaN in {op.name}"
        tol = BF16_TOL if op.dtype.name == "bf16" or any(i.dtype.name == "bf16" for i in kernel.inputs) else F32_TOL
        np.testing.assert_allclose(g, w, err_msg=op.name, **tol)


EXAMPLES = ["causal_attention", "document_attention", "local_gqa_attention", "masked_attention"]
# Ragged lengths where the spec allows them (S is symbolic; the masked example's tiles divide).
LENGTHS = {"causal_attention": 700, "document_attention": 600, "local_gqa_attention": 1300, "masked_attention": 384}


# sha256 of ../shared/specs-v1's attention examples, as they were copied.
SHARED = {
    "causal_attention": "b1642d4054dfe9ba13fb326faa6e744f8deb5153db3f9f9733ba44cdde5a6897",
    "document_attention": "ad933f2e46acf0b67c22bf6f82fe8ad188b499bac7a54c23e690d7a844c0efae",
    "local_gqa_attention": "a5328bd908a14c61750f98ee074c5ca8edd8d99ef7bfac24a977b0847782bdbe",
    "masked_attention": "3c6ff5279e86558ef33096e07863b30f90c3a2744b2f9b71c79f3622ce3fe406",
}


def test_examples_are_the_shared_ones_verbatim():
    import hashlib

    shared = SPECS.parent.parent / "shared" / "specs-v1"
    for name in EXAMPLES:
        text = (SPECS / f"{name}.spk").read_bytes()
        assert hashlib.sha256(text).hexdigest() == SHARED[name], name
        if (shared / f"{name}.spk").exists():  # beside a checkout of the workplace
            assert text == (shared / f"{name}.spk").read_bytes()


# In the simulator causal_attention and the segment ids of document_attention
# (test_example_gradients runs the other two forward there), the other two in the CPU
# interpreter; every example in both under SPARSEGEN_SWEEP=1. The simulator runs the same
# call as the interpreter, its memory NaN-filled and its revisits checked.
EXAMPLES_SIMULATED = ["causal_attention", "document_attention"]


@pytest.mark.parametrize(*in_both_modes(EXAMPLES, EXAMPLES_SIMULATED, "name", alone=True), indirect=["interpret"])
def test_example_matches_numpy(name, interpret):
    kernel, mod = build(spec_text(name))
    rng = np.random.default_rng(0)
    args, kw = example(name, LENGTHS[name], rng)
    got = getattr(mod, name)(*args, **kw, interpret=interpret)
    check_outputs(kernel, got, args, sizes_of(kernel, args))
    # The module's own reference says the same.
    ref = mod.reference(*args, **kw)
    for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(r, np.float64), **BF16_TOL)


def test_rows_with_nothing_present_are_zero_and_minus_infinity():
    text = spec_text("causal_attention").replace("where i >= j", "where i >= j + 300")
    kernel, mod = build(text)
    args, _ = example("causal_attention", 640, np.random.default_rng(1))
    o, lse = mod.causal_attention(*args, interpret=True)
    assert np.all(np.asarray(o, np.float32)[:, :, :300] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, :300]))
    check_outputs(kernel, (o, lse), args, sizes_of(kernel, args))


def test_traced_segment_ids_under_jit():
    """Segment ids traced: classified with jax.numpy, the walk has the dense count of steps."""
    kernel, mod = build(spec_text("document_attention"))
    args, _ = example("document_attention", 512, np.random.default_rng(2))
    fn = jax.jit(lambda *a: mod.document_attention(*a, interpret=True))
    check_outputs(kernel, fn(*args), args, sizes_of(kernel, args))
    kinds = jax.jit(mod.block_kinds)(*args)
    assert kinds.shape == (2, 2, 2)


# ------------------------------------------------------------- classification

CONDITIONS = {
    "causal": "i >= j",
    "local": "i >= j and i - j < 300",
    "chunked": "i // 256 == j // 256 and i >= j",
    "offset causal": "i + T - S >= j",
    "band": "i - 200 <= j <= i + 100",
}


def condition_spec(cond: str, ti=128, tj=128, segs=False, mask=False) -> str:
    seg = "\n    in  seg: i32[S]" if segs else ""
    kseg = "\n    in  kseg: i32[T]" if segs else ""
    kseg += "\n    in  keep: i8[S, T] mask" if mask else ""
    return f"""kernel cond_attention {{
    in  q: f32[S, D]
    in  k: f32[T, D]
    in  v: f32[T, D]{seg}{kseg}
    out o: f32[S, D]
    out lse: f32[S]

    s[i, j] = q[i, d] * k[j, d] where {cond}
    o[i, e] = softmax(s[i, j], j) * v[j, e]
    lse[i] = logsumexp(s[i, j], j)

    tile i = {ti}, j = {tj}, d = 128, e = 128
}}
"""


@pytest.mark.parametrize("name", sorted(CONDITIONS))
@pytest.mark.parametrize("S,T", [(1024, 1024), (700, 900)])
def test_affine_classification_is_exact(name, S, T):
    kernel, mod = build(condition_spec(CONDITIONS[name]))
    args = [np.zeros((S, 128), np.float32), np.zeros((T, 128), np.float32), np.zeros((T, 128), np.float32)]
    got = np.asarray(mod.block_kinds(*args))
    want = brute_kinds(kernel, row_plan(kernel), args, {"S": S, "T": T, "D": 128})
    np.testing.assert_array_equal(got, want)


def test_sorted_segment_classification_is_exact():
    kernel, mod = build(spec_text("document_attention"))
    rng = np.random.default_rng(3)
    for S in (512, 777):
        args, _ = example("document_attention", S, rng, docs=6)
        got = np.asarray(mod.block_kinds(*args))
        want = brute_kinds(kernel, row_plan(kernel), args, sizes_of(kernel, args))
        np.testing.assert_array_equal(got, want)


def test_split_kinds_name_the_one_part_that_may_fail():
    """The walk's kinds (`split=True`): a partial block where only one part of the condition
    is not true over the whole block is _PARTIAL + 2 * (part + 1), and its step evaluates that
    part alone; element by element, per part. The forward and gradients at such blocks: the
    examples above (S = 600 has both kinds)."""
    kernel, mod = build(spec_text("document_attention"))
    plan = row_plan(kernel)
    S = 1024
    args, _ = example("document_attention", S, np.random.default_rng(7), docs=3)
    sizes = sizes_of(kernel, args)
    base = brute_kinds(kernel, plan, args, sizes)
    parts = plan.condition.args  # seg[b, i] == seg[b, j], i >= j
    # `i >= j` alone classifies over (i, j): broadcast over b.
    whole = [np.broadcast_to(brute_kinds(kernel, dataclasses.replace(plan, points=(dataclasses.replace(plan.points[0], condition=c),)),
                                         args, sizes) == 2, base.shape) for c in parts]
    alone = (base == 1) & (sum(~w for w in whole) == 1)
    want = np.where(alone, 1 + 2 * (np.argmax(~np.stack(whole), axis=0) + 1), base)
    got = np.asarray(mod._classify_blocks(np, np.asarray(args[3]), (2, 1, S, 64), split=True))
    np.testing.assert_array_equal(got, want)
    assert {3, 5} <= set(np.unique(got).tolist())
    np.testing.assert_array_equal(np.asarray(mod.block_kinds(*args)), base)  # the public kinds stay 0, 1, 2


def test_mask_classification_is_exact():
    kernel, mod = build(spec_text("masked_attention"))
    args, _ = example("masked_attention", 512, np.random.default_rng(4), T=640)
    got = np.asarray(mod.block_kinds(*args))
    want = brute_kinds(kernel, row_plan(kernel), args, sizes_of(kernel, args))
    np.testing.assert_array_equal(got, want)


def walk_counts(kinds: np.ndarray):
    """Steps, computing steps and key-block copies of the walk built from block kinds."""
    steps = 0
    computing = int((kinds != 0).sum())
    for row in kinds.reshape(-1, kinds.shape[-1]):
        steps += max(1, int((row != 0).sum()))
    return steps, computing


def test_walk_visits_exactly_the_nonempty_blocks():
    """Sizes-only conditions: the grid has one step per non-empty block (one per empty row),
    and consecutive steps that read the same key block start no copy."""
    kernel, mod = build(condition_spec(CONDITIONS["local"]))
    S = 2048
    args = [np.zeros((S, 128), np.float32)] * 3
    kinds = np.asarray(mod.block_kinds(*args))[None]
    (rows, cols, read_rows, step_kinds, flags), steps, _ = mod._row_walk(np, kinds)
    expect_steps, computing = walk_counts(kinds)
    assert steps == expect_steps and int((step_kinds != 0).sum()) == computing
    # Each non-empty block exactly once, in its row; first/last flags bracket each row.
    seen = {(int(r), int(c)) for r, c, k in zip(rows, cols, step_kinds) if k != 0}
    assert seen == {(int(r), int(c)) for r, c in zip(*np.nonzero(kinds[0]))}
    assert int(((flags & 1) != 0).sum()) == int(((flags & 2) != 0).sum()) == kinds.shape[1]


def test_empty_steps_start_no_copy():
    """Traced kinds: the walk has the dense count; its empty steps read what the last computing
    step read (the same block index: Pallas starts no copy)."""
    kernel, mod = build(spec_text("document_attention"))
    args, _ = example("document_attention", 1024, np.random.default_rng(5), docs=8)
    kinds = np.asarray(mod.block_kinds(*args))
    (rows, cols, read_rows, step_kinds, flags), steps, _ = mod._row_walk(jnp, jnp.asarray(kinds))
    rows, cols, read_rows, step_kinds = map(np.asarray, (rows, cols, read_rows, step_kinds))
    per = steps
    for g in range(kinds.shape[0]):
        sl = slice(g * per, (g + 1) * per)
        c, r, k = cols[sl], read_rows[sl], step_kinds[sl]
        for t in range(1, per):
            if k[t] == 0:
                assert (c[t], r[t]) == (c[t - 1], r[t - 1])
        assert int((k != 0).sum()) == int((kinds[g] != 0).sum())


# ------------------------------------------------------------- random conditions


def random_condition(rng) -> str:
    atoms = [
        lambda: f"i >= j + {rng.integers(-300, 300)}",
        lambda: f"i - j < {rng.integers(1, 600)}",
        lambda: f"i // {rng.choice([64, 100, 256])} == j // {rng.choice([64, 100, 256])}",
        lambda: f"(i + j) % {rng.integers(2, 5)} != 0",
        lambda: f"2 * i + 3 <= 3 * j + {rng.integers(0, 200)}",
        lambda: "seg[i] == kseg[j]",
        lambda: "seg[i] <= kseg[j] + 1",
        lambda: f"j < {rng.integers(50, 900)}",
        lambda: "keep[i, j]",
    ]
    n = int(rng.integers(1, 4))
    parts = [atoms[int(rng.integers(0, len(atoms)))]() for _ in range(n)]
    joins = [str(rng.choice(["and", "or"])) for _ in range(n - 1)]
    text = parts[0]
    for j, p in zip(joins, parts[1:]):
        text = f"{text} {j} {p}"
    if rng.random() < 0.2:
        text = f"not ({text})"
    return text


# Seeds 1: a mask, 6: a modulo. The simulator runs the kernel for the first three, the CPU
# interpreter for the others (both for every seed under SPARSEGEN_SWEEP=1); the
# classification is checked in either mode, for every seed.
@pytest.mark.parametrize(*in_both_modes(range(24) if SWEEP else (0, 1, 2, 6, 9), lambda seed: seed < 3, "seed", alone=True),
                         indirect=["interpret"])
def test_random_conditions(seed, interpret):
    rng = np.random.default_rng(100 + seed)
    cond = random_condition(rng)
    segs, mask = "seg" in cond, "keep" in cond
    ti, tj = (int(x) for x in rng.choice([128, 256], 2))
    text = condition_spec(cond, ti, tj, segs=segs, mask=mask)
    if not segs:
        text = re.sub(r"\n    in  k?seg: i32\[[ST]\]", "", text)
    kernel, mod = build(text)
    S, T = int(rng.integers(200, 700)), int(rng.integers(200, 900))
    args = [rand(rng, (S, 128), jnp.float32), rand(rng, (T, 128), jnp.float32), rand(rng, (T, 128), jnp.float32)]
    if segs:
        args += [jnp.asarray(np.sort(rng.integers(0, 5, S)).astype(np.int32)), jnp.asarray(np.sort(rng.integers(0, 5, T)).astype(np.int32))]
    if mask:  # random blocks, some all zero, some all ones, some mixed
        blocks = rng.choice(3, (-(-S // ti), -(-T // tj)))
        mixed = rng.random((S, T)) < 0.5
        keep = np.where(np.repeat(np.repeat(blocks, ti, 0), tj, 1)[:S, :T] == 2, mixed, np.repeat(np.repeat(blocks, ti, 0), tj, 1)[:S, :T] == 1)
        args.append(jnp.asarray(keep.astype(np.int8)))
    sizes = {"S": S, "T": T, "D": 128}
    # The classification is correct: empty blocks hold nothing present, full ones everything.
    got = np.asarray(mod.block_kinds(*args))
    exact = brute_kinds(kernel, row_plan(kernel), [np.asarray(a) for a in args], sizes)
    assert np.all(exact[got == 0] == 0), cond
    assert np.all(exact[got == 2] == 2), cond
    if interpret is True or seed < 3:  # the simulator is slow: a few seeds
        out = mod.cond_attention(*args, interpret=interpret)
        check_outputs(kernel, out, args, sizes)


# ------------------------------------------------------------------- gradients


def gradients(fn, args, n_float, seed=7):
    """The gradient of a weighted sum of every output (finite elements) for the float inputs."""

    def loss(*xs):
        out = fn(*xs, *args[n_float:])
        out = out if isinstance(out, tuple) else (out,)
        total = 0.0
        for n, o in enumerate(out):
            w = jnp.asarray(np.random.default_rng(seed + n).standard_normal(o.shape).astype(np.float32))
            o = o.astype(jnp.float32)
            total = total + jnp.sum(jnp.where(jnp.isfinite(o), o, 0.0) * w)
        return total

    return jax.grad(loss, argnums=tuple(range(n_float)))(*args[:n_float])


def assert_gradients_match(got, want, bf16: bool):
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert not np.isnan(g).any()
        scale = max(1.0, float(np.abs(w).max()))
        tol = 2e-2 if bf16 else 1e-4
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale)


# In the simulator grouped heads with a window and soft-capping (bf16), and a mask whose
# first row block sees nothing (f32): the backward's walks are those of every example; the
# other two in the CPU interpreter (every example in both under SPARSEGEN_SWEEP=1).
GRADIENTS_SIMULATED = ["local_gqa_attention", "masked_attention"]


@pytest.mark.parametrize(*in_both_modes(EXAMPLES, GRADIENTS_SIMULATED, "name", alone=True), indirect=["interpret"])
def test_example_gradients(name, interpret):
    """grad through the kernel (dq over rows, dk and dv over key blocks) equals JAX's
    gradient of `reference`, ragged lengths and grouped heads included."""
    kernel, mod = build(spec_text(name))
    args, _ = example(name, {"masked_attention": 384, "local_gqa_attention": 700}.get(name, 600), np.random.default_rng(11))
    got = gradients(lambda *a: getattr(mod, name)(*a, interpret=interpret), args, 3)
    want = gradients(mod.reference, args, 3)
    assert_gradients_match(got, want, bf16=name != "masked_attention")


VARIANTS = {
    # ALiBi-like distance penalty, a sum reduction and a logsumexp, no softmax product.
    "alibi_sum": """kernel alibi_sum {
    in  q: f32[H, S, D]
    in  k: f32[H, S, D]
    out total: f32[H, S]
    out lse: f32[H, S]

    raw[h, i, j] = q[h, i, d] * k[h, j, d]
    s[h, i, j] = raw[h, i, j] - 0.5 * abs(i - j) where i >= j
    total[h, i] = sum(s[h, i, j], j)
    lse[h, i] = logsumexp(s[h, i, j], j)

    tile h = 1, i = 128, j = 128, d = 128
}
""",
    # Multi-query: one key/value head for every query head; a scaled softmax product.
    "multi_query": """kernel multi_query {
    in  q: f32[B, H, S, D]
    in  k: f32[B, S, D]
    in  v: f32[B, S, E]
    out o: f32[B, H, S, E]

    s[b, h, i, j] = q[b, h, i, d] * k[b, j, d] * 0.125 where j <= i and j > i - 200
    o[b, h, i, e] = softmax(s[b, h, i, j], j) * v[b, j, e] * 2.0

    tile b = 1, h = 1, i = 128, j = 128, d = 128, e = 128
}
""",
}


# multi_query in the CPU interpreter; alibi_sum (a sum and a logsumexp, no softmax product)
# in the simulator (multi_query's shared key head: test_example_gradients' local_gqa_attention);
# both in both under SPARSEGEN_SWEEP=1.
@pytest.mark.parametrize(*in_both_modes(sorted(VARIANTS), ["alibi_sum"], "which", alone=True), indirect=["interpret"])
def test_variant_forward_and_gradients(which, interpret):
    kernel, mod = build(VARIANTS[which])
    rng = np.random.default_rng(12)
    if which == "alibi_sum":
        args = [rand(rng, (2, 300, 128), jnp.float32), rand(rng, (2, 300, 128), jnp.float32)]
    else:
        args = [rand(rng, (2, 3, 260, 128), jnp.float32), rand(rng, (2, 260, 128), jnp.float32), rand(rng, (2, 260, 128), jnp.float32)]
    fn = getattr(mod, kernel.name)
    check_outputs(kernel, fn(*args, interpret=interpret), args, sizes_of(kernel, args))
    got = gradients(lambda *a: fn(*a, interpret=interpret), args, len(args))
    want = gradients(mod.reference, args, len(args))
    assert_gradients_match(got, want, bf16=False)


TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v4": "v4:2x2x1"}


# tests/test_verify.py compiles every example's forward and backward (causal_attention for
# each target, the others for one each): here by default local_gqa_attention (grouped heads, a window, soft-capping) on v5e, every
# example on one target, the three in turn, under SPARSEGEN_SWEEP=1 (on all three).
BACKWARD_COMPILES = across_targets(EXAMPLES, sorted(TOPOLOGIES)) if SWEEP else [("local_gqa_attention", "v5e")]


@pytest.mark.parametrize("name,target", BACKWARD_COMPILES)
def test_example_backward_compiles_for_tpu(name, target):
    """Forward and backward (two pallas_calls; three where the backward is not fused)
    through libtpu, at H = 2 (GQA: 4 query heads on 1), S = 1024: two blocks of the largest
    tile (the compiled kernels are those of any longer S; the compile takes longer with the
    arrays)."""
    from aot import compile_for

    kernel, mod = build(spec_text(name))
    args, _ = example(name, 1024, np.random.default_rng(0))
    if name != "masked_attention":
        heads = [2, 2, 2] if name != "local_gqa_attention" else [4, 1, 1]
        args = [np.zeros((a.shape[0], h) + a.shape[2:], a.dtype) for a, h in zip(args[:3], heads)] + [np.asarray(a) for a in args[3:]]
    fn = getattr(mod, name)
    compiled = compile_for(lambda *a: gradients(fn, list(a), 3), [np.asarray(a) for a in args], TOPOLOGIES[target])
    text = compiled.as_text()
    assert text.count("tpu_custom_call") >= 2  # forward, the fused backward (dq, dk/dv where it does not apply)
    if name == "local_gqa_attention":  # fused: tests/test_fused_backward.py's v5e case (SPARSEGEN_SWEEP=1) is this compile
        assert text.count("tpu_custom_call") == 2


def test_stored_softmax_and_scores():
    """A softmax no product sums, and the scores themselves, stored whole: two walks (the
    row statistics, then every block; empty blocks written as zeros)."""
    text = """kernel stored_softmax {
    in  q: f32[S, D]
    in  k: f32[T, D]
    out p: f32[S, T]
    out scores: f32[S, T]
    out m: f32[S]

    s[i, j] = q[i, d] * k[j, d] * 0.1 where i >= j and i - j < 300
    p[i, j] = softmax(s[i, j], j)
    scores[i, j] = 2.0 * s[i, j]
    m[i] = max(s[i, j], j)

    tile i = 128, j = 128, d = 128
}
"""
    kernel, mod = build(text)
    rng = np.random.default_rng(13)
    args = [rand(rng, (520, 128), jnp.float32), rand(rng, (600, 128), jnp.float32)]
    for interpret in (True, pltpu.InterpretParams()):
        check_outputs(kernel, mod.stored_softmax(*args, interpret=interpret), args, sizes_of(kernel, args))
    with pytest.raises(NotImplementedError, match=r"the gradient of 'q' through 'p' \(a stored softmax\) is not derived yet"):
        jax.grad(lambda q: jnp.sum(mod.stored_softmax(q, args[1], interpret=True)[0]))(args[0])


# A softmax product and a row maximum of the same biased scores.
WITH_MAX = """kernel with_max {
    in  q: f32[H, S, D]
    in  k: f32[H, S, D]
    in  v: f32[H, S, E]
    in  bias: f32[H, S]
    out o: f32[H, S, E]
    out m: f32[H, S]

    raw[h, i, j] = q[h, i, d] * k[h, j, d] * 0.125
    s[h, i, j] = raw[h, i, j] + bias[h, j] where i >= j
    o[h, i, e] = softmax(s[h, i, j], j) * v[h, j, e]
    m[h, i] = max(s[h, i, j], j)

    tile h = 1, i = 128, j = 128, d = 128, e = 128
}
"""


def with_max_setup():
    kernel, mod = build(WITH_MAX)
    rng = np.random.default_rng(21)
    args = [rand(rng, (2, 260, 128), jnp.float32) for _ in range(3)] + [rand(rng, (2, 260), jnp.float32)]
    w = jnp.asarray(rng.standard_normal((2, 260, 128)).astype(np.float32))
    return kernel, mod, args, w


@cpu_unless_sweep
def test_a_max_output_blocks_no_other_gradient(interpret):
    """A loss on o alone (m's cotangent a symbolic zero), or with m behind stop_gradient:
    every input's gradient equals JAX's gradient of `reference`; a loss on m differentiates
    v (zero: m does not read it)."""
    kernel, mod, args, w = with_max_setup()
    run = lambda *a: mod.with_max(*a, interpret=interpret)  # noqa: E731
    want = jax.grad(lambda *a: jnp.sum(mod.reference(*a)[0] * w), argnums=(0, 1, 2, 3))(*args)
    got = jax.grad(lambda *a: jnp.sum(run(*a)[0] * w), argnums=(0, 1, 2, 3))(*args)
    assert_gradients_match(got, want, bf16=False)
    got = jax.grad(lambda *a: jnp.sum(run(*a)[0] * w) + jnp.sum(lax.stop_gradient(run(*a)[1])), argnums=(0, 1, 2, 3))(*args)
    assert_gradients_match(got, want, bf16=False)
    got = jax.grad(lambda v: jnp.sum(run(args[0], args[1], v, args[3])[1]))(args[2])
    assert not np.asarray(got).any()


def test_the_gradient_through_a_max_raises_where_it_is_asked_for():
    kernel, mod, args, w = with_max_setup()

    def loss(*a):
        o, m = mod.with_max(*a, interpret=True)
        return jnp.sum(o * w) + jnp.sum(jnp.where(jnp.isfinite(m), m, 0.0))

    for n, name in ((0, "q"), (1, "k"), (3, "bias")):
        with pytest.raises(NotImplementedError, match=rf"with_max: the gradient of '{name}' through 'm' \(a max reduction\) is not "
                                                      rf"derived yet; asked for because '{name}' is differentiated and the cotangent "
                                                      "of 'm' is not zero"):
            jax.grad(loss, argnums=n)(*args)
    assert jax.grad(loss, argnums=2)(*args).shape == args[2].shape  # v's gradient does not go through m


def test_plan_lists_the_attention_gradients_per_input(tmp_path, capsys):
    from sparsegen.cli import main

    spec = tmp_path / "with_max.spk"
    spec.write_text(WITH_MAX)
    assert main(["plan", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "not derived: the gradient of a max" not in out and "backward (jax.grad), through o:" in out
    lines = out[out.index("gradients (jax.grad), per float input:"):].splitlines()[1:5]
    for line, name in zip(lines, ("q", "k", "v", "bias")):
        assert line.strip().startswith(f"{name}: through o"), line
        assert (f"not derived through m: the gradient of '{name}' through 'm' (a max reduction)" in line) == (name != "v"), line


def test_max_steps_bounds_a_traced_walk():
    """Segment ids: the walk's tables have the dense count unless the caller bounds it; a bound below
    what the walk needs is a ValueError on concrete ids, and NaN outputs under jit."""
    kernel, mod = build(spec_text("document_attention"))
    args, _ = example("document_attention", 1024, np.random.default_rng(14), docs=8)
    kinds = np.asarray(mod.block_kinds(*args))
    need = max(int(mod._row_walk(np, k)[1]) for k in (kinds, kinds.transpose(0, 2, 1)))
    assert need < kinds.shape[1] * kinds.shape[2]  # the bound saves steps
    out = mod.document_attention(*args, max_steps=need, interpret=True)
    check_outputs(kernel, out, args, sizes_of(kernel, args))
    got = gradients(lambda *a: mod.document_attention(*a, max_steps=need, interpret=True), args, 3)
    assert_gradients_match(got, gradients(mod.reference, args, 3), bf16=True)
    with pytest.raises(ValueError, match=f"below the {need} steps"):
        mod.document_attention(*args, max_steps=need - 1, interpret=True)
    cut = jax.jit(lambda *a: mod.document_attention(*a, max_steps=need - 1, interpret=True))(*args)
    assert np.isnan(np.asarray(cut, np.float32)).all()


@sim_unless_sweep  # the CPU interpreter's traced walks: test_traced_segment_ids_under_jit, test_max_steps_...
def test_traced_walk_runs_the_steps_the_data_needs(interpret):
    """Segment ids traced under jit: the grid's step axis is a traced extent, the most steps
    any group needs (here the two batch rows' documents differ), not the tables' dense
    count; the steps past a group's own last are empty. Values and gradients (the fused
    backward's key-side walk has its own extent, and writes dq at its last step) match; the
    simulator checks revisits."""
    from sparsegen.tpu import cycles

    kernel, mod = build(spec_text("document_attention"))
    rng = np.random.default_rng(21)
    args, _ = example("document_attention", 1000, rng)
    seg = np.zeros((2, 1000), np.int32)
    seg[0] = np.arange(1000) // 250  # four documents: 6 of 16 blocks
    seg[1] = np.arange(1000) // 600  # two: 7 of 16 blocks, the longer walk
    args[3] = jnp.asarray(seg)
    fn = jax.jit(lambda *a: mod.document_attention(*a, interpret=interpret))
    check_outputs(kernel, fn(*args), args, sizes_of(kernel, args))
    got = gradients(lambda *a: jax.jit(lambda *x: mod.document_attention(*x, interpret=interpret))(*a), args, 3)
    assert_gradients_match(got, gradients(mod.reference, args, 3), bf16=True)
    # The grids, recorded as concrete values (the extent is computed from the ids).
    kinds = np.asarray(mod.block_kinds(*args)).reshape(2, 4, 4)
    needs = [max(int(n) for n in mod._row_walk(np, k[None])[2]) for k in kinds]
    needs_t = [max(int(n) for n in mod._row_walk(np, k.T[None])[2]) for k in kinds]
    assert needs[0] != needs[1] and max(needs) < 16
    forward, backward = cycles.capture(mod.document_attention, args, {"interpret": True}, True, mod.pl)
    assert forward[0].grid == (2, 1, max(needs))
    # The backward: the fused walk over key blocks (dq summed in it), its own extent.
    assert [c.grid for c in backward] == [(2, 1, max(needs_t))]
    assert forward[0].tables[0].size == 2 * 16  # the tables keep the dense count


def test_reference_of_a_spec_whose_every_size_is_literal():
    """`reference` with no size symbols: the classification it visits by still takes the
    (empty) sizes (it used to `del sizes` first: UnboundLocalError)."""
    text = spec_text("causal_attention")
    text = text.replace("[B, H, S, D]", "[1, 2, 1024, 128]").replace("[B, H, S]", "[1, 2, 1024]")
    assert "B, H" not in text  # every dimension literal
    kernel, mod = build(text)
    args = [rand(np.random.default_rng(3), (1, 2, 1024, 128), jnp.bfloat16) for _ in range(3)]
    got, want = mod.causal_attention(*args, interpret=True), mod.reference(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), **BF16_TOL)


BIASED = """kernel biased {
    in  q: f32[B, H, S, D]
    in  k: f32[B, H, S, D]
    in  v: f32[B, H, S, D]
    in  bias: f32[H, S, S]
    in  slope: f32[H]
    in  qb: f32[B, H, S]
    in  kpad: f32[B, S]
    out o: f32[B, H, S, D]
    out lse: f32[B, H, S]

    raw[b, h, i, j] = q[b, h, i, d] * k[b, h, j, d] * 0.125
    s[b, h, i, j] = raw[b, h, i, j] + bias[h, i, j] - slope[h] * abs(i - j) + qb[b, h, i] * tanh(kpad[b, j]) where i >= j
    o[b, h, i, e] = softmax(s[b, h, i, j], j) * v[b, h, j, e]
    lse[b, h, i] = logsumexp(s[b, h, i, j], j)

    tile b = 1, h = 1, i = 128, j = 128, d = 128, e = 128
}
"""


@cpu_unless_sweep  # every one of these gradients in the simulator: test_sums_over_a_traced_walk_finish_at_its_last_step
def test_bias_slope_and_per_row_and_per_key_terms_get_gradients(interpret):
    """Every float input gets its gradient: a per-head bias block (shared over the batch,
    placed per step), an ALiBi slope (summed over the walk), a per-row and a per-key term."""
    kernel, mod = build(BIASED)
    rng = np.random.default_rng(15)
    B, H, S = 2, 2, 300
    args = [rand(rng, (B, H, S, 128), jnp.float32) for _ in range(3)]
    args += [rand(rng, (H, S, S), jnp.float32), jnp.abs(rand(rng, (H,), jnp.float32)) * 0.01, rand(rng, (B, H, S), jnp.float32),
             rand(rng, (B, S), jnp.float32)]
    check_outputs(kernel, mod.biased(*args, interpret=interpret), args, sizes_of(kernel, args))
    got = gradients(lambda *a: mod.biased(*a, interpret=interpret), args, len(args))
    want = gradients(mod.reference, args, len(args))
    assert_gradients_match(got, want, bf16=False)


@sim_unless_sweep  # the CPU interpreter's bias gradients: test_bias_slope_and_per_row_and_per_key_terms_get_gradients
def test_sums_over_a_traced_walk_finish_at_its_last_step(interpret):
    """The slope's gradient, summed over the whole dq walk, is written at the grid's last
    step: with segment ids traced under jit that is the traced extent's, not the tables'."""
    text = BIASED.replace("in  kpad: f32[B, S]", "in  kpad: f32[B, S]\n    in  seg: i32[B, S]")
    kernel, mod = build(text.replace("where i >= j", "where seg[b, i] == seg[b, j] and i >= j"))
    rng = np.random.default_rng(16)
    B, H, S = 2, 2, 300
    args = [rand(rng, (B, H, S, 128), jnp.float32) for _ in range(3)]
    args += [rand(rng, (H, S, S), jnp.float32), jnp.abs(rand(rng, (H,), jnp.float32)) * 0.01, rand(rng, (B, H, S), jnp.float32),
             rand(rng, (B, S), jnp.float32), jnp.asarray(np.arange(2 * S).reshape(B, S) // 100 % 3, jnp.int32)]
    fn = jax.jit(lambda *a: mod.biased(*a, interpret=interpret))
    got = gradients(fn, args, 7)
    assert_gradients_match(got, gradients(mod.reference, args, 7), bf16=False)


@pytest.mark.parametrize("target", sorted(TOPOLOGIES))
def test_biased_backward_compiles_for_tpu(target):
    from aot import compile_for

    kernel, mod = build(BIASED)
    B, H, S = 1, 2, 512  # four blocks of 128 each way: the kernels of any longer S
    f = np.float32
    args = [np.zeros((B, H, S, 128), f)] * 3 + [np.zeros((H, S, S), f), np.zeros((H,), f), np.zeros((B, H, S), f), np.zeros((B, S), f)]
    compiled = compile_for(lambda *a: gradients(mod.biased, list(a), 7), args, TOPOLOGIES[target])
    assert compiled.as_text().count("tpu_custom_call") >= 3


def test_cli_walks_attention_kernels(capsys, monkeypatch):
    """plan --pattern and variants take attention-like kernels (tests/test_plan_attention.py
    and test_variants.py check their figures); --png, which draws einsum walks, says so.
    In this process (`main`; tests/test_cli.py runs the command in subprocesses)."""
    from conftest import ROOT

    from sparsegen.cli import main

    monkeypatch.chdir(ROOT)
    for argv, said in ((["plan", "specs/causal_attention.spk", "--pattern", "tril", "--shape", "B=1,H=2,S=2048"], "blocks visited (computing steps)"),
                       (["variants", "specs/causal_attention.spk", "--tile", "i=256,512", "--shape", "B=1,H=2,S=2048", "--no-compile"], "variants ranked by the model"),
                       (["plan", "specs/document_attention.spk"], "key-side walk")):
        code = main(argv)
        out = capsys.readouterr()
        assert code == 0 and said in out.out and "Traceback" not in out.err, out.err
    assert "traced operands" in out.out


# Spec names that are the generated code's own names (tables, steps, kinds, the kernel's locals).
HOSTILE = """kernel hostile {
    in  rows: f32[steps, kinds, D]
    in  cols: f32[steps, kinds, D]
    in  probs: f32[steps, kinds, D]
    in  delta: f32[steps]
    out flags: f32[steps, kinds, D]
    out lse: f32[steps, kinds]

    raw[at, kind, flag] = rows[at, kind, d] * cols[at, flag, d]
    s[at, kind, flag] = raw[at, kind, flag] + delta[at] - 0.01 * abs(kind - flag) where kind >= flag
    flags[at, kind, e] = softmax(s[at, kind, flag], flag) * probs[at, flag, e]
    lse[at, kind] = logsumexp(s[at, kind, flag], flag)

    tile at = 1, kind = 128, flag = 128, d = 128, e = 128
}
"""


def test_hostile_names_build_and_run():
    kernel, mod = build(HOSTILE)
    rng = np.random.default_rng(16)
    args = [rand(rng, (2, 300, 128), jnp.float32) for _ in range(3)] + [rand(rng, (2,), jnp.float32)]
    check_outputs(kernel, mod.hostile(*args, interpret=True), args, sizes_of(kernel, args))
    got = gradients(lambda *a: mod.hostile(*a, interpret=True), args, 4)
    assert_gradients_match(got, gradients(mod.reference, args, 4), bf16=False)


# The row walk's own fixed names as spec names: a lead index `masked` (the kernels' flag), operands
# `bound`, `overflow`, a mask `xp` (the classification's module), a size `can`, nested function names.
HOSTILE_WALK = """kernel hostile2 {
    in  bound: f32[masked, can, D]
    in  overflow: f32[masked, can, D]
    in  probs: f32[masked, can, D]
    in  xp: i8[can, can] mask
    out o: f32[masked, can, D]

    _scores[masked, _step, _chain] = bound[masked, _step, d] * overflow[masked, _chain, d] where xp[_step, _chain] and _step + masked * 64 >= _chain
    o[masked, _step, e] = softmax(_scores[masked, _step, _chain], _chain) * probs[masked, _chain, e]

    tile masked = 1, _step = 128, _chain = 128, d = 128, e = 128
}
"""


def test_walk_names_as_spec_names():
    kernel, mod = build(HOSTILE_WALK)
    rng = np.random.default_rng(17)
    args = [rand(rng, (3, 300, 128), jnp.float32) for _ in range(3)]
    args.append(jnp.asarray((rng.random((300, 300)) < 0.7).astype(np.int8)))
    check_outputs(kernel, mod.hostile2(*args, interpret=True), args, sizes_of(kernel, args))
    got = gradients(lambda *a: mod.hostile2(*a, max_steps=9, interpret=True), args, 3)
    assert_gradients_match(got, gradients(mod.reference, args, 3), bf16=False)


def _pallas_calls(jaxpr) -> list:
    """The pallas_call equations of a jaxpr, inside jit and custom_vjp bodies too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's
                if hasattr(sub, "eqns"):
                    found += _pallas_calls(sub)
    return found


@sim_unless_sweep  # the same call as the CPU interpreter's, with unwritten memory NaN
def test_a_call_not_differentiated_keeps_no_logsumexp(interpret):
    """The primal call (no gradient asked) runs a forward with the outputs alone: no row
    logsumexp written (nor computed in the flush); the same values as the forward a gradient
    runs (which keeps it for the backward) and as the reference. Ragged S: the selects past
    the end, and a first block row with nothing present (its rows zero)."""
    text = spec_text("causal_attention").replace("where i >= j", "where i >= j + 200").replace("    out lse: f32[B, H, S]\n", "")
    text = text.replace("    lse[b, h, i] = logsumexp(s[b, h, i, j], j)\n", "").replace("i = 512, j = 512", "i = 128, j = 128")
    kernel, mod = build(text)
    assert [o.name for o in kernel.outputs] == ["o"]
    args, _ = example("causal_attention", 400, np.random.default_rng(3))
    fn = lambda *a: mod.causal_attention(*a, interpret=interpret)  # noqa: E731
    primal = _pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr)
    assert len(primal) == 1 and len(primal[0].outvars) == 1  # o alone
    differentiated = _pallas_calls(jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[0])(*args).jaxpr)
    assert len(differentiated[0].outvars) == 2  # o and the row logsumexp
    o = fn(*args)
    o_vjp, pull = jax.vjp(fn, *args)
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o_vjp, np.float32))
    assert np.all(np.asarray(o, np.float32)[:, :, :200] == 0)
    check_outputs(kernel, o, args, sizes_of(kernel, args))
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in pull(jnp.ones_like(o)))


# Two integer bounds on one affine term in the positions (`_ranges`): one unsigned compare.
# Every way of writing the bounds: either side, strict or not, a negative coefficient, a
# size in the term (the pair then kept as two tests: `S` is no integer constant) beside one.
RANGES = {
    "window": ("i >= j and i - j < 100", True),
    "flipped": ("j <= i and 100 > i - j", True),
    "strict": ("j - i > -100 and j - i < 7", True),
    "twice": ("2 * i - 2 * j >= -40 and 2 * i - 2 * j <= 300 and j < T - 5", True),
    "sized": ("i - j >= 0 and i - j < S - 200", False),
}


@pytest.mark.parametrize(*in_both_modes(sorted(RANGES), ["window"], "name", alone=True), indirect=["interpret"])
def test_two_bounds_on_positions_are_one_unsigned_compare(name, interpret):
    cond, one = RANGES[name]
    kernel, mod = build(condition_spec(cond), formatted=True)  # its text is read
    code = open(mod.__file__).read()
    scores = code[code.index("def _attention_kernel("):code.index("def _attention_primal_kernel(")]
    assert ("bitcast_convert_type" in scores) == one, cond
    rng = np.random.default_rng(7)
    S, T = 333, 450  # ragged: the end tests join the range's
    args = [rand(rng, (S, 128), jnp.float32), rand(rng, (T, 128), jnp.float32), rand(rng, (T, 128), jnp.float32)]
    check_outputs(kernel, mod.cond_attention(*args, interpret=interpret), args, {"S": S, "T": T, "D": 128})
