"""Language v1 features, one spec each: batch indices, a coo input with batch dimensions,
several summed indices, a row sum, three factors, literal factors, `h // n`, offsets on
the left, a coo input with a coo output, several outputs and chained statements, ragged
sizes in every walk. Each equals `reference` and the numpy oracle in the CPU interpreter
and the TPU simulator, and compiles ahead of time for v5e, v6e and v4."""

from __future__ import annotations

import numpy as np
import pytest
from aot import across_targets, compile_for
from conftest import SWEEP, assert_matches, build, in_both_modes
from oracle import oracle

from sparsegen.source import SpecError
from sparsegen.testing import example_args, resolve_sizes

SPECS = {
    "batched_mm": ("""
kernel batched_mm {
    in  x: bf16[B, M, K]
    in  y: bf16[B, K, N]
    out o: f32[B, M, N]
    o[b, m, n] = x[b, m, k] * y[b, k, n]
    tile b = 2, m = 128, n = 128, k = 128
}""", dict(B=4, M=256, K=256, N=128)),
    "batched_coo": ("""
kernel batched_coo {
    in  x: f32[B, M, K] coo
    in  y: f32[B, K, N]
    out o: f32[B, M, N]
    o[b, m, n] = x[b, m, k] * y[b, k, n]
    tile b = 1, m = 128, n = 128, k = 128
}""", dict(B=3, M=256, K=384, N=256)),
    "two_sums": ("""
kernel two_sums {
    in  x: f32[M, K, L]
    in  y: f32[K, L, N]
    out o: f32[M, N]
    o[m, n] = x[m, k, l] * y[k, l, n]
    tile m = 128, n = 128, k = 8, l = 128
}""", dict(M=256, K=16, L=256, N=128)),
    "row_sum": ("""
kernel row_sum {
    in  x: f32[M, K]
    out o: f32[M]
    o[m] = x[m, k]
    tile m = 128, k = 128
}""", dict(M=384, K=256)),
    "three_factors": ("""
kernel three_factors {
    in  g: bf16[M, N]
    in  keep: bf16[M, N] mask
    in  y: bf16[K, N]
    out dx: bf16[M, K]
    dx[m, k] = g[m, n] * keep[m, n] * y[k, n] * 0.5
    tile m = 128, n = 128, k = 128
}""", dict(M=256, N=384, K=128)),
    "grouped_heads": ("""
kernel grouped_heads {
    in  q: bf16[B, H, S, D]
    in  k: bf16[B, G, T, D]
    out s: f32[B, H, S, T]
    s[b, h, i, j] = q[b, h, i, d] * k[b, h // 4, j, d] * 0.125
    tile b = 1, h = 1, i = 128, j = 128, d = 128
}""", dict(B=2, H=8, S=256, T=384, D=128)),
    "left_offsets": ("""
kernel left_offsets {
    in  g: f32[128, 256]
    in  at: index[2]
    out dx: f32[512, 512]
    dx[at[0] + i, at[1] + j] = g[i, j]
    tile i = 128, j = 128
}""", {}),
    "coo_join": ("""
kernel coo_join {
    in  x: bf16[M, K] coo
    in  y: bf16[K, N]
    out o: f32[M, N] coo
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}""", dict(M=384, K=256, N=256)),
    "chained": ("""
kernel chained {
    in  x: f32[M, K]
    in  y: f32[K, N]
    in  z: f32[N, P]
    out t: f32[M, N]
    out u: f32[M, P]
    t[m, n] = x[m, k] * y[k, n]
    u[m, p] = t[m, n] * z[n, p]
    tile m = 128, n = 128, k = 128, p = 128
}""", dict(M=256, K=384, N=256, P=128)),
    "coo_outer_sum": ("""
kernel coo_outer_sum {
    in  x: f32[M, K] coo
    in  y: f32[K, J, N]
    out o: f32[M, N]
    o[m, n] = x[m, k] * y[k, j, n]
    tile m = 128, n = 128, k = 8, j = 8
}""", dict(M=256, K=16, J=24, N=128)),
    "coo_outside_sum": ("""
kernel coo_outside_sum {
    in  x: f32[M, N] coo
    in  y: f32[N, J]
    out o: f32[N, M]
    o[n, m] = x[m, n] * y[n, j]
    tile m = 128, n = 128, j = 128
}""", dict(M=256, N=256, J=200)),
    "sampled_product": ("""
kernel sampled_product {
    in  x: f32[M, K]
    in  y: f32[K, N]
    in  s: f32[M, N] coo
    out o: f32[M, N]
    o[m, n] = s[m, n] * x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}""", dict(M=256, K=384, N=256)),
    "ragged_coo": ("""
kernel ragged_coo {
    in  x: f32[M, K] coo
    in  y: f32[K, N]
    out o: f32[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}""", dict(M=300, K=200, N=250)),
    "ragged_mask": ("""
kernel ragged_mask {
    in  x: f32[M, K]
    in  y: f32[K, N]
    in  keep: i32[M, N] mask
    out o: f32[M, N]
    o[m, n] = keep[m, n] * x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}""", dict(M=300, K=200, N=250)),
    "ragged_sdd": ("""
kernel ragged_sdd {
    in  x: f32[M, K] mask
    in  y: f32[K, N]
    out o: f32[M, N] coo
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}""", dict(M=300, K=200, N=250)),
}
PATTERNS = ("random", "padded", "duplicates", "all_empty")


