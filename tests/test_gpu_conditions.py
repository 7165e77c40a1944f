"""`where` conditions on GPU products (issue 21, "one spec, every target"): the schedule's
condition walk lowered for Mosaic GPU. The classification's non-empty (row, column) pairs
are an output block's steps in the work list; a partial step zeroes the A or B tile it reads
in shared memory where the condition is false, before its WGMMA (one warpgroup per CTA); a
condition on the output's indices alone (a gradient's) masks the accumulator. Language v2's
examples, verbatim for lowering and ptxas, retiled small for the Mosaic GPU interpreter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches, build, spec_text, with_tiles

from sparsegen.compiler import lower_source
from sparsegen.source import SourceFile
from sparsegen.testing import example_args, resolve_sizes

# tril: 128-row blocks of 2 k tiles each (a partial step's k tile is the second of its block
# too); grouped: 64-row blocks, 64-wide k and n.
TRIL = with_tiles(spec_text("tril_matmul"), m=128, n=64, k=128)
GROUPED = with_tiles(spec_text("grouped_matmul"), m=64, n=64, k=64, g=1)


def grouped_args(gid, seed=0, K=128, E=4, N=64):
    rng = np.random.default_rng(seed)
    M = len(gid)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((E, K, N)), jnp.bfloat16)
    return x, w, jnp.asarray(gid, jnp.int32)


# Rows 0..69 expert 0 (rows of blocks 0 and 1), expert 1 none, rows 70..150 expert 2 (blocks
# 1 and 2), rows 151..199 expert 3 (blocks 2 and 3; block 3 is ragged: 8 rows of 64).
SORTED = np.repeat([0, 2, 3], [70, 81, 49])


def test_tril_matches_reference_in_the_interpreter():
    """Ragged M (3 blocks, the last of 44 rows): the diagonal blocks are partial, x above the
    diagonal is never multiplied (its blocks are not in the walk; in a diagonal block, zeroed)."""
    kernel, mod = build(TRIL, "h200")
    (p,) = lower_source(SourceFile("tril.spk", TRIL), "h200")[0].passes
    assert p.walk == "condition" and p.selection.on == "a" and p.tiles.wgs == 1 and p.tiles.ksub == 2
    sizes = dict(M=300, N=64)
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(0))
    x, y = args
    # NaN above the diagonal: a masked element that reached the WGMMA would poison its row.
    upper = np.triu(np.ones((300, 300), bool), 1)
    x_nan = jnp.where(upper, jnp.nan, x).astype(jnp.bfloat16)
    out = mod.tril_matmul(x_nan, y, interpret=True)
    ref = mod.reference(x, y)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert_matches(kernel, out, ref, resolve_sizes(kernel, sizes))


@pytest.mark.parametrize("gid", [SORTED, np.random.default_rng(3).permutation(SORTED)], ids=["sorted", "unsorted"])
def test_grouped_matches_reference_in_the_interpreter(gid):
    """Ragged groups, a group spanning two row blocks, an empty group; unsorted ids are
    correct too (more blocks partial)."""
    kernel, mod = build(GROUPED, "h200")
    args = grouped_args(gid)
    out = mod.grouped_matmul(*args, interpret=True)
    assert_matches(kernel, out, mod.reference(*args), dict(M=200, K=128, E=4, N=64))


def test_a_row_block_no_group_reaches_stores_zeros():
    """Ids outside 0..E-1 meet no expert: their rows are zeros; a row block of only those
    runs no step (its count is 0) and stores zeros."""
    kernel, mod = build(GROUPED, "h200")
    gid = np.concatenate([np.zeros(64, np.int32), np.full(64, 7, np.int32), np.repeat([1, 9], [30, 42])])
    args = grouped_args(gid, seed=1)
    out = np.asarray(mod.grouped_matmul(*args, interpret=True), np.float32)
    assert not out[64:128].any() and not out[158:].any() and out[:64].any()
    assert_matches(kernel, out, mod.reference(*args), dict(M=200, K=128, E=4, N=64))


@pytest.mark.parametrize("name", ["tril_matmul", "grouped_matmul"])
def test_gradients_equal_those_of_reference(name):
    """The backward kernels the pipeline derives are condition walks too: tril's dx masks
    its accumulator (the condition reads dx's indices only), dy masks x's tile; grouped's
    dx masks g_o's rows, dw (an output block per expert) masks x's."""
    text = TRIL if name == "tril_matmul" else GROUPED
    kernel, mod = build(text, "h200")
    (m,) = lower_source(SourceFile(f"{name}.spk", text), "h200")
    walks = sorted(p.walk for p in m.backward_module.passes)
    assert walks == (["condition", "condition output"] if name == "tril_matmul" else ["condition", "condition"]), walks
    if name == "tril_matmul":
        args, keywords = example_args(kernel, dict(M=200, N=64), "random", np.random.default_rng(7))
        which = (0, 1)
    else:
        args, keywords = grouped_args(SORTED, seed=7), {}
        which = (0, 1)
    weights = np.random.default_rng(8).standard_normal(np.shape(mod.reference(*args, **keywords))).astype(np.float32)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a, **keywords).astype(jnp.float32) * weights)

    got = jax.grad(loss(lambda *a, **k: getattr(mod, kernel.name)(*a, **k, interpret=True)), argnums=which)(*args)
    want = jax.grad(loss(mod.reference), argnums=which)(*args)
    for n, g, w in zip(which, got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = max(1.0, float(np.sqrt(np.mean(w**2))))
        np.testing.assert_allclose(g, w, rtol=0.02, atol=0.02 * scale, err_msg=f"argument {n}")


def test_the_examples_lower_and_compile_for_h200():
    """Language v2's examples verbatim: they lower (forward and backward) under an abstract
    H200, their shared memory exactly as `rules.smem_bytes` says (grouped holds an int32 tile
    of gid beside the pipeline); stage 3 compiles tril's forward kernel through ptxas."""
    from sparsegen.verify import verify_gpu_modules

    items = []
    for name in ("tril_matmul", "grouped_matmul"):
        source = SourceFile(f"{name}.spk", spec_text(name))
        items += [(m, source, "h200") for m in lower_source(source, "h200")]
    results = verify_gpu_modules(items, stage3={"tril_matmul"})
    assert [r.kernel for r in results] == ["tril_matmul", "grouped_matmul"]
    for r in results:
        assert r.lowered, (r.kernel, r.raw_error)
        assert r.backward == "lowers", (r.kernel, r.backward)
        assert r.smem_used == r.smem_estimate, (r.kernel, r.smem_used, r.smem_estimate)
    if results[0].compiled is None:
        pytest.skip(f"stage 3 (ptxas for sm_90a) not run: {results[0].stage3}")
    assert results[0].compiled, results[0].raw_error
    assert results[0].registers and max(results[0].registers) <= 255 and results[0].spill_bytes == 0, results[0].registers


def test_conditions_reading_an_operand_per_coordinate_or_group():
    """Other shapes of the condition walk: `k < lens[b]` (a scalar read per batch coordinate,
    from a table in GMEM; a batch with length 0 runs no step) and the offsets form
    `lo[g] <= m < lo[g + 1]` (two reads of lo per step, an empty group)."""
    from test_sum_conditions import LENGTHS, OFFSETS

    rng = np.random.default_rng(2)
    kernel, mod = build(LENGTHS, "h200")
    x, y = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((2, 128, 256), (2, 256, 128)))
    lens = jnp.asarray([200, 0], jnp.int32)
    out = mod.ragged_sum(x, y, lens, interpret=True)
    assert not np.asarray(out)[1].any()
    assert_matches(kernel, out, mod.reference(x, y, lens), dict(B=2, M=128, K=256, N=128))
    kernel, mod = build(OFFSETS, "h200")
    x, w = jnp.asarray(rng.standard_normal((200, 128)), jnp.bfloat16), jnp.asarray(rng.standard_normal((3, 128, 128)), jnp.bfloat16)
    lo = jnp.asarray([0, 100, 100, 200], jnp.int32)
    assert_matches(kernel, mod.gmm_offsets(x, w, lo, interpret=True), mod.reference(x, w, lo), dict(M=200, K=128, E=3, E1=4, N=128))


@pytest.mark.parametrize("operand,condition,needle", [
    ("keep: i32[M, K]", "keep[m, k] != 0", "reads one index of the tile it masks (x[m, k])"),
    ("lim: i32[N]", "m < lim[n]", "masks the accumulator by positions and by operands read one element at a time"),
])
def test_conditions_the_gpu_does_not_lower_are_refused_at_the_read(operand, condition, needle):
    from sparsegen.source import SpecError

    text = f"""kernel t {{
    in  x: bf16[M, K]
    in  y: bf16[K, N]
    in  {operand}
    out o: bf16[M, N]

    o[m, n] = x[m, k] * y[k, n] where {condition}

    tile m = 64, k = 64, n = 64
}}
"""
    with pytest.raises(SpecError) as info:
        lower_source(SourceFile("bad.spk", text), "h200")
    rendered = info.value.render()
    assert rendered.count("error:") == 1 and needle in rendered and "not lowered for GPUs yet" in rendered, rendered
    read = condition.split(" ")[0] if "[" in condition.split(" ")[0] else condition.split(" ")[-1]
    assert f"bad.spk:7:{text.splitlines()[6].index(read) + 1}: error:" in rendered, rendered
