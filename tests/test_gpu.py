"""The GPU backend (issue 11): the same specs as Mosaic GPU kernels for H100/H200.

Three stages, none needs a GPU:
1. numerics in the Mosaic GPU interpreter (`interpret=True`) against `reference`;
2. lowering under an abstract H200 (WGMMA shapes, layouts, shared memory; its shared
   memory measured against the rules' estimate);
3. an XLA:GPU compile for a compile-only H200 through ptxas, in the plugin's own venv
   (`make gpu-venv`); where that venv is missing, those tests skip and say why.
Tiles WGMMA or shared memory cannot take are refused at the spec's tile line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, SPECS, assert_matches, build, spec_text, with_tiles
from test_einsum import SPECS as FEATURES

from sparsegen.compiler import lower_source
from sparsegen.gpu.verify import gpu_python
from sparsegen.source import SourceFile, SpecError
from sparsegen.testing import example_args, resolve_sizes

SWEEP = os.environ.get("SPARSEGEN_SWEEP") == "1"
# Every einsum example (attention: tests/test_gpu_attention.py), by file and kernel.
EXAMPLES = ["dsd_matmul", "dds_matmul", "sdd_matmul", "batched_dsd", "masked_matmul",
            "masked_backward:masked_matmul_dx", "masked_backward:masked_matmul_dy", "block_slice"]  # fmt: skip


def example_text(name: str) -> str:
    if ":" not in name:
        return spec_text(name)
    file, kernel = name.split(":")
    return "kernel " + next(b for b in spec_text(file).split("kernel ")[1:] if b.startswith(kernel + " "))


def run(text, sizes, pattern, seed=0):
    kernel, mod = build(text, "h200")
    args, keywords = example_args(kernel, sizes, pattern, np.random.default_rng(seed))
    out = getattr(mod, kernel.name)(*args, **keywords, interpret=True)
    ref = mod.reference(*args, **keywords)
    assert_matches(kernel, out, ref, resolve_sizes(kernel, sizes))
    return out, ref


# ------------------------------------------------------------------ stage 1: numerics

SMALL = {  # the examples retiled to GPU-sized blocks, with ragged sizes where they are symbolic
    "dsd_matmul": (dict(m=128, n=128, k=128), dict(M=300, K=256, N=256)),
    "dds_matmul": (dict(m=64, n=64, k=64), dict(M=128, K=192, N=200)),
    "sdd_matmul": (dict(m=128, n=128, k=128), dict(M=256, K=300, N=256)),
    "batched_dsd": (dict(b=1, m=128, n=128, k=128), dict(B=2, M=128, K=256, N=200)),
    "masked_matmul": (dict(m=64, n=128, k=64), dict(M=200, K=100, N=300)),
    "masked_backward:masked_matmul_dx": (dict(m=128, n=128, k=128), dict(M=200, K=256, N=300)),
    "masked_backward:masked_matmul_dy": (dict(m=64, n=64, k=64), dict(M=300, K=128, N=200)),
    "block_slice": (dict(i=128, j=128), {}),
}


# Every example with random blocks; more patterns on one example of each walk (all of them
# with SPARSEGEN_SWEEP=1). A coo operand's "padded" draws its random blocks and padding
# entries among them: dsd_matmul, dds_matmul and sdd_matmul run "padded" in place of
# "random"; without a coo operand "padded" draws what "random" does (the same seed: the same
# arrays), so masked_matmul_dy runs "random" alone (every pair under SPARSEGEN_SWEEP=1).
PADDED = ["dsd_matmul", "dds_matmul", "sdd_matmul"]
CASES = [(name, "random") for name in EXAMPLES if SWEEP or name not in PADDED] + [
    (name, pattern) for name in (EXAMPLES if SWEEP else PADDED + ["masked_backward:masked_matmul_dy"])
    for pattern in ("empty_lines", "padded") if SWEEP or pattern != "padded" or name in PADDED
]


@pytest.mark.parametrize("name,pattern", CASES)
def test_example_matches_reference_in_the_gpu_interpreter(name, pattern):
    tiles, sizes = SMALL[name]
    run(with_tiles(example_text(name), **tiles), sizes, pattern)


@pytest.mark.parametrize("pattern", ["duplicates", "all_empty", "all_full", "tril"])
@pytest.mark.parametrize("name", ["dsd_matmul", "masked_matmul"] + (["sdd_matmul", "masked_backward:masked_matmul_dx"] if SWEEP else []))
def test_every_pattern(name, pattern):
    tiles, sizes = SMALL[name]
    out, _ = run(with_tiles(example_text(name), **tiles), sizes, pattern, seed=1)
    if pattern == "all_empty" and name != "sdd_matmul":
        assert not np.asarray(out, np.float32).any()


def test_verbatim_tiles_dsd():
    """The example as written (512 blocks: 4x4 CTAs of 128x128 each, 8 k steps per block),
    one ragged block row (two under SPARSEGEN_SWEEP=1)."""
    run(example_text("dsd_matmul"), dict(M=1000 if SWEEP else 500, K=512, N=512), "random")


def test_a_block_nothing_reaches_is_never_read():
    """Skipped blocks are not multiplied: NaN in them stays out (as on the TPU, and in `reference`)."""
    text = with_tiles(example_text("masked_backward:masked_matmul_dx"), m=64, n=64, k=64)
    kernel, mod = build(text, "h200")
    rng = np.random.default_rng(3)
    g = rng.standard_normal((128, 256)).astype(np.float32)
    keep = np.ones((128, 256), np.float32)
    keep[:, 64:128] = 0  # n-block 1 is empty for every m
    g[:, 64:128] = np.nan
    y = rng.standard_normal((192, 256)).astype(np.float32)
    args = [jnp.asarray(a, jnp.bfloat16) for a in (g, keep, y)]
    out = np.asarray(mod.masked_matmul_dx(*args, interpret=True), np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np.asarray(mod.reference(*args), np.float32), rtol=0.02, atol=0.3)


def test_operands_stored_transposed_and_batch_dimensions_anywhere():
    """A stored (k, m), B stored (n, k): the kernel transposes the shared-memory tiles; a head
    index between the matrix dimensions is moved by the wrapper."""
    text = """
