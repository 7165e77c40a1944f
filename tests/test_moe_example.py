"""examples/moe_transformer: a mixture-of-experts transformer whose attention and experts are
generated kernels under `sharded` on a mesh of 8 host CPU devices, trained side by side with
the same model in plain jax.numpy.

A tiny configuration (one layer, a few steps), in a subprocess: the device count is set
before jax is imported there (train.py sets it), and this process has imported jax already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import PartitionSpec
from conftest import ROOT

pytest.importorskip("optax")  # the `examples` extra

EXAMPLE = ROOT / "examples" / "moe_transformer"
BATCH, SEQ, D_MODEL, D_FF, STEPS = 2, 64, 128, 128, 4


def test_kernels_are_current():
    """The committed kernels are what the example's specs build (`sparsegen check`)."""
    specs = sorted(str(p.relative_to(ROOT)) for p in (EXAMPLE / "specs").glob("*.spk"))
    result = subprocess.run([sys.executable, "-m", "sparsegen", "check", *specs, "-o", str(EXAMPLE / "kernels")],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(specs)} modules up to date" in result.stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    result = subprocess.run(
        [sys.executable, "-m", "examples.moe_transformer.train", "--steps", str(STEPS), "--layers", "1",
         "--batch", str(BATCH), "--seq", str(SEQ), "--d-model", str(D_MODEL), "--d-ff", str(D_FF), "--lr", "1e-2",
         "--quiet", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "losses.json").read_text()), out, result.stdout


def test_losses_agree_step_by_step_and_fall(run):
    report, out, stdout = run
    kernels, control = (np.array(report["losses"][name]) for name in ("kernels", "control"))
    assert len(kernels) == len(control) == STEPS
    assert np.all(np.isfinite(kernels)) and np.all(np.isfinite(control))
    # Within bf16 tolerance at every step (train.py's TOLERANCE, relative).
    np.testing.assert_allclose(kernels, control, rtol=0.02, atol=0)
    # Not the same computation: the kernels round and sum in another order.
    assert np.any(kernels != control)
    # The loss falls (from about ln(vocab) = 3.5).
    assert kernels[-1] < kernels[0] - 0.5 and control[-1] < control[0] - 0.5
    assert report["agree"] and report["fell"]
    assert (out / "loss.png").stat().st_size > 0
    assert f"{STEPS} steps" in stdout


def test_kernels_ran_sharded_on_the_mesh(run):
    report, _, _ = run
    mesh = {"data": 2, "seq": 4}
    assert report["mesh"] == mesh
    calls = report["step_jaxpr"]
    # The kernel model's training step: every Pallas kernel (forward and backward) inside a
    # shard_map on the (data, seq) mesh; the control's: none.
    kernels = calls["kernels"]
    assert kernels["meshes"] == [mesh]
    assert kernels["pallas_calls_outside"] == 0
    # One layer: attention and two grouped matmuls, forward and backward.
    assert kernels["shard_maps"] >= 3 and kernels["pallas_calls_in_shard_map"] >= 6
    assert calls["control"] == {"shard_maps": 0, "pallas_calls_in_shard_map": 0, "pallas_calls_outside": 0, "meshes": []}
    # Each kernel's output laid out as its mapping says (`model.ATTENTION_AXES`,
    # `EXPERT_AXES`), one device holding its slice: attention's o[b, h, i, e] split over the
    # indices mapped (batch over data, heads over seq); the experts' o[m, n] rows over data,
    # whole over seq (each device's experts' partial products added with psum).
    for name, dims in (("attention", "bhie"), ("experts", "mn")):
        got = report["sharded_outputs"][name]
        axes = [got["axes"].get(i) for i in dims]
        assert got["axes"] == report["axes"][name] and set(got["axes"].values()) == set(mesh), name
        while axes[-1] is None:  # jax writes a spec without its trailing Nones
            axes.pop()
        assert got["spec"] == str(PartitionSpec(*axes)), (name, got["spec"])
        assert got["local_shape"] == [n // mesh.get(got["axes"].get(i), 1) for n, i in zip(got["shape"], dims)], name
        assert got["devices"] == 8
