"""The GPU einsum kernels' persistent grid (issue 21, item 2): a fixed number of CTAs runs a
work list dealt by steps (`_deal`), so a skewed pattern (one row block holding half of the
stored blocks) is shared by several CTAs instead of serialising the kernel on one.

The balance is measured in the Mosaic GPU interpreter: every pipeline step the kernel runs
reports its CTA (a `jax.debug.callback` wrapped around the pipeline's body), so the counts
are the steps each CTA actually ran, not the work list's promise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from conftest import build, with_tiles
from jax import lax
from test_gpu import example_text

from sparsegen.compiler import lower_source
from sparsegen.gpu.targets import GPU_TARGETS
from sparsegen.source import SourceFile

TILE = 64  # m, n, k: one 64x64 CTA tile per block, one step per block
ROWS, K_BLOCKS = 8, 16  # row blocks of x, blocks along k


def skewed_pattern(rng):
    """Row block 0 holds every block along k; the other seven rows share as many, so row 0
    holds half of the stored blocks."""
    rows = [0] * K_BLOCKS
    cols = list(range(K_BLOCKS))
    others = rng.choice((ROWS - 1) * K_BLOCKS, size=K_BLOCKS, replace=False)
    rows += [1 + int(i) // K_BLOCKS for i in others]
    cols += [int(i) % K_BLOCKS for i in others]
    return np.array(rows, np.int32), np.array(cols, np.int32)


def skewed_args(rng):
    rows, cols = skewed_pattern(rng)
    blocks = jnp.asarray(rng.standard_normal((len(rows), TILE, TILE)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((K_BLOCKS * TILE, TILE)), jnp.bfloat16)
    return (blocks, rows, cols, y), dict(M=ROWS * TILE)


class _CountingPlgpu:
    """`plgpu` with `emit_pipeline` wrapped: each step the pipeline runs reports its CTA's
    grid coordinates to `steps` (the interpreter runs the callback once per step)."""

    def __init__(self, plgpu, steps: dict):
        self._plgpu, self._steps = plgpu, steps

    def __getattr__(self, name):
        return getattr(self._plgpu, name)

    def emit_pipeline(self, body, **kwargs):
        def note(*where):
            where = tuple(int(w) for w in where)
            self._steps[where] = self._steps.get(where, 0) + 1

        def counted(indices, *refs):
            jax.debug.callback(note, lax.axis_index("cta"), lax.axis_index("m"), lax.axis_index("n"))
            return body(indices, *refs)

        return self._plgpu.emit_pipeline(counted, **kwargs)


def depth(text: str) -> int:
    """The pipeline's depth of the kernel's pass: `_deal`'s least run of steps."""
    (m,) = lower_source(SourceFile("t.spk", text), "h200")
    return m.passes[0].tiles.stages


def steps_per_cta(mod, fn, args, keywords, monkeypatch) -> dict:
    steps: dict = {}
    monkeypatch.setattr(mod, "plgpu", _CountingPlgpu(mod.plgpu, steps))
    out = fn(*args, **keywords, interpret=True)
    jax.block_until_ready(out)
    jax.effects_barrier()
    monkeypatch.undo()
    return steps, out


def test_a_skewed_pattern_is_balanced_over_the_persistent_grid(monkeypatch):
    """One row block holds half of x's stored blocks. One CTA per output tile (the grid
    before the persistent one) would give that row's CTA half of the work: 4x the mean per
    CTA here. The persistent grid (a CTA per SM of the target: an H200 with 8 SMs, so that
    the interpreter runs more steps than CTAs, quickly) keeps every CTA within 2x of the
    mean, counted step by step in the interpreter; the result equals `reference`.
    132 SMs: `test_the_work_list_at_the_chips_scale`."""
    sms = 8
    monkeypatch.setitem(GPU_TARGETS, "h200", dataclasses.replace(GPU_TARGETS["h200"], sms=sms))
    text = with_tiles(example_text("dsd_matmul"), m=TILE, n=TILE, k=TILE) + f"\n# {sms} SMs\n"  # a module of its own
    kernel, mod = build(text, "h200")
    monkeypatch.undo()
    rng = np.random.default_rng(0)
    args, keywords = skewed_args(rng)
    rows = np.asarray(args[1])
    assert np.sum(rows == 0) * 2 == len(rows)  # half of the stored blocks in row block 0

    # The old grid: one CTA per output tile, each running its row's steps.
    n_blocks = args[3].shape[1] // TILE
    per_tile = np.repeat(np.bincount(rows, minlength=ROWS), n_blocks)  # steps of each output tile (one step per block)
    assert per_tile.max() > 2 * per_tile.mean()  # the criterion below fails on one CTA per tile

    steps, out = steps_per_cta(mod, mod.dsd_matmul, args, keywords, monkeypatch)
    ctas = {cta for cta, _, _ in steps}
    assert max(ctas) < sms  # a persistent grid: no more CTAs than SMs
    work = np.zeros(sms, np.int64)
    for (cta, _, _), n in steps.items():
        work[cta] += n
    assert work.sum() == per_tile.sum()  # every step ran, once
    # Row 0's block is shared by CTAs: its pieces' partial sums are added by the wrapper.
    slots = np.asarray(mod._deal(jnp.asarray(per_tile), sms, depth(text))[4])
    assert np.sum(slots >= 0) >= 4
    assert work.max() <= 2 * work.mean(), (work.tolist(), per_tile.tolist())
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(mod.reference(*args, **keywords), np.float32),
                               rtol=0.02, atol=0.1)


