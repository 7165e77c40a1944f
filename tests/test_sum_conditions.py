"""Conditions that restrict a sum (language v2, section 1): triangular and grouped
(mixture-of-experts) matmuls, in the CPU interpreter, the TPU simulator and ahead of time.

The examples' own tiles are 512; the interpreter tests use the same specs with 128 tiles
(the walk and the classification are the same code), small enough for the simulator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from aot import across_targets, compile_for
from conftest import SPECS, assert_matches, both_modes, build, in_both_modes, spec_text, with_tiles
from hypothesis import given, settings
from hypothesis import strategies as st

TRIL = with_tiles(spec_text("tril_matmul"), m=128, k=128, n=128)
GROUPED = with_tiles(spec_text("grouped_matmul"), m=128, k=128, n=128, g=1)


def bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def f32(x):
    return np.asarray(x, np.float32)


def ids_of(sizes, m):
    return jnp.repeat(jnp.arange(len(sizes), dtype=jnp.int32), jnp.asarray(sizes, jnp.int32), total_repeat_length=m)


# ------------------------------------------------------------------ classification


def test_tril_classification_is_exact_against_brute_force():
    _, mod = build(TRIL)
    m = 300  # ragged: the last block holds 44 rows
    kinds = mod._classify(np, (m, 128))
    t = 128
    for a in range(kinds.shape[0]):
        for b in range(kinds.shape[1]):
            rows = np.arange(a * t, min(m, a * t + t))[:, None]
            cols = np.arange(b * t, min(m, b * t + t))[None, :]
            present = cols <= rows
            want = 2 if present.all() else 1 if present.any() else 0
            assert kinds[a, b] == want, (a, b)


def test_grouped_classification_against_brute_force_and_the_bound():
    _, mod = build(GROUPED)
    rng = np.random.default_rng(0)
    for _ in range(6):
        e = int(rng.integers(1, 9))
        sizes = rng.multinomial(640, np.ones(e) / e)
        sizes[rng.integers(0, e)] = 0  # an empty group
        sizes = np.append(sizes, 0)[:e]
        m = int(sizes.sum()) or 1
        gid = np.asarray(ids_of(sizes, m))
        kinds = np.asarray(mod._classify(jnp, jnp.asarray(gid), (m, 128, e, 128)))
        blocks = -(-m // 128)
        for a in range(blocks):
            rows = gid[a * 128:(a + 1) * 128]
            for g in range(e):
                present = rows == g
                if present.all():
                    assert kinds[a, g] == 2
                elif present.any():
                    assert kinds[a, g] == 1
                else:
                    # Exact for sorted ids but for a group with no rows inside the block's range.
                    assert kinds[a, g] == 0 or (rows.min() < g < rows.max() and sizes[g] == 0)
        # Sorted ids: the non-empty (row block, group) pairs fit the walk's static bound.
        assert (kinds != 0).sum() <= blocks + e - 1


# ------------------------------------------------------------------ tril


# The simulator at ragged sizes, the CPU interpreter at whole blocks (both in both under
# SPARSEGEN_SWEEP=1).
@pytest.mark.parametrize(*in_both_modes([(256, 128), (300, 200)], [(300, 200)], "m,n", alone=True), indirect=["interpret"])
def test_tril_matches_the_oracle(interpret, m, n):
    kernel, mod = build(TRIL)
    rng = np.random.default_rng(m)
    x, y = bf16(rng, (m, m)), bf16(rng, (m, n))
    want = np.tril(f32(x)) @ f32(y)
    out = mod.tril_matmul(x, y, interpret=interpret)
    assert_matches(kernel, out, want)
    assert_matches(kernel, mod.reference(x, y), want)


def test_tril_never_reads_the_upper_triangle():
    """A NaN above the diagonal is selected out, in partial blocks and skipped ones."""
    kernel, mod = build(TRIL)
    rng = np.random.default_rng(1)
    x, y = f32(bf16(rng, (256, 256))), bf16(rng, (256, 128))
    x[np.triu_indices(256, 1)] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    want = np.tril(np.nan_to_num(f32(x))) @ f32(y)
    assert_matches(kernel, mod.tril_matmul(x, y, interpret=True), want)
    assert_matches(kernel, mod.reference(x, y), want)


def test_tril_steps_visit_only_the_lower_blocks():
    _, mod = build(TRIL)
    row, read, col, kind, flags = mod._prefetch(None, None, (512, 128))
    assert len(kind) == 4 * 5 // 2  # the blocks on or below the diagonal, no more
    assert all(c <= r for r, c in zip(row, col))


def test_tril_dx_walks_an_empty_output_block_once():
    """d_x[m, k] = g[m, n] * y[k, n] where k <= m: a condition on the output's indices alone.
    The sum over n is walked as the steps' columns, so each of the 6 output blocks above the
    diagonal (of 4 x 4) takes one step that writes zeros, not one per block of n (2 here):
    10 x 2 + 6 = 26 steps, where n walked inside each step took 16 x 2 = 32."""
    _, mod = build(TRIL)
    row, read, col, kind, flags = mod._d_x_prefetch(None, None, None, (512, 256))
    assert len(kind) == 10 * 2 + 6
    assert int((np.asarray(kind) == mod._EMPTY).sum()) == 6
    # Each output block's steps are consecutive (one run), flagged first and last.
    runs = [r for n, r in enumerate(row) if n == 0 or r != row[n - 1]]
    assert sorted(runs) == list(range(16)) and len(runs) == 16
    flags = np.asarray(flags)
    assert int(((flags & 1) != 0).sum()) == int(((flags & 2) != 0).sum()) == 16


def test_tril_gradients(interpret):
    kernel, mod = build(TRIL)
    rng = np.random.default_rng(2)
    x, y = bf16(rng, (256, 256)), bf16(rng, (256, 128))

    def loss(f):
        return lambda x, y: (f(x, y).astype(jnp.float32) ** 2).sum()

    got = jax.grad(loss(lambda x, y: mod.tril_matmul(x, y, interpret=interpret)), argnums=(0, 1))(x, y)
    want = jax.grad(loss(lambda x, y: jnp.tril(x.astype(jnp.float32)) @ y.astype(jnp.float32)), argnums=(0, 1))(x, y)
    for g, w in zip(got, want):
        w = f32(w)
        assert np.abs(f32(g) - w).max() <= 0.02 * np.abs(w).max()
    assert np.all(f32(got[0])[np.triu_indices(256, 1)] == 0)  # absent terms have no gradient


# ------------------------------------------------------------------ grouped


GROUPS = {
    "empty groups": [100, 0, 200, 0, 84],
    "a group spanning several row blocks": [20, 300, 64],
    "a block straddling three groups": [50, 30, 40, 264],
    "one group": [384],
}


# The simulator where groups are empty and where a block straddles three, the CPU
# interpreter the others (every case in both under SPARSEGEN_SWEEP=1).
@pytest.mark.parametrize(*in_both_modes(list(GROUPS), ["empty groups", "a block straddling three groups"], "group", alone=True),
                         indirect=["interpret"])
def test_grouped_matches_ragged_dot(interpret, group):
    sizes = GROUPS[group]
    kernel, mod = build(GROUPED)
    rng = np.random.default_rng(len(sizes))
    m, e = sum(sizes), len(sizes)
    x, w = bf16(rng, (m, 256)), bf16(rng, (e, 256, 128))
    gid = ids_of(sizes, m)
    want = jax.lax.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32), preferred_element_type=jnp.float32)
    assert_matches(kernel, mod.grouped_matmul(x, w, gid, interpret=interpret), want)
    assert_matches(kernel, mod.reference(x, w, gid), want)


def test_grouped_matches_megablox_gmm():
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    kernel, mod = build(GROUPED)
    rng = np.random.default_rng(3)
    sizes = GROUPS["a block straddling three groups"]
    m, e = sum(sizes), len(sizes)
    x, w = bf16(rng, (m, 256)), bf16(rng, (e, 256, 128))
    want = gmm(x, w, jnp.asarray(sizes, jnp.int32), preferred_element_type=jnp.float32, tiling=(128, 128, 128), interpret=True)
    assert_matches(kernel, mod.grouped_matmul(x, w, ids_of(sizes, m), interpret=True), want)


def test_grouped_under_jit_sorted_and_unsorted():
    """Traced ids: the walk has row blocks + groups - 1 steps; unsorted ids take the dense
    walk (lax.cond), still correct."""
    kernel, mod = build(GROUPED)
    rng = np.random.default_rng(4)
    sizes = [100, 0, 200, 84]
    m = sum(sizes)
    x, w = bf16(rng, (m, 128)), bf16(rng, (4, 128, 128))
    gid = ids_of(sizes, m)
    run = jax.jit(lambda x, w, gid: mod.grouped_matmul(x, w, gid, interpret=True))
    want = f32(jax.lax.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32), preferred_element_type=jnp.float32))
    assert_matches(kernel, run(x, w, gid), want)
    perm = rng.permutation(m)
    assert_matches(kernel, run(x[perm], w, gid[perm]), want[perm])
    # Rows whose id is no group's (padding, -1) are absent: zeros.
    pad = gid.at[-10:].set(-1)
    expect = want.copy()
    expect[-10:] = 0
    assert_matches(kernel, run(x, w, pad), expect)
    text = str(jax.make_jaxpr(lambda x, w, gid: mod.grouped_matmul(x, w, gid, interpret=True))(x, w, gid))
    assert "cond" in text


def test_grouped_gradients_equal_ragged_dots(interpret):
    """dx is gmm with the matrices transposed and dw is tgmm, both derived with the condition."""
    kernel, mod = build(GROUPED)
    rng = np.random.default_rng(5)
    sizes = [50, 0, 300, 34]
    m = sum(sizes)
    x, w = bf16(rng, (m, 128)), bf16(rng, (4, 128, 128))
    gid, gs = ids_of(sizes, m), jnp.asarray(sizes, jnp.int32)

    def loss(f):
        return lambda x, w: (f(x, w).astype(jnp.float32) ** 2).sum()

    got = jax.grad(loss(lambda x, w: mod.grouped_matmul(x, w, gid, interpret=interpret)), argnums=(0, 1))(x, w)
    want = jax.grad(loss(lambda x, w: jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)), argnums=(0, 1))(x, w)
    for g, wv in zip(got, want):
        wv = f32(wv)
        assert np.abs(f32(g) - wv).max() <= 0.02 * np.abs(wv).max()
    assert np.all(f32(got[1])[1] == 0)  # the empty group's matrix gets no gradient


# ------------------------------------------------------------------ random conditions on a sum

AFFINE = """kernel banded {{
    in  x: f32[M, K]
    in  y: f32[K, N]
    out o: f32[M, N]

    o[m, n] = x[m, k] * y[k, n] where {cond}

    tile m = 128, k = 128, n = 128
}}
"""


@settings(max_examples=8, deadline=None)
@given(lo=st.integers(-300, 300), width=st.integers(0, 400), outside=st.booleans())
def test_random_affine_conditions_on_the_sum(lo, width, outside):
    """A band of the sum (exact: one affine form, intersected), or what lies outside it (an
    `or`: correct, partial where unsure)."""
    cond = f"k >= m + {lo} and k < m + {lo + width}" if not outside else f"k < m + {lo} or k >= m + {lo + width}"
    kernel, mod = build(AFFINE.format(cond=cond))
    rng = np.random.default_rng(abs(lo) + width)
    m, kk, n = 256, 384, 256
    x, y = rng.standard_normal((m, kk), dtype=np.float32), rng.standard_normal((kk, n), dtype=np.float32)
    mi, ki = np.arange(m)[:, None, None], np.arange(kk)[None, :, None]
    present = (ki >= mi + lo) & (ki < mi + lo + width)
    present = ~present if outside else present
    want = np.einsum("mk,mk,kn->mn", present[..., 0].astype(np.float64), x, y)
    assert_matches(kernel, mod.banded(x, y, interpret=True), want)
    assert_matches(kernel, mod.reference(x, y), want)


NEGATED = {  # condition: its truth over (m, k), numpy (n = N = 128)
    "not (m % N < 3)": lambda m, k, n: ~(m % n < 3),
    "not (k % N < 5 and m >= 3)": lambda m, k, n: ~((k % n < 5) & (m >= 3)),
    "not (m < m + 3)": lambda m, k, n: ~(m < m + 3) & (k >= 0),  # no index left after the difference: never present
    "not (N < 300)": lambda m, k, n: np.zeros_like(m + k, bool) if n < 300 else np.ones_like(m + k, bool),  # sizes only
}


# What is checked is the classification (the same in both modes): the simulator for one
# condition (every one under SPARSEGEN_SWEEP=1).
@pytest.mark.parametrize(*in_both_modes(sorted(NEGATED), ["not (k % N < 5 and m >= 3)"], "cond"), indirect=["interpret"])
def test_a_negated_condition_is_never_full_where_terms_are_absent(interpret, cond):
    """A negation of what the classifier cannot bound (`m % N`) must stay "maybe", and of
    a comparison decided without an index (`m < m + 3`, `N < 300`) must stay decided. The
    classification wrote `~(...)`, which on a Python bool is -2 or -1 (truthy): every block
    full, the condition silently dropped."""
    kernel, mod = build(AFFINE.format(cond=cond))
    rng = np.random.default_rng(5)
    m, kk, n = 256, 128, 128
    x, y = rng.standard_normal((m, kk), dtype=np.float32), rng.standard_normal((kk, n), dtype=np.float32)
    present = np.broadcast_to(NEGATED[cond](np.arange(m)[:, None], np.arange(kk)[None, :], n), (m, kk))
    want = np.einsum("mk,mk,kn->mn", present.astype(np.float64), x, y)
    kinds = np.asarray(mod._classify(np, (m, kk, n)))
    # Full blocks hold every term: over the condition's indices (m, then k; none: one block).
    blocks = present.reshape(m // 128, 128, kk // 128, 128).all(axis=(1, 3))
    every = {0: blocks.all(), 1: blocks.all(axis=1), 2: blocks}[kinds.ndim]
    assert not ((kinds == 2) & ~every).any()
    assert_matches(kernel, mod.banded(x, y, interpret=interpret), want)
    assert_matches(kernel, mod.reference(x, y), want)


def test_a_condition_no_factor_can_select_is_refused():
    from sparsegen.source import SpecError

    with pytest.raises(SpecError, match="no factor holds every index of the condition"):
        build(AFFINE.format(cond="k + n >= m"))  # x has m and k, y has k and n


# ------------------------------------------------------------------ ahead of time


# Each example on one target by default, the targets in turn (all under SPARSEGEN_SWEEP=1):
# tests/test_verify.py compiles both examples, forward and backward, for v5e, v6e and v4.
@pytest.mark.parametrize("name,topology", across_targets(["tril_matmul", "grouped_matmul"], ["v5e:2x2", "v6e:2x2", "v4:2x2x1"]))
def test_examples_compile_ahead_of_time_forward_and_backward(name, topology):
    """The examples at their own 512 tiles."""
    x = np.zeros((2048, 2048), jnp.bfloat16)
    if name == "tril_matmul":
        _, tril = build(spec_text("tril_matmul"))
        y = np.zeros((2048, 1024), jnp.bfloat16)
        assert "tpu_custom_call" in compile_for(lambda x, y: tril.tril_matmul(x, y), (x, y), topology).as_text()
        compile_for(jax.grad(lambda x, y: tril.tril_matmul(x, y).astype(jnp.float32).sum(), argnums=(0, 1)), (x, y), topology)
    else:
        _, grouped = build(spec_text("grouped_matmul"))
        w, gid = np.zeros((8, 2048, 1024), jnp.bfloat16), np.zeros((2048,), np.int32)
        assert "tpu_custom_call" in compile_for(lambda x, w, g: grouped.grouped_matmul(x, w, g), (x, w, gid), topology).as_text()
        compile_for(jax.grad(lambda x, w, g: grouped.grouped_matmul(x, w, g).astype(jnp.float32).sum(), argnums=(0, 1)), (x, w, gid), topology)


def test_plan_pattern_counts_the_condition_walk():
    """`plan --pattern` runs the walk's own tables: tril visits the 10 blocks on or below the
    diagonal of 4 x 4 per column block; grouped ids of 256 rows visit 8 (row block, group)
    pairs of the 4 x 8 the dense product would."""
    from sparsegen.compiler import plans
    from sparsegen.backends import analyse_module as analyse

    (tril,) = plans(SPECS / "tril_matmul.spk")
    report = analyse(tril, {"M": 2048, "N": 1024}, "density=0.5")
    assert report.sim.block_products == 2 * 10 and report.dense.block_products == 2 * 16
    (grouped,) = plans(SPECS / "grouped_matmul.spk")
    report = analyse(grouped, {"M": 2048, "K": 1024, "N": 1024, "E": 8}, "band=256")
    assert report.sim.block_products == 2 * 2 * 8 and report.dense.block_products == 2 * 2 * 4 * 8


# ------------------------------------------------------------------ group offsets, scalars from SMEM

OFFSETS = """kernel gmm_offsets {
    in  x: bf16[M, K]
    in  w: bf16[E, K, N]
    in  lo: i32[E1]
    out o: bf16[M, N]

    o[m, n] = x[m, k] * w[g, k, n] where lo[g] <= m < lo[g + 1]

    tile m = 128, k = 128, n = 128, g = 1
}
"""

LENGTHS = """kernel ragged_sum {
    in  x: f32[B, M, K]
    in  y: f32[B, K, N]
    in  lens: i32[B]
    out o: f32[B, M, N]

    o[b, m, n] = x[b, m, k] * y[b, k, n] where k < lens[b]

    tile b = 1, m = 128, k = 128, n = 128
}
"""


# Empty groups in the CPU interpreter, a block straddling groups in the simulator (both in
# both under SPARSEGEN_SWEEP=1; test_grouped_matches_ragged_dot runs both groupings there).
@pytest.mark.parametrize(*in_both_modes(["empty groups", "a block straddling three groups"], ["a block straddling three groups"], "group",
                                        alone=True), indirect=["interpret"])
def test_group_offsets_match_ragged_dot(interpret, group):
    """`lo[g] <= m < lo[g + 1]`: the offsets form; `lo` has E + 1 entries (its own size), read
    one entry per step from SMEM."""
    kernel, mod = build(OFFSETS)
    rng = np.random.default_rng(6)
    sizes = GROUPS[group]
    m, e = sum(sizes), len(sizes)
    x, w = bf16(rng, (m, 128)), bf16(rng, (e, 128, 128))
    lo = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
    gs = jnp.asarray(sizes, jnp.int32)
    want = jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
    assert_matches(kernel, mod.gmm_offsets(x, w, lo, interpret=interpret), want)
    assert_matches(kernel, mod.reference(x, w, lo), want)
    got = jax.grad(lambda x, w: (mod.gmm_offsets(x, w, lo, interpret=interpret).astype(jnp.float32) ** 2).sum(), argnums=(0, 1))(x, w)
    ref = jax.grad(lambda x, w: (jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32) ** 2).sum(), argnums=(0, 1))(x, w)
    for g, r in zip(got, ref):
        assert np.abs(f32(g) - f32(r)).max() <= 0.02 * np.abs(f32(r)).max()


def test_group_offsets_walk_is_bounded_and_reads_are_checked():
    _, mod = build(OFFSETS, formatted=True)  # its text is read
    assert "pl.cdiv(M, 128) + E - 1" in open(mod.__file__).read()  # the sorted bound, as for ids
    x, w = np.zeros((256, 128), jnp.bfloat16), np.zeros((4, 128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"lo dim 0 has 4 entries, but lo\[g \+ 1\] reads entry 4"):
        mod.gmm_offsets(x, w, np.zeros(4, np.int32), interpret=True)


def test_lengths_read_from_smem(interpret):
    """`k < lens[b]`: a per-batch length, one scalar per step (SMEM), under jit too."""
    kernel, mod = build(LENGTHS, formatted=True)  # its text is read
    rng = np.random.default_rng(7)
    b, m, kk, n = 3, 128, 384, 128
    x, y = rng.standard_normal((b, m, kk), dtype=np.float32), rng.standard_normal((b, kk, n), dtype=np.float32)
    lens = np.array([0, 130, 384], np.int32)
    want = np.einsum("bmk,bkn->bmn", x * (np.arange(kk)[None, None, :] < lens[:, None, None]), y)
    assert_matches(kernel, mod.ragged_sum(x, y, lens, interpret=interpret), want)
    assert_matches(kernel, jax.jit(lambda x, y, lens: mod.ragged_sum(x, y, lens, interpret=interpret))(x, y, lens), want)
    assert "lens_smem[step_read[step]]" in open(mod.__file__).read()


@pytest.mark.parametrize("text,message", [
    ("o[m, n] = x[m, k] * w[g + 1, k, n] where lo[g] <= m", r"reads an integer operand in a condition only"),
    ("o[m, n] = x[m, k] * w[g, k, n] where lo[g - 1] <= m", r"not supported yet: a read at an index minus an integer"),
])
def test_shifted_reads_outside_conditions_are_refused(text, message):
    from sparsegen.source import SpecError

    spec = OFFSETS.replace("o[m, n] = x[m, k] * w[g, k, n] where lo[g] <= m < lo[g + 1]", text)
    with pytest.raises(SpecError, match=message):
        build(spec)


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_offsets_and_lengths_compile_ahead_of_time(topology):
    _, off = build(OFFSETS)
    x, w, lo = np.zeros((1024, 256), jnp.bfloat16), np.zeros((8, 256, 256), jnp.bfloat16), np.zeros((9,), np.int32)
    compile_for(lambda x, w, lo: off.gmm_offsets(x, w, lo), (x, w, lo), topology)
    compile_for(jax.grad(lambda x, w, lo: off.gmm_offsets(x, w, lo).astype(jnp.float32).sum(), argnums=(0, 1)), (x, w, lo), topology)
    _, lengths = build(LENGTHS)
    x, y, lens = np.zeros((2, 256, 512), np.float32), np.zeros((2, 512, 256), np.float32), np.zeros((2,), np.int32)
    compile_for(lambda x, y, lens: lengths.ragged_sum(x, y, lens), (x, y, lens), topology)


def test_a_negated_condition_compiles_ahead_of_time():
    """`not` is written jnp.logical_not in kernels too (Mosaic lowers it as it lowers `~`)."""
    kernel, mod = build(AFFINE.format(cond="not (k >= m + 64 and k < m + 200)"))
    x, y = np.zeros((256, 384), np.float32), np.zeros((384, 256), np.float32)
    compile_for(lambda a, b: mod.banded(a, b), [x, y])


INDEX_LENGTHS = """kernel lens_matmul {
    in  x: f32[B, M, K]
    in  y: f32[B, K, N]
    in  lens: index[B]
    out o: f32[B, M, N]

    o[b, m, n] = x[b, m, k] * y[b, k, n] where k < lens[b]

    tile b = 1, m = 128, k = 128, n = 128
}
"""


@both_modes  # jit and gradients in the CPU interpreter
def test_an_index_operand_in_a_condition(interpret):
    """`lens: index[B]` read by a condition (issue 18: index operands in conditions): an
    int32 array the classification and the kernel read, as an i32 operand is; under jit the
    grid runs the steps the lengths need; gradients keep the condition."""
    import jax

    kernel, mod = build(INDEX_LENGTHS)
    rng = np.random.default_rng(2)
    b, m, kk, n = 3, 256, 384, 128
    x, y = rng.standard_normal((b, m, kk), dtype=np.float32), rng.standard_normal((b, kk, n), dtype=np.float32)
    lens = np.array([0, 200, 384], np.int32)
    present = (np.arange(kk)[None, :] < lens[:, None]).astype(np.float64)
    want = np.einsum("bmk,bk,bkn->bmn", x, present, y)
    assert_matches(kernel, mod.lens_matmul(x, y, lens, interpret=interpret), want)
    assert_matches(kernel, mod.reference(x, y, lens), want)
    if interpret is True:
        assert_matches(kernel, jax.jit(lambda *a: mod.lens_matmul(*a, interpret=True))(x, y, lens), want)
        got = jax.grad(lambda a: mod.lens_matmul(a, y, lens, interpret=True).sum())(x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(jax.grad(lambda a: mod.reference(a, y, lens).sum())(x)), rtol=1e-4, atol=1e-4)


def test_plan_pattern_reads_an_index_operand_in_a_condition(tmp_path, capsys):
    """An index operand only a condition reads is an integer array in the IR (as an i32 one
    is), so `plan --pattern` draws it as it draws ids (it crashed: the simulator passed no
    array for it)."""
    from sparsegen.cli import main

    spec = tmp_path / "lens.spk"
    spec.write_text(INDEX_LENGTHS)
    code = main(["plan", str(spec), "--pattern", "density=0.5", "--shape", "B=2,M=256,K=384,N=128"])  # in this process
    out = capsys.readouterr()
    assert code == 0 and "Traceback" not in out.err, out.err
    assert "block products" in out.out