kernel tn {
    in  x: bf16[K, H, M]
    in  y: bf16[N, H, K]
    out o: bf16[H, M, N]
    o[h, m, n] = x[k, h, m] * y[n, h, k]
    tile h = 1, m = 64, n = 64, k = 64
    accumulate f32
}
"""
    run(text, dict(K=128, H=2, M=192, N=100), "random")


def test_chained_statements_and_a_scale():
    text = """
kernel chain {
    in  x: bf16[M, K]
    in  y: bf16[K, N] coo
    in  z: bf16[N, P]
    out t: bf16[M, N]
    out o: f32[M, P]
    t[m, n] = x[m, k] * y[k, n]
    o[m, p] = t[m, n] * z[n, p] * 0.5
    tile m = 64, n = 64, k = 64, p = 128
    accumulate f32
}
"""
    run(text, dict(M=128, K=128, N=192, P=128), "random")


def test_traced_coordinates_under_jit():
    tiles, sizes = SMALL["dsd_matmul"]
    kernel, mod = build(with_tiles(example_text("dsd_matmul"), **tiles), "h200")
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(5))
    fn = jax.jit(mod.dsd_matmul, static_argnames=("M", "interpret"))
    out = fn(*args, **keywords, interpret=True)
    # Against `reference` (eager calls: test_example_matches_reference_in_the_gpu_interpreter's).
    assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, sizes))


def test_misuse_is_a_value_error():
    from jax.experimental.pallas import tpu as pltpu

    tiles, sizes = SMALL["dsd_matmul"]
    kernel, mod = build(with_tiles(example_text("dsd_matmul"), **tiles), "h200")
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(5))
    with pytest.raises(ValueError, match="y has dtype float32"):
        mod.dsd_matmul(*args[:3], np.asarray(args[3], np.float32), **keywords, interpret=True)
    with pytest.raises(ValueError, match="InterpretGPUParams"):
        mod.dsd_matmul(*args, **keywords, interpret=pltpu.InterpretParams())


# The v1 einsum features (tests/test_einsum.py), on the GPU: what lowers matches `reference`;
# the rest is refused at the spec, saying what the GPU backend does not do yet.
GPU_REFUSES = {
    "coo_outer_sum": "'j' is in one only",
    "row_sum": "two groups of factors",
    "coo_outside_sum": "two groups of factors",
    "coo_join": "one sparse operand per statement",
    "sampled_product": "a dense or mask factor after the sum, tile by tile of a dense output",
}


# The interpreter runs every CTA and step: fewer output blocks than tests/test_einsum.py's
# sizes (each sum still takes two steps or more; its sizes under SPARSEGEN_SWEEP=1, but
# grouped_heads').
SMALLER = {"grouped_heads": dict(B=1, H=4, S=128, T=256, D=128)} | ({} if SWEEP else {
    "two_sums": dict(M=128, K=16, L=256, N=128), "chained": dict(M=128, K=256, N=256, P=128),
    "batched_coo": dict(B=2, M=256, K=256, N=128), "batched_mm": dict(B=4, M=128, K=256, N=128)})


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_v1_einsum_features(name):
    text, sizes = FEATURES[name]
    if name in GPU_REFUSES:
        assert GPU_REFUSES[name] in refused(text)
        return
    sizes = SMALLER.get(name, sizes)
    run(text, sizes, "random")
    if SWEEP:
        run(text, sizes, "padded" if "coo" in text else "empty_lines", seed=2)


def test_several_summed_indices_flatten_into_one_contraction():
    """Heads summed away, and a sum over (k, l) with a mask after it; a sparse factor skips
    blocks along one summed index only, so with two it is refused."""
    heads = """
