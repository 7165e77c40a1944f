"""The pipeline simulator on a 32768 x 32768 pattern with 256 stored blocks.

    .venv/bin/python bench/bench_simulator.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparsegen.compiler import plans  # noqa: E402
from sparsegen.backends import analyse_module as analyse  # noqa: E402
from sparsegen.tpu.simulate import load_module  # noqa: E402


def main() -> int:
    (plan,) = plans(Path(__file__).resolve().parents[1] / "specs" / "dsd_matmul.spk")
    module = load_module(plan)
    sizes = dict(M=32768, K=32768, N=4096)
    with tempfile.TemporaryDirectory() as tmp:
        # Exactly 256 stored blocks of the 64 x 64 grid of 512 x 512 blocks.
        blocks = np.zeros(64 * 64, bool)
        blocks[np.random.default_rng(0).choice(blocks.size, 256, replace=False)] = True
        pattern = str(Path(tmp) / "pattern.npy")
        np.save(pattern, blocks.reshape(64, 64))
        analyse(plan, sizes, pattern, module=module)  # warm up imports
        times = []
        for _ in range(5):
            start = time.perf_counter()
            report = analyse(plan, sizes, pattern, module=module, targets=("v5e", "v6e"))
            times.append(time.perf_counter() - start)
    sim = report.sim
    print(f"dsd_matmul, x 32768 x 32768 with 256 stored blocks: {sum(t.copies for t in sim.traffic.values())} copies over {sim.steps} grid steps, "
          f"{report.sim.block_products} block products: best {min(times) * 1e3:.1f} ms, median {sorted(times)[2] * 1e3:.1f} ms "
          f"(simulation and its dense twin)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
