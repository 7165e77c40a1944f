"""Runs generated kernels' `sharded` on 8 host CPU devices for tests/mesh_jobs.py's jobs.

A script, run in a subprocess: the device count (`--xla_force_host_platform_device_count`)
must be set before jax is imported, and the test process has imported it already. It takes
a job (JSON): a generated module's path, its arguments (an .npz), and cases (a mesh, the
mapping of indices to its axes); per case it runs the sharded function, the kernel unsplit
and `reference`, values and `jax.grad`, in the CPU interpreter (a case's "interpret":
"simulator": in the TPU simulator, `pltpu.InterpretParams`, which fills memory no step
writes with NaN and raises on out-of-bounds reads), and saves them (an .npz) for the test
to compare; a case expecting a ValueError saves its message instead, and any other
exception its traceback (as does a job whose unsplit run fails): one broken case fails its
own test, not every test of the session. Each case's seconds are saved too, wall and CPU
(`case{c}_seconds`, `case{c}_cpu`; the unsplit runs' `job_seconds`, `job_cpu`): where the
time goes. A case's "typed": shard_map typed by the mesh axes values vary over, as
`sharded` runs compiled (`_on_mesh(typed=True)`); its "fill" ({argument: value}): bad input,
those arguments filled with the value, for the unsplit call and the sharded one to refuse.

    python tests/mesh_runner.py JOB.json...
"""

from __future__ import annotations

import os
import sys

# Eight host devices; and XLA's CPU backend without its LLVM optimisations: the interpreted
# kernels' programs are compiled once and run briefly, so compiling is most of a case's
# time (optimised, about 15% more CPU time here). Only this process: it runs on the CPU
# alone (no libtpu: the ahead-of-time compiles and cycle estimates are not made here).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import contextlib  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"sharded_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def values_and_grads(fn, args, keywords, argnums, weights, grad: bool):
    """fn's outputs and, with `grad`, the gradients of `sum(output * weight)` with respect to
    the arguments `argnums`: one forward (jax.vjp) serves both."""
    if not (grad and argnums):
        return outputs(fn(*args, **keywords)), ()

    def of(*diff):
        full = list(args)
        for n, a in zip(argnums, diff):
            full[n] = a
        return outputs(fn(*full, **keywords))

    outs, pullback = jax.vjp(of, *(args[n] for n in argnums))
    # Each cotangent laid out as its output (on an explicit mesh, its type says how).
    return outs, pullback(tuple(jax.device_put(jnp.asarray(w, o.dtype), o.sharding) for o, w in zip(outs, weights)))


def save(saved: dict, tag: str, outs, grads, argnums):
    for n, o in enumerate(outs):
        saved[f"{tag}out{n}"] = np.asarray(o.astype(jnp.float32) if o.dtype == jnp.bfloat16 else o)
        saved[f"{tag}spec{n}"] = np.array(str(o.sharding.spec) if hasattr(o.sharding, "spec") else "")
    for n, g in zip(argnums, grads):
        saved[f"{tag}grad{n}"] = np.asarray(g.astype(jnp.float32))


def run_case(mod, job, case, args, weights, saved: dict, tag: str):
    keywords = dict(job["keywords"])
    if case.get("fill"):
        # Bad input for this case alone: arguments filled with one value; the message of the
        # kernel's unsplit call on them is saved to compare with the sharded call's.
        args = [np.full_like(a, case["fill"][str(n)]) if str(n) in case["fill"] else a for n, a in enumerate(args)]
        try:
            getattr(mod, job["kernel"])(*args, **keywords, interpret=True)
            saved[f"{tag}unsplit_error"] = np.array("")
        except ValueError as e:
            saved[f"{tag}unsplit_error"] = np.array(str(e))
    kind = jax.sharding.AxisType.Explicit if case.get("explicit") else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh(tuple(case["mesh"]), tuple(case["names"]), axis_types=(kind,) * len(case["mesh"]))
    try:
        # JSON has no tuples: ["seq", "zigzag"] is ("seq", "zigzag").
        axes = {i: tuple(a) if isinstance(a, list) else a for i, a in case["axes"].items()}
        fn = mod.sharded(mesh, **axes)
        if case.get("presharded"):
            # Arrays arriving laid out otherwise: every dense argument split along its first
            # dimension over the first mesh axis, where it divides.
            first, size = case["names"][0], case["mesh"][0]
            args = [jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(first)))
                    if a.ndim and a.shape[0] % size == 0 else a for a in args]
        call = jax.jit(fn, static_argnames=("interpret", *keywords)) if case.get("jit") else fn
        mode = interpret_mode(case.get("interpret", "cpu"))
        try:
            with jax.set_mesh(mesh) if case.get("explicit") else _nothing(), typed(mod, case.get("typed")):
                outs, grads = values_and_grads(lambda *a, **k: call(*a, **k, interpret=mode), args, keywords, job["diff"],
                                               weights, case.get("grad", True))
        finally:
            if mode is not True:
                jax.effects_barrier()  # a kernel whose result nobody awaited (a forward under grad) may still run
                pltpu.reset_tpu_interpret_mode_state()
    except ValueError as e:
        saved[f"{tag}error"] = np.array(str(e))
        return
    except Exception:  # noqa: BLE001 (reported to the test)
        saved[f"{tag}error"] = np.array(traceback.format_exc())
        return
    save(saved, tag, outs, grads, job["diff"])