kernel heads_sum {
    in  q: bf16[B, H, S, D]
    in  k: bf16[B, H, T, D]
    out s: f32[B, S, T]
    s[b, i, j] = q[b, h, i, d] * k[b, h, j, d]
    tile b = 1, h = 1, i = 64, j = 64, d = 64
}
"""
    run(heads, dict(B=2, H=3, S=128, T=64, D=64), "random")
    two = """
kernel masked_two {
    in  x: bf16[M, K, L]
    in  y: bf16[K, L, N]
    in  keep: i32[M, N] mask
    out o: bf16[M, N]
    o[m, n] = keep[m, n] * x[m, k, l] * y[k, l, n]
    tile m = 64, n = 64, k = 1, l = 64
}
"""
    run(two, dict(M=128, K=3, L=100, N=128), "random")
    coo = two.replace("in  x: bf16[M, K, L]", "in  x: bf16[M, K, L] coo").replace("in  keep: i32[M, N] mask\n", "")
    coo = coo.replace("keep[m, n] * ", "")
    assert "along one summed index" in refused(coo)


def test_elementwise_statements_with_scales_and_grid_coordinates():
    text = """
kernel scaled {
    in  x: bf16[H, M, N]
    in  y: bf16[M, H, N]
    out o: f32[H, M, N]
    o[h, m, n] = x[h, m, n] * y[m, h, n] * 0.5
    tile h = 1, m = 64, n = 128
}
"""
    run(text, dict(H=2, M=200, N=256), "random")


# Spec names that are the GPU einsum kernels' own locals (indices `mi`, `ni`: the CTA's tile).
HOSTILE_EINSUM = """
kernel barrier_ {
    in  cell: bf16[acc, count] coo
    in  barrier: bf16[count, step]
    out out_smem: bf16[acc, step]
    out_smem[mi, ni] = cell[mi, kk] * barrier[kk, ni]
    tile mi = 64, ni = 64, kk = 64
    accumulate f32
}
"""


def test_hostile_names():
    """Spec names that are the GPU kernels' own locals, or module names, stay apart."""
    text = HOSTILE_EINSUM
    run(text, dict(acc=128, count=192, step=64), "random")
    assert "plgpu" in refused(text.replace("kernel barrier_", "kernel plgpu"))


