"""Generating 100 variants with --no-compile (goal: under 10 s on two cores).

    .venv/bin/python bench/bench_variants.py

Runs `sparsegen variants` as a user would (a fresh process, start-up included): 4 x 5 x 5
tilings of dsd_matmul, modelled on a 10% pattern, every surviving module written.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    with tempfile.TemporaryDirectory() as out:
        argv = [
            sys.executable, "-m", "sparsegen", "variants", str(ROOT / "specs" / "dsd_matmul.spk"),
            "--tile", "m=128,256,512,1024", "--tile", "n=128,256,512,1024,2048", "--tile", "k=128,256,512,1024,2048",
            "--shape", "M=16384,N=8192,K=16384", "--pattern", "density=0.1", "--no-compile", "-o", out,
        ]  # fmt: skip
        start = time.perf_counter()
        result = subprocess.run(argv, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
        written = len(list(Path(out).glob("*.py")))
    dropped = result.stderr.count("dropped ")
    print(f"100 variants: {written} written, {dropped} dropped, {elapsed:.2f} s (goal: < 10 s), exit {result.returncode}")
    return 0 if result.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
