"""`sparsegen verify --target h100|h200`: prove GPU kernels without a GPU.

Stage 2 (here): lower under an abstract H200 (`AbstractDevice`, platform "cuda"): the whole
Pallas -> Mosaic GPU lowering runs (WGMMA shapes, layouts, the shared-memory budget). The
shared memory a kernel takes is measured there too: lowered again under Mosaic GPU's test
limit of 0 bytes, it says how many it needs.

Stage 3 (a subprocess): an XLA:GPU compile for a compile-only H200 through the jax-cuda13
plugin (Mosaic GPU -> PTX -> ptxas for sm_90a); ptxas reports registers and spills. The
plugin has an environment of its own (`make gpu-venv` makes `.venv-gpu`, or set
SPARSEGEN_GPU_PYTHON); without one, `sparsegen verify` stops before stage 2 and says how
to provide it (`--lower-only` asks for stage 2 alone). What stage 3 did not measure is
None (unknown), never a count.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..shapes import _load, concrete, differentiated
from ..source import Diagnostic, SourceFile
from .attention.lower import GpuWalkModule
from .plan import GpuModule
from .targets import GPU_TARGETS, target_config

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class GpuResult:
    kernel: str
    target: str
    lowered: bool
    shapes: dict[str, int]
    nb: int | None
    smem_estimate: int
    smem_limit: int
    smem_used: int | None = None
    compiled: bool | None = None  # stage 3; None: not run
    registers: list[int] | None = None  # per kernel, from ptxas; None: unknown (stage 3 not run, or ptxas said nothing)
    spill_bytes: int | None = None  # None: unknown
    lower_seconds: float = 0.0
    compile_seconds: float = 0.0
    stage3: str = ""  # why stage 3 did not run, or its error
    backward: str | None = None  # "lowers", "fails: ...", or why jax.grad cannot go through the kernel
    backward_smem_estimate: list[int] | None = None  # per backward kernel of an attention-like kernel (dq, dk/dv)
    backward_smem_used: list[int] | None = None  # the same, measured (None: not lowered)
    kernels: list[dict] | None = None  # stage 3, per kernel compiled: name, registers, spill_bytes (an attention-like kernel's backward too)
    error: Diagnostic | None = None
    raw_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.lowered and self.compiled is not False

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "target": self.target, "lowered": self.lowered, "compiled": self.compiled, "shapes": self.shapes,
                "nb": self.nb, "smem_estimate_bytes": self.smem_estimate, "smem_used_bytes": self.smem_used, "smem_limit_bytes": self.smem_limit,
                "registers": self.registers, "spill_bytes": self.spill_bytes, "lower_seconds": self.lower_seconds,
                "compile_seconds": self.compile_seconds, "stage3": self.stage3, "backward": self.backward,
                "backward_smem_estimate_bytes": self.backward_smem_estimate, "backward_smem_used_bytes": self.backward_smem_used,
                "kernels": self.kernels, "error": self.error.message if self.error else None}


# How to provide stage 3's environment: said by every message that finds none (and by --help).
PLUGIN_HOWTO = ("run `make gpu-venv` in a sparsegen checkout (it makes .venv-gpu), or set SPARSEGEN_GPU_PYTHON to a Python "
                "with jax, jax-cuda13-plugin and nvidia-cuda-nvcc (ptxas); --lower-only skips stage 3")


def gpu_python() -> tuple[str | None, str]:
    """The Python that has the jax-cuda13 plugin, or None and why not. SPARSEGEN_GPU_PYTHON,
    where set, is the only candidate (a wrong one is reported, not passed over)."""
    chosen = os.environ.get("SPARSEGEN_GPU_PYTHON")
    python = chosen or str(ROOT / ".venv-gpu" / "bin" / "python")
    if not os.path.exists(python):
        where = f"SPARSEGEN_GPU_PYTHON={chosen} does not exist" if chosen else "no environment with the jax-cuda13 plugin"
        return None, f"{where}: {PLUGIN_HOWTO}"
    last = _probe(python)
    if last is None:
        return python, ""
    return None, f"{python} lacks the jax-cuda13 plugin ({last}): {PLUGIN_HOWTO}"


@functools.lru_cache(maxsize=None)
def _probe(python: str) -> str | None:
    """None where `python` imports jax and the plugin, else the last line it printed (once
    per Python and process: the import takes seconds)."""
    probe = subprocess.run([python, "-c", "import jax_plugins.xla_cuda13, jax"], capture_output=True, text=True,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if probe.returncode == 0:
        return None
    return probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else "import failed"


def _lower(fn, structs, keywords, target, argnums: tuple[int, ...] | None = None) -> str:
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractDevice, AbstractMesh

    call = lambda *a: fn(*a, **keywords)  # noqa: E731
    if argnums is not None:
        # The gradient of a sum of the outputs for the arguments `argnums`: the backward kernels.
        call = jax.grad(lambda *a: sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(fn(*a, **keywords))), argnums=argnums)
    device = AbstractDevice(device_kind=GPU_TARGETS[target].device_kind, num_cores=GPU_TARGETS[target].sms, platform="cuda")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
        return jax.jit(call).trace(*structs).lower().as_text()


def explain(m: GpuModule, target: str, message: str) -> Diagnostic:
    """A Mosaic GPU refusal, at the spec's tile line."""
    first = next((line.strip() for line in message.splitlines() if line.strip()), "lowering failed")
    if "shared memory" in message:
        return Diagnostic(m.kernel.tile_span, f"the tiles need more shared memory than {target} has: {first}")
    return Diagnostic(m.kernel.tile_span, f"Mosaic GPU refuses the kernel for {target}: {first}")


