"""`make run` (scripts/run_examples.py) for one attention kernel: its TPU simulator row, an
ahead-of-time compile, and its GPU row (interpreter, lowering). `make run` broke once
unnoticed when GPU attention landed (its GPU table read einsum passes from a row walk);
the full run stays `make run`'s, this keeps its code paths alive in the suite. The GPU
row's ptxas compile is left out (SPARSEGEN_GPU_PYTHON names no Python: the row says
"skipped"): tests/test_gpu_attention.py compiles causal_attention through ptxas."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT


def test_run_examples_runs_a_kernel_through_both_tables():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_examples.py"), "--targets", "v5e", "causal_attention"],
                            capture_output=True, text=True, timeout=900, cwd=ROOT,
                            env={**os.environ, "SPARSEGEN_GPU_PYTHON": str(ROOT / "no-gpu-python")})
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    tpu, gpu = out.split("the same specs built for h200")
    # TPU: a row per pattern (random, all empty), each ok, and its v5e compile; nothing else ran.
    assert tpu.count("causal_attention") == 2 and tpu.count("ok") == 3 and "MISMATCH" not in tpu, tpu
    assert "dsd_matmul" not in out
    assert "causal_attention" in gpu and "ok" in gpu, gpu


def test_run_examples_refuses_an_unknown_kernel():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_examples.py"), "no_such_kernel"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode != 0 and "no example kernel no_such_kernel" in result.stderr
