"""libtpu's static cycle estimate of every einsum example, forward and backward, on v5e.

    .venv/bin/python bench/bench_einsum_cycles.py [--only dsd_matmul,tril_matmul] [--target v5e] [--json FILE]

With --only, the kernels measured replace theirs in an existing JSON file (the others are
kept as measured before, and the file says which run was partial).

Runs `sparsegen verify SPEC --cycles` (sparsegen.cycles.measure: one helper process, every
pass's `pl.when` regions weighted by the real tables of the stated pattern) on each einsum
example in specs/ at its production tiles (the spec's `tile` line, unchanged) and the shapes
below: big enough that the grid runs many steps per output block (the steady state the
MXU minimum is about), small enough that each profiled compile stays near a minute here
(compile time grows with the grid; a weighted pass compiles three times).

The attention-like examples (`*attention.spk`, `masked_softmax.spk`: the row walk) and the
paged decoders are measured elsewhere (bench/bench_attention.py, bench/bench_paged_decode.py).

Prints a markdown table (example, pass, grid steps, computing steps, cycles, x MXU minimum,
HBM cycles, memory-bound?, note) and writes bench/results/einsum_cycles_v5e.json. A pass is
memory-bound where the real walk's copies at the chip's HBM bandwidth (`hbm_cycles`) take
longer than the estimate: the estimate is then a lower bound, and the MXU ratio says little.
No timed assertion anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparsegen import cycles  # noqa: E402
from sparsegen.formats import group_ids  # noqa: E402

# Group sizes of the grouped matmul (E = 8, M = 8192): uneven and not multiples of the
# 512-row tile, so that partial steps (a row block shared by two groups) are on the walk.
GROUP_SIZES = [1664, 1000, 1400, 600, 1200, 900, 828, 600]

# (example, spec, kernel, shapes, pattern, what the pattern means). Sizes are symbolic
# dimensions of the spec; tiles are the spec's own.
CASES = [
    ("dsd_matmul", "dsd_matmul.spk", "dsd_matmul", {"M": 4096, "K": 4096, "N": 4096}, "density=0.25",
     "x stores 25% of its 512x512 blocks (random, seed 0)"),
    ("batched_dsd", "batched_dsd.spk", "batched_dsd", {"B": 4, "M": 2048, "K": 2048, "N": 2048}, "density=0.25",
     "x stores 25% of its 512x256 blocks per batch (random, seed 0)"),
    ("dds_matmul", "dds_matmul.spk", "dds_matmul", {"M": 4096, "K": 4096, "N": 4096}, "density=0.25",
     "y stores 25% of its 512x256 blocks (random, seed 0)"),
    ("sdd_matmul", "sdd_matmul.spk", "sdd_matmul", {"M": 2048, "K": 4096, "N": 2048}, "density=0.25",
     "o stores 25% of its 128x128 blocks (random, seed 0)"),
    ("masked_matmul", "masked_matmul.spk", "masked_matmul", {"M": 4096, "K": 4096, "N": 4096}, "tril",
     "causal mask (m >= n) on the 4096x4096 output"),
    ("masked_backward", "masked_backward.spk", "masked_matmul_dx", {"M": 4096, "K": 4096, "N": 4096}, "tril",
     "causal keep mask (m >= n)"),
    ("masked_backward", "masked_backward.spk", "masked_matmul_dy", {"M": 4096, "K": 4096, "N": 4096}, "tril",
     "causal keep mask (m >= n)"),
    ("tril_matmul", "tril_matmul.spk", "tril_matmul", {"M": 4096, "N": 4096}, "tril",
     "lower-triangular x (the spec's k <= m; the pattern is not read)"),
    ("grouped_matmul", "grouped_matmul.spk", "grouped_matmul", {"M": 8192, "K": 2048, "N": 2048, "E": 8}, "GROUPS",
     f"gid sorted, E = 8 groups of {'/'.join(map(str, GROUP_SIZES))} rows"),
    ("w8a8_matmul", "w8a8_matmul.spk", "w8a8_matmul", {"M": 4096, "K": 4096, "N": 4096}, "density=1",
     "dense int8 x int8, i32 sum, f32 scales per row and column after it"),
    ("block_slice", "block_slice.spk", "block_slice", {}, "density=1",
     "fixed 512x512 -> 128x128 i32 slice (no product)"),
]


def jobs_for(cases, target: str, tmp: Path) -> list[dict]:
    gid = tmp / "gid.npy"
    np.save(gid, np.asarray(group_ids(GROUP_SIZES, sum(GROUP_SIZES)), np.int32))
    out = []
    for example, spec, kernel, shapes, pattern, _ in cases:
        out.append({"spec": str(ROOT / "specs" / spec), "kernel": kernel, "target": target, "shapes": shapes,
                    "pattern": str(gid) if pattern == "GROUPS" else pattern, "seed": 0})
    return out


def note_for(p: dict) -> str:
    if p.get("note"):
        return p["note"]
    if p["estimated_cycles"] is None:
        return "not estimated"
    if not p["mxu_min_cycles"]:
        return "no MXU work (a copy)"
    if p["memory_bound"]:
        return f"memory-bound: HBM {p['hbm_cycles']:,} > the estimate (a lower bound here)"
    if p["hbm_cycles"] > p["mxu_min_cycles"]:
        return f"HBM {p['hbm_cycles'] / p['mxu_min_cycles']:.2f}x the MXU minimum: the copies bound it"
    return ""


def rows(results: list[dict]) -> list[dict]:
    out = []
    for r in results:
        if r["error"]:
            out.append({"example": r["example"], "kernel": r["kernel"], "pass": "-", "error": r["error"]})
            continue
        for side in ("forward", "backward"):
            for p in (r[side] or {}).get("passes", []):
                out.append({"example": r["example"], "kernel": r["kernel"], "side": side, "pass": p["kernel"],
                            "steps": p["steps"], "computing": p["computing_steps"], "cycles": p["estimated_cycles"],
                            "mxu_ratio": p["mxu_ratio"], "mxu_min": p["mxu_min_cycles"], "hbm_cycles": p["hbm_cycles"],
                            "memory_bound": p["memory_bound"], "note": note_for(p)})
    return out


def table(found: list[dict]) -> str:
    lines = ["| example | pass | grid steps | computing steps | cycles | x MXU minimum | HBM cycles | memory-bound? | note |",
             "|---|---|--:|--:|--:|--:|--:|---|---|"]
    for row in found:
        if "error" in row:
            lines.append(f"| {row['example']} | - | | | | | | | {row['error']} |")
            continue
        name = row["kernel"] if row["kernel"] != row["example"] else row["example"]
        fmt = lambda v: f"{v:,}" if isinstance(v, int) else "-"  # noqa: E731
        lines.append(f"| {name} | {'fwd' if row['side'] == 'forward' else 'bwd'} {row['pass']} | {row['steps']:,} | {row['computing']:,} | "
                     f"{fmt(row['cycles'])} | {row['mxu_ratio'] if row['mxu_ratio'] is not None else '-'} | {row['hbm_cycles']:,} | "
                     f"{'yes' if row['memory_bound'] else 'no'} | {row['note']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=None, help="comma-separated examples or kernels")
    parser.add_argument("--target", default="v5e")
    parser.add_argument("--json", metavar="FILE", default=None, help="default bench/results/einsum_cycles_TARGET.json")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    cases = [c for c in CASES if only is None or c[0] in only or c[2] in only]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-einsum-") as tmp:
        jobs = jobs_for(cases, args.target, Path(tmp))
        measured = cycles.measure(jobs)
    results = []
    for (example, spec, kernel, shapes, pattern, meaning), job, k in zip(cases, jobs, measured):
        j = k.to_json()
        results.append({"example": example, "spec": f"specs/{spec}", "kernel": kernel, "shapes": shapes,
                        "pattern": "gid file" if pattern == "GROUPS" else pattern, "pattern_meaning": meaning, **j})
    out = Path(args.json or ROOT / "bench" / "results" / f"einsum_cycles_{args.target}.json")
    seconds = {"seconds": round(time.perf_counter() - start, 1)}
    if only is not None and out.exists():
        # --only: the measured kernels replace theirs in the file; the others stay as measured before.
        before = json.loads(out.read_text())
        fresh = {(r["example"], r["kernel"]): r for r in results}
        results = [fresh.pop((r["example"], r["kernel"]), r) for r in before["kernels"]] + list(fresh.values())
        seconds = {"seconds": before.get("seconds"), "seconds_of_last_partial_run": seconds["seconds"],
                   "last_partial_run": sorted({r["kernel"] for r in fresh.values()} | {c[2] for c in cases})}
    found = rows(results)
    text = table(found)
    print(text)
    out.write_text(json.dumps({"target": args.target, **seconds,
                               "group_sizes": GROUP_SIZES, "kernels": results, "rows": found, "table": text}, indent=1) + "\n")
    print(f"\nwrote {out} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