def stage2(m: GpuModule, source: SourceFile, target: str, shapes=None, nnz: float = 0.1, *, emit) -> tuple[GpuResult, dict | None]:
    """Lower the kernel (and its backward) under an abstract device; measure its shared
    memory. `m`: an einsum's GpuModule or the row walk's GpuAttentionModule. Returns the result and, if it lowered, the stage-3 job that compiles it.
    `emit(module, origin)` writes a module's source (the pipeline's `backends.emit_module`, as for `tpu/verify.py`)."""
    import jax

    k = m.kernel
    env, nb, args, keywords = concrete(k, shapes, nnz)
    chip = GPU_TARGETS[target]
    result = GpuResult(k.name, target, False, {s: env[s] for s, _ in k.symbols}, nb, m.smem_bytes, chip.smem_bytes)
    code = emit(m, source.name)  # an einsum's passes or the row walk's kernel
    fn = getattr(_load(code, f"verify_{k.name}"), k.name)
    structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in args]
    start = time.perf_counter()
    try:
        launched = launch_smem(lambda: _lower(fn, structs, keywords, target))
    except Exception as exc:
        result.lower_seconds = time.perf_counter() - start
        result.raw_error = str(exc)
        result.error = explain(m, target, str(exc))
        return result, None
    result.lower_seconds = time.perf_counter() - start
    result.lowered = True
    # The (first) kernel's shared memory as Mosaic GPU sizes it at its launch: what its limit
    # check compares (read in the one lowering, not measured by a second one under a 0-byte limit).
    result.smem_used = launched[0] if launched else 0
    own = isinstance(m, GpuWalkModule)  # the row walk's backward kernels are its own (an einsum's: a backward module)
    argnums = None
    if m.backward_error or not m.has_backward:
        result.backward = f"not derived: {m.backward_error or 'no input has a gradient'}"
    else:
        argnums = differentiated(m.conv, [s.dtype for s in structs], m.refused)
        try:
            launched = launch_smem(lambda: _lower(fn, structs, keywords, target, argnums=argnums))
            result.backward = "lowers"
            if own:
                # Kernels launch in order: the forward, then the backward's (dq, then dk/dv).
                result.backward_smem_estimate = list(m.backward_smem)
                result.backward_smem_used = launched[-len(m.backward_smem):]
        except Exception as exc:  # reported, not raised: the forward kernel stands on its own
            result.backward = "fails: " + next((line.strip() for line in str(exc).splitlines() if line.strip()), "lowering failed")
            argnums = None
    job = {"code": code, "function": k.name, "keywords": keywords, "target_config": target_config(chip),
           "args": [[list(shape), np.dtype(dtype).name] for shape, dtype in args]}
    if own and argnums:
        job["argnums"] = list(argnums)  # stage 3 compiles the gradient: the forward and backward kernels
    return result, job