def test_on_a_real_gpu():
    """The examples compiled for and run on the GPU (skipped where there is none)."""
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("no GPU here (the interpreter and the compile-only H200 cover this machine)")
    for name in EXAMPLES:
        tiles, sizes = SMALL[name]
        kernel, mod = build(with_tiles(example_text(name), **tiles), "h200")
        args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(0))
        out = getattr(mod, kernel.name)(*args, **keywords)
        assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, sizes))


# ------------------------------------------------------------------ stages 2 and 3

# Stage 2 (lowering, shared memory, the backward's lowering) for every example whose forward
# or backward adds a walk: batched_dsd (forward rows, backward coo output and rows, as
# dsd_matmul) and masked_matmul_dy (forward cols as dds_matmul; backward rows and output mask,
# as dsd_matmul and masked_matmul_dx) under SPARSEGEN_SWEEP=1. Stage 3 compiles an einsum's
# forward kernel: one example of each forward walk (rows, cols, coo output, output mask,
# elementwise), every example under SPARSEGEN_SWEEP=1.
LOWERED = EXAMPLES if SWEEP else [e for e in EXAMPLES if e not in ("batched_dsd", "masked_backward:masked_matmul_dy")]
COMPILED = EXAMPLES if SWEEP else ["dsd_matmul", "dds_matmul", "sdd_matmul", "masked_matmul", "block_slice"]


def test_every_example_lowers_and_compiles_for_h200():
    """Stage 2 for LOWERED (and their backward), then stage 3 for COMPILED in one process."""
    from sparsegen.verify import verify_gpu_modules

    items = []
    for name in LOWERED:
        source = SourceFile(f"{name}.spk", example_text(name))
        items += [(m, source, "h200") for m in lower_source(source, "h200")]
    results = verify_gpu_modules(items, stage3={n.split(":")[-1] for n in COMPILED})
    assert [r.kernel for r in results] == [n.split(":")[-1] for n in LOWERED]
    for name, result in zip(LOWERED, results):
        assert result.lowered, (name, result.raw_error)
        if name != "block_slice":  # integers: no gradient
            assert result.backward == "lowers", (name, result.backward)
        # The rules' estimate is what Mosaic GPU allocates.
        assert result.smem_used == result.smem_estimate, (name, result.smem_used, result.smem_estimate)
        if name not in COMPILED:
            assert result.compiled is None and result.stage3 == "not asked for", (name, result.stage3)
    if results[0].compiled is None:
        pytest.skip(f"stage 3 (ptxas for sm_90a) not run: {results[0].stage3}")
    for name, result in zip(LOWERED, results):
        if name in COMPILED:
            assert result.compiled, (name, result.raw_error)
            assert result.registers and max(result.registers) <= 255 and result.spill_bytes == 0, (name, result.registers)


def test_stage3_environment_is_found_where_make_gpu_venv_made_it():
    python, why = gpu_python()
    if python is None:
        pytest.skip(f"stage 3 unavailable here: {why}")
    assert python.endswith("python")


# ------------------------------------------------------------------ rules at the tile line

def refused(text: str, target: str = "h200") -> str:
    with pytest.raises(SpecError) as info:
        lower_source(SourceFile("bad.spk", text), target)
    return info.value.render()


def caret_at(rendered: str, text: str, needle: str, line_with: str | None = None, skip: int = 0) -> None:
    """The diagnostic points at `needle` (plus `skip` characters) in the spec, on the line holding `line_with`."""
    line_no = next(n for n, line in enumerate(text.splitlines(), 1) if (line_with or needle) in line)
    col = text.splitlines()[line_no - 1].index(needle) + 1 + skip
    assert f"bad.spk:{line_no}:{col}: error:" in rendered, rendered