# Every feature with every pattern in the CPU interpreter ("random" or "padded":
# feature_interpreted); in the simulator every feature with random blocks, and with none
# stored where a coo or mask operand drives the walk (its outputs must then be written as
# zeros, which the simulator's NaN-filled memory shows); every pair under SPARSEGEN_SWEEP=1.
# Every pattern where the feature has a coo or mask operand; a dense feature's arguments
# do not depend on the pattern (sparsegen.testing.example_args: the same seed, the same
# arrays), so the random one alone (every pair under SPARSEGEN_SWEEP=1).
FEATURE_CASES = [(n, p) for n in sorted(SPECS) for p in PATTERNS
                 if p == "random" or " coo" in SPECS[n][0] or " mask" in SPECS[n][0] or SWEEP]
# In the simulator every feature on the random pattern, and all_empty (outputs no step
# writes: NaN-filled memory) for a coo input, a coo output and a mask (every coo or mask
# feature under SPARSEGEN_SWEEP=1: in_both_modes).
FEATURE_SIMULATED = [(n, p) for n, p in FEATURE_CASES if p == "random" or (n, p) in {("ragged_coo", "all_empty"), ("ragged_sdd", "all_empty"),
                                                                                     ("ragged_mask", "all_empty")}]


def feature_interpreted(case):
    """In the CPU interpreter, "padded" in place of "random" where the feature has a coo
    operand ("padded" draws random blocks and padding entries among them); without one,
    "padded" draws what "random" does (the same seed: the same arrays), so "random" alone
    (both under SPARSEGEN_SWEEP=1)."""
    name, pattern = case
    coo = " coo" in SPECS[name][0]
    return pattern not in ("random", "padded") or (pattern == "padded") == coo


@pytest.mark.parametrize(*in_both_modes(FEATURE_CASES, FEATURE_SIMULATED, "name,pattern", feature_interpreted), indirect=["interpret"])
def test_feature_matches_reference_and_oracle(name, pattern, interpret):
    text, sizes = SPECS[name]
    kernel, mod = build(text)
    args, keywords = example_args(kernel, sizes, pattern, np.random.default_rng(len(name)))
    env = resolve_sizes(kernel, sizes)
    ref = mod.reference(*args, **keywords)
    assert_matches(kernel, ref, oracle(kernel, args, keywords), env)
    assert_matches(kernel, getattr(mod, name)(*args, **keywords, interpret=interpret), ref, env)


V4_REFUSED = {("row_sum", "v4"): "v4 cannot sum over 'k' here: it is the last dimension of 'x' blocks",
              ("coo_outside_sum", "v4"): "v4 cannot sum over 'j' here: it is the last dimension of 'y' blocks"}
# Each feature compiled for one target, the three in turn; the two v4 refuses, refused at
# build on v4 and compiled for v5e (every pair under SPARSEGEN_SWEEP=1): a compile takes
# seconds, and what differs between targets (VMEM, layouts, refusals) is the targets'
# rules, which one example of each walk exercises on all three in tests/test_verify.py.
FEATURE_COMPILES = sorted({(n, t + ":2x2" + ("x1" if t == "v4" else "")) for n, t in V4_REFUSED} | {(n, "v5e:2x2") for n, _ in V4_REFUSED}
                          | set(across_targets(sorted(SPECS), ["v5e:2x2", "v6e:2x2", "v4:2x2x1"])))


