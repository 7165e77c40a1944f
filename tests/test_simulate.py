"""The pipeline simulator and cost model: every example hits the ideal (no wasted copy) on
every pattern; the counts match what the tutorial states and what a dense grid implies;
the metric catches waste when there is some; `plan --pattern` and `--png` work."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, SPECS, spec_text, with_tiles
from hygiene_specs import MASKED_SDD, NASTY_MASK, TRANSPOSED, XMASK, XMASK_SDD

from sparsegen.cli import main
from sparsegen.compiler import compile_source, plans
from sparsegen.backends import analyse_module as analyse
from sparsegen.tpu.simulate import load_module, pattern_args, simulate
from sparsegen.source import SourceFile

PATTERNS = ["tril", "density=0.1", "density=0.5", "band=300", "density=0.0", "density=1.0"]
SHAPES = {
    "dsd_matmul": dict(M=2048, K=2048, N=1024),
    "dds_matmul": dict(M=1024, K=2048, N=2048),
    "masked_matmul": dict(M=2048, K=2048, N=2048),
    "sdd_matmul": dict(M=1024, K=1024, N=1024),
    "block_slice": {},
}


def plan_of(text):
    (module,) = compile_source(SourceFile("t.spk", text))
    return module.plan


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_example_hits_the_ideal(name, pattern):
    (plan,) = plans(SPECS / f"{name}.spk")
    report = analyse(plan, SHAPES[name], pattern)
    assert report.sim.wasted_copies == 0, {t.operand: (t.copies, t.ideal, t.wasted) for t in report.sim.traffic.values()}
    for t in report.sim.traffic.values():
        assert t.copies == t.ideal, (t.operand, t.copies, t.ideal)
    assert report.sim.block_products <= report.dense.block_products


@pytest.mark.parametrize(
    "text,sizes,pattern",
    [(NASTY_MASK, dict(M=1024, K=1024, N=1024), p) for p in ("tril", "density=0.3", "density=0.0")]
    + [(TRANSPOSED, dict(M=512, K=768, N=1024), p) for p in ("density=0.3", "density=0.0", "density=1.0")]  # a 1-D mask
    + [(XMASK, dict(M=512, K=1024, N=512), p) for p in ("tril", "density=0.3", "band=200", "density=0.0")]
    + [(MASKED_SDD, dict(S=1024, D=512, T=1024), p) for p in ("tril", "density=0.3", "band=200", "density=0.0", "density=1.0")]
    + [(XMASK_SDD, dict(M=512, K=1024, N=512), p) for p in ("tril", "density=0.3", "band=200", "density=0.0")],
)
def test_mask_variants_hit_the_ideal(text, sizes, pattern):
    report = analyse(plan_of(text), sizes, pattern)
    assert report.sim.wasted_copies == 0


def test_tutorial_masked_matmul_does_144_of_256_block_products():
    (plan,) = plans(SPECS / "masked_matmul.spk")
    report = analyse(plan, dict(M=4096, N=4096, K=4096), "tril", targets=("v4", "v5e", "v5p", "v6e"))
    assert (report.sim.block_products, report.dense.block_products) == (144, 256)
    # The walk's steps: the 144 products, and one zero-writing step for each of the 28
    # output blocks above the diagonal (the dense grid visited each once per k block: 112).
    assert report.sim.steps == 144 + 28
    assert report.sim.traffic["mask"].copies == 8  # only the diagonal (partial) blocks are read
    # One TensorCore's chips; on v4 and v5p the dense grid's parallel axes split over two
    # (the walk has no parallel axis: the mask covers every output index).
    for target in ("v5e", "v6e"):
        assert report.estimates[target]["speedup"] > 1


def test_dense_copies_match_the_grid():
    """A dense matmul copies x at every step (its block changes with k), and y likewise."""
    plan = plan_of(with_tiles(spec_text("dsd_matmul").replace("bf16[M, K] coo", "bf16[M, K]"), m=256, n=256, k=256))
    sim = analyse(plan, dict(M=1024, K=768, N=512), "density=1.0").sim
    grid = (4, 2, 3)
    assert sim.grid == grid and sim.block_products == 24 and sim.write_backs == 8
    assert sim.traffic["x"].copies == 24 and sim.traffic["y"].copies == 24


MASKED_SCALE = """
kernel masked_scale {
    in  x: bf16[M, N]
    in  mask: i32[M, N] mask
    out o: bf16[M, N]

    o[m, n] = mask[m, n] * x[m, n]

    tile m = 512, n = 512
}
"""


def test_the_metric_catches_waste(tmp_path):
    """The tutorial's prefetch maps point past-the-end steps at the grid's last block: a copy
    nobody uses. Swap that behaviour into the generated module and the simulator sees it
    (a mask without a sum: a dense grid whose maps follow the next cell that computes)."""
    plan = plan_of(MASKED_SCALE)
    module = load_module(plan)
    original = module._next_live

    def tutorial_next(live):
        out = original(live)
        after_last = np.arange(live.shape[0]) > (np.flatnonzero(live).max() if live.any() else -1)
        return np.where(after_last, live.shape[0] - 1, out)

    module._next_live = tutorial_next
    env = dict(M=2048, N=2048)
    pattern = np.zeros((4, 4), bool)
    pattern[0, 0] = True
    np.save(tmp_path / "first_block.npy", pattern)
    args, _ = pattern_args(plan, env, str(tmp_path / "first_block.npy"))
    assert simulate(plan, module, args, env).wasted_copies > 0
    assert simulate(plan, load_module(plan), args, env).wasted_copies == 0


def test_host_evaluation_agrees_with_jax():
    (plan,) = plans(SPECS / "dsd_matmul.spk")
    env = SHAPES["dsd_matmul"]
    args, _ = pattern_args(plan, env, "density=0.3")
    host = simulate(plan, load_module(plan, host=True), args, env, keep_trace=True)
    device = simulate(plan, load_module(plan, host=False), args, env, keep_trace=True)
    assert {t.operand: t.copies for t in host.traffic.values()} == {t.operand: t.copies for t in device.traffic.values()}
    np.testing.assert_array_equal(host.trace["out"], device.trace["out"])


def test_plan_pattern_json(capsys):
    argv = ["plan", str(SPECS / "masked_matmul.spk"), "--shape", "M=4096,N=4096,K=4096", "--pattern", "tril", "--json"]
    assert main(argv) == 0
    (record,) = json.loads(capsys.readouterr().out)
    for key in ("block_products", "dense_block_products", "wasted_copies", "copies", "hbm_bytes", "flops", "vmem_bytes", "estimate"):
        assert key in record
    assert record["block_products"] == 144 and record["dense_block_products"] == 256
    assert set(record["estimate"]) == {"v4", "v5e", "v5p", "v6e"}
    assert set(record["copies"]) == {"x", "y", "mask"}


def test_plan_pattern_from_a_file_and_errors(tmp_path, capsys):
    blocks = np.eye(8, dtype=bool)
    np.save(tmp_path / "diag.npy", blocks)
    assert main(["plan", str(SPECS / "dsd_matmul.spk"), "--shape", "M=4096,K=4096,N=1024", "--pattern", str(tmp_path / "diag.npy"), "--json"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["block_products"] == 8 * 2  # eight stored blocks, two output column blocks
    assert main(["plan", str(SPECS / "dsd_matmul.spk"), "--pattern", "zigzag"]) == 2
    assert "unknown pattern 'zigzag'" in capsys.readouterr().err


def test_plan_png(tmp_path):
    out = tmp_path / "plan.png"
    assert main(["plan", str(SPECS / "masked_matmul.spk"), "--shape", "M=2048,N=2048,K=2048", "--pattern", "tril", "--png", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plan_png_without_matplotlib_says_which_extra_before_simulating(tmp_path):
    out = tmp_path / "plan.png"
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # as if it were not installed\n"
        "from sparsegen.cli import main\n"
        f"rc = main(['plan', {str(SPECS / 'masked_matmul.spk')!r}, '--pattern', 'tril', '--png', {str(out)!r}])\n"
        "assert 'jax' not in sys.modules, 'it simulated first'\n"
        "sys.exit(rc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr == "sparsegen plan: --png draws with matplotlib, which is not installed: pip install 'sparsegen[viz]'\n"
    assert not out.exists()


def test_plan_png_into_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    argv = ["plan", str(SPECS / "masked_matmul.spk"), "--shape", "M=2048,N=2048,K=2048", "--pattern", "tril", "--png"]
    assert main([*argv, str(tmp_path / "no" / "plan.png")]) == 2
    assert capsys.readouterr().err == f"sparsegen plan: --png {tmp_path / 'no' / 'plan.png'}: {tmp_path / 'no'} does not exist\n"
    assert main([*argv, str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"sparsegen plan: --png {tmp_path}: is a directory\n"
    assert main([*argv, str(tmp_path / "plan.txt")]) == 0  # a PNG, whatever its name
    assert (tmp_path / "plan.txt").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cost_estimate_in_every_pallas_call():
    for path in (ROOT / "generated").glob("*.py"):
        assert "cost_estimate=pl.CostEstimate(" in path.read_text(), path.name


@pytest.mark.parametrize("kernel,copies", [("masked_matmul_dx", 16), ("masked_matmul_dy", 16)])
def test_a_mask_inside_the_sum_is_read_at_its_partial_blocks_only(kernel, copies):
    """keep multiplies g inside the sum: its all-ones blocks are left out of a full step's
    product, so its map follows the partial (diagonal) blocks only: the walk's grid (k,
    steps), dx's and dy's alike, reads the 4 again for each of the 4 blocks of k, the
    parallel index (16); every computing step copied it before (40)."""
    plan = next(p for p in plans(SPECS / "masked_backward.spk") if p.name == kernel)
    report = analyse(plan, dict(M=2048, K=2048, N=2048), "tril")
    assert report.sim.wasted_copies == 0
    assert report.sim.traffic["keep"].copies == copies
    assert report.sim.block_products == 10 * 4  # the 10 non-empty keep blocks, each for 4 blocks of the other index


def _old_count_copies(keys: np.ndarray, used: np.ndarray) -> tuple[int, int, int, np.ndarray]:
    """The plain count (one array of every coordinate at every step): the oracle of the
    row-by-row `count_copies` that skips broadcast rows."""

    def runs(k):
        changed = np.ones(k.shape[-1], bool)
        changed[1:] = np.any(k[:, 1:] != k[:, :-1], axis=0) if k.shape[-1] > 1 else changed[1:]
        return changed

    new = runs(keys)
    run_id = np.cumsum(new) - 1
    used_runs = np.zeros(int(new.sum()), bool)
    np.logical_or.at(used_runs, run_id[used], True)
    wasted = int((~used_runs).sum()) - (0 if used.any() else 1)
    ideal = max(1, int(runs(keys[:, used]).sum())) if used.any() else 1
    return int(new.sum()), wasted, ideal, new & ~used_runs[run_id]


@pytest.mark.parametrize("seed", range(6))
def test_count_copies_agrees_with_the_plain_count(seed):
    """Rows broadcast from one value (a coordinate that never moves) are skipped, the runs
    are reduced in one pass: the counts are the plain count's, with and without per-step flags."""
    from sparsegen.tpu.simulate import Traffic, _coordinate, count_copies

    rng = np.random.default_rng(seed)
    steps = int(rng.integers(1, 40))
    coords = [rng.integers(0, 3, steps) // 2, np.int32(rng.integers(0, 4)), np.sort(rng.integers(0, 5, steps))]
    keys = [_coordinate(c, steps) for c in coords]
    used = rng.random(steps) < (0.0 if seed == 0 else 0.5)
    copies, wasted, ideal, per_step = _old_count_copies(np.stack(keys).astype(np.int64), used)
    t = Traffic("x", 0)
    np.testing.assert_array_equal(count_copies(t, keys, used, per_step=True), per_step)
    assert (t.copies, t.wasted, t.ideal) == (copies, wasted, ideal)
    assert count_copies(Traffic("x", 0), keys, used) is None


@pytest.mark.parametrize("pattern", ["tril", "band=40", "density=0.4", "density=1.0", "file"])
@pytest.mark.parametrize("tiles", [(32, 16), (48, 64), (100, 100)])
def test_host_block_kinds_agree(pattern, tiles, tmp_path):
    """The simulator's host `_block_kinds` reads a lazy mask's blocks from its pattern (never
    making the elements); what it returns is the module's own on the elements, partial last
    blocks included, at the mask's own tiles and at others."""
    from sparsegen.patterns import LazyMask, parse_pattern
    from sparsegen.tpu.simulate import _host_block_kinds

    (plan,) = plans(SPECS / "masked_matmul.spk")
    module = load_module(plan)
    shape, own = (150, 200), (32, 16)
    if pattern == "file":
        np.save(tmp_path / "blocks.npy", np.random.default_rng(1).random((5, 13)) < 0.5)
        pattern = str(tmp_path / "blocks.npy")
    mask = LazyMask(parse_pattern(pattern), shape, own, 0, np.float32)
    for ones in (False, True):
        fast = _host_block_kinds(module)(mask, tiles, ones)
        np.testing.assert_array_equal(fast, module._block_kinds(np.asarray(mask), tiles, ones))
