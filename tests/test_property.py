"""Property test over the matmul family: random kinds, orientations, dtypes, tiles, shapes and
sparsity patterns; every kernel equals an independent numpy oracle.

The CPU interpreter runs many examples; the TPU simulator, slower, fewer. Set
SPARSEGEN_SWEEP=1 for a long sweep (the `slow` tests run bounded by default, as in CI).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import assert_matches, build
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu
from oracle import oracle

from sparsegen.testing import PATTERNS, example_args

SWEEP = os.environ.get("SPARSEGEN_SWEEP") == "1"
KINDS = ("dense", "dsd", "dds", "masked", "xmask", "sdd", "masked_sdd", "xmask_sdd")


@st.composite
def matmul_specs(draw, kind=None):
    kind = kind or draw(st.sampled_from(KINDS))
    dtype = draw(st.sampled_from(["f32", "bf16"]))
    x_t = draw(st.booleans())  # x stored as [K, M]
    y_t = draw(st.booleans())  # y stored as [N, K]
    x_dims, x_sub = ("K, M", "k, m") if x_t else ("M, K", "m, k")
    y_dims, y_sub = ("N, K", "n, k") if y_t else ("K, N", "k, n")
    sparsity = {"x": "", "y": "", "o": "", "mask": None}
    if kind == "dsd":
        sparsity["x"] = " coo"
    elif kind == "dds":
        sparsity["y"] = " coo"
    elif kind == "xmask":
        sparsity["x"] = " mask"
    elif kind == "sdd":
        sparsity["o"] = " coo"
    elif kind == "masked":
        sparsity["mask"] = draw(st.sampled_from(["i32", "f32", "bf16"]))
    elif kind == "masked_sdd":
        sparsity["mask"] = draw(st.sampled_from(["i32", "f32", "bf16"]))
        sparsity["o"] = " coo"
    elif kind == "xmask_sdd":
        sparsity["x"] = " mask"
        sparsity["o"] = " coo"
    # Which indices end up as the last (lane) dim of a block-specced array?
    lane = set()
    dense_arrays = [] if sparsity["o"] else [("m", "n")]
    if sparsity["x"] != " coo":
        dense_arrays.append(tuple(x_sub.split(", ")))
    if sparsity["y"] != " coo":
        dense_arrays.append(tuple(y_sub.split(", ")))
    if sparsity["mask"]:
        dense_arrays.append(("m", "n"))
    for dims in dense_arrays:
        lane.add(dims[-1])
    tiles = {}
    for index in "mnk":
        choices = [128, 256] if index in lane else [16, 32, 64, 128]
        tiles[index] = draw(st.sampled_from(choices))
    # Two blocks first: the simplest example (Hypothesis draws it first) still has a first and
    # a last block along each index, and a sum over two.
    blocks = {index: draw(st.sampled_from([2, 1, 3])) for index in "mnk"}
    sizes = {index.upper(): tiles[index] * blocks[index] for index in "mnk"}
    lines = [
        f"kernel prop_{kind} {{",
        f"    in  x: {dtype}[{x_dims}]{sparsity['x']}",
        f"    in  y: {dtype}[{y_dims}]{sparsity['y']}",
    ]
    factors = [f"x[{x_sub}]", f"y[{y_sub}]"]
    if sparsity["mask"]:
        lines.append(f"    in  mask: {sparsity['mask']}[M, N] mask")
        factors.insert(draw(st.integers(0, 2)), "mask[m, n]")
    lines += [
        f"    out o: {dtype}[M, N]{sparsity['o']}",
        f"    o[m, n] = {' * '.join(factors)}",
        f"    tile m = {tiles['m']}, n = {tiles['n']}, k = {tiles['k']}",
        "}",
    ]
    return "\n".join(lines) + "\n", sizes


def check_example(text, sizes, pattern, seed, interpret):
    kernel, mod = build(text)
    args, keywords = example_args(kernel, sizes, pattern, np.random.default_rng(seed))
    out = getattr(mod, kernel.name)(*args, **keywords, interpret=interpret)
    assert_matches(kernel, out, oracle(kernel, args, keywords))


COMMON = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# Each kind drawn on its own, so none goes untested: 2 examples each by default (the first
# Hypothesis draws is the simplest: two blocks along each index), 25 under SPARSEGEN_SWEEP=1.
@pytest.mark.parametrize("kind", KINDS)
def test_matmul_family_in_cpu_interpreter(kind):
    @seed(KINDS.index(kind))  # one stream of draws per kind (not the same dtypes and orientations for all)
    @settings(max_examples=25 if SWEEP else 2, **COMMON)
    @given(matmul_specs(kind), st.sampled_from(PATTERNS), st.integers(0, 2**16))
    def run(spec, pattern, rng_seed):
        text, sizes = spec
        check_example(text, sizes, pattern, rng_seed, True)

    run()


@pytest.mark.slow
@settings(max_examples=100 if SWEEP else 7, **COMMON)
@given(matmul_specs(), st.sampled_from(PATTERNS), st.integers(0, 2**16))
def test_matmul_family_in_tpu_simulator(spec, pattern, seed):
    text, sizes = spec
    try:
        check_example(text, sizes, pattern, seed, pltpu.InterpretParams())
    finally:
        pltpu.reset_tpu_interpret_mode_state()
