"""Stage 3 of `sparsegen verify --target h100|h200`, run in the environment that has the
jax-cuda13 plugin (`make gpu-venv`); it imports only jax, numpy and the generated module.

    python stage3.py REQUEST.json

REQUEST: a list of jobs, each {"module": path, "function": name, "args": [[shape, dtype], ...],
"keywords": {...}, "target_config": GpuTargetConfigProto text, optionally "argnums": [...] (the
gradient of the outputs' sum for those arguments: the forward and the backward kernels)}. Compiles each kernel through
XLA:GPU for a compile-only device (Mosaic GPU -> PTX -> ptxas, sm_90a) and prints one JSON
line per job, in order: compiled, seconds, registers and spill bytes per kernel (from
ptxas -v), or the error. One process for many jobs: jax and the plugin load once.
"""

import importlib.util
import json
import os
import re
import sys
import tempfile
import time

os.environ["JAX_PLATFORMS"] = "cpu"  # the plugin would stop at cuDNN without a GPU
os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"  # ptxas -v output, on the C-level stdout


def main(path):
    with open(path) as f:
        jobs = json.load(f)
    for job in jobs:
        print(json.dumps(compile_job(job)), flush=True)


def compile_job(request: dict) -> dict:
    import jax
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    keywords = request["keywords"]
    log = tempfile.TemporaryFile()
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    start = time.perf_counter()
    error = None
    try:  # a failing job is reported as its own, and the next ones still run
        spec = importlib.util.spec_from_file_location("stage3_module", request["module"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, request["function"])
        topology = topologies.get_topology_desc(platform="cuda", target_config=request["target_config"], topology="1x1x1")
        sharding = NamedSharding(Mesh(np.array(topology.devices), ("x",)), PartitionSpec())
        structs = [jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype) if dtype != "bfloat16" else jax.numpy.bfloat16, sharding=sharding)
                   for shape, dtype in request["args"]]
        call = lambda *a: fn(*a, **keywords)  # noqa: E731
        if request.get("argnums"):
            outputs = call
            call = jax.grad(lambda *a: sum(jax.numpy.sum(o.astype(jax.numpy.float32)) for o in jax.tree.leaves(outputs(*a))),
                            argnums=tuple(request["argnums"]))
        jax.jit(call).lower(*structs).compile()
    except Exception as exc:  # reported to the caller
        error = f"{type(exc).__name__}: {exc}"
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    seconds = time.perf_counter() - start
    log.seek(0)
    text = log.read().decode(errors="replace")
    kernels = [{"registers": int(r)} for r in re.findall(r"Used (\d+) registers", text)]
    names = re.findall(r"Compiling entry function '([^']*)'", text)
    for k, name in zip(kernels, names if len(names) == len(kernels) else []):
        k["name"] = name
    # Per function ("N bytes stack frame, ..."), not ptxas's warning, which repeats a spilling one's.
    spills = [int(a) + int(b) for a, b in re.findall(r"bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)]
    for k, s in zip(kernels, spills):
        k["spill_bytes"] = s
    return {"compiled": error is None, "seconds": seconds, "kernels": kernels, "error": error,
            "ptxas_warnings": sorted(set(re.findall(r"ptxas warning\s*:\s*(.*)", text)))}


if __name__ == "__main__":
    main(sys.argv[1])