def interpret_mode(name: str):
    if name == "cpu":
        return True
    assert name == "simulator", name
    return pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")


@contextlib.contextmanager
def typed(mod, on: bool):
    """With `on`, the module's shard_map typed by the mesh axes values vary over, as it runs
    compiled (`_on_mesh(typed=True)`; interpreted, jax evaluates only some kernels so)."""
    on_mesh = mod._on_mesh
    if on:
        mod._on_mesh = functools.partial(on_mesh, typed=True)
    try:
        yield
    finally:
        mod._on_mesh = on_mesh


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def gpu_interpreter_on_many_devices() -> None:
    """jax's Mosaic GPU interpreter checks, as each device ends a kernel, that no barrier of
    any device is allocated, while the other devices may still be in theirs (they run it
    together: a kernel's end waits for every device); that check (of the interpreter itself,
    not of the kernel: each barrier's use is still checked as it is deallocated) then fails
    at random on a mesh. Made here per device: the barriers of the device ending the kernel."""
    from jax._src import callback
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret

    def check(token, device):
        memory = gpu_callbacks._get_shared_memory()
        with memory.lock:
            for key, alloc in memory.mem.items():
                assert key.device_id != int(device) or type(alloc).__name__ not in ("Barrier", "ClusterBarrier"), (
                    f"Barrier remains allocated at key `{key}`.")
        return token

    def call(token):
        device = jaxpr_interpret.DeviceInfo().device_id
        return callback.io_callback(gpu_callbacks.fail_on_exception(check), gpu_callbacks.TOKEN_SHAPE_DTYPE, token, device)

    gpu_callbacks.call_assert_no_barriers_allocated = call


def main(path: str) -> None:
    with open(path) as f:
        job = json.load(f)
    mod = load(job["module"])
    if hasattr(mod, "_gpu_interpret"):
        gpu_interpreter_on_many_devices()
    kernel = getattr(mod, job["kernel"])
    data = np.load(job["args"])
    # bf16 arrays travel as f32 (an .npz keeps no bfloat16).
    args = [jnp.asarray(data[f"arg{n}"], dtype) if dtype == "bfloat16" else data[f"arg{n}"] for n, dtype in enumerate(job["dtypes"])]
    weights = [data[f"weight{n}"] for n in range(job["n_outputs"])]
    keywords = dict(job["keywords"])
    saved: dict[str, np.ndarray] = {}
    start, cpu = time.perf_counter(), time.process_time()
    try:
        # The kernel unsplit and `reference`, values and gradients.
        for tag, fn in (("kernel_", lambda *a, **k: kernel(*a, **k, interpret=True)), ("reference_", mod.reference)):
            save(saved, tag, *values_and_grads(fn, args, keywords, job["diff"], weights, True), job["diff"])
    except Exception:  # noqa: BLE001 (reported to the test)
        np.savez(job["result"], job_error=np.array(traceback.format_exc()))
        return
    saved["job_seconds"], saved["job_cpu"] = np.array(time.perf_counter() - start), np.array(time.process_time() - cpu)
    for c, case in enumerate(job["cases"]):
        start, cpu = time.perf_counter(), time.process_time()
        run_case(mod, job, case, args, weights, saved, f"case{c}_")
        saved[f"case{c}_seconds"], saved[f"case{c}_cpu"] = np.array(time.perf_counter() - start), np.array(time.process_time() - cpu)
    np.savez(job["result"], **saved)


if __name__ == "__main__":
    for job_path in sys.argv[1:]:
        main(job_path)
