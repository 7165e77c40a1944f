"""sparsegen variants: deterministic names, drops with reasons, model ranking, modules out."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
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
    assert "dropped masked_matmul_m100_n512_k256: tile m = 100 breaks the TPU layout rule" in captured.err
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
