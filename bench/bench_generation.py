"""Generation speed (issue 42), on two cores: `sparsegen build` of each spec (the examples, the
mixture-of-experts example's, the version-3 specs, long specs), 100 variants with
`--no-compile` of every example under 10 s each (ranking and all), 2,000 small matmul kernels
in one build under 15 s, a chain of 2,000 elementwise statements in one kernel under 5 s.

    .venv/bin/python bench/bench_generation.py [--repeats N] [--baseline DIR] [--json FILE] [CASE|GROUP ...]
    .venv/bin/python bench/bench_generation.py --list

GROUPs: `specs` (one build per spec file, the default), `long`, `variants`, `all`. With
`--baseline DIR` (another sparsegen checkout, e.g. a `git archive` of main) every case also
runs under DIR's sparsegen, alternating with this one's, and the table shows both. Each case
runs as a first build (an empty cache folder) and as a rebuild (black's results kept from the
first: `sparsegen.formatting`). Results
go to bench/results/generation.json unless `--json` says otherwise.

Each case runs the command a user would (`python -m sparsegen ...`) in a fresh process:
`wall` is its time from start to exit, start-up and imports included, the figure the goal
is about. That process first times a fixed reference workload (pure Python parsing and
compiling a fixed text, and a numpy sort: the same work in every run and every commit),
then the command in-process; `ratio` is the command's time over the reference's, taken in
the same process, so that a loaded machine (this one is shared) slows both: compare ratios
between runs and commits, seconds against the goals. `cpu` is the command's CPU seconds,
with those of the worker processes a build of many kernels forks (`sparsegen build -j`):
less sensitive to other load than wall seconds, and on two idle cores the wall time of a
build with workers is about its parent's CPU seconds plus half its workers'. Each case
runs N times (default 3); medians are printed, with the load average before and after.
The paged kernels have no walk model yet: their `variants` drop all 100 after checking
and lowering them ("none ranked"), timed all the same.

Before/after: `git archive BASE | tar -x -C /tmp/base` and `--baseline /tmp/base` runs each
case under the base's sparsegen too, alternating, and prints `ratio this/base` (of the
ratios to the reference workload, measured in each case's own process).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
sys.path.insert(0, str(ROOT / "bench"))

from bench_long_specs import chain  # noqa: E402  (a score through N chained elementwise locals)

MNK = ["--tile", "m=128,256,512,1024,2048", "--tile", "n=128,256,512,1024,2048", "--tile", "k=128,256,512,1024"]  # 100: the issue's
ROW = ["--tile", "i=64,128,256,512,1024", "--tile", "j=64,128,256,512,1024"]  # 25, times a lead index's 4 below
LEAD = ["1,2,4,8"]  # tile choices of a lead index (b or h; the row walk takes 1 only: the others are dropped)
TEN = "8,16,32,64,128,256,512,1024,2048,4096"
PAGED = ["--tile", "j=128,256,512,1024,2048", "--tile", "b=1,2,4,8"]  # 20, times h's 5 below

# 100 tile combinations of each example kernel (spec, then `variants` arguments).
VARIANTS: dict[str, list[str]] = {
    "dsd_matmul": ["dsd_matmul.spk", *MNK],
    "dds_matmul": ["dds_matmul.spk", *MNK],
    "sdd_matmul": ["sdd_matmul.spk", *MNK],
    "tril_matmul": ["tril_matmul.spk", *MNK],
    "masked_matmul": ["masked_matmul.spk", *MNK],
    "masked_matmul_dx": ["masked_backward.spk", "--kernel", "masked_matmul_dx", *MNK],
    "masked_matmul_dy": ["masked_backward.spk", "--kernel", "masked_matmul_dy", *MNK],
    "batched_dsd": ["batched_dsd.spk", *MNK],
    "grouped_matmul": ["grouped_matmul.spk", *MNK],
    "block_slice": ["block_slice.spk", "--tile", "i=8,16,24,32,40,48,56,64,96,128", "--tile", "j=8,16,24,32,40,48,56,64,96,128"],
    "causal_attention": ["causal_attention.spk", *ROW, "--tile", f"b={LEAD[0]}", "--shape", "B=4,H=8"],
    "document_attention": ["document_attention.spk", *ROW, "--tile", f"b={LEAD[0]}", "--shape", "B=4,H=8"],
    "local_gqa_attention": ["local_gqa_attention.spk", *ROW, "--tile", f"b={LEAD[0]}", "--shape", "B=4,H=8,G=2"],
    "masked_attention": ["masked_attention.spk", *ROW, "--tile", f"h={LEAD[0]}", "--shape", "H=8"],
    "masked_softmax": ["masked_softmax.spk", "--tile", f"i={TEN}", "--tile", f"j={TEN}", "--shape", "S=4096,T=4096"],
    **{name: [f"{name}.spk", *PAGED, "--tile", "h=1,2,4,8,16"] for name in (
        "paged_decode", "paged_mqa_decode", "paged_softcap_decode", "paged_window_decode", "paged_speculative_decode",
        "paged_gqa_speculative_decode")},
}

# The paged kernels' walk has no model yet (backends.TABLE: no `analyse`): `variants` drops
# every variant, saying so, after checking and lowering all 100 (timed all the same).
UNMODELLED = {name for name in VARIANTS if name.startswith("paged")}

EXAMPLE_SPECS = sorted(SPECS.glob("*.spk")) + sorted((ROOT / "examples" / "moe_transformer" / "specs").glob("*.spk"))
# The version-3 language's specs (spk-language-v3.md), where the shared folder has them: most
# use what the compiler refuses yet; a refusal is timed too (the checks are most of a build).
V3_SPECS = sorted(Path("/work/shared/specs-v3").glob("*.spk"))

CASES = {f"spec:{p.relative_to(ROOT)}": "specs" for p in EXAMPLE_SPECS} | {f"spec:v3/{p.name}": "specs" for p in V3_SPECS} | {
    "long:chain-1000": "long",  # bench_long_specs.py's shapes, at 1,000 lines
    "long:many-1000": "long",
} | {f"variants:{name}": "variants" for name in VARIANTS} | {
    "variants-written:dsd_matmul": "variants",  # bench_variants.py's: every survivor formatted and written
    "build:2000-kernels": "long",
    "build:2000-statement-chain": "long",
}
GOALS = {"variants": 10.0, "build:2000-kernels": 15.0, "build:2000-statement-chain": 5.0}


def matmuls(n: int) -> str:
    """One spec of `n` small matmul kernels."""
    out = []
    for m in range(n):
        out += [f"kernel mm{m} {{", "    in  x: f32[M, K]", "    in  y: f32[K, N]", "    out o: f32[M, N]", "",
                "    o[m, n] = x[m, k] * y[k, n]", "", "    tile m = 128, n = 128, k = 128", "}", ""]
    return "\n".join(out)


def argv_of(case: str, tmp: Path) -> list[str]:
    """The `sparsegen` arguments of a case (its spec written under `tmp` where it is generated)."""
    kind, _, name = case.partition(":")
    if kind == "spec":
        path = Path("/work/shared/specs-v3") / name[3:] if name.startswith("v3/") else ROOT / name
        return ["build", str(path), "-o", str(tmp / "out"), "-q"]
    if kind == "long":
        from bench_long_specs import many

        shape, _, lines = name.partition("-")
        path = tmp / "long.spk"
        path.write_text((chain if shape == "chain" else many)(int(lines)))
        return ["build", str(path), "-o", str(tmp / "out"), "-q"]
    if kind == "variants":
        spec, *rest = VARIANTS[name]
        return ["variants", str(SPECS / spec), *rest, "--no-compile"]
    if kind == "variants-written":
        spec, *rest = VARIANTS[name]
        return ["variants", str(SPECS / spec), *rest, "--no-compile", "-o", str(tmp / "out")]
    path = tmp / f"{name}.spk"
    path.write_text(matmuls(2000) if name == "2000-kernels" else chain(2000))  # bench_long_specs.py's chain
    return ["build", str(path), "-o", str(tmp / "out"), "-q"]


# ------------------------------------------------------------------ the reference workload


def reference() -> float:
    """Seconds of a fixed workload like generation's (Python parsing and compiling text, a
    numpy sort): the same work in every run of every commit."""
    import ast

    import numpy as np

    text = "\n".join(f"def f{n}(a, b=({n}, 'x')):\n    return [a[i] * b[0] + {n} for i in range(len(a)) if i % 3]\n" for n in range(400))
    data = np.random.default_rng(0).integers(0, 1 << 30, 2_000_000)
    start = time.perf_counter()
    for _ in range(3):
        compile(ast.parse(text), "<reference>", "exec")
    np.sort(data)
    return time.perf_counter() - start


def child(argv: list[str]) -> None:
    """In the case's own process: the reference, then the command as the `sparsegen` program
    runs it (`main()` reading sys.argv); their seconds as JSON, CPU seconds with those of the
    worker processes a build forks."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    ref = reference()
    import contextlib
    import io
    import resource

    def cpu_now() -> float:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))

    start, cpu = time.perf_counter(), cpu_now()
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        from sparsegen.cli import main

        sys.argv = ["sparsegen", *argv]
        code = main()
    seconds, cpu = time.perf_counter() - start, cpu_now() - cpu
    said = err.getvalue()
    print(json.dumps({"reference": ref, "command": seconds, "cpu": cpu, "exit": code, "stderr": said[-2000:],
                      "unmodelled": "cannot model it on" in said and "no pattern analysis" in said}))