@pytest.mark.parametrize("tile,needle,message", [
    ("m = 32, n = 128, k = 64", "m = 32", "multiple of 64"),
    ("m = 64, n = 8, k = 64", "n = 8", "multiple of 16 up to 256"),
    ("m = 64, n = 300, k = 64", "n = 300", "multiple of 16 up to 256"),
    ("m = 64, n = 128, k = 8", "k = 8", "multiples of 16"),
    ("m = 64, n = 128, k = 100", "k = 100", "multiples of 16"),
])  # fmt: skip
def test_tiles_wgmma_cannot_take_are_refused_at_the_tile_line(tile, needle, message):
    text = re.sub(r"tile .*", f"tile {tile}", example_text("dsd_matmul"))
    rendered = refused(text)
    value = needle.split(" = ")[1]  # the caret is at the tile's value
    caret_at(rendered, text, needle, line_with="tile ", skip=len(needle) - len(value))
    assert message in rendered


def test_dtypes_and_accumulators_wgmma_cannot_take():
    base = with_tiles(example_text("dsd_matmul"), m=64, n=64, k=64)
    text = base.replace("in  y: bf16", "in  y: i16")
    rendered = refused(text)
    caret_at(rendered, text, "i16")
    assert "bf16, f16, f32 (as tf32) or i8 (into i32)" in rendered  # i8: tests/test_gpu_int8.py
    text = base.replace("in  y: bf16", "in  y: f32")
    rendered = refused(text)
    caret_at(rendered, text, "f32")
    assert "one dtype" in rendered
    assert "WGMMA accumulates bf16 products in f32" in refused(base.replace("accumulate f32", "accumulate bf16"))


def test_shared_memory_the_tiles_need_is_checked_against_the_chip():
    """Fewer pipeline stages where four do not fit; refused at the tile line where none does."""
    import dataclasses

    from sparsegen.gpu.rules import product_tiles
    from sparsegen.gpu.targets import GPU_TARGETS

    text = with_tiles(example_text("dsd_matmul"), m=128, n=128, k=128)
    kernel, _ = build(text, "h200")
    bf16 = kernel.operand("x").dtype
    small = dataclasses.replace(GPU_TARGETS["h200"], smem_bytes=70000)  # room for two stages, not four
    assert product_tiles(kernel, GPU_TARGETS["h200"], "m", "n", "k", bf16, bf16, None).stages == 4
    assert product_tiles(kernel, small, "m", "n", "k", bf16, bf16, None).stages == 2
    with pytest.raises(Exception) as info:
        product_tiles(kernel, dataclasses.replace(small, smem_bytes=20000), "m", "n", "k", bf16, bf16, None)
    assert "shared memory" in info.value.diagnostics[0].message


def test_review_findings_stay_fixed():
    """An output mask whose coordinates are ordered unlike the output's; an integer output of a
    fractional scale; factors dividing an index differently; a scale that is not finite; a
    TMA row too narrow for a factor."""
    permuted = """
kernel permuted {
    in  x: bf16[B, H, M, K]
    in  y: bf16[B, H, K, N]
    in  keep: i32[H, B, M, N] mask
    out o: f32[B, H, M, N]
    o[b, h, m, n] = keep[h, b, m, n] * x[b, h, m, k] * y[b, h, k, n]
    tile b = 1, h = 1, m = 64, n = 64, k = 64
}
"""
    run(permuted, dict(B=2, H=3, M=128, K=64, N=128), "random")
    halved = """
kernel halved {
    in  x: i32[256, 256]
    out o: i32[256, 256]
    o[i, j] = x[i, j] * 0.5
    tile i = 128, j = 128
}
"""
    run(halved, {}, "random")
    divided = """
kernel divided {
    in  x: bf16[H, M, K]
    in  z: bf16[G, M, K]
    in  y: bf16[H, K, N]
    out o: f32[H, M, N]
    o[h, m, n] = x[h, m, k] * z[h // 4, m, k] * y[h, k, n]
    tile h = 1, m = 64, n = 64, k = 64
}
"""
    assert "divided differently" in refused(divided)
    infinite = example_text("sdd_matmul").replace("x[m, k] * y[k, n]", "x[m, k] * y[k, n] * 1e200 * 1e200")
    assert "not a finite number" in refused(infinite, "v5e") and "not a finite number" in refused(infinite)
    narrow = """
kernel narrow {
    in  x: i8[64, 64]
    out o: f32[64, 64]
    o[i, j] = x[i, j]
    tile i = 64, j = 8
}
"""
    rendered = refused(narrow)
    assert "16 bytes" in rendered and "use a multiple of 16" in rendered