@pytest.mark.parametrize("name,topology", FEATURE_COMPILES)
def test_feature_compiles_ahead_of_time(name, topology):
    text, sizes = SPECS[name]
    target = topology.split(":")[0]
    refused = V4_REFUSED
    if (name, target) in refused:
        # Refused at build time on v4, at the statement (what libtpu would refuse).
        with pytest.raises(SpecError, match=refused[name, target]):
            build(text, target)
        return
    kernel, mod = build(text, target)
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(0))
    fn = getattr(mod, name)
    assert "tpu_custom_call" in compile_for(lambda *a: fn(*a, **keywords), args, topology).as_text()


def test_coo_blocks_with_tile_1_dimensions_kept_are_accepted(interpret):
    """batched_dsd's blocks are (nb, 512, 256); (nb, 1, 512, 256) works the same."""
    text, sizes = SPECS["batched_coo"]
    kernel, mod = build(text)
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(1))
    kept = [args[0][:, None]] + list(args[1:])
    env = resolve_sizes(kernel, sizes)
    assert_matches(kernel, mod.batched_coo(*kept, **keywords, interpret=interpret), mod.reference(*args, **keywords), env)


def test_several_outputs_come_back_as_a_tuple_in_declaration_order():
    kernel, mod = build(SPECS["chained"][0])
    args, keywords = example_args(kernel, SPECS["chained"][1], "random", np.random.default_rng(2))
    t, u = mod.chained(*args, **keywords, interpret=True)
    assert t.shape == (256, 256) and u.shape == (256, 128)


def test_vmem_estimate_bounds_a_factor_widened_by_a_broadcast():
    """Covered factors broadcast into a 3-D block make Mosaic keep a widened copy of it
    (measured: 24 MiB for a 16 MiB double-buffered f32 block); the estimate counts it."""
    from sparsegen.compiler import compile_source
    from sparsegen.source import SourceFile
    from sparsegen.tpu import verify
    from sparsegen.verify import verify_plan

    text = """
kernel widened {
    in  x0: f32[A]
    in  x1: f32[C]
    in  x2: f32[C, A, B]
    out o: f32[A, B]
    o[a, b] = x0[a] * x1[c] * x2[c, a, b]
    tile a = 128, b = 128, c = 128
}"""
    source = SourceFile("widened.spk", text)
    (module,) = compile_source(source, "v5e")
    result = verify_plan(module.plan, source, "v5e", dict(A=256, B=256, C=256))
    assert result.compiled and result.vmem_used is not None
    assert result.vmem_used <= result.vmem_estimate <= verify.ESTIMATE_SLACK * result.vmem_used + verify.ESTIMATE_FLOOR


def test_a_mask_inside_the_sum_is_skipped_where_all_ones(interpret):
    """three_factors' keep multiplies g inside the sum: a step whose keep block is all ones
    leaves it out (`_compute_full`), a partial one multiplies it in, an empty one computes
    nothing; all three kinds in one call, equal to the reference and the oracle."""
    text, sizes = SPECS["three_factors"]  # keep blocks (128, 128): a 2 x 3 grid of them
    kernel, mod = build(text)
    rng = np.random.default_rng(3)
    g, keep, y = example_args(kernel, sizes, "random", rng)[0]
    keep = np.ones((256, 384), np.float32)
    keep[0:128, 128:256] = 0  # empty
    keep[0:128, 256:384] = rng.random((128, 128)) < 0.5  # partial 0/1
    keep[128:256, 128:256] = 2.0  # nonzero but not ones: multiplied
    keep = keep.astype(np.asarray(g).dtype)
    env = resolve_sizes(kernel, sizes)
    ref = mod.reference(g, keep, y)
    assert_matches(kernel, ref, oracle(kernel, [g, keep, y], {}), env)
    assert_matches(kernel, mod.three_factors(g, keep, y, interpret=interpret), ref, env)
    from sparsegen.compiler import compile_source
    from sparsegen.source import SourceFile

    (module,) = compile_source(SourceFile("t.spk", text))
    assert "def _compute_full():" in module.code and "keep is all ones here" in module.code
