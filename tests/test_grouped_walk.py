"""The grouped walk (issue 37, items 3, 6 and 7): ids and offsets at the ends of their type
classified without overflow, and read as the same values by the kernel, the classification
and `reference`; exactly the (row block, group) pairs that hold a row visited (megablox's
step count); the dense fallback for unsorted ids in calls whose tables fit SMEM. Values
against numpy oracles written from the math, in the CPU interpreter and the TPU simulator
(and the Mosaic GPU interpreter), and ahead of time through libtpu at the issue's size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from aot import SWEEP, compile_for
from conftest import assert_matches, build, in_both_modes, spec_text, with_tiles

GROUPED = with_tiles(spec_text("grouped_matmul"), m=128, k=128, n=128, g=1)
GROUPED_U32 = GROUPED.replace("gid: i32[M]", "gid: u32[M]").replace("kernel grouped_matmul", "kernel grouped_u32")
# The same kernel under another name: a module of its own, whose SMEM size a test makes small.
GROUPED_SMALL = GROUPED.replace("kernel grouped_matmul", "kernel grouped_small_smem")

OFFSETS = """kernel gmm_offsets {
    in  x: bf16[M, K]
    in  w: bf16[E, K, N]
    in  lo: i32[E1]
    out o: bf16[M, N]

    o[m, n] = x[m, k] * w[g, k, n] where lo[g] <= m < lo[g + 1]

    tile m = 128, k = 128, n = 128, g = 1
}
"""
OFFSETS_SMALL = OFFSETS.replace("kernel gmm_offsets", "kernel gmm_offsets_small_smem")

LENGTHS_U32 = """kernel ragged_sum_u32 {
    in  x: f32[B, M, K]
    in  y: f32[B, K, N]
    in  lens: u32[B]
    out o: f32[B, M, N]

    o[b, m, n] = x[b, m, k] * y[b, k, n] where k < lens[b]

    tile b = 1, m = 128, k = 128, n = 128
}
"""

I32_MIN, I32_MAX, U32_MAX = -(2**31), 2**31 - 1, 2**32 - 1


def bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def f64(x):
    return np.asarray(x, np.float64)


def grouped_oracle(x, w, gid):
    """o[m] = x[m] @ w[gid[m]] where 0 <= gid[m] < E (ids compared as Python integers)."""
    gid = np.asarray(gid).astype(np.int64)
    e = w.shape[0]
    inside = (gid >= 0) & (gid < e)
    return np.einsum("mk,mkn->mn", f64(x), f64(w)[np.where(inside, gid, 0)] * inside[:, None, None])


def offsets_oracle(x, w, lo):
    """o[m] = sum over g with lo[g] <= m < lo[g + 1] of x[m] @ w[g]."""
    lo = np.asarray(lo).astype(np.int64)
    m = np.arange(x.shape[0])[:, None]
    present = (lo[None, :-1] <= m) & (m < lo[None, 1:])  # [M, E]
    return np.einsum("mk,mg,gkn->mn", f64(x), present.astype(np.float64), f64(w))


def brute_kinds(gid, tile, e):
    """Per (row block, group): 0 no row of the block has that id, 2 every row has, 1 some."""
    gid = np.asarray(gid).astype(np.int64)
    blocks = -(-len(gid) // tile)
    out = np.zeros((blocks, e), np.int32)
    for b in range(blocks):
        rows = gid[b * tile:(b + 1) * tile]
        for g in range(e):
            hit = rows == g
            out[b, g] = 2 if hit.all() else 1 if hit.any() else 0
    return out


# ------------------------------------------------------------------ item 3: ends of the type

# Sorted ids 0..3 over 256 rows; rows 200..229 (inside the second row block, beside experts
# 2 and 3) padded with a value at an end of the ids' type. The classification computed
# `-g + gid_min <= 0` in the ids' type: INT32_MIN wrapped, and that block met no expert
# above 0 (its valid rows came out zero).
PADDINGS = {"i32 INT32_MIN": (GROUPED, np.int32, I32_MIN), "u32 0xFFFFFFFF": (GROUPED_U32, np.uint32, U32_MAX),
            "u32 2**31": (GROUPED_U32, np.uint32, 2**31)}


def padded_ids(dtype, pad):
    gid = np.repeat(np.arange(4), [60, 70, 80, 46]).astype(np.int64)
    gid[200:230] = pad
    return gid.astype(dtype)


# The simulator for two paddings, the CPU interpreter the third (all in both under SPARSEGEN_SWEEP=1).
@pytest.mark.parametrize(*in_both_modes(list(PADDINGS), ["i32 INT32_MIN", "u32 0xFFFFFFFF"], "padding", alone=True), indirect=["interpret"])
def test_ids_at_the_ends_of_their_type(interpret, padding):
    text, dtype, pad = PADDINGS[padding]
    kernel, mod = build(text)
    rng = np.random.default_rng(1)
    x, w = bf16(rng, (256, 128)), bf16(rng, (4, 128, 128))
    gid = padded_ids(dtype, pad)
    want = grouped_oracle(x, w, gid)
    assert np.abs(want[230:]).max() > 1  # expert 3's rows beside the padding are not zero
    assert_matches(kernel, getattr(mod, kernel.name)(x, w, gid, interpret=interpret), want)
    assert_matches(kernel, mod.reference(x, w, gid), want)
    # The classification of the ids as the call gives them to it (u32 past int32 saturated).
    seen = np.minimum(gid.astype(np.int64), I32_MAX).astype(np.int32)
    kinds = np.asarray(mod._classify(jnp, jnp.asarray(seen), (256, 128, 4, 128)))
    np.testing.assert_array_equal(kinds, brute_kinds(gid, 128, 4))


@pytest.mark.parametrize(*in_both_modes(["min and max", "max only"], ["min and max"], "case", alone=True), indirect=["interpret"])
def test_offsets_at_the_ends_of_int32(interpret, case):
    """`lo[g] <= m < lo[g + 1]` with the first offset INT32_MIN (group 0 from before row 0) or
    the last INT32_MAX (the last group to past the end): `-m_hi + lo_min` wrapped."""
    kernel, mod = build(OFFSETS)
    rng = np.random.default_rng(2)
    m, e = 300, 3
    lo = np.array([I32_MIN if case == "min and max" else 0, 100, 250, I32_MAX], np.int32)
    x, w = bf16(rng, (m, 128)), bf16(rng, (e, 128, 128))
    want = offsets_oracle(x, w, lo)
    assert_matches(kernel, mod.gmm_offsets(x, w, lo, interpret=interpret), want)
    assert_matches(kernel, mod.reference(x, w, lo), want)
    run = jax.jit(lambda x, w, lo: mod.gmm_offsets(x, w, lo, interpret=interpret))
    assert_matches(kernel, run(x, w, jnp.asarray(lo)), want)


@pytest.mark.parametrize(*in_both_modes(["u32"], ["u32"], "dtype", alone=True), indirect=["interpret"])
def test_u32_lengths_past_int32_mean_their_value(interpret, dtype):
    """`k < lens[b]` with lens a u32 of 0xFFFFFFFF (every k) and 2**31 + 5: the kernel (a scalar
    read from SMEM), the classification and `reference` all read a value past int32 as its
    own (they read -1 and -2**31 + 5, nothing present)."""
    kernel, mod = build(LENGTHS_U32)
    rng = np.random.default_rng(3)
    b, m, kk, n = 4, 128, 384, 128
    x, y = rng.standard_normal((b, m, kk), dtype=np.float32), rng.standard_normal((b, kk, n), dtype=np.float32)
    lens = np.array([U32_MAX, 130, 0, 2**31 + 5], np.uint32)
    present = np.arange(kk)[None, :].astype(np.int64) < lens[:, None].astype(np.int64)
    want = np.einsum("bmk,bk,bkn->bmn", f64(x), present.astype(np.float64), f64(y))
    assert_matches(kernel, mod.ragged_sum_u32(x, y, lens, interpret=interpret), want)
    assert_matches(kernel, mod.reference(x, y, lens), want)


BOUNDS = """kernel bounded_sum {{
    in  x: f32[M, K]
    in  y: f32[K, N]
    in  lim: i32[M]
    in  off: i32[M]
    out o: f32[M, N]

    o[m, n] = x[m, k] * y[k, n] where {cond}

    tile m = 128, k = 128, n = 128
}}
"""

EXTREME_CONDITIONS = {  # condition: its truth over (m, k) given lim[m], off[m] (int64)
    "k <= lim[m] and off[m] > k - 1000": lambda k, lim, off: (k <= lim) & (off > k - 1000),
    "k + 300 > lim[m] and k + 1 != off[m]": lambda k, lim, off: (k + 300 > lim) & (k + 1 != off),
    "lim[m] >= off[m] and k < 200": lambda k, lim, off: (lim >= off) & (k < 200),
    "k >= lim[m] and k < off[m]": lambda k, lim, off: (k >= lim) & (k < off),
}


@pytest.mark.parametrize(*in_both_modes(sorted(EXTREME_CONDITIONS), ["k >= lim[m] and k < off[m]"], "cond", alone=True), indirect=["interpret"])
def test_operand_values_at_the_ends_of_int32_in_conditions(interpret, cond):
    """Per-row bounds holding INT32_MIN and INT32_MAX beside ordinary values: a block is never
    full where a term is absent, nor empty where one is present, and the values match (the
    classification wrote `k_hi - lim_min <= 0`, which INT32_MIN wrapped: full, the condition
    dropped). Two bounds from operands (`k >= lim[m] and k < off[m]`) compare their values
    with each other saturating (`_sat_sub`)."""
    kernel, mod = build(BOUNDS.format(cond=cond))
    rng = np.random.default_rng(10)
    m, kk, n = 384, 384, 128
    pick = rng.integers(0, 4, m)
    lim = np.where(pick == 0, I32_MIN, np.where(pick == 1, I32_MAX, rng.integers(-5, kk + 5, m)))
    off = np.where(rng.integers(0, 4, m) == 0, I32_MIN, np.where(rng.integers(0, 3, m) == 0, I32_MAX, rng.integers(-5, kk + 5, m)))
    lim[:128], off[:128] = I32_MIN, I32_MAX  # a whole row block at the ends
    lim, off = lim.astype(np.int32), off.astype(np.int32)
    x, y = rng.standard_normal((m, kk), dtype=np.float32), rng.standard_normal((kk, n), dtype=np.float32)
    present = EXTREME_CONDITIONS[cond](np.arange(kk)[None, :], lim.astype(np.int64)[:, None], off.astype(np.int64)[:, None])
    kinds = np.asarray(mod._classify(jnp, jnp.asarray(lim), jnp.asarray(off), (m, kk, n)))
    blocks = present.reshape(m // 128, 128, kk // 128, 128)
    assert not ((kinds == 2) & ~blocks.all(axis=(1, 3))).any()
    assert not ((kinds == 0) & blocks.any(axis=(1, 3))).any()
    want = np.einsum("mk,mk,kn->mn", present.astype(np.float64), f64(x), f64(y))
    assert_matches(kernel, mod.bounded_sum(x, y, lim, off, interpret=interpret), want)
    assert_matches(kernel, mod.reference(x, y, lim, off), want)


# One-based ids (0: no expert): the group of an id is the id less 1, a shift the
# classification adds to every id before it compares (`_group_presence`).
ONE_BASED = GROUPED.replace("where gid[m] == g", "where gid[m] == g + 1").replace("kernel grouped_matmul", "kernel grouped_one_based")


@pytest.mark.parametrize(*in_both_modes(["sorted", "unsorted"], ["sorted"], "order", alone=True), indirect=["interpret"])
def test_ids_compared_with_a_shifted_group(interpret, order):
    """`gid[m] == g + 1` over 300 rows (a ragged last block), ids 0..4 with 0 a padding row
    in no group: the classification is the brute force's for the ids less 1 (a block of
    expert 1's ids is group 0's, full), and the kernel and `reference` equal the oracle."""
    kernel, mod = build(ONE_BASED)
    rng = np.random.default_rng(6)
    x, w = bf16(rng, (300, 128)), bf16(rng, (4, 128, 128))
    gid = np.repeat(np.arange(5), [20, 140, 30, 60, 50]).astype(np.int32)  # rows 20..147: expert 1
    if order == "unsorted":
        gid = rng.permutation(gid)
    kinds = np.asarray(mod._classify(jnp, jnp.asarray(gid), (300, 128, 4, 128)))
    np.testing.assert_array_equal(kinds, brute_kinds(gid.astype(np.int64) - 1, 128, 4))
    want = grouped_oracle(x, w, gid.astype(np.int64) - 1)
    assert_matches(kernel, mod.grouped_one_based(x, w, gid, interpret=interpret), want)
    assert_matches(kernel, mod.reference(x, w, gid), want)


# ------------------------------------------------------------------ item 7: exact pairs


def test_classification_is_exact_for_ids_in_any_order():
    """Per (row block, group) the classification is the brute force's: sorted, unsorted, with
    padding ids (-1, E, the ends of int32) and a ragged last block; the walk's steps are the
    non-empty pairs (a row block with none: one step), within row blocks + E - 1 when sorted."""
    _, mod = build(GROUPED)
    rng = np.random.default_rng(4)
    for trial in range(8):
        e = int(rng.integers(1, 40))
        m = int(rng.integers(1, 700))
        gid = np.sort(rng.integers(0, e, m))
        if trial % 2:
            gid = rng.permutation(gid)
        if trial % 3 == 0:
            gid[rng.integers(0, m, m // 10)] = rng.choice([-1, e, I32_MIN, I32_MAX])
        gid = gid.astype(np.int32)
        kinds = np.asarray(mod._classify(jnp, jnp.asarray(gid), (m, 128, e, 128)))
        want = brute_kinds(gid, 128, e)
        np.testing.assert_array_equal(kinds, want)
        steps = int(mod._row_walk(np, kinds[None])[1])
        nonempty = want != 0
        assert steps == int(nonempty.sum() + (~nonempty.any(axis=1)).sum())
        if trial % 2 == 0 and trial % 3:
            assert steps <= -(-m // 128) + e - 1


def issue_case():
    """The issue's case: 256 sorted rows over 4,096 experts, 250 of them used, row blocks of 128."""
    rng = np.random.default_rng(5)
    e = 4096
    used = np.sort(rng.choice(e, 250, replace=False))
    sizes = np.zeros(e, np.int32)
    sizes[used] = 1 + np.bincount(rng.choice(250, 6), minlength=250)
    return sizes, np.repeat(np.arange(e, dtype=np.int32), sizes)


