"""Where the cycles go: the final VLIW bundles of each attention kernel's forward pass, per
`pl.when` region, from libtpu's LLO dumps (no TPU needed). Used by bench/bench_attention.py
(`--bundles`); a helper process, since libtpu reads its dump flags when it loads:

    LIBTPU_INIT_ARGS="--xla_jf_dump_to=DIR --xla_jf_dump_llo_text=true
        --xla_jf_dump_llo_pass_label_regex=final_bundles|final_hlo-static-per-bundle-utilization"
    python bench/attention_bundles.py DIR REQUEST.json

For each kernel, libtpu writes `*-final_bundles.txt` (one line per bundle, its address first;
`PF:` marks the fallthrough bundle after a predicated region) and
`*-final_hlo-static-per-bundle-utilization.txt` (one row per bundle, in the same order: slot
uses of MXU, XLU, VALU, VPOP, EUP, VLOAD, VLOAD:FILL, VSTORE, VSTORE:SPILL, SALU). A region
is the bundles between a forward `sbr.rel` (the skip branch of a `pl.when`) and the next `PF:`
bundle; the regions come in source order, so the kernel's regions (`pl.when` bodies, counted
while tracing) are matched to the last that many forward branches (the pipeline's own
branches come first).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

COLUMNS = ("MXU", "XLU", "VALU", "VPOP", "EUP", "VLOAD", "VLOAD:FILL", "VSTORE", "VSTORE:SPILL", "SALU")
DUMP_FLAGS = ("--xla_jf_dump_llo_text=true",
              "--xla_jf_dump_llo_pass_label_regex=final_bundles|final_hlo-static-per-bundle-utilization")


def parse(bundles_text: str, utilization_text: str) -> dict:
    """Bundle count, slot-use totals and the predicated regions (start, end, totals) of one kernel."""
    rows = []
    started = False
    for line in utilization_text.splitlines():
        if line.startswith("== UTILIZATION"):
            started = True
            continue
        if started and re.fullmatch(r"[\d ]+", line.strip() or "x"):
            rows.append([int(x) for x in line.split()])
    addr = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+([A-Z]{2})?\s*:")
    branches, fallthroughs = [], []
    for line in bundles_text.splitlines():
        m = addr.match(line)
        if not m:
            continue
        a = int(m.group(1), 0)
        if m.group(2) == "PF":
            fallthroughs.append(a)
        if "sbr.rel" in line and "(!%" not in line:
            branches.append(a)

    def totals(lo, hi):
        return {c: sum(r[k] for r in rows[lo:hi]) for k, c in enumerate(COLUMNS)}

    regions = []
    for b in branches:
        end = next((f for f in fallthroughs if f > b), None)
        if end is not None:
            regions.append({"start": b + 1, "end": end, "bundles": end - b - 1, **totals(b + 1, end)})
    return {"bundles": len(rows), **totals(0, len(rows)), "regions": regions}


def analyse(dump: Path, name_part: str) -> dict:
    bundles = next(p for p in dump.iterdir() if name_part in p.name and p.name.endswith("-final_bundles.txt")
                   and "schedule-analysis" not in p.name)
    util = next(p for p in dump.iterdir() if name_part in p.name and p.name.endswith("final_hlo-static-per-bundle-utilization.txt"))
    return parse(bundles.read_text(), util.read_text())


def compile_forward(job: dict, dump: Path) -> dict:
    """Compile the job's forward pass (as recorded, flattened) and read its bundles; with
    `"pass": N`, the gradient's Nth backward kernel instead (sparsegen: 0 dq, 1 dk/dv)."""
    import jax
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.sharding import SingleDeviceSharding

    import attention_cycles as ac
    from sparsegen.tpu.cycles import _CompilePl, _globals
    from sparsegen.tpu.targets import TARGETS
    from sparsegen.tpu.verify import _device

    device = _device(TARGETS[job["chip"]].topology)
    H, S, D, kind = job["H"], job["S"], job["D"], job["kind"]
    if job["impl"] == "sparsegen":
        import bench_attention as b

        fn, args = getattr(b.module(kind), f"{kind}_bench"), ac.generated_arguments(kind, H, S, D)
    elif job["impl"] == "module":  # a scratch copy of a generated module
        fn, args = ac.module_fn(job["path"], kind), ac.generated_arguments(kind, H, S, D)
    else:
        fn = {"splash": ac.splash_fn, "tokamax": ac.tokamax_fn}[job["impl"]](kind, H, S, D, job["block"], job.get("variant"))
        args = ac.arguments(kind, H, S, D)
    forward, _, backward = ac.record(fn, args, "pass" in job)
    call = ac.flat_call(backward[job["pass"]] if "pass" in job else forward[0])
    sharding = SingleDeviceSharding(device)
    structs = [jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding) for a in call.args]
    kernel = call.kernel
    names = []
    real_when = pl.when

    def when(condition):  # the region names, in source order
        inner = real_when(condition)

        def region(body):
            names.append(body.__name__)
            return inner(body)

        return region

    counting = _CompilePl(pl, call.grid)
    counting.when = when

    def fresh(*a):
        return kernel(*a)

    before = set(dump.iterdir()) if dump.exists() else set()
    with _globals(kernel, pl=counting), jax.default_device(device):
        jax.jit(lambda *a: pl.pallas_call(fresh, **call.kwargs)(*a)).trace(*structs).lower().compile()
    new = [p for p in dump.iterdir() if p not in before and p.name.endswith("-final_bundles.txt")
           and "schedule-analysis" not in p.name and "TLP" not in p.name and "<late" not in p.name]
    stem = max(new, key=lambda p: p.stat().st_size).name[: -len("-02-final_bundles.txt")]
    out = analyse(dump, stem)
    # The kernel's regions are the last len(names) predicated regions.
    regions = out["regions"][-len(names):] if names else []
    for r, name in zip(regions, names):
        r["name"] = name
    out["kernel_regions"] = regions
    out["pipeline_regions"] = out["regions"][: len(out["regions"]) - len(regions)]
    del out["regions"]
    return out


def worker(dump: str, request: str) -> None:
    for job in json.loads(Path(request).read_text()):
        try:
            out = compile_forward(job, Path(dump))
        except Exception as exc:
            text = str(exc).strip()
            out = {"error": f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"}
        print(json.dumps({"job": job, "result": out}), flush=True)


def run(jobs: list[dict], python: str = sys.executable) -> list[dict]:
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="attention-bundles-") as tmp:
        req = Path(tmp) / "jobs.json"
        req.write_text(json.dumps(jobs))
        dump = Path(tmp) / "dump"
        dump.mkdir()
        env = {**os.environ, "LIBTPU_INIT_ARGS": " ".join((os.environ.get("LIBTPU_INIT_ARGS", ""), f"--xla_jf_dump_to={dump}", *DUMP_FLAGS)).strip()}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
        proc = subprocess.run([python, __file__, str(dump), str(req)], capture_output=True, text=True, env=env, timeout=3600)
    results = [json.loads(line)["result"] for line in proc.stdout.splitlines() if line.startswith("{")]
    if len(results) < len(jobs):
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        results += [{"error": f"helper stopped (exit {proc.returncode}): {tail[:300]}"}] * (len(jobs) - len(results))
    return results


if __name__ == "__main__":
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    worker(sys.argv[1], sys.argv[2])
