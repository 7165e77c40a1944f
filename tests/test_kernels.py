"""Every example spec, at several tilings and sparsity patterns, equals its reference (and an
independent numpy oracle): in the TPU simulator at its first tiling here, every pattern; in
the CPU interpreter at its other tilings, every pattern (every tiling in both under
SPARSEGEN_SWEEP=1: the simulator makes the interpreter's call and checks more, NaN-filled
memory and revisits, which depend on the walk and the pattern, not on the tile sizes)."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SWEEP, assert_matches, build, spec_text, with_tiles
from oracle import oracle

from sparsegen.testing import example_args, tolerance

BASIC = ("random", "empty_lines", "duplicates", "all_empty", "all_full")

# (spec, tiles, sizes, patterns): small shapes keep the simulator fast; each spec
# also runs once at its own tiles.
CASES = [
    ("dsd_matmul", dict(m=128, n=128, k=128), dict(M=384, K=256, N=256), BASIC),
    ("dsd_matmul", dict(m=256, n=256, k=128), dict(M=512, K=384, N=256), BASIC),
    ("dsd_matmul", dict(m=512, n=512, k=512), dict(M=1024, K=1024, N=512), ("random",)),
    ("dds_matmul", dict(m=128, n=128, k=128), dict(M=256, K=384, N=384), BASIC),
    ("dds_matmul", dict(m=64, n=256, k=256), dict(M=128, K=512, N=512), BASIC),
    ("dds_matmul", dict(m=256, n=256, k=512), dict(M=512, K=1024, N=512), ("random",)),
    ("masked_matmul", dict(m=128, n=128, k=128), dict(M=384, K=256, N=384), BASIC + ("tril",)),
    ("masked_matmul", dict(m=256, n=128, k=256), dict(M=512, K=512, N=256), BASIC + ("tril",)),
    ("masked_matmul", dict(m=512, n=512, k=1024), dict(M=1024, K=1024, N=1024), ("tril",)),
    ("sdd_matmul", dict(m=128, n=128, k=128), dict(M=256, K=256, N=384), BASIC),
    ("sdd_matmul", dict(m=256, n=128, k=256), dict(M=512, K=512, N=256), BASIC),
    ("sdd_matmul", dict(m=128, n=128, k=512), dict(M=256, K=1024, N=256), ("random",)),
    ("block_slice", dict(i=128, j=128), {}, ("random", "random", "random")),
    ("block_slice", dict(i=32, j=128), {}, ("random", "random", "random")),
]

FIRST = {name: tiles for name, tiles, _, _ in reversed(CASES)}  # each spec's first tiling
PARAMS = [
    pytest.param(name, tiles, sizes, pattern, seed, mode, id=f"{mode}-{name}-{'x'.join(map(str, tiles.values()))}-{pattern}{seed or ''}")
    for mode in ("cpu", "sim")
    for name, tiles, sizes, patterns in CASES
    for seed, pattern in enumerate(patterns)
    if SWEEP or (mode == "sim") == (tiles == FIRST[name])
]


def _args(name, tiles, sizes, pattern, seed):
    kernel, mod = build(with_tiles(spec_text(name), **tiles))
    rng = np.random.default_rng(zlib.crc32(f"{name}{tiles}{pattern}{seed}".encode()))
    args, keywords = example_args(kernel, sizes, pattern, rng)
    return kernel, mod, args, keywords


@pytest.mark.parametrize("name,tiles,sizes,pattern,seed,interpret", PARAMS, indirect=["interpret"])
def test_kernel_matches_reference(name, tiles, sizes, pattern, seed, interpret):
    kernel, mod, args, keywords = _args(name, tiles, sizes, pattern, seed)
    ref = mod.reference(*args, **keywords)
    assert_matches(kernel, ref, oracle(kernel, args, keywords))
    out = getattr(mod, name)(*args, **keywords, interpret=interpret)
    assert_matches(kernel, out, ref)


@pytest.mark.parametrize("name", ["dsd_matmul", "dds_matmul", "masked_matmul", "sdd_matmul", "block_slice"])
def test_kernel_under_jit_with_every_argument_traced(name, interpret):
    """Masks, coordinates and offsets traced: metadata is computed on the device."""
    tiles, sizes = next((t, s) for n, t, s, _ in CASES if n == name)
    kernel, mod, args, keywords = _args(name, tiles, sizes, "random", 0)
    fn = jax.jit(lambda *a: getattr(mod, name)(*a, **keywords, interpret=interpret))
    out = fn(*args)
    assert_matches(kernel, out, oracle(kernel, args, keywords))


def test_tolerance_is_strict_enough_to_catch_a_missing_block():
    """The comparison fails when one stored block is dropped: tolerances are not vacuous."""
    kernel, mod, args, keywords = _args("dsd_matmul", dict(m=128, n=128, k=128), dict(M=384, K=256, N=256), "random", 0)
    blocks, i0, i1, y = args
    ref = mod.reference(*args, **keywords)
    out = mod.dsd_matmul(blocks[1:], i0[1:], i1[1:], y, **keywords, interpret=True)
    assert tolerance(kernel, "o")[0] < 0.1
    with pytest.raises(AssertionError):
        assert_matches(kernel, out, ref)


def _kernel_text(spec: str, name: str) -> str:
    """One kernel of an example spec (masked_backward.spk holds two)."""
    chunk = next(c for c in ("\n" + spec_text(spec)).split("\nkernel ")[1:] if c.startswith(f"{name} "))
    return "kernel " + chunk[: chunk.index("\n}") + 2]


# (spec, kernel, the mask's position among the arguments, whether the output's block rows
# run along the mask's second dimension)
MASK_ROWS = [("masked_matmul", "masked_matmul", 2, False), ("masked_backward", "masked_matmul_dx", 1, False),
             ("masked_backward", "masked_matmul_dy", 2, True)]


@pytest.mark.parametrize("spec,name,at,columns", MASK_ROWS, ids=[m[1] for m in MASK_ROWS])
def test_mask_walk_with_an_all_zero_and_a_full_block_row(spec, name, at, columns, interpret):
    """The mask walk's step tables: a block row of the mask all zero (its output blocks each
    take one step that writes zeros), one all ones (every step full: the mask unread), one
    with a zero, a partial and a full block, the last partial. In the simulator, output
    blocks revisited out of order or left unwritten (NaN-filled memory) would fail."""
    kernel, mod = build(with_tiles(_kernel_text(spec, name), m=128, n=128, k=128))
    sizes = dict(M=384, K=256, N=512) if columns else dict(M=512, K=256, N=384)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    args, keywords = example_args(kernel, sizes, "random", rng)
    mask = np.asarray(args[at])
    rows = mask.T.copy() if columns else mask.copy()  # the output's block rows first
    rows[:] = (rng.random(rows.shape) < 0.5) * rng.integers(1, 3, rows.shape)
    rows[:128] = 0
    rows[128:256] = 1
    rows[256:384, :128] = 0
    rows[256:384, 256:384] = 1
    rows[384:, ::128] = 1  # never an all-zero block
    args = list(args)
    args[at] = jnp.asarray(rows.T if columns else rows, mask.dtype)
    ref = mod.reference(*args, **keywords)
    assert_matches(kernel, ref, oracle(kernel, args, keywords))
    out = getattr(mod, name)(*args, **keywords, interpret=interpret)
    assert_matches(kernel, out, ref)
    assert np.all(np.asarray(out.T if columns else out, np.float32)[:128] == 0)