def test_many_experts_walk_the_pairs_megablox_walks():
    """256 sorted rows, 4,096 experts, 250 used: the grid runs the non-empty (row block, expert)
    pairs (it ran 4,059 steps, every expert between a block's least and greatest id), as many as
    megablox's num_active_tiles; a weight block is copied once per step (each step its own
    expert), as megablox's. The backward: dx the same walk, dw one step per expert (an empty
    one writes zeros), as tgmm with visit_empty_groups."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import make_group_metadata

    _, mod = build(GROUPED)
    sizes, gid = issue_case()
    m, e = len(gid), len(sizes)
    want = brute_kinds(gid, 128, e)
    pairs = int((want != 0).sum())
    assert pairs in (250, 251)
    shape = (m, 128, e, 128)
    kinds = mod._classify(jnp, jnp.asarray(gid), shape).reshape(1, 2, e)
    needed = int(mod._row_walk(jnp, kinds, 1)[2][0])  # the grid's traced extent
    (_, _, _), active = make_group_metadata(group_sizes=jnp.asarray(sizes), m=m, tm=128, start_group=jnp.int32(0),
                                            num_nonzero_groups=e, visit_empty_groups=False)
    assert needed == pairs == int(active)
    row, read, col, kind, flags, cond = (np.asarray(t) for t in mod._prefetch(None, None, jnp.asarray(gid), shape))
    run = slice(0, needed)
    assert (kind[run] != mod._EMPTY).all() and (kind[needed:] == mod._EMPTY).all()
    w_copies = 1 + int(np.count_nonzero(np.diff(col[run])))
    assert w_copies == int(active)
    d_w = mod._d_w_classify(jnp, jnp.asarray(gid), shape).reshape(1, e, 2)
    assert int(mod._row_walk(jnp, d_w, 1)[2][0]) == pairs + int((sizes == 0).sum())


@pytest.mark.parametrize(*in_both_modes(["sorted", "unsorted"], ["sorted"], "order", alone=True), indirect=["interpret"])
def test_many_experts_match_the_oracle(interpret, order):
    """64 experts, 12 used, ragged rows: the walk of exactly the non-empty pairs computes the
    same values, forward and gradients (dw of an unused expert: zeros)."""
    kernel, mod = build(GROUPED)
    rng = np.random.default_rng(6)
    e, m = 64, 300
    gid = np.sort(rng.choice(rng.choice(e, 12, replace=False), m)).astype(np.int32)
    if order == "unsorted":
        gid = rng.permutation(gid)
    x, w = bf16(rng, (m, 128)), bf16(rng, (e, 128, 128))
    assert_matches(kernel, mod.grouped_matmul(x, w, gid, interpret=interpret), grouped_oracle(x, w, gid))
    if order == "sorted":
        loss = lambda f: lambda x, w: (f(x, w).astype(jnp.float32) ** 2).sum()  # noqa: E731
        got = jax.grad(loss(lambda x, w: mod.grouped_matmul(x, w, gid, interpret=interpret)), argnums=(0, 1))(x, w)
        ref = jax.grad(loss(lambda x, w: mod.reference(x, w, gid)), argnums=(0, 1))(x, w)
        for g, r in zip(got, ref):
            assert np.abs(f64(g) - f64(r)).max() <= 0.02 * np.abs(f64(r)).max()
        unused = np.setdiff1d(np.arange(e), gid)
        assert not f64(got[1])[unused].any()


# ------------------------------------------------------------------ item 6: the fallback in SMEM


def small_smem(text, entries):
    """The module of `text` with a TensorCore of `entries` int32 entries of SMEM."""
    kernel, mod = build(text)
    mod._SMEM_BYTES = 4 * entries
    return kernel, mod


def pallas_calls(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


@pytest.mark.parametrize(*in_both_modes(["forward", "gradients"], ["gradients"], "what", alone=True), indirect=["interpret"])
def test_unsorted_ids_run_the_dense_walk_in_pieces(interpret, what):
    """Unsorted ids (with -1 padding) over 3 row blocks (ragged) and 4 experts need 12 steps, more
    than the 6 of the sorted bound; with SMEM for 40 entries the dense walk's 6 tables of 12
    steps (72) do not fit: it runs as 3 calls of one row block each (dw: 2 calls of 2 experts),
    each writing its rows into the last one's output."""
    kernel, mod = small_smem(GROUPED_SMALL, 40)
    rng = np.random.default_rng(7)
    m, e = 300, 4
    x, w = bf16(rng, (m, 128)), bf16(rng, (e, 128, 128))
    gid = rng.integers(-1, e, m).astype(np.int32)
    run = lambda x, w: mod.grouped_small_smem(x, w, gid, interpret=interpret)  # noqa: E731
    if what == "forward":
        assert pallas_calls(run, x, w) == 1 + 3  # the bounded walk, and the dense one's pieces
        assert_matches(kernel, run(x, w), grouped_oracle(x, w, gid))
        return
    loss = lambda f: lambda x, w: (f(x, w).astype(jnp.float32) ** 2).sum()  # noqa: E731
    got = jax.grad(loss(run), argnums=(0, 1))(x, w)
    ref = jax.grad(loss(lambda x, w: mod.reference(x, w, gid)), argnums=(0, 1))(x, w)
    for g, r in zip(got, ref):
        assert np.abs(f64(g) - f64(r)).max() <= 0.02 * np.abs(f64(r)).max()


