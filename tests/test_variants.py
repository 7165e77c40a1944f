"""sparsegen variants: deterministic names, drops with reasons, model ranking, modules out."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest
from conftest import SPECS, assert_matches

from sparsegen.cli import main
from sparsegen.compiler import plans
from sparsegen.testing import example_args
from sparsegen.variants import expand, parse_tile_options


def test_expansion_is_deterministic_and_named_by_tiles():
    (plan,) = plans(SPECS / "dsd_matmul.spk")
    options = parse_tile_options(["n=128,256", "k=512,1024"], plan.kernel)
    names = [v.name for v in expand(plan.kernel, "dsd.spk", options)]
    assert names == ["dsd_matmul_m512_n128_k512", "dsd_matmul_m512_n128_k1024", "dsd_matmul_m512_n256_k512", "dsd_matmul_m512_n256_k1024"]


def test_variants_rank_drop_and_write(tmp_path, capsys):
    out, report = tmp_path / "out", tmp_path / "variants.json"
    argv = ["variants", str(SPECS / "masked_matmul.spk"), "--tile", "m=128,256,100", "--tile", "k=256,512",
            "--pattern", "tril", "--shape", "M=1024,N=1024,K=1024", "--no-compile", "-o", str(out), "--json", str(report)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "dropped masked_matmul_m100_n512_k256: tile m = 100 must span M, which is 1024: 'mask' breaks the TPU layout rule otherwise" in captured.err
    data = json.loads(report.read_text())
    alive = sorted((v for v in data["variants"] if v["rank"]), key=lambda v: v["rank"])
    assert len(alive) == 4 and len(data["variants"]) == 6
    seconds = [v["model"]["estimate"]["v5e"]["seconds"] for v in alive]
    assert seconds == sorted(seconds)
    assert all(v["model"]["wasted_copies"] == 0 for v in alive)
    # The written modules are ordinary generated kernels.
    best = alive[0]["name"]
    spec = importlib.util.spec_from_file_location(best, out / f"{best}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[best] = module
    spec.loader.exec_module(module)
    (plan,) = plans(SPECS / "masked_matmul.spk")
    import dataclasses

    tiles = alive[0]["tiles"]
    kernel = dataclasses.replace(plan.kernel, indices=tuple(dataclasses.replace(i, tile=tiles[i.name]) for i in plan.kernel.indices))
    args, keywords = example_args(kernel, dict(M=512, K=512, N=512), "tril", np.random.default_rng(0))
    assert_matches(kernel, getattr(module, best)(*args, **keywords, interpret=True), module.reference(*args, **keywords))


def test_variants_compile_check(tmp_path, capsys):
    argv = ["variants", str(SPECS / "sdd_matmul.spk"), "--tile", "k=256,512", "--shape", "M=1024,N=1024,K=1024", "--pattern", "tril",
            "--json", str(tmp_path / "v.json")]
    assert main(argv) == 0
    data = json.loads((tmp_path / "v.json").read_text())
    assert len(data["variants"]) == 2  # k = 256 and k = 512: all() over an empty list would pass
    assert all(v["compiled"] == {"v5e": True} for v in data["variants"])


def test_variants_usage_errors(capsys):
    assert main(["variants", str(SPECS / "dsd_matmul.spk"), "--tile", "q=128"]) == 2
    assert "INDEX one of m, n, k" in capsys.readouterr().err
    assert main(["variants", str(SPECS / "dsd_matmul.spk"), "--tile", "n=abc"]) == 2


def test_attention_variants_drop_illegal_tiles(tmp_path, capsys):
    """The row walk's rules: lead indices tile 1, the summed `d` spans D, blocks keep the TPU
    layout (an lse row of 64 lanes does not); the legal query and key tiles are ranked."""
    report = tmp_path / "v.json"
    argv = ["variants", str(SPECS / "causal_attention.spk"), "--tile", "i=64,128", "--tile", "j=128,256", "--tile", "h=1,2",
            "--tile", "d=64,128", "--shape", "B=1,H=2,S=512", "--pattern", "tril", "--no-compile", "--json", str(report)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "dropped causal_attention_b1_h2_i128_j128_d128_e128: an attention kernel walks 'h' one at a time: tile h = 1" in err
    assert "dropped causal_attention_b1_h1_i128_j128_d64_e128: tile d = 64 must span D, which is 128" in err
    assert "dropped causal_attention_b1_h1_i64_j128_d128_e128: the output block (None, None, 1, 64) of 'lse'" in err
    assert "breaks the TPU layout rule" in err
    data = json.loads(report.read_text())
    assert len(data["variants"]) == 16
    alive = sorted((v for v in data["variants"] if v["rank"]), key=lambda v: v["rank"])
    assert sorted(v["name"] for v in alive) == ["causal_attention_b1_h1_i128_j128_d128_e128", "causal_attention_b1_h1_i128_j256_d128_e128"]
    seconds = [v["model"]["estimate"]["v5e"]["seconds"] for v in alive]
    assert seconds == sorted(seconds)
    # 4 row blocks of 128 causal over 4 key blocks of 128 (10 pairs) or 2 of 256 (6), per head.
    assert {v["tiles"]["j"]: v["model"]["block_products"] for v in alive} == {128: 2 * 10, 256: 2 * 6}


def test_rank_cycles_orders_by_the_estimate(tmp_path, capsys):
    """Two variants of a dense matmul, one profiled compile each."""
    from sparsegen import cycles

    spec = tmp_path / "mm.spk"
    spec.write_text(DENSE)
    report = tmp_path / "v.json"
    argv = ["variants", str(spec), "--tile", "k=256,512", "--shape", "M=512,N=512,K=512", "--pattern", "density=1",
            "--no-compile", "--rank", "cycles", "--json", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr()
    data = json.loads(report.read_text())
    found = [v["cycles"] for v in data["variants"]]
    if all(c["estimated_cycles"] is None for c in found) and any(cycles.FLAG in (c["reason"] or "") for c in found):
        pytest.skip(f"this libtpu lacks {cycles.FLAG} (no static profile): {found[0]['reason']}")
    assert data["rank_by"] == "cycles"
    assert all(c["estimated_cycles"] is not None for c in found), found
    ranked = sorted(data["variants"], key=lambda v: v["rank"])
    figures = [v["cycles"]["estimated_cycles"] for v in ranked]
    assert figures == sorted(figures) and figures[0] < figures[1]
    # The figure ranked by is the weighted estimate of the forward pass, parsed from libtpu's profile.
    assert all(v["cycles"]["forward"]["estimated_cycles"] == v["cycles"]["estimated_cycles"] for v in ranked)
    assert f"{figures[0]:,}" in out.out


def test_rank_cycles_puts_unknown_last_with_the_reason(tmp_path, capsys, monkeypatch):
    """A variant whose profile failed shows "unknown", ranks last and says why (no compile here)."""
    from sparsegen import cycles

    def measure(jobs):
        out = []
        for n, job in enumerate(jobs):
            k = cycles.KernelCycles(job["kernel"], job["target"], job["pattern"])
            note = None if n else "not estimated: libtpu's static profiler aborted: test"
            k.forward.append(cycles.PassCycles("kernel", (2,), 2, 100, None if note else 100, note=note))
            out.append(k)
        return out

    monkeypatch.setattr(cycles, "measure", measure)
    spec = tmp_path / "mm.spk"
    spec.write_text(DENSE)
    report = tmp_path / "v.json"
    argv = ["variants", str(spec), "--tile", "k=256,512", "--shape", "M=512,N=512,K=512", "--pattern", "density=1",
            "--no-compile", "--rank", "cycles", "--json", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr()
    ranked = sorted(json.loads(report.read_text())["variants"], key=lambda v: v["rank"])
    assert [v["name"] for v in ranked] == ["mm_m256_n256_k512", "mm_m256_n256_k256"]
    assert ranked[1]["cycles"] == {"estimated_cycles": None, "reason": "not estimated: libtpu's static profiler aborted: test",
                                   "forward": ranked[1]["cycles"]["forward"]}
    assert "unknown" in out.out
    assert "cycles unknown for mm_m256_n256_k256 (ranked last): not estimated: libtpu's static profiler aborted: test" in out.err


def test_rank_cycles_without_a_profile_is_unknown_not_a_traceback(tmp_path, capsys, monkeypatch):
    from sparsegen import cycles

    def measure(jobs):
        raise cycles.NoProfile(f"libtpu wrote no estimated_cycles: this libtpu may not know {cycles.FLAG}")

    monkeypatch.setattr(cycles, "measure", measure)
    spec = tmp_path / "mm.spk"
    spec.write_text(DENSE)
    argv = ["variants", str(spec), "--tile", "k=256,512", "--shape", "M=512,N=512,K=512", "--no-compile", "--rank", "cycles"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "cycles unknown for mm_m256_n256_k256 (ranked last): no estimate: libtpu wrote no estimated_cycles" in err


DENSE = """kernel mm {
    in  x: bf16[M, K]
    in  y: bf16[K, N]
    out o: bf16[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 256, n = 256, k = 256
    accumulate f32
}
"""


@pytest.mark.parametrize(("spec", "shape", "pattern"), [("dsd_matmul.spk", "M=1024,N=1024,K=1024", "tril"),
                                                        ("document_attention.spk", "B=1,H=1,S=512", "band=256")])
def test_timing_runs_the_module_as_written(monkeypatch, spec, shape, pattern):
    """The TPU timing path (no TPU here: the variant's own module, run by the CPU interpreter)
    builds the arguments from the pattern, segment ids included, and calls the real module
    (not the simulator's numpy stand-ins)."""
    import functools

    from sparsegen import shapes
    from sparsegen import variants as vs

    (plan,) = plans(SPECS / spec)
    (v,) = vs.expand(plan.kernel, spec, {})
    vs.build(v, "v5e")
    real = shapes._load

    def interpreted(code, name):
        module = real(code, name)
        setattr(module, v.name, functools.partial(getattr(module, v.name), interpret=True))
        return module

    monkeypatch.setattr(shapes, "_load", interpreted)
    sizes = {k: int(x) for k, x in (item.split("=") for item in shape.split(","))}
    vs.time_on_tpu(v, {**vs.default_sizes(plan.kernel, {}), **sizes}, pattern, 0, repeats=1)
    assert v.measured is not None and v.measured > 0