def run_case(case: str, root: Path, cache: Path) -> dict:
    """One run of a case, with `root`'s sparsegen (this checkout's, or a baseline's) and
    `cache` as its cache folder (empty: a first build; kept from a run before: a rebuild)."""
    with tempfile.TemporaryDirectory(prefix="sparsegen-bench-") as tmp:
        argv = argv_of(case, Path(tmp))
        start = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(argv)], cwd=root, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(root), "SPARSEGEN_CACHE_DIR": str(cache)})
        wall = time.perf_counter() - start
    if done.returncode != 0 or not done.stdout.strip():
        raise SystemExit(f"{case}: the command failed:\n{done.stderr[-2000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    unranked = case.partition(":")[2] in UNMODELLED and found["unmodelled"]
    if found["exit"] and not case.startswith("spec:v3/") and not unranked:  # a v3 spec may be refused; an example must build
        raise SystemExit(f"{case}: exit status {found['exit']}:\n{found['stderr'][-2000:]}")
    found["stderr"] = found["stderr"][-300:]
    return {"wall": wall, **found}


def medians(runs: list[dict]) -> dict:
    out = {key: statistics.median(r[key] for r in runs) for key in ("wall", "command", "cpu", "reference")}
    out["ratio"] = statistics.median(r["command"] / r["reference"] for r in runs)
    return out


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", metavar="CASE", help="cases or groups to run (default: specs; --list names them)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", metavar="DIR", help="another sparsegen checkout, run alternately for a before/after table")
    parser.add_argument("--json", metavar="FILE", default=str(ROOT / "bench" / "results" / "generation.json"),
                        help="write every run's figures here (default: %(default)s)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    if args.list:
        print("\n".join(f"{case:44} ({group})" for case, group in CASES.items()))
        return 0
    groups = set(CASES.values()) | {"all"}
    unknown = [c for c in args.cases if c not in CASES and c not in groups]
    if unknown:
        parser.error(f"unknown case {', '.join(unknown)} (--list names them; groups: {', '.join(sorted(groups))})")
    wanted = args.cases or ["specs"]
    cases = [c for c, g in CASES.items() if c in wanted or g in wanted or "all" in wanted]
    # "this": a first build (an empty cache folder); "rebuild": the same again, its cache
    # kept (what a user exploring a spec, `make run` or `sparsegen check` mostly meets).
    roots = {"this": ROOT, "rebuild": ROOT} | ({"baseline": Path(args.baseline).resolve()} if args.baseline else {})
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    columns = [f"{'case':44}", f"{'goal s':>6}"]
    for label in roots:
        columns += [f"{label + ' wall':>13}", f"{'cpu s':>7}", f"{'ratio':>6}"]
    if args.baseline:
        columns.append(f"{'ratio this/base':>15}")
    print(" ".join(columns))
    results: dict[str, dict] = {}
    totals = {label: {"wall": 0.0, "cpu": 0.0} for label in roots}
    for case in cases:
        runs: dict[str, list] = {label: [] for label in roots}
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="sparsegen-bench-cache-") as cache:
                for label, root in roots.items():  # alternated: a load that comes and goes hits both
                    runs[label].append(run_case(case, root, Path(cache) / ("baseline" if label == "baseline" else "this")))
        med = {label: medians(r) for label, r in runs.items()}
        results[case] = {"runs": runs, "medians": med}
        goal = GOALS.get(case, GOALS.get(case.partition(":")[0].split("-")[0]))
        row = [f"{case:44}", f"{goal:6.0f}" if goal else f"{'':6}"]
        for label in roots:
            m = med[label]
            totals[label]["wall"] += m["wall"]
            totals[label]["cpu"] += m["cpu"]
            row += [f"{m['wall']:13.2f}", f"{m['cpu']:7.2f}", f"{m['ratio']:6.1f}"]
        if args.baseline:
            row.append(f"{med['this']['ratio'] / med['baseline']['ratio']:15.2f}")
        flag = "  over" if goal and med["this"]["wall"] >= goal else ""
        refused = ("  none ranked (no model)" if case.partition(":")[2] in UNMODELLED else "  refused") if runs["this"][0]["exit"] else ""
        print(" ".join(row) + flag + refused, flush=True)
        save(args.json, roots, totals, results)  # after each case: a long run stopped early keeps what it measured
    row = [f"{'total (medians)':44}", f"{'':6}"]
    for label in roots:
        row += [f"{totals[label]['wall']:13.2f}", f"{totals[label]['cpu']:7.2f}", f"{'':6}"]
    if args.baseline:
        row.append(f"{totals['this']['cpu'] / totals['baseline']['cpu']:15.2f}")
    print(" ".join(row))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    save(args.json, roots, totals, results)
    return 0


def save(path: str, roots: dict, totals: dict, results: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"load": os.getloadavg(), "cpus": os.cpu_count(), "roots": {k: str(v) for k, v in roots.items()},
                                      "totals": totals, "cases": results}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