@pytest.mark.parametrize(*in_both_modes(["overlapping"], ["overlapping"], "case", alone=True), indirect=["interpret"])
def test_unsorted_offsets_run_the_dense_walk_in_pieces(interpret, case):
    """Offsets that are not sorted (group 1 empty, group 2's rows overlapping group 0's) need
    more steps than the bound; the dense walk runs in pieces beside the SMEM table of `lo`."""
    kernel, mod = small_smem(OFFSETS_SMALL, 40)
    rng = np.random.default_rng(8)
    m, e = 300, 3
    lo = np.array([0, 200, 100, 300], np.int32)
    x, w = bf16(rng, (m, 128)), bf16(rng, (e, 128, 128))
    run = lambda x, w: mod.gmm_offsets_small_smem(x, w, lo, interpret=interpret)  # noqa: E731
    assert pallas_calls(run, x, w) > 2
    assert_matches(kernel, run(x, w), offsets_oracle(x, w, lo))


@pytest.mark.parametrize("what", ["forward", "backward"] if SWEEP else ["forward"])
def test_issue_size_compiles_ahead_of_time(what):
    """M = 131072 (16k tokens x top-8), E = 256, tiles 512: the dense fallback's tables
    (6 x 65,536 steps, 1.5 MiB) passed the call's SMEM check (it counts the sorted bound) and
    libtpu refused them ("Used 1.50M of 1.00M smem"); now the fallback runs in two calls of
    128 row blocks, both branches compile (the backward too: SPARSEGEN_SWEEP=1)."""
    _, mod = build(spec_text("grouped_matmul"))
    x = np.zeros((131072, 512), jnp.bfloat16)
    w, gid = np.zeros((256, 512, 512), jnp.bfloat16), np.zeros((131072,), np.int32)
    if what == "forward":
        compiled = compile_for(lambda x, w, g: mod.grouped_matmul(x, w, g), (x, w, gid))
        assert compiled.as_text().count("tpu_custom_call") == 1 + 2
    else:
        compile_for(jax.grad(lambda x, w, g: mod.grouped_matmul(x, w, g).astype(jnp.float32).sum(), argnums=(0, 1)), (x, w, gid))


# ------------------------------------------------------------------ GPU


def test_gpu_walk_takes_the_same_classification():
    """The GPU condition walk classifies with the schedule's classifier: ids padded with
    INT32_MIN beside valid experts, in the Mosaic GPU interpreter."""
    g = with_tiles(spec_text("grouped_matmul"), m=64, n=64, k=64, g=1)
    kernel, mod = build(g, "h200")
    rng = np.random.default_rng(9)
    gid = np.repeat(np.arange(4), [40, 50, 60, 42]).astype(np.int32)
    gid[150:170] = I32_MIN
    x, w = bf16(rng, (192, 128)), bf16(rng, (4, 128, 64))
    assert_matches(kernel, mod.grouped_matmul(x, w, gid, interpret=True), grouped_oracle(x, w, gid))
