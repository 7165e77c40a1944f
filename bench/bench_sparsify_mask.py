"""sparsify_mask: ours vs the tutorial's vs one numpy pass over the mask (the floor).

    .venv/bin/python bench/bench_sparsify_mask.py [--quick]

Ratios are measured side by side in one run (best of several repeats; the tutorial once
or twice, it takes seconds). Scaling is checked up to a 32768x32768 mask (bool, 1 GiB).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from sparsegen.formats import sparsify_mask  # noqa: E402


def best(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def floor(mask, block):
    bm, bn = block
    return mask.reshape(mask.shape[0] // bm, bm, mask.shape[1] // bn, bn).any(axis=(1, 3))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="skip the tutorial and the largest masks")
    args = parser.parse_args()
    block = (256, 256)
    mask = np.tril(np.ones((4096, 4096), np.int32))
    # Interleave the contenders so that machine noise hits them alike.
    ours, base, tutorial = [], [], []
    if not args.quick:
        import jax.numpy as jnp

        from bench.tutorial_sparsify import tutorial_sparsify_mask

        device_mask = jnp.asarray(mask)
        tutorial_sparsify_mask(device_mask, block)  # warm up: jax compiles its little ops once
    for _ in range(3):
        ours.append(best(lambda: sparsify_mask(mask, block), 10))
        base.append(best(lambda: floor(mask, block), 10))
        if not args.quick:
            tutorial.append(best(lambda: tutorial_sparsify_mask(device_mask, block), 1))
    ours, base = min(ours), min(base)
    print("4096x4096 causal int32 mask, 256x256 blocks (best of interleaved repeats)")
    print(f"  floor (one numpy pass) {base * 1e3:8.2f} ms")
    print(f"  sparsegen              {ours * 1e3:8.2f} ms   {ours / base:5.2f}x the floor (goal: <= 2x)")
    if tutorial:
        tutorial = min(tutorial)
        print(f"  tutorial               {tutorial * 1e3:8.0f} ms   sparsegen is {tutorial / ours:6.0f}x faster (goal: >= 150x)")
    print("scaling (bool causal masks, 256x256 blocks): time per element should stay flat")
    sizes = (4096, 8192, 16384) if args.quick else (4096, 8192, 16384, 32768)
    for n in sizes:
        big = np.tril(np.ones((n, n), np.bool_))
        t = best(lambda: sparsify_mask(big, block), 3)  # noqa: B023 (called at once)
        f = best(lambda: floor(big, block), 3)  # noqa: B023
        print(f"  {n:6d}^2  {t * 1e3:9.1f} ms  {t / big.size * 1e9:6.3f} ns/element  {t / f:5.2f}x the floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
