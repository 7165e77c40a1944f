"""Calling a generated kernel wrong: ValueErrors that name the argument and dimension;
under jit, out-of-range coordinates and offsets are clamped so no copy leaves its array."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches, build, spec_text, with_tiles

DSD = with_tiles(spec_text("dsd_matmul"), m=128, n=128, k=128)
SDD = with_tiles(spec_text("sdd_matmul"), m=128, n=128, k=128)
MASKED = with_tiles(spec_text("masked_matmul"), m=128, n=128, k=128)


def dsd_args(nb=3, M=384, K=256, N=256):
    rng = np.random.default_rng(0)
    blocks = rng.standard_normal((nb, 128, 128)).astype(jnp.bfloat16)
    rows = np.arange(nb) % (M // 128)
    cols = np.arange(nb) % (K // 128)
    y = rng.standard_normal((K, N)).astype(jnp.bfloat16)
    return blocks, rows.astype(np.int32), cols.astype(np.int32), y


def raises(fn, *fragments):
    with pytest.raises(ValueError) as info:
        fn()
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return str(info.value)


def test_missing_size_keyword_says_which_and_how():
    _, mod = build(DSD)
    raises(lambda: mod.dsd_matmul(*dsd_args()), "dsd_matmul: size M is carried only by 'x' and 'o'", "dsd_matmul(..., M=...)")


def test_bad_shapes_name_the_argument_and_dimension():
    _, mod = build(DSD)
    blocks, rows, cols, y = dsd_args()
    raises(lambda: mod.dsd_matmul(blocks[:, :64], rows, cols, y, M=384), "x_blocks dim 1 (the tile of m) is 64, but the spec declares 128")
    raises(lambda: mod.dsd_matmul(blocks, rows[:2], cols, y, M=384), "x_idx_0 length")
    raises(lambda: mod.dsd_matmul(blocks, rows, cols, y, M=256), "x_idx_0[2] = 2 is out of range: x dim 0 has 2 blocks")


def test_ragged_sizes_are_not_errors(interpret):
    """Sizes need not be multiples of their tiles: the last block is partial."""
    kernel, mod = build(DSD)
    blocks, rows, cols, y = dsd_args()
    out = mod.dsd_matmul(blocks, rows, cols, y[:200, :250], M=300, interpret=interpret)
    assert out.shape == (300, 250)
    assert_matches(kernel, out, mod.reference(blocks, rows, cols, y[:200, :250], M=300))
    raises(lambda: mod.dsd_matmul(blocks, rows, cols, y, M=384, N=512), "y dim 1 is 256, but N = 512 from the keyword N=")
    raises(lambda: mod.dsd_matmul(blocks, rows, cols, y[None], M=384), "y must have 2 dimensions, got shape (1, 256, 256)")
    raises(lambda: mod.dsd_matmul(blocks.astype(np.float32), rows, cols, y, M=384), "x_blocks has dtype float32, but the spec declares bfloat16")
    raises(lambda: mod.dsd_matmul(blocks, rows.astype(np.float32), cols, y, M=384), "x_idx_0 must hold integers")


def test_disagreeing_sizes_across_arguments():
    _, mod = build(MASKED)
    x = np.zeros((256, 256), jnp.bfloat16)
    y = np.zeros((256, 384), jnp.bfloat16)
    mask = np.ones((256, 256), np.int32)
    raises(lambda: mod.masked_matmul(x, y, mask), "mask dim 1 is 256, but N = 384 from y dim 1")


def test_concrete_coordinates_out_of_range_raise():
    _, mod = build(DSD)
    blocks, rows, cols, y = dsd_args()
    bad = rows.copy()
    bad[2] = 3
    raises(lambda: mod.dsd_matmul(blocks, bad, cols, y, M=384), "x_idx_0[2] = 3 is out of range: x dim 0 has 3 blocks")
    bad = cols.copy()
    bad[0] = -2
    raises(lambda: mod.reference(blocks, rows, bad, y, M=384), "x_idx_1[0] = -2 is out of range")
    bad[0] = -1
    raises(lambda: mod.dsd_matmul(blocks, rows, bad, y, M=384), "x_idx_1[0] = -1 marks padding, but x_idx_0[0] does not")
    _, sdd = build(SDD)
    x = np.zeros((256, 256), jnp.bfloat16)
    raises(lambda: sdd.sdd_matmul(x, x, np.array([0, 2]), np.array([0, 0])), "o_idx_0[1] = 2 is out of range: o dim 0 has 2 blocks")


def test_traced_coordinates_are_clamped_never_read_outside(interpret):
    """Under jit an out-of-range coordinate cannot raise; it is clamped into range, and the
    TPU simulator (which raises on out-of-bounds reads) confirms no copy leaves the array."""
    kernel, mod = build(DSD)
    blocks, rows, cols, y = dsd_args()
    wild = rows.copy()
    wild[1] = 1000
    fn = jax.jit(lambda b, r, c, yy: mod.dsd_matmul(b, r, c, yy, M=384, interpret=interpret))
    out = fn(blocks, wild, cols, y)
    clamped = np.minimum(wild, 2)
    assert_matches(kernel, out, mod.reference(blocks, clamped, cols, y, M=384))


def test_unaligned_and_out_of_bounds_offsets():
    kernel, mod = build(spec_text("block_slice"))
    x = np.arange(512 * 512, dtype=np.int32).reshape(512, 512)
    raises(lambda: mod.block_slice(x, np.array([100, 0])), "start[0] = 100 is not a multiple of the tile 128 (x dim 0 is read in blocks)")
    raises(lambda: mod.block_slice(x, np.array([0, 512])), "start[1] = 512 reads x dim 1 out of bounds: 0 <= start[1] <= 384")
    raises(lambda: mod.block_slice(x, np.array([0])), "start length is 1, but the spec declares 2")
    raises(lambda: mod.block_slice(x[:256], np.array([0, 0])), "x dim 0 is 256, but the spec declares 512")


def test_traced_offsets_round_down_and_clamp(interpret):
    kernel, mod = build(spec_text("block_slice"))
    x = np.arange(512 * 512, dtype=np.int32).reshape(512, 512)
    fn = jax.jit(lambda xx, s: mod.block_slice(xx, s, interpret=interpret))
    np.testing.assert_array_equal(fn(x, np.array([130, 700], np.int32)), x[128:256, 384:512])
    np.testing.assert_array_equal(fn(x, np.array([-5, 256], np.int32)), x[0:128, 256:384])


def test_smem_overflow_is_a_clear_error():
    _, mod = build(DSD)
    nb = 70_000
    blocks = np.zeros((nb, 128, 128), jnp.bfloat16)
    idx = np.zeros(nb, np.int32)
    raises(lambda: mod.dsd_matmul(blocks, idx, idx, np.zeros((256, 256), jnp.bfloat16), M=384), "bytes of SMEM, more than the")


def test_keyword_sizes_and_interpret_are_keyword_only():
    _, mod = build(DSD)
    blocks, rows, cols, y = dsd_args()
    with pytest.raises(TypeError):
        mod.dsd_matmul(blocks, rows, cols, y, 384)


def test_padding_entries_change_nothing(interpret):
    """Entries whose coordinates are all -1 are padding (what BlockCOO.pad_to appends)."""
    kernel, mod = build(DSD)
    blocks, rows, cols, y = dsd_args()
    rng = np.random.default_rng(5)
    junk = rng.standard_normal((3, 128, 128)).astype(jnp.bfloat16)  # never read
    padded = (np.concatenate([junk[:1], blocks, junk[1:]]), np.r_[-1, rows, -1, -1].astype(np.int32), np.r_[-1, cols, -1, -1].astype(np.int32))
    out = mod.dsd_matmul(*padded, y, M=384, interpret=interpret)
    assert_matches(kernel, out, mod.reference(blocks, rows, cols, y, M=384))
    assert_matches(kernel, mod.reference(*padded, y, M=384), mod.reference(blocks, rows, cols, y, M=384))
    only_padding = mod.dsd_matmul(junk, -np.ones(3, np.int32), -np.ones(3, np.int32), y, M=384, interpret=interpret)
    assert not np.asarray(only_padding, np.float32).any()


def test_one_offset_on_operands_of_different_extents(interpret):
    from hygiene_specs import TWO_OFFSETS

    kernel, mod = build(TWO_OFFSETS)
    x = np.arange(512 * 256, dtype=np.float32).reshape(512, 256)
    w = np.ones((1024, 256), np.float32)
    np.testing.assert_array_equal(mod.window(x, w, np.array([384]), interpret=interpret), x[384:])
    raises(lambda: mod.window(x, w, np.array([512])), "at[0] = 512 reads x dim 0 out of bounds: 0 <= at[0] <= 384")
    # Under jit, 700 rounds down to 640: clamped to 384 for x, kept at 640 for w.
    w2 = np.arange(1024 * 256, dtype=np.float32).reshape(1024, 256)
    out = jax.jit(lambda a, b, s: mod.window(a, b, s, interpret=interpret))(x, w2, np.array([700], np.int32))
    np.testing.assert_array_equal(out, x[384:] * w2[640:768])
