"""`sparsegen verify --cycles` and `variants --rank cycles`, the pipeline's part: libtpu's
static cycle estimate of each kernel's passes (what it is and how it is made: `tpu/cycles.py`).

Like libtpu's flags, the profile flag must be set before libtpu loads, so the compiles run
in a helper process, one for all kernels: `measure` (the parent) starts it as
`python -m sparsegen.cycles REQUEST.json` with the flag set, and `main` (the helper) takes
each job's spec through the compiler (checked, lowered for the job's target, emitted and
loaded) and hands the module to `tpu.cycles.estimate_job`, which prints one line per pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from .backends import emit_module
from .compiler import lower_source
from .shapes import _load
from .source import SourceFile
from .tpu.cycles import FLAG, CyclesUnavailable, KernelCycles, NoProfile, PassCycles, Region, _first_line, estimate_job

# ------------------------------------------------------------------ the parent side


def measure(jobs: list[dict], timeout: float = 3600) -> list[KernelCycles]:
    """Run the helper process on `jobs` ({"spec", "kernel", "target", "shapes", "pattern", "seed"}
    each; "backward": False leaves the backward out; "text": the spec's text, where "spec"
    only names it). libtpu's profiler aborts the process on some kernels ("No DMA issue node found for
    sync flag"): that pass is reported as not estimated, and a new process goes on after it.
    NoProfile if this libtpu writes no estimate at all."""
    from .jaxenv import quiet_libtpu

    quiet_libtpu()
    results = [KernelCycles(j["kernel"], j["target"], j["pattern"]) for j in jobs]
    done: set[tuple] = set()
    for _ in range(64):  # one restart per aborted pass
        with tempfile.TemporaryDirectory(prefix="sparsegen-cycles-") as tmp:
            request = os.path.join(tmp, "request.json")
            with open(request, "w") as f:
                json.dump({"jobs": jobs, "skip": sorted(done)}, f)
            env = {**os.environ, "LIBTPU_INIT_ARGS": f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {FLAG}={tmp}/profile".strip()}
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
            proc = subprocess.run([sys.executable, "-m", "sparsegen.cycles", request], capture_output=True, text=True, env=env, timeout=timeout)
        started = None
        for line in proc.stdout.splitlines():
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if "no_profile" in msg:
                raise NoProfile(msg["no_profile"])
            key = (msg["job"], msg["side"], msg["index"])
            if "starting" in msg:
                started = key, msg["starting"]
                continue
            done.add(key)
            started = None
            r = results[msg["job"]]
            if "error" in msg:
                r.error = msg["error"]
            else:
                getattr(r, msg["side"]).append(_pass_from_json(msg["pass"]))
        if proc.returncode == 0:
            break
        if started is None:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
            raise CyclesUnavailable(f"the cycle-estimate process stopped (exit {proc.returncode}): {tail}")
        key, name = started
        why = next((line.split("] ", 1)[-1] for line in proc.stderr.splitlines() if line.startswith("F") and "] " in line), f"exit {proc.returncode}")
        aborted = PassCycles(name, (), 0, None, None, note=f"not estimated: libtpu's static profiler aborted: {why}", order=key[2])
        getattr(results[key[0]], key[1]).append(aborted)
        done.add(key)
    for r in results:
        r.forward.sort(key=lambda p: p.order)
        r.backward.sort(key=lambda p: p.order)
    return results


def _pass_from_json(d: dict) -> PassCycles:
    regions = [Region(**r) for r in d.pop("regions")]
    return PassCycles(**{**d, "grid": tuple(d["grid"])}, regions=regions)


def for_verify(report, shapes: dict[str, int], pattern: str, seed: int = 0) -> dict[tuple[str, str, str], KernelCycles]:
    """The estimate of every kernel `verify` compiled: {(spec, kernel, target): KernelCycles}."""
    jobs, keys = [], []
    for spec, _, results in report:
        for r in results:
            if r.compiled:
                jobs.append({"spec": spec, "kernel": r.kernel, "target": r.target, "shapes": shapes, "pattern": pattern, "seed": seed})
                keys.append((spec, r.kernel, r.target))
    return dict(zip(keys, measure(jobs))) if jobs else {}


# ------------------------------------------------------------------ the helper process


def run_job(n: int, job: dict, skip: set[tuple], emit_line) -> None:
    """One job: its kernel through the compiler for its target, emitted and loaded, then
    every pass estimated (`tpu.cycles.estimate_job`, a line before each and one after)."""
    try:
        # A variant's spec exists only as text (`variants --rank cycles`).
        source = SourceFile(job["spec"], job["text"]) if "text" in job else SourceFile.read(job["spec"])
        plan = next(p for p in lower_source(source, job["target"]) if p.name == job["kernel"])
        module = _load(emit_module(plan, source.name), f"cycles_{plan.name}")
    except Exception as exc:  # reported per kernel; the others still run
        emit_line({"job": n, "side": "forward", "index": -1, "error": _first_line(exc)})
        return
    estimate_job(n, job, plan, module, skip, emit_line)


def main(path: str) -> None:
    if FLAG not in os.environ.get("LIBTPU_INIT_ARGS", ""):
        sys.exit(f"sparsegen.cycles: LIBTPU_INIT_ARGS must carry {FLAG}=DIR before libtpu loads")
    with open(path) as f:
        request = json.load(f)
    skip = {tuple(key) for key in request["skip"]}

    def emit_line(msg):
        print(json.dumps(msg), flush=True)

    try:
        for n, job in enumerate(request["jobs"]):
            run_job(n, job, skip, emit_line)
    except NoProfile as exc:
        emit_line({"no_profile": str(exc)})


if __name__ == "__main__":
    main(sys.argv[1])
