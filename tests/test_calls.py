"""Calling a generated kernel wrong: ValueErrors that name the argument and dimension;
under jit, out-of-range coordinates and offsets are clamped so no copy leaves its array."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches, build, spec_text, with_tiles

from sparsegen.source import SpecError

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


# ------------------------------------------------------------------ issue 12: call checks


@pytest.mark.parametrize("value", [256.7, "256", True, 384.0])
def test_size_keyword_must_be_an_integer(value):
    _, mod = build(DSD)
    blocks, rows, cols, y = dsd_args()
    message = raises(
        lambda: mod.dsd_matmul(blocks, rows, cols, y, M=value), f"size M must be an integer, got {value!r}"
    )
    assert message.startswith("dsd_matmul: ")
    raises(lambda: mod.reference(blocks, rows, cols, y, M=value), "size M must be an integer")


def test_numpy_integer_sizes_are_integers():
    kernel, mod = build(DSD)
    blocks, rows, cols, y = dsd_args()
    out = mod.dsd_matmul(blocks, rows, cols, y, M=np.int64(384), interpret=True)
    assert_matches(kernel, out, mod.reference(blocks, rows, cols, y, M=384))


@pytest.mark.parametrize("value", ["yes", 1, 0, None])
def test_interpret_must_be_a_bool_or_interpret_params(value):
    _, mod = build(DSD)
    blocks, rows, cols, y = dsd_args()
    raises(
        lambda: mod.dsd_matmul(blocks, rows, cols, y, M=384, interpret=value),
        "interpret must be True, False or the interpreter's parameters (pltpu.InterpretParams(...)",
        repr(value),
    )


def test_empty_python_lists_as_coordinates(interpret):
    """`[]` coordinates with zero blocks: nothing is stored, the result is zeros."""
    kernel, mod = build(DSD)
    _, _, _, y = dsd_args()
    blocks = np.zeros((0, 128, 128), jnp.bfloat16)
    out = mod.dsd_matmul(blocks, [], [], y, M=384, interpret=interpret)
    assert out.shape == (384, 256) and out.dtype == jnp.bfloat16
    assert not np.asarray(out, np.float32).any()
    assert not np.asarray(mod.reference(blocks, [], [], y, M=384), np.float32).any()
    # A coo output with no requested block: an empty stack.
    _, sdd = build(SDD)
    x = np.ones((256, 256), jnp.bfloat16)
    assert sdd.sdd_matmul(x, x, [], [], interpret=interpret).shape == (0, 128, 128)


def test_jit_without_static_argnames_says_what_must_be_static():
    _, mod = build(DSD)
    blocks, rows, cols, y = dsd_args()
    with pytest.raises(ValueError) as info:
        jax.jit(mod.dsd_matmul)(blocks, rows, cols, y, M=384)
    assert type(info.value) is ValueError  # not a ConcretizationTypeError (a TypeError)
    assert (
        'size M is traced: sizes shape the grid, so pass them as static arguments (jax.jit(..., static_argnames=("M", "interpret")))'
        in str(info.value)
    )
    with pytest.raises(ValueError) as info:
        jax.jit(mod.dsd_matmul, static_argnames="M")(blocks, rows, cols, y, M=384, interpret=True)
    assert type(info.value) is ValueError
    assert 'interpret is traced: pass it as a static argument (jax.jit(..., static_argnames=("interpret",)))' in str(
        info.value
    )


def test_jit_with_static_argnames_runs():
    kernel, mod = build(DSD)
    blocks, rows, cols, y = dsd_args()
    out = jax.jit(mod.dsd_matmul, static_argnames=("M", "interpret"))(blocks, rows, cols, y, M=384, interpret=True)
    assert_matches(kernel, out, mod.reference(blocks, rows, cols, y, M=384))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_coo_output_padding_entries_come_back_as_zeros(jit, interpret):
    """Requested coordinates that are all -1 are padding: skipped, their blocks are zeros
    (in the TPU simulator memory starts as NaN, so an unwritten block would show)."""
    kernel, mod = build(SDD)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((256, 256)).astype(jnp.bfloat16)
    y = rng.standard_normal((256, 384)).astype(jnp.bfloat16)
    rows = np.array([-1, 0, 1, -1, 1], np.int32)
    cols = np.array([-1, 2, 0, -1, 1], np.int32)
    call = lambda *a: mod.sdd_matmul(*a, interpret=interpret)  # noqa: E731
    out = np.asarray((jax.jit(call) if jit else call)(x, y, rows, cols), np.float32)
    assert out.shape == (5, 128, 128)
    assert not out[0].any() and not out[3].any()
    product = x.astype(np.float64) @ y.astype(np.float64)
    for b in (1, 2, 4):
        expected = product[rows[b] * 128 : (rows[b] + 1) * 128, cols[b] * 128 : (cols[b] + 1) * 128]
        assert np.abs(expected).max() > 0
        np.testing.assert_allclose(out[b], expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())
    assert_matches(kernel, out.astype(jnp.bfloat16), mod.reference(x, y, rows, cols))
    assert not np.asarray(mod.reference(x, y, rows, cols), np.float32)[[0, 3]].any()


# ---------------------------------------------------------------- issue 12: big specs, BOM


def many_kernels(n: int) -> str:
    """n kernels of about 2.6 KB each (comments included): 2,000 make a 5 MB spec."""
    parts = []
    for i in range(n):
        parts += [f"# kernel {i}, comment line {j}: " + "x" * 100 + "\n" for j in range(20)]
        parts.append(
            f"kernel k{i} {{\n    in  x: bf16[M, K] coo\n    in  y: bf16[K, N]\n    out o: bf16[M, N]\n"
            "    o[m, n] = x[m, k] * y[k, n]\n    tile m = 512, n = 512, k = 512\n    accumulate f32\n}\n"
        )
    return "".join(parts)


def test_a_5_mb_spec_of_2000_kernels_checks_in_linear_time():
    """parse + check per kernel: 2,000 kernels cost no more than about twice per kernel what
    200 do (a quadratic step would cost ten times). CPU time, best of a few runs."""
    import time

    from sparsegen.check import check
    from sparsegen.source import SourceFile
    from sparsegen.syntax import parse

    def per_kernel(n: int, runs: int) -> float:
        text = many_kernels(n)
        best = float("inf")
        for _ in range(runs):
            start = time.process_time()
            kernels = check(parse(SourceFile("many.spk", text)))
            best = min(best, time.process_time() - start)
            assert [k.name for k in kernels[:2]] == ["k0", "k1"] and len(kernels) == n
        return best / n

    assert len(many_kernels(2000).encode()) >= 5_000_000
    small = per_kernel(200, 3)
    large = per_kernel(2000, 2)
    assert large <= 2.0 * small, f"{large * 1e3:.2f} ms per kernel at 2,000 kernels, {small * 1e3:.2f} ms at 200"


BOM_SPEC = "# a spec saved with a byte-order mark\n" + spec_text("dsd_matmul")


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    from sparsegen.compiler import compile_file

    plain, bom = tmp_path / "plain.spk", tmp_path / "bom.spk"
    plain.write_bytes(BOM_SPEC.encode())
    bom.write_bytes(b"\xef\xbb\xbf" + BOM_SPEC.encode())
    (a,) = compile_file(plain)
    (b,) = compile_file(bom)
    assert a.kernel == b.kernel == "dsd_matmul"
    assert a.code.replace("plain.spk", "bom.spk") == b.code
    # Positions in diagnostics do not count the mark.
    bad = tmp_path / "bad.spk"
    bad.write_bytes(b"\xef\xbb\xbf" + b"kernel k {\n    in  x: f64[M]\n}\n")
    with pytest.raises(SpecError) as info:
        compile_file(bad)
    assert f"{bad}:2:12: error: unknown dtype 'f64'" in info.value.render()


def test_the_command_line_builds_a_spec_with_a_byte_order_mark(tmp_path):
    import subprocess
    import sys

    spec = tmp_path / "bom.spk"
    spec.write_bytes(b"\xef\xbb\xbf" + BOM_SPEC.encode())
    result = subprocess.run(
        [sys.executable, "-m", "sparsegen", "build", str(spec), "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "dsd_matmul.py").is_file()


def test_a_byte_order_mark_in_source_text():
    from sparsegen.compiler import compile_source
    from sparsegen.source import SourceFile

    (module,) = compile_source(SourceFile("bom.spk", "\ufeff" + BOM_SPEC))
    assert module.kernel == "dsd_matmul"
