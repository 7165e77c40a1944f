"""sparsegen.formats: BlockCOO constructors and transforms, sparsify_mask, bucketing, and the
generated kernels fed from formats."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from conftest import ROOT, assert_matches, build, spec_text, with_tiles
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.tutorial_sparsify import tutorial_sparsify_mask
from sparsegen.formats import BlockCOO, bucket_size, sparsify_mask


def block_sparse(rng, shape, block, density=0.4, dtype=np.float32):
    dense = rng.standard_normal(shape).astype(dtype)
    keep = rng.random((shape[0] // block[0], shape[1] // block[1])) < density
    return dense * np.kron(keep, np.ones(block)).astype(dtype)


def test_formats_needs_only_numpy():
    """Importable and usable with jax and scipy unavailable, and without the compiler."""
    code = (
        "import sys\n"
        "for name in ('jax', 'scipy', 'jinja2', 'lark', 'black'):\n"
        "    sys.modules[name] = None  # any import of them now fails\n"
        "import numpy as np\n"
        "from sparsegen.formats import BlockCOO, sparsify_mask\n"
        "x = BlockCOO.from_dense(np.eye(256, dtype=np.float32), (128, 128))\n"
        "assert x.nb == 2 and (x.to_dense() == np.eye(256)).all()\n"
        "assert sparsify_mask(np.tril(np.ones((256, 256), np.int32)), (128, 128))[4].shape == (2, 128, 128)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_from_dense_keeps_nonzero_blocks_in_row_major_order():
    rng = np.random.default_rng(0)
    dense = block_sparse(rng, (256, 384), (64, 128))
    x = BlockCOO.from_dense(dense, (64, 128))
    assert x.shape == (256, 384) and x.block_shape == (64, 128)
    assert all(c.dtype == np.int32 for c in x.coords)
    keys = x.coords[0] * 3 + x.coords[1]
    assert np.all(np.diff(keys) > 0)
    assert all(np.any(b != 0) for b in x.blocks)
    np.testing.assert_array_equal(x.to_dense(), dense)


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "bsr", "lil", "dok"])
def test_from_scipy_every_format(fmt):
    rng = np.random.default_rng(1)
    dense = block_sparse(rng, (128, 256), (32, 128), density=0.5)
    matrix = sp.csr_matrix(dense).asformat(fmt)
    x = BlockCOO.from_scipy(matrix, (32, 128))
    np.testing.assert_allclose(x.to_dense(), dense)
    np.testing.assert_array_equal(BlockCOO.from_scipy(sp.csr_array(dense), (32, 128)).to_dense(), dense)


def test_from_scipy_sums_duplicates_and_drops_explicit_zero_blocks():
    m = sp.coo_matrix((np.array([1.0, 2.0, 0.0]), (np.array([0, 0, 100]), np.array([0, 0, 200]))), shape=(128, 256))
    x = BlockCOO.from_scipy(m, (64, 128))
    assert x.nb == 1 and x.to_dense()[0, 0] == 3.0


def test_from_bcoo_and_bcsr():
    from jax.experimental import sparse

    rng = np.random.default_rng(2)
    dense = block_sparse(rng, (128, 256), (64, 128), density=0.5)
    for matrix in (sparse.BCOO.fromdense(dense), sparse.BCSR.fromdense(dense)):
        np.testing.assert_allclose(BlockCOO.from_bcoo(matrix, (64, 128)).to_dense(), dense)


def test_transpose_and_args():
    rng = np.random.default_rng(3)
    dense = block_sparse(rng, (128, 256), (64, 128))
    x = BlockCOO.from_dense(dense, (64, 128))
    np.testing.assert_array_equal(x.T.to_dense(), dense.T)
    blocks, i0, i1 = x.args()
    assert blocks is x.blocks and i0 is x.coords[0] and i1 is x.coords[1]


def test_validation_errors_are_clear():
    with pytest.raises(ValueError, match=r"does not divide the shape \(100, 128\) along dim 0"):
        BlockCOO.from_dense(np.zeros((100, 128)), (64, 128))
    with pytest.raises(ValueError, match="has 1 dimensions, the array 2"):
        BlockCOO.from_dense(np.zeros((128, 128)), (64,))
    with pytest.raises(ValueError, match=r"coordinate 1 of block 0 is 5, outside 0..1"):
        BlockCOO(np.zeros((1, 64, 128)), (np.array([0]), np.array([5])), (128, 256))
    with pytest.raises(ValueError, match="must hold integers"):
        BlockCOO(np.zeros((1, 64, 128)), (np.array([0.0]), np.array([0])), (128, 256))


def test_pytree_roundtrip_under_jit():
    rng = np.random.default_rng(4)
    x = BlockCOO.from_dense(block_sparse(rng, (128, 256), (64, 128)), (64, 128))
    leaves, tree = jax.tree_util.tree_flatten(x)
    assert len(leaves) == 3
    dense = jax.jit(lambda m: m.to_dense())(x)
    np.testing.assert_allclose(dense, x.to_dense())


def test_bucket_sizes():
    assert [bucket_size(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    assert bucket_size(10, [8, 16, 100]) == 16
    with pytest.raises(ValueError, match="do not fit any bucket"):
        bucket_size(101, [8, 16, 100])


def test_pad_to_changes_no_result():
    rng = np.random.default_rng(5)
    dense = block_sparse(rng, (128, 256), (64, 128))
    x = BlockCOO.from_dense(dense, (64, 128))
    padded = x.pad_to(x.nb + 5)
    assert padded.nb == x.nb + 5 and np.all(padded.coords[0][x.nb :] == -1)
    np.testing.assert_array_equal(padded.to_dense(), dense)
    with pytest.raises(ValueError, match="cannot pad"):
        x.pad_to(0)


# ------------------------------------------------------------------ sparsify_mask


def check_invariant(mask, block, result):
    block_mask, prefetch_mask, prefetch_i, prefetch_j, mask_data = result
    bm, bn = block
    for i, j in zip(*np.nonzero(block_mask)):
        np.testing.assert_array_equal(mask_data[prefetch_mask[i, j]], mask[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn])


def test_sparsify_mask_matches_the_tutorial_on_a_causal_mask():
    mask = np.tril(np.ones((512, 768), np.int32))
    ours = sparsify_mask(mask, (128, 128))
    theirs = tutorial_sparsify_mask(jnp.asarray(mask), (128, 128))
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, np.asarray(b))
    check_invariant(mask, (128, 128), ours)


def test_sparsify_mask_does_not_merge_blocks_that_print_alike():
    """Two partial blocks whose printed (truncated) forms agree: the tutorial merges them."""
    mask = np.zeros((128, 256), np.int32)
    mask[:64, :128] = 1
    mask[:64, 128:] = 1
    mask[30, 140] = 0  # inside the part numpy elides when printing a 64x128 block
    theirs = tutorial_sparsify_mask(jnp.asarray(mask), (64, 128))
    assert np.asarray(theirs[4]).shape[0] == 1  # the bug: one block for two different ones
    ours = sparsify_mask(mask, (64, 128))
    assert ours[4].shape[0] == 2
    check_invariant(mask, (64, 128), ours)
    for k in (0, 2, 3):
        np.testing.assert_array_equal(ours[k], np.asarray(theirs[k]))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.sampled_from([(8, 128), (16, 128), (32, 256), (64, 128)]),
    st.integers(1, 4),
    st.integers(1, 4),
    st.sampled_from(["int32", "bool", "float32", "int8"]),
    st.floats(0.0, 1.0),
    st.integers(0, 2**16),
)
def test_sparsify_mask_invariant_and_tutorial_maps(block, gm, gn, dtype, density, seed):
    rng = np.random.default_rng(seed)
    bm, bn = block
    cells = rng.random((gm, gn)) < density
    kinds = rng.integers(0, 3, (gm, gn))
    mask = np.zeros((gm * bm, gn * bn), np.float32)
    for i, j in zip(*np.nonzero(cells)):
        sl = (slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn))
        mask[sl] = 1.0 if kinds[i, j] == 0 else (rng.random((bm, bn)) < 0.3) if kinds[i, j] == 1 else np.tril(np.ones((bm, bn)))
        mask[sl][0, 0] = 1.0
    mask = mask.astype(dtype)
    ours = sparsify_mask(mask, block)
    check_invariant(mask, block, ours)
    np.testing.assert_array_equal(ours[0] != 0, cells)
    nz = np.flatnonzero(cells.reshape(-1))
    flat = np.arange(gm * gn)
    nxt = np.array([nz[nz >= c][0] if (nz >= c).any() else gm * gn - 1 for c in flat])
    np.testing.assert_array_equal(ours[2].reshape(-1), nxt // gn)
    np.testing.assert_array_equal(ours[3].reshape(-1), nxt % gn)
    # Exact dedup: distinct blocks are distinct entries.
    data = ours[4].reshape(ours[4].shape[0], bm * bn)
    assert len({row.tobytes() for row in data}) == data.shape[0]


def test_sparsify_mask_all_zero_and_errors():
    block_mask, prefetch_mask, prefetch_i, prefetch_j, data = sparsify_mask(np.zeros((256, 256), np.int32), (128, 128))
    assert not block_mask.any() and data.shape == (0, 128, 128)
    np.testing.assert_array_equal(prefetch_i, 1)
    with pytest.raises(ValueError, match="must be 2-D"):
        sparsify_mask(np.zeros((4, 4, 4)), (2, 2))


# ---------------------------------------------------- formats feed the kernels


def test_every_example_spec_from_formats_matches_dense_numpy():
    rng = np.random.default_rng(7)
    # dsd: scipy -> BlockCOO -> kernel
    _, dsd = build(with_tiles(spec_text("dsd_matmul"), m=128, n=128, k=128))
    x_dense = block_sparse(rng, (384, 256), (128, 128)).astype(jnp.bfloat16)
    x = BlockCOO.from_scipy(sp.csr_matrix(x_dense.astype(np.float32)), (128, 128))
    x = BlockCOO(x.blocks.astype(jnp.bfloat16), x.coords, x.shape)
    y = rng.standard_normal((256, 256)).astype(jnp.bfloat16)
    expect = x_dense.astype(np.float64) @ y.astype(np.float64)
    out = dsd.dsd_matmul(*x.args(), y, M=x.shape[0], interpret=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), expect, rtol=2e-2, atol=2e-2 * np.abs(expect).max())
    # dds: dense -> BlockCOO
    _, dds = build(with_tiles(spec_text("dds_matmul"), m=128, n=128, k=128))
    w_dense = block_sparse(rng, (256, 384), (128, 128)).astype(jnp.bfloat16)
    w = BlockCOO.from_dense(w_dense, (128, 128))
    a = rng.standard_normal((128, 256)).astype(jnp.bfloat16)
    expect = a.astype(np.float64) @ w_dense.astype(np.float64)
    out = dds.dds_matmul(a, *w.args(), N=w.shape[1], interpret=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), expect, rtol=2e-2, atol=2e-2 * np.abs(expect).max())
    # masked: a tutorial-style mask goes in as it is
    _, masked = build(with_tiles(spec_text("masked_matmul"), m=128, n=128, k=128))
    mask = np.tril(np.ones((256, 256), np.int32))
    a = rng.standard_normal((256, 128)).astype(jnp.bfloat16)
    b = rng.standard_normal((128, 256)).astype(jnp.bfloat16)
    expect = mask * (a.astype(np.float64) @ b.astype(np.float64))
    out = masked.masked_matmul(a, b, mask, interpret=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), expect, rtol=2e-2, atol=2e-2 * np.abs(expect).max())
    # sdd: output topology from a BlockCOO's coordinates, result back into a BlockCOO
    _, sdd = build(with_tiles(spec_text("sdd_matmul"), m=128, n=128, k=128))
    topology = BlockCOO.from_dense(np.tril(np.ones((256, 384), np.float32)), (128, 128))
    b = rng.standard_normal((128, 384)).astype(jnp.bfloat16)
    out = sdd.sdd_matmul(a, b, *topology.coords, interpret=True)
    assert out.shape == (topology.nb, 128, 128)
    product = BlockCOO(np.asarray(out, np.float32), topology.coords, (256, 384)).to_dense()
    assert product.shape == (256, 384)
    # The requested blocks hold the product, the others are zeros.
    requested = np.zeros((256, 384), bool)
    for r, c in zip(*(np.asarray(c) for c in topology.coords)):
        requested[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128] = True
    assert requested.any() and not requested.all()
    expect = np.where(requested, a.astype(np.float64) @ b.astype(np.float64), 0)
    np.testing.assert_allclose(product, expect, rtol=2e-2, atol=2e-2 * np.abs(expect).max())
    # block_slice: dense in, dense out
    _, bs = build(spec_text("block_slice"))
    xs = np.arange(512 * 512, dtype=np.int32).reshape(512, 512)
    np.testing.assert_array_equal(bs.block_slice(xs, np.array([256, 128]), interpret=True), xs[256:384, 128:256])


def test_bucketing_compiles_at_most_once_per_bucket():
    """Ten patterns of different nnz through one jitted kernel: one trace (= one compile) per bucket."""
    kernel, mod = build(with_tiles(spec_text("dsd_matmul"), m=128, n=128, k=128))
    y = np.ones((512, 128), jnp.bfloat16)
    traces = []

    @jax.jit
    def run(x_blocks, i0, i1, yy):
        traces.append(x_blocks.shape[0])
        return mod.dsd_matmul(x_blocks, i0, i1, yy, M=512, interpret=True)

    rng = np.random.default_rng(9)
    buckets = set()
    for nnz in (1, 2, 3, 4, 5, 6, 7, 9, 12, 16):
        cells = rng.choice(16, size=nnz, replace=False)
        dense = np.zeros((512, 512), np.float32)
        for c in cells:
            dense[(c // 4) * 128 : (c // 4 + 1) * 128, (c % 4) * 128 : (c % 4 + 1) * 128] = rng.standard_normal((128, 128))
        x = BlockCOO.from_dense(dense.astype(jnp.bfloat16), (128, 128))
        padded = x.bucketed()
        buckets.add(padded.nb)
        out = run(*padded.args(), y)
        assert_matches(kernel, out, mod.reference(*x.args(), y, M=512))
    assert len(traces) == len(buckets) == 5  # buckets 1, 2, 4, 8, 16


def test_sparsify_mask_any_layout_and_negative_zero():
    rng = np.random.default_rng(11)
    mask = (rng.random((256, 512)) < 0.01).astype(np.int32)
    mask[:128, :128] = 1
    mask[128:, 256:384] = 1
    contiguous = sparsify_mask(mask, (128, 128))
    for variant in (np.asfortranarray(mask), np.ascontiguousarray(mask.T).T):
        for a, b in zip(contiguous, sparsify_mask(variant, (128, 128))):
            np.testing.assert_array_equal(a, b)
    floats = np.zeros((128, 256), np.float32)
    floats[:, :128] = -0.0  # zero by value: an empty block
    floats[:, 128:] = 1.0
    block_mask, _, _, _, data = sparsify_mask(floats, (128, 128))
    np.testing.assert_array_equal(block_mask, [[0, 1]])
    assert data.shape == (1, 128, 128)


# ------------------------------------------------------------------ mixture of experts


@pytest.mark.parametrize("sizes", [[3, 0, 5, 1], [0, 0, 4], [2], [0, 7, 0]])
def test_group_ids_and_offsets_match_repeat(sizes):
    from sparsegen.formats import group_ids, group_offsets

    expected = np.repeat(np.arange(len(sizes)), sizes)
    ids = group_ids(np.array(sizes))
    assert ids.dtype == np.int32 and ids.tolist() == expected.tolist()
    offsets = group_offsets(np.array(sizes))
    assert offsets.tolist() == [0, *np.cumsum(sizes).tolist()]
    # Every row m lies in its group's offsets: lo[gid[m]] <= m < lo[gid[m] + 1].
    m = np.arange(len(expected))
    assert ((offsets[ids] <= m) & (m < offsets[ids + 1])).all()


def test_group_ids_puts_rows_past_the_sizes_in_no_group():
    """Rows past the sizes' total are in no group (id E), as the offsets form leaves rows
    past lo[E] out: a dropped or padding row runs through no expert in either form."""
    import jax
    import jax.numpy as jnp

    from sparsegen.formats import group_ids

    ids = jax.jit(lambda s: group_ids(s, num_rows=10))(jnp.array([2, 0, 3], jnp.int32))
    assert np.asarray(ids).tolist() == [0, 0, 2, 2, 2, 3, 3, 3, 3, 3]
    assert group_ids(np.array([2, 0, 3]), num_rows=7).tolist() == [0, 0, 2, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="num_rows"):
        jax.jit(group_ids)(jnp.array([1, 2], jnp.int32))


def test_group_helpers_refuse_bad_sizes():
    from sparsegen.formats import group_ids, route

    with pytest.raises(ValueError, match="group_sizes: sizes must be >= 0"):
        group_ids(np.array([2, -1]))
    with pytest.raises(ValueError, match="more than num_rows=3"):
        group_ids(np.array([2, 2]), num_rows=3)
    with pytest.raises(ValueError, match="group_sizes: expected an integer array"):
        group_ids(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"choices: expert 4 at slot 3 is outside \[0, 4\)"):
        route(np.array([[0, 1], [2, 4]]), 4)
    with pytest.raises(ValueError, match=r"choices: expert -2 at slot 1 is outside \[0, 4\) \(-1 drops a choice\)"):
        route(np.array([[0, -2], [2, 1]]), 4)


@pytest.mark.parametrize("use_jax", [False, True])
def test_route_sorts_tokens_by_expert_stably(use_jax):
    import jax
    import jax.numpy as jnp

    from sparsegen.formats import route

    rng = np.random.default_rng(0)
    choices = rng.integers(0, 5, size=(13, 2)).astype(np.int32)
    if use_jax:
        r = jax.jit(lambda c: route(c, 6))(jnp.asarray(choices))
        r = type(r)(*(np.asarray(a) for a in r))
    else:
        r = route(choices, 6)
    flat = choices.reshape(-1)
    assert r.ids.tolist() == sorted(flat.tolist())
    assert (flat[r.order] == r.ids).all()
    # Stable: within an expert the slots keep their order.
    for e in range(6):
        slots = r.order[r.ids == e]
        assert (np.diff(slots) > 0).all()
    assert r.sizes.tolist() == np.bincount(flat, minlength=6).tolist() and r.sizes[5] == 0
    assert (r.order[r.inverse] == np.arange(flat.size)).all()
    # Tokens gathered in sorted order and scattered back come home.
    x = rng.normal(size=(13, 3))
    rows = x[r.order // 2]
    assert np.allclose(rows[r.inverse], np.repeat(x, 2, axis=0))


# Capacity routers drop a token's choice as -1: it counts for no expert, in the ids form and
# in the offsets form, on concrete arguments and under jit (where jnp.bincount counted -1 for
# expert 0, and the sorted -1 rows came first, inside expert 0's offsets).
DROPPED = np.array([[0, -1], [2, 1], [-1, 0], [1, -1], [2, 2]], np.int32)


@pytest.mark.parametrize("use_jax", [False, True])
def test_route_drops_minus_one_in_both_forms(use_jax):
    from sparsegen.formats import group_ids, group_offsets, route

    if use_jax:
        r = jax.jit(lambda c: route(c, 3))(jnp.asarray(DROPPED))
        r = type(r)(*(np.asarray(a) for a in r))
    else:
        r = route(DROPPED, 3)
    flat = DROPPED.reshape(-1)
    kept = flat[flat >= 0]
    assert r.sizes.tolist() == np.bincount(kept, minlength=3).tolist() == [2, 2, 3]
    # The kept choices sorted, stably, then the dropped ones (id E = 3: no expert).
    assert r.ids.tolist() == [0, 0, 1, 1, 2, 2, 2, 3, 3, 3]
    assert r.order.tolist() == [0, 5, 3, 6, 2, 8, 9, 1, 4, 7]
    assert (r.order[r.inverse] == np.arange(flat.size)).all()
    # Both forms agree on every row: the ids group_ids makes, and the offsets' ranges.
    m = np.arange(flat.size)
    assert group_ids(r.sizes, num_rows=flat.size).tolist() == r.ids.tolist()
    lo = np.asarray(group_offsets(r.sizes))
    in_offsets = [[lo[g] <= i < lo[g + 1] for g in range(3)] for i in m]
    assert in_offsets == [[r.ids[i] == g for g in range(3)] for i in m]
    # Under jit a choice outside [0, E) other than -1 is dropped too (not clamped to an expert).
    r = jax.jit(lambda c: route(c, 3))(jnp.array([[0, 7], [-5, 1]], jnp.int32))
    assert np.asarray(r.sizes).tolist() == [1, 1, 0] and np.asarray(r.ids).tolist() == [0, 1, 3, 3]


GMM_OFFSETS = """kernel gmm_offsets {
    in  x: bf16[M, K]
    in  w: bf16[E, K, N]
    in  lo: i32[E1]
    out o: bf16[M, N]

    o[m, n] = x[m, k] * w[g, k, n] where lo[g] <= m < lo[g + 1]

    tile m = 128, k = 128, n = 128, g = 1
}
"""


@pytest.mark.parametrize("form", ["ids", "offsets"])
@pytest.mark.parametrize("interpret", ["cpu", "sim"], indirect=True)
def test_routed_grouped_matmul_leaves_dropped_choices_out(form, interpret):
    """Tokens routed under jit with dropped choices, through the grouped matmul: each kept
    slot gets its expert's product, a dropped slot zero (before the fix, the offsets form
    ran it through expert 0 and shifted expert 0's rows)."""
    from sparsegen.formats import group_offsets, route

    rng = np.random.default_rng(3)
    tokens, top_k, experts, d = 150, 2, 4, 128
    choices = rng.integers(0, experts, size=(tokens, top_k)).astype(np.int32)
    choices[rng.random(choices.shape) < 0.3] = -1
    x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, d, d)), jnp.bfloat16)
    if form == "ids":
        kernel, mod = build(with_tiles(spec_text("grouped_matmul"), m=128, k=128, n=128, g=1))
        call = lambda rows, r: mod.grouped_matmul(rows, w, r.ids, interpret=interpret)  # noqa: E731
    else:
        kernel, mod = build(GMM_OFFSETS)
        call = lambda rows, r: mod.gmm_offsets(rows, w, group_offsets(r.sizes), interpret=interpret)  # noqa: E731

    @jax.jit
    def moe(choices, x):
        r = route(choices, experts)
        out = call(x[r.order // top_k], r)
        return out[r.inverse].reshape(tokens, top_k, d)

    got = np.asarray(moe(jnp.asarray(choices), x), np.float32)
    xf, wf = np.asarray(x, np.float32), np.asarray(w, np.float32)
    want = np.zeros((tokens, top_k, d), np.float32)
    for t, c in zip(*np.nonzero(choices >= 0)):
        want[t, c] = xf[t] @ wf[choices[t, c]]
    assert (got[choices < 0] == 0).all()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=0.1 * np.sqrt(d))


def test_from_dense_keeps_blocks_of_negative_and_nan_values():
    """Nonzero means != 0: a block holding only negative values, or only NaN, is kept; a
    block of zeros (negative zero too) is not."""
    dense = np.zeros((256, 256), np.float32)
    dense[0:128, 128:256] = -1.5  # block (0, 1): negatives only
    dense[128:256, 0:128] = np.nan  # block (1, 0): NaN only
    dense[128:256, 128:256] = -0.0  # block (1, 1): negative zeros
    x = BlockCOO.from_dense(dense, (128, 128))
    assert [tuple(map(int, c)) for c in zip(*x.coords)] == [(0, 1), (1, 0)]
    np.testing.assert_array_equal(x.blocks[0], dense[0:128, 128:256])
    assert np.isnan(x.blocks[1]).all()