def test_the_work_list_at_the_chips_scale():
    """`_deal` for 132 CTAs over a skewed pattern too large for the interpreter: every step
    dealt once, no CTA over 2x the mean, a block shared by CTAs only where its steps cross
    a CTA's share, each piece a slot of its own, blocks without steps a chunk of none,
    dealt round-robin."""
    text = with_tiles(example_text("dsd_matmul"), m=TILE, n=TILE, k=TILE)
    _, mod = build(text, "h200")
    rng = np.random.default_rng(1)
    steps = rng.integers(0, 4, size=600)
    steps[17] = steps.sum()  # one block holds half of the steps
    steps[40:90] = 0
    ctas = 132
    cta_first, cell, first, count, slot, slot_cell = (np.asarray(t) for t in mod._deal(jnp.asarray(steps), ctas, depth(text)))
    used = slice(0, int(cta_first[-1]))
    work = np.array([count[cta_first[j]:cta_first[j + 1]].sum() for j in range(ctas)])
    assert work.sum() == steps.sum() and work.max() <= 2 * work.mean(), work.tolist()
    # Each block's chunks cover its steps in order, without gaps or overlaps.
    for c in range(len(steps)):
        mine = np.flatnonzero(cell[used] == c)
        assert len(mine) >= 1
        assert first[mine[0]] == 0 and np.all(first[mine[1:]] == np.cumsum(count[mine])[:-1])
        assert count[mine].sum() == steps[c]
        split = len(mine) > 1
        assert np.all((slot[mine] >= 0) == split)
        if split:
            assert np.all(slot_cell[slot[mine]] == c)
    assert len(set(slot[slot >= 0].tolist())) == np.sum(slot >= 0) <= 2 * ctas
    # The blocks without steps (their stores of zeros) are spread over the CTAs too.
    empty = [np.sum(steps[cell[cta_first[j]:cta_first[j + 1]]] == 0) for j in range(ctas)]
    assert max(empty) == -(-np.sum(steps == 0) // ctas), empty


def test_skewed_values_and_gradients_in_the_gpu_interpreter():
    """The skewed pattern's result and gradients (the backward's kernels run persistent too)
    equal `reference`'s, on the H200's 132 SMs: every block of more than one step is shared
    by CTAs, its pieces added by the wrapper."""
    _, mod = build(with_tiles(example_text("dsd_matmul"), m=TILE, n=TILE, k=TILE), "h200")
    args, keywords = skewed_args(np.random.default_rng(3))
    out = mod.dsd_matmul(*args, **keywords, interpret=True)
    ref = mod.reference(*args, **keywords)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=0.02, atol=0.1)
    w = jnp.asarray(np.random.default_rng(4).standard_normal(np.shape(ref)), jnp.float32)

    def loss(fn):
        return lambda blocks, y: jnp.sum(fn(blocks, args[1], args[2], y, **keywords).astype(jnp.float32) * w)

    got = jax.grad(loss(lambda *a, **k: mod.dsd_matmul(*a, **k, interpret=True)), argnums=(0, 1))(args[0], args[3])
    want = jax.grad(loss(mod.reference), argnums=(0, 1))(args[0], args[3])
    for g, r in zip(got, want):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        np.testing.assert_allclose(g, r, rtol=0.02, atol=0.02 * max(1.0, float(np.sqrt(np.mean(r**2)))))