def verify_modules(items, shapes=None, nnz: float = 0.1, stage3=True, python: str | None = None, *, emit) -> list[GpuResult]:
    """Stage 2 for each (module, source, target), then stage 3 for all that lowered, in one
    process of the plugin's environment (`python`, found by gpu_python() if not given).
    `stage3`: True, False (--lower-only), or the names of the kernels to compile (the
    others are lowered only)."""
    results, jobs = [], []
    for m, source, target in items:
        result, job = stage2(m, source, target, shapes, nnz, emit=emit)
        results.append(result)
        if stage3 is not True and (not stage3 or result.kernel not in stage3):
            result.stage3 = "not asked for"  # --lower-only
        elif job is not None:
            jobs.append((result, m, job))
    if stage3 is not True and not jobs:
        return results
    why = ""
    if python is None:
        python, why = gpu_python()
    if python is None:
        for result in results:
            result.stage3 = result.stage3 or why
        return results
    outcomes = compile_stage3(python, [job for _, _, job in jobs])
    for (result, m, _), outcome in zip(jobs, outcomes):
        result.compile_seconds = outcome.get("seconds", 0.0)
        error = outcome.get("error") or ""
        if outcome.get("compiled"):
            result.compiled = True
            kernels = outcome["kernels"]  # what ptxas -v said; nothing said is unknown, not zero
            result.kernels = kernels or None
            result.registers = [kk["registers"] for kk in kernels] or None
            if kernels and all("spill_bytes" in kk for kk in kernels):
                result.spill_bytes = sum(kk["spill_bytes"] for kk in kernels)
        elif "ptxas" in error and ("not found" in error or "No such file" in error):
            result.stage3 = "ptxas not found (the nvidia-cuda-nvcc wheel or a CUDA install provides it)"
        else:
            result.compiled = False
            result.raw_error = error or "compile failed"
            result.error = explain(m, result.target, result.raw_error)
    return results


def verify_module(m: GpuModule, source: SourceFile, target: str, shapes=None, nnz: float = 0.1, stage3: bool = True, *, emit) -> GpuResult:
    return verify_modules([(m, source, target)], shapes, nnz, stage3, emit=emit)[0]


def launch_smem(lower) -> list[int]:
    """Run `lower()` and return the shared memory of every kernel it launches, in order, as
    Mosaic GPU allocates it (each launch's buffers, read where it sizes them: the limit
    check sees one kernel at a time and stops at the first that exceeds it)."""
    from jax.experimental.mosaic.gpu import core

    seen: list[int] = []
    launch = core._launch

    def spy(token, grid, cluster, block, smem_buffers, *args, **kwargs):
        seen.append(core._smem_tree_size(smem_buffers))
        return launch(token, grid, cluster, block, smem_buffers, *args, **kwargs)

    core._launch = spy
    try:
        lower()
    finally:
        core._launch = launch
    return seen


def compile_stage3(python: str, jobs: list[dict]) -> list[dict]:
    """Run stage 3 for every job in one process of the plugin's environment."""
    if not jobs:
        return []
    with tempfile.TemporaryDirectory(prefix="sparsegen-gpu-") as tmp:
        request = []
        for n, job in enumerate(jobs):
            module = Path(tmp) / f"m{n}_{job['function']}.py"
            module.write_text(job["code"])
            request.append({"module": str(module), **{key: value for key, value in job.items() if key != "code"}})
        path = Path(tmp) / "request.json"
        path.write_text(json.dumps(request))
        run = subprocess.run([python, str(Path(__file__).with_name("stage3.py")), str(path)], capture_output=True, text=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
        outcomes = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        last = (run.stderr.strip().splitlines() or ["stage 3 printed nothing"])[-1]
        return outcomes + [{"compiled": False, "error": last}] * (len(jobs) - len(outcomes))
