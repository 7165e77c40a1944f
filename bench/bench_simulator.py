"""The pipeline simulator on a 32768 x 32768 pattern with 256 stored blocks.

    .venv/bin/python bench/bench_simulator.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparsegen.compiler import plans  # noqa: E402
from sparsegen.simulate import analyse, load_module  # noqa: E402


def main() -> int:
    (plan,) = plans(Path(__file__).resolve().parents[1] / "specs" / "dsd_matmul.spk")
    module = load_module(plan)
    sizes = dict(M=32768, K=32768, N=4096)
    pattern = f"density={256 / (64 * 64)}"  # 256 of the 64 x 64 blocks of 512 x 512
    analyse(plan, sizes, pattern, module=module)  # warm up imports
    times = []
    for seed in range(5):
        start = time.perf_counter()
        report = analyse(plan, sizes, pattern, module=module, seed=seed, targets=("v5e", "v6e"))
        times.append(time.perf_counter() - start)
    sim = report.sim
    print(f"dsd_matmul 32768 x 32768 (x), {sum(t.copies for t in sim.traffic.values())} copies over {sim.steps} grid steps, "
          f"{report.sim.block_products} block products: best {min(times) * 1e3:.1f} ms, median {sorted(times)[2] * 1e3:.1f} ms "
          f"(simulation and its dense twin)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
