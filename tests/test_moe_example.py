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
from conftest import ROOT

EXAMPLE = ROOT / "examples" / "moe_transformer"
BATCH, SEQ, D_MODEL, D_FF, STEPS = 2, 64, 128, 128, 4


def test_kernels_are_current(capsys, monkeypatch):
    """The committed kernels are what the example's specs build (`sparsegen check`, in this process)."""
    from sparsegen.cli import main

    monkeypatch.chdir(ROOT)
    specs = sorted(str(p.relative_to(ROOT)) for p in (EXAMPLE / "specs").glob("*.spk"))
    code = main(["check", *specs, "-o", str(EXAMPLE / "kernels")])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert f"{len(specs)} modules up to date" in out.out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    # XLA's CPU backend unoptimised, as in this process (sparsegen.jaxenv): the programs are
    # compiled once and run for a few steps, compiling is most of the time.
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    result = subprocess.run(
        [sys.executable, "-m", "examples.moe_transformer.train", "--steps", str(STEPS), "--layers", "1",
         "--batch", str(BATCH), "--seq", str(SEQ), "--d-model", str(D_MODEL), "--d-ff", str(D_FF),
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


def test_gradients_agree_at_the_first_step(run):
    """From the same parameters, every parameter's gradient within bf16 tolerance (Adam,
    scale-free, would hide a gradient off by a constant factor from the losses): the
    kernels round each gradient pass's output to bf16, and the sums over positions carry it
    (about 0.3% here, 2% at the full configuration); a psum missing or doubled would be 50%."""
    report, _, _ = run
    differences = report["first_step_gradient_difference"]
    assert len(differences) == 3 + 7  # embed, pos, out; one layer's seven
    assert all(0 < d < 0.05 for d in differences.values()), differences


def test_kernels_ran_sharded_on_the_mesh(run):
    report, _, _ = run
    mesh = {"data": 2, "seq": 4}
    assert report["mesh"] == mesh
    calls = report["step_jaxpr"]
    # The control's training step runs no kernel; the kernel model's runs every Pallas kernel,
    # forward and backward, inside a shard_map on the (data, seq) mesh.
    assert calls["control"] == {"shard_maps": [], "pallas_calls_in_shard_map": 0, "pallas_calls_outside": 0}
    kernels = calls["kernels"]
    assert kernels["pallas_calls_outside"] == 0 and kernels["pallas_calls_in_shard_map"] >= 6
    ran = {k for sm in kernels["shard_maps"] for k in sm["kernels"]}
    assert ran == {"gqa_attention._attention_kernel", "gqa_attention._attention_fused_backward_kernel", "expert_matmul._kernel", "expert_matmul._d_x_kernel",
                   "expert_matmul._d_w_kernel"}
    for sm in kernels["shard_maps"]:
        assert sm["mesh"] == mesh
        # Each device holds its slice: every dimension divided by the mesh axes laid along it.
        for shapes, local, specs in ((sm["in_shapes"], sm["local_in_shapes"], sm["in_specs"]),
                                     (sm["out_shapes"], sm["local_out_shapes"], sm["out_specs"])):
            for shape, part, spec in zip(shapes, local, specs):
                assert part == [n // devices(mesh, axis) for n, axis in zip(shape, spec)], sm

    def forward(kernel, count):
        found = [sm for sm in kernels["shard_maps"] if sm["kernels"] == [kernel]]
        assert len(found) == count, kernel
        return found

    # Laid out as the mappings say (`model.ATTENTION_AXES`, `EXPERT_AXES`): attention's q, k, v
    # and o over its batch and sequence; the experts' x and w rows over data, experts over
    # seq, o whole over seq (the experts' partial products psum-added).
    att, exp = report["axes"]["attention"], report["axes"]["experts"]
    assert set(att.values()) == set(exp.values()) == set(mesh)
    (att_forward,) = forward("gqa_attention._attention_kernel", 1)  # one layer
    qkv = [spec for spec, shape in zip(att_forward["in_specs"], att_forward["in_shapes"]) if len(shape) == 4]
    assert qkv == [[att.get(i) for i in "bhid"], [att.get(i) for i in "bhjd"], [att.get(i) for i in "bhjd"]]
    assert att_forward["out_specs"][0] == [att.get(i) for i in "bhid"]
    assert exp == {"m": "data", "g": "seq"}
    for sm in forward("expert_matmul._kernel", 2):  # the up and down projections
        assert sm["in_specs"][:3] == [["data", None], ["seq", None, None], ["data"]]
        assert sm["out_specs"][0] == ["data", None]
        assert sm["collectives"] == {"psum": 1}  # the rows' partial products over the experts

    # The attention ran as a ring over the query and key positions: each device's kernels
    # see its S/n rows against S/n keys at a time (every call's q, k and v), and the keys and
    # values travel by ppermute at each of the n - 1 steps after the first (causal in order:
    # every step has a device whose rows see another's keys); the backward sends them again
    # and returns their gradients (4 per step). No psum: partial results merge locally.
    ring = att["i"]
    assert att["j"] == ring and att["b"] == "data"
    n, heads = mesh[ring], report["config"]["heads"]
    rows, positions = BATCH // mesh["data"], SEQ // n
    want = [[rows, h, positions, 64] for h in (heads, heads // 2, heads // 2)]  # q, k, v
    backward = {"gqa_attention._attention_fused_backward_kernel"}
    (att_backward,) = shard_maps_running(kernels, backward)
    assert att_forward["collectives"] == {"ppermute": 2 * (n - 1)}
    assert att_backward["collectives"] == {"ppermute": 4 * (n - 1)}
    for sm in (att_forward, att_backward):
        for kernel, calls in sm["kernel_shapes"].items():
            for call in calls:
                assert call[:3] == want, (kernel, call)


def shard_maps_running(calls: dict, kernels: set) -> list:
    """The shard_maps that run exactly `kernels`."""
    return [sm for sm in calls["shard_maps"] if set(sm["kernels"]) == kernels]


def devices(mesh: dict, axis) -> int:
    """The devices along a spec's entry: None, an axis, or a list of axes."""
    axes = [] if axis is None else [axis] if isinstance(axis, str) else axis
    return int(np.prod([mesh[a] for a in axes]))
