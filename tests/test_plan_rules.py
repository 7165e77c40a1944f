"""The plan's rules, shown to hold where a TPU would enforce them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GENERATED, assert_matches, build, spec_text, with_tiles
from jax.experimental.pallas import tpu as pltpu

from sparsegen.compiler import plans
from sparsegen.testing import example_args

DSD = with_tiles(spec_text("dsd_matmul"), m=128, n=128, k=128)


def test_no_output_is_aliased_so_the_simulator_checks_revisits():
    """An aliased output starts as its input, so the simulator's NaN fill could not show a block
    left unwritten. Only a walk split into SMEM-sized pieces aliases (each piece writes into the
    output of the pieces before it); its single call, the one every test runs, never does."""
    for path in GENERATED.glob("*.py"):
        for line in path.read_text().splitlines():
            if "input_output_aliases" in line:
                assert "input_output_aliases={} if written is None else" in line, (path.name, line)


def test_simulator_catches_a_non_consecutive_output_revisit(monkeypatch):
    """Break the plan's ordering on purpose (interleave output rows): the TPU simulator raises,
    while the CPU interpreter, which rereads outputs, silently returns a result. This is why
    every kernel test runs in the simulator too."""
    kernel, mod = build(DSD)
    args, keywords = example_args(kernel, dict(M=384, K=256, N=128), "all_full", np.random.default_rng(0))
    steps = mod._coo_steps

    def interleaved(rows, n_rows, pad):
        kind, block, row = steps(rows, n_rows, pad)
        # Swap the first step with the first step of the next row: row 0's run is split.
        other = jnp.argmax(row != row[0])
        order = jnp.arange(row.shape[0]).at[0].set(other).at[other].set(0)
        return kind[order], block[order], row[order]

    monkeypatch.setattr(mod, "_coo_steps", interleaved)
    jax.clear_caches()
    try:
        # The CPU interpreter raises nothing: its result is silently wrong.
        wrong = mod.dsd_matmul(*args, **keywords, interpret=True)
        with pytest.raises(AssertionError):
            assert_matches(kernel, wrong, mod.reference(*args, **keywords))
        with pytest.raises(Exception, match="Revisited block"):
            mod.dsd_matmul(*args, **keywords, interpret=pltpu.InterpretParams())
    finally:
        pltpu.reset_tpu_interpret_mode_state()
        jax.clear_caches()


def test_dimension_semantics_parallel_only_where_output_blocks_never_repeat():
    expected = {
        "dsd_matmul": ("parallel", "arbitrary"),
        "dds_matmul": ("parallel", "arbitrary"),
        # The mask walk's steps over (output block, summed block) pairs: arbitrary (an
        # output block's steps are a run); output indices the mask lacks stay parallel.
        "masked_matmul": ("arbitrary",),
        "sdd_matmul": ("parallel", "arbitrary"),
        "block_slice": ("parallel", "parallel"),
        "batched_dsd": ("parallel", "arbitrary"),
        "masked_matmul_dx": ("parallel", "arbitrary"),
        "masked_matmul_dy": ("parallel", "arbitrary"),
    }
    found = {p.name: p for spec in ("dsd_matmul", "dds_matmul", "masked_matmul", "sdd_matmul", "block_slice", "batched_dsd", "masked_backward")
             for p in plans(f"specs/{spec}.spk")}
    for name, semantics in expected.items():
        (tp,) = found[name].passes
        assert tp.dimension_semantics == semantics, name
        # The summed or stored-block axis is innermost: reductions on the last grid axis.
        assert tp.p.axes[-1].parallel == (not tp.p.statement.summed and tp.p.walk == "dense")


def test_coo_flush_steps_hold_the_next_block():
    """A row's last block writes its output block (_LAST): no step of its own. A row no block
    feeds takes one flush step (zeros), which reads the block of the next real step, so it
    starts no new copy. The grid runs `_coo_run` steps: the two unneeded flushes trail."""
    kernel, mod = build(DSD)
    rows = jnp.array([2, 0, 2, 0], jnp.int32)
    kind, block, row = mod._coo_steps(rows, 3, jnp.zeros(4, bool))
    # Row 0: blocks 1, 3 (the last writes); row 1: flush only; row 2: blocks 0, 2; then 2 unneeded.
    B, L, F, S = mod._BLOCK, mod._LAST, mod._FLUSH, mod._SKIP
    np.testing.assert_array_equal(kind, [B, L, F, B, L, S, S])
    np.testing.assert_array_equal(row, [0, 0, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(block, [1, 3, 0, 0, 2, 2, 2])  # the flush and the trailing steps hold a block read
    assert int(mod._coo_run(rows, 3, jnp.zeros(4, bool))) == 5  # 4 blocks and row 1's zeros, not 4 + 3


def test_padding_entries_go_last_do_nothing_and_hold_the_last_block():
    kernel, mod = build(DSD)
    rows = jnp.array([-1, 2, -1, 0], jnp.int32)
    pad = rows < 0
    kind, block, row = mod._coo_steps(rows, 3, pad)
    # Row 0: block 3 (writes); row 1: flush; row 2: block 1 (writes); then padding and unneeded steps.
    B, L, F, S = mod._BLOCK, mod._LAST, mod._FLUSH, mod._SKIP
    np.testing.assert_array_equal(kind, [L, F, L, S, S, S, S])
    np.testing.assert_array_equal(block, [3, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(row, [0, 1, 2, 2, 2, 2, 2])
    assert int(mod._coo_run(rows, 3, pad)) == 3


def test_coo_run_counts_the_steps_the_walk_runs():
    """`_coo_run` counts the grid's steps without the walk's sort: it must equal the number of
    steps `_coo_steps` does not skip, for any rows, padding and empty rows."""
    kernel, mod = build(DSD)
    rng = np.random.default_rng(0)
    n_rows, nb = 5, 8  # one shape: jnp's eager ops compile once
    for _ in range(40):
        rows = rng.integers(0, int(rng.integers(1, n_rows + 1)), nb).astype(np.int32)  # some rows never fed
        pad = rng.random(nb) < 0.3
        rows = jnp.asarray(np.where(pad, -1, rows))
        kind, _, _ = mod._coo_steps(rows, n_rows, jnp.asarray(pad))
        assert int(mod._coo_run(rows, n_rows, jnp.asarray(pad))) == int(np.sum(np.asarray(kind) != mod._SKIP)), (rows, pad)
