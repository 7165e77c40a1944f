"""The machinery of the tests that run kernels on 8 host CPU devices (tests/test_sharded.py,
tests/test_sharded_gpu.py, tests/test_sharded_sweep.py, tests/test_sharded_typed.py): a test
module registers its tests' jobs at import (`MeshJobs.add`: a spec, sizes, cases), its
fixture `mesh_results` runs them in one `tests/mesh_runner.py` process (jax's start on 8
devices and its compiles are the cost), and `assert_case` compares a case's values and
gradients with the kernel unsplit and `reference`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
from conftest import ROOT, build

from sparsegen.callconv import convention
from sparsegen.names import ModuleNames
from sparsegen.testing import example_args, resolve_sizes, tolerance

MESH = dict(mesh=[2, 4], names=["data", "model"])


def differentiable(kernel, mod) -> list[int]:
    """The positional arguments a job differentiates: floating data whose gradient the
    module derives (not those its `_REFUSED` names: a paged walk's, issue 19)."""
    conv = convention(kernel, ModuleNames(kernel))
    refused = {n for n, _, _ in mod._REFUSED}
    return [n for n, p in enumerate(conv.params) if p.kind in ("dense", "blocks") and n not in refused
            and kernel.operand(p.operand).dtype.is_float and kernel.operand(p.operand).sparsity != "mask"]


def prepare(folder, text: str, sizes: dict, cases: list[dict], pattern="random", seed=0, target="v5e", write=True):
    """Build `text` for `target`, draw its arguments (`pattern`: example_args's, or the
    arguments), write a job for mesh_runner.py in `folder` (`write`: False where it is
    written already)."""
    kernel, mod = build(text, target, formatted=target.startswith("h"))  # a GPU module only formatted
    if not write:
        return kernel, resolve_sizes(kernel, sizes), folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    if isinstance(pattern, str):
        args, keywords = example_args(kernel, sizes, pattern, rng)
    else:  # the arguments: the sizes only they and the outputs carry as keywords
        env = resolve_sizes(kernel, sizes)
        args, keywords = pattern, {s.symbol: env[s.symbol] for s in convention(kernel, ModuleNames(kernel)).sizes if s.keyword_only}
    ref = mod.reference(*args, **keywords)
    outs = ref if isinstance(ref, tuple) else (ref,)
    weights = [rng.standard_normal(o.shape).astype(np.float32) for o in outs]
    dtypes = [str(np.asarray(a).dtype) for a in args]
    saved = {f"arg{n}": np.asarray(a, np.float32) if d == "bfloat16" else np.asarray(a) for n, (a, d) in enumerate(zip(args, dtypes))}
    saved.update({f"weight{n}": w for n, w in enumerate(weights)})
    np.savez(folder / "args.npz", **saved)
    job = {"module": mod.__file__, "kernel": kernel.name, "args": str(folder / "args.npz"), "n_args": len(args),
           "dtypes": dtypes, "n_outputs": len(outs), "keywords": keywords, "diff": differentiable(kernel, mod), "cases": cases,
           "result": str(folder / "result.npz")}
    (folder / "job.json").write_text(json.dumps(job))
    return kernel, resolve_sizes(kernel, sizes), folder


class MeshJobs:
    """A test module's jobs, by test (`add`: `prepare`'s arguments after the folder), run in
    one mesh_runner.py process of their own (`run`), which starts jax on 8 devices once. One
    process per module rather than one for the session: each is a part of the suite that a
    test worker takes alone, and none is long enough to hold the other worker's end."""

    def __init__(self, name: str):
        self.name = name
        self.jobs: dict[str, tuple] = {}

    def add(self, test: str, *jobs):
        self.jobs[test] = jobs

    def run(self, tmp_path_factory, worker_id):
        """Per test, per job: (kernel, env, results), for the module's `mesh_results`
        fixture (module scope). Test workers that both run some of the module's tests
        share one run (the first to take the lock makes it; the results lie in the
        session's shared temporary folder)."""
        import fcntl

        shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
        folder = shared / f"mesh_jobs_{self.name}"
        with open(shared / f"mesh_jobs_{self.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            done = (folder / "done").exists()
            prepared = {test: [prepare(folder / f"{test}{n}", *job, write=not done) for n, job in enumerate(jobs)]
                        for test, jobs in self.jobs.items()}
            if not done:
                paths = [str(f / "job.json") for jobs in prepared.values() for _, _, f in jobs]
                result = subprocess.run([sys.executable, str(ROOT / "tests" / "mesh_runner.py"), *paths], capture_output=True,
                                        text=True, timeout=1800)
                assert result.returncode == 0, result.stderr[-4000:]
                (folder / "done").write_text("")
        return {test: [(kernel, env, dict(np.load(f / "result.npz"))) for kernel, env, f in jobs] for test, jobs in prepared.items()}


def run_on_mesh(mesh_results, test: str):
    out = mesh_results[test]
    return out[0] if len(out) == 1 else out


def assert_case(kernel, env, res, c: int, specs=None, parts=1):
    """Case `c`'s outputs and gradients equal the kernel's unsplit (to rounding) and
    `reference`'s (within the kernel's tolerance). `parts`: the partial sums psum adds, each
    rounded to the output's dtype first (up to half a unit in the last place of a partial
    sum, which can be larger than the total)."""
    tag = f"case{c}_"
    assert "job_error" not in res, str(res["job_error"])
    assert f"{tag}error" not in res, str(res[f"{tag}error"])
    bf16 = any(op.dtype.name == "bf16" for op in kernel.operands)
    close = (2.0**-8 if bf16 else 1e-6) * (1 if parts == 1 else 4 * parts)
    for n, op in enumerate(kernel.outputs):
        got, unsplit, ref = (res[f"{t}out{n}"].astype(np.float64) for t in (tag, "kernel_", "reference_"))
        scale = max(1.0, float(np.sqrt(np.mean(ref**2))))
        np.testing.assert_allclose(got, unsplit, rtol=close, atol=close * scale, err_msg=f"case {c}: {op.name} against the kernel")
        rtol, atol = tolerance(kernel, op.name, env)
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=(atol + close) * scale, err_msg=f"case {c}: {op.name} against reference")
        if specs is not None:
            assert str(res[f"{tag}spec{n}"]) == specs[n], (op.name, str(res[f"{tag}spec{n}"]))
    grads = [k for k in res if k.startswith(f"{tag}grad")]
    for key in grads:
        n = key[len(f"{tag}grad"):]
        got, unsplit, ref = (res[f"{t}grad{n}"].astype(np.float64) for t in (tag, "kernel_", "reference_"))
        scale = max(1.0, float(np.sqrt(np.mean(ref**2))))
        np.testing.assert_allclose(got, unsplit, rtol=4 * close, atol=4 * close * scale, err_msg=f"case {c}: gradient {n} against the kernel")
        tol = max(tolerance(kernel, op.name, env)[1] for op in kernel.outputs) + (4 * 2.0**-8 if bf16 else 1e-5)
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * scale, err_msg=f"case {c}: gradient {n} against reference")
    return len(grads)


def one_device_mesh():
    return jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