@pytest.mark.parametrize("name,needle,message,line", [
    ("masked_softmax", "lower[i, j] = x", "not lowered for GPUs yet: scores read from stored operands", None),
])  # fmt: skip
def test_what_has_no_gpu_lowering_yet_says_so_at_the_spec(name, needle, message, line):
    """Attention-like kernels lower for GPUs (tests/test_gpu_attention.py; the paged walk:
    tests/test_gpu_decode.py), except a stored score's walk."""
    text = spec_text(name)
    rendered = refused(text.replace(f"{SPECS}", ""))
    assert message in rendered
    caret_at(rendered.replace(f"{name}.spk", "bad.spk"), text, needle, line_with=line)


# The GPU strategies each walk of the schedule may become (schedule.choose_walk).
GPU_WALKS = {"dense": {"dense", "elementwise"}, "coo input": {"rows", "cols"}, "coo output": {"coo output"},
             "masked": {"rows", "cols", "output mask", "dense", "elementwise"},
             "condition": {"condition", "condition output"}}  # fmt: skip


def test_the_gpu_walks_what_the_schedule_chooses():
    """Every example's passes (forward and backward) follow the walk the schedule chooses,
    over the operand it names; the GPU lowering does not decide again."""
    from sparsegen.schedule import choose_walk

    # A mask that is its group's covering factor: the schedule's masked walk, multiplied whole here (dense).
    covering = """
kernel covering {
    in  x: bf16[M, K] mask
    in  y: bf16[K, N]
    out o: f32[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 64, n = 64, k = 64
}
"""
    seen = set()
    conditions = ["tril_matmul", "grouped_matmul"]  # language v2's `where` (tests/test_gpu_conditions.py)
    for name, text in [(name, example_text(name)) for name in EXAMPLES + conditions] + [("covering", covering)]:
        for m in lower_source(SourceFile(f"{name}.spk", text), "h200"):
            for module in (m, m.backward_module):
                for p in module.passes if module is not None else ():
                    walk = choose_walk(module.kernel, p.statement)
                    assert p.walk in GPU_WALKS[walk.name], (name, p.statement.target.text, walk.name, p.walk)
                    assert getattr(p, "sparse", None) in {None, *(s.operand for s in walk.sources)}, (name, p.walk)
                    seen.add((walk.name, p.walk))
    assert {"rows", "cols", "coo output", "output mask", "dense", "condition", "condition output"} <= {w for _, w in seen}, seen


# ------------------------------------------------------------------ the command line

def sparsegen(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "sparsegen", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_builds_plans_and_verifies_for_h200(tmp_path):
    spec = str(SPECS / "dsd_matmul.spk")
    built = sparsegen("build", spec, "--target", "h200", "-o", str(tmp_path))
    assert built.returncode == 0, built.stderr
    code = (tmp_path / "dsd_matmul.py").read_text()
    assert "plgpu.kernel(" in code and "plgpu.wgmma(" in code and "pallas import tpu" not in code
    plan = sparsegen("plan", spec, "--target", "h200")
    assert plan.returncode == 0 and "WGMMA" in plan.stdout and "shared memory" in plan.stdout, plan.stderr
    if SWEEP:
        # The command's stage 3 where its environment is (verify exits 2 asked for it without
        # one). By default: test_every_example_lowers_and_compiles_for_h200 compiles
        # dsd_matmul through ptxas, and tests/test_verify.py runs `verify --target h200` in
        # process (--lower-only, and its stage-3 report).
        verify = sparsegen("verify", spec, "--target", "h200", "--json", *(["--lower-only"] if gpu_python()[0] is None else []))
        assert verify.returncode == 0, verify.stderr
        (result,) = json.loads(verify.stdout)["results"]
        assert result["lowered"] and result["smem_used_bytes"] <= result["smem_limit_bytes"]
        assert result["compiled"] is not False, result
    refused_tile = tmp_path / "bad.spk"
    refused_tile.write_text(re.sub(r"tile .*", "tile m = 32, n = 128, k = 64", (SPECS / "dsd_matmul.spk").read_text()))
    bad = sparsegen("build", str(refused_tile), "--target", "h200", "-o", str(tmp_path / "out"))
    assert bad.returncode == 1 and "multiple of 64" in bad.stderr and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ gradients

GRADIENT_EXAMPLES = ["dsd_matmul", "dds_matmul", "sdd_matmul", "masked_backward:masked_matmul_dx"]  # a backward of every walk
# Fewer blocks than SMALL's (the forward and two backward kernels run in the interpreter),
# one size ragged each; SMALL's under SPARSEGEN_SWEEP=1.
GRADIENT_SIZES = {"dsd_matmul": dict(M=200, K=256, N=128), "dds_matmul": dict(M=128, K=128, N=100),
                  "sdd_matmul": dict(M=256, K=300, N=128), "masked_backward:masked_matmul_dx": dict(M=200, K=128, N=256)}


@pytest.mark.parametrize("name", [e for e in EXAMPLES if e != "block_slice"] if SWEEP else GRADIENT_EXAMPLES)
def test_gradients_equal_those_of_reference(name):
    """jax.grad through the kernel (its backward: the derived kernels, on the GPU too) equals
    JAX's gradient of `reference`, for every differentiable input (masks get none)."""
    from test_gradients import differentiable

    tiles, sizes = SMALL[name]
    sizes = sizes if SWEEP else GRADIENT_SIZES.get(name, sizes)
    kernel, mod = build(with_tiles(example_text(name), **tiles), "h200")
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(7))
    which = tuple(differentiable(kernel))
    weights = [np.random.default_rng(8).standard_normal(np.shape(r)).astype(np.float32) for r in [mod.reference(*args, **keywords)]]

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a, **keywords).astype(jnp.float32) * weights[0])

    got = jax.grad(loss(lambda *a, **k: getattr(mod, kernel.name)(*a, **k, interpret=True)), argnums=which)(*args)
    want = jax.grad(loss(mod.reference), argnums=which)(*args)
    for n, g, w in zip(which, got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = max(1.0, float(np.sqrt(np.mean(w**2))))
        np.testing.assert_allclose(g, w, rtol=0.02, atol=0.02 * scale, err_msg=f"argument {n}")


def test_an_f32_output_of_bf16_factors_is_differentiated_its_cotangent_read_as_bf16():
    """bf16 x bf16 -> f32 (logits): WGMMA multiplies two factors of one dtype, so the backward
    kernels read the f32 cotangent as bf16, cast by the wrapper (the gradients are bf16
    anyway); jax.grad equals JAX's gradient of `reference` to bf16 rounding. Refused before."""
    text = """kernel logits {
    in  x: bf16[M, K]
    in  y: bf16[K, N]
    out o: f32[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 64, n = 128, k = 64
}
"""
    kernel, mod = build(text, "h200")
    assert mod._REFUSED == ()
    assert mod.__file__ and open(mod.__file__).read().count("_matrix(g_o.astype(jnp.bfloat16)") == 2  # dx's and dy's calls
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((100, 128)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((128, 128)), jnp.bfloat16)
    w = rng.standard_normal((100, 128)).astype(np.float32)
    got = jax.grad(lambda x, y: jnp.sum(mod.logits(x, y, interpret=True) * w), argnums=(0, 1))(x, y)
    want = jax.grad(lambda x, y: jnp.sum(mod.reference(x, y) * w), argnums=(0, 1))(x, y)
    for g, r in zip(got, want):
        assert g.dtype == jnp.bfloat16
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        np.testing.assert_allclose(g, r, rtol=2**-7, atol=2**-7 * float(np.abs(r).max()))


def test_what_lies_past_a_ragged_end_of_a_stored_block_is_absent():
    """A stored block at a ragged end holds values past the array's end: they are not part of
    the operand (as in `reference` and on the TPU), so not even a NaN there reaches the output."""
    text = with_tiles(example_text("dsd_matmul"), m=64, n=64, k=64)
    kernel, mod = build(text, "h200")
    rng = np.random.default_rng(4)
    blocks = rng.standard_normal((2, 64, 64)).astype(np.float32)
    blocks[1, :, 40:] = np.nan  # K = 104: block column 1 holds 40 columns of x
    blocks[1, 50:, :] = np.nan  # M = 114: block row 1 holds 50 rows
    args = [jnp.asarray(blocks, jnp.bfloat16), np.array([0, 1], np.int32), np.array([0, 1], np.int32),
            jnp.asarray(rng.standard_normal((104, 64)), jnp.bfloat16)]
    out = np.asarray(mod.dsd_matmul(*args, M=114, interpret=True), np.float32)
    ref = np.asarray(mod.reference(*args, M=114), np.float32)
    assert np.isfinite(out).all() and np.isfinite(ref).all()
    np.testing.assert_allclose(out, ref, rtol=0.02, atol=0.1)


def test_an_underivable_gradient_blocks_no_other_on_the_gpu():
    """Grouped heads: k's gradient (read through h // 4) is not derived, q's is; asking for
    q's runs the GPU backward (interpreted) and equals JAX's gradient of `reference`, asking
    for k's raises, naming it; `plan --target h200` says which is which."""
    text = """kernel grouped {
    in  q: bf16[B, H, S, D]
    in  k: bf16[B, G, T, D]
    out s: bf16[B, H, S, T]
    s[b, h, i, j] = q[b, h, i, d] * k[b, h // 2, j, d] * 0.125
    tile b = 1, h = 1, i = 64, j = 64, d = 64
}"""
    from sparsegen.gpu.describe import describe

    kernel, mod = build(text, "h200")
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((1, 2, 64, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 1, 128, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1, 2, 64, 128)), jnp.float32)
    run = lambda q, k: mod.grouped(q, k, interpret=True)  # noqa: E731
    got = jax.grad(lambda q: jnp.sum(run(q, k).astype(jnp.float32) * w))(q)
    want = jax.grad(lambda q: jnp.sum(mod.reference(q, k).astype(jnp.float32) * w))(q)
    g, r = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(g, r, rtol=0.02, atol=0.02 * max(1.0, float(np.sqrt(np.mean(r**2)))))
    with pytest.raises(NotImplementedError, match=r"grouped: the gradient of 'k', read as k\[b, h // 2, j, d\], is not supported yet"):
        jax.grad(lambda k: jnp.sum(run(q, k).astype(jnp.float32)))(k)
    (m,) = lower_source(SourceFile("grouped.spk", text), "h200")
    lines = describe(m)
    assert lines[lines.index("gradients (jax.grad), per float input:") + 1] == "  q: through s"
    assert lines[-1].startswith("  k: not derived through s: the gradient of 'k', read as k[b, h // 2, j, d]")
