"""Static figures of GPU attention kernels for an H200, without a GPU: sparsegen's generated
causal attention (forward, dq, dk/dv) beside tokamax's Mosaic GPU flash attention for sm90
(`pallas_mosaic_gpu_kernel_sm90.py` and its vjp), both lowered and compiled through ptxas
for a compile-only H200 (sm_90a).

    python bench/gpu_attention_static.py [--python GPU_PYTHON] [--json FILE]

Causal, one batch, H = 16 heads, S = 8192, D = 128, bf16 (the shapes only set the grids).
Per kernel: ptxas's registers (at launch; a warp-specialized kernel then moves them between
its warpgroups with `setmaxnreg`, listed too) and spilled bytes (stores + loads), the
shared memory Mosaic GPU allocates for a CTA, the CTA's threads, the grid, the tile a CTA
owns, the rows or keys one pipeline step reads, and the steps in flight.

Two processes, as `sparsegen verify --target h200`: this one (sparsegen's environment)
writes the generated module; the compile runs in a Python that has jax, the jax-cuda13
plugin, ptxas (nvidia-cuda-nvcc) and, for tokamax's side, tokamax (a benchmark-only
package, never a dependency of sparsegen):

    python3.12 -m venv /tmp/tokvenv
    /tmp/tokvenv/bin/pip install jax==0.12.0.1 jaxlib==0.12.0.1 jax-cuda13-plugin==0.12.0.1 \\
        jax-cuda13-pjrt==0.12.0.1 'nvidia-cuda-nvcc>=13,<14' tokamax==0.0.17
    python bench/gpu_attention_static.py --python /tmp/tokvenv/bin/python

Without `--python`, SPARSEGEN_GPU_PYTHON or `.venv-gpu` (`make gpu-venv`) is used; where
that Python lacks tokamax, tokamax's rows say so and sparsegen's are still measured.
tokamax's kernels are called directly with the configs its sm90 heuristics choose for these
shapes (it has no H200 autotuning cache, and its public API checks for a real GPU before
it lowers anything); `tokamax_cross_compile` is not needed for the kernel functions.
Writes bench/results/gpu_attention_static.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
S, H, D = 8192, 16, 128

# Tiles that fill a CTA on an H200 (as tests/test_gpu_attention.py's LOWERED): 128-row and
# 128-key blocks, the full head dimension.
CAUSAL = f"""
kernel causal_attention {{
    in  q: bf16[B, H, S, D]
    in  k: bf16[B, H, S, D]
    in  v: bf16[B, H, S, D]
    out o: bf16[B, H, S, D]
    out lse: f32[B, H, S]

    s[b, h, i, j] = q[b, h, i, d] * k[b, h, j, d] * {D ** -0.5!r} where i >= j
    o[b, h, i, e] = softmax(s[b, h, i, j], j) * v[b, h, j, e]
    lse[b, h, i] = logsumexp(s[b, h, i, j], j)

    tile b = 1, h = 1, i = 128, j = 128, d = {D}, e = {D}
}}
"""


# ---------------------------------------------------------------- parent (sparsegen's side)

def sparsegen_job(tmp: Path) -> tuple[dict, dict]:
    """The generated module, written to `tmp`, as a compile job (its gradient: forward, dq
    and dk/dv in one compile), and what its plan says of each kernel."""
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from sparsegen.backends import emit_module
    from sparsegen.compiler import lower_source
    from sparsegen.gpu.attention import backward as gpu_backward
    from sparsegen.gpu.attention import lower as gpu_lower
    from sparsegen.gpu.targets import GPU_TARGETS, target_config
    from sparsegen.shapes import concrete, differentiated
    from sparsegen.source import SourceFile

    source = SourceFile("causal_attention.spk", CAUSAL)
    (m,) = lower_source(source, "h200")
    env, _, args, keywords = concrete(m.kernel, {"B": 1, "H": H, "S": S, "D": D}, 0.1)
    path = tmp / "causal_attention.py"
    path.write_text(emit_module(m, source.name))
    argnums = differentiated(m.conv, [dtype for _, dtype in args], m.refused)
    job = {"side": "sparsegen", "module": str(path), "function": m.kernel.name, "keywords": keywords,
           "args": [[list(shape), np.dtype(dtype).name] for shape, dtype in args], "argnums": list(argnums),
           "target_config": target_config(GPU_TARGETS["h200"])}
    # Per kernel (as its `kernel_name` names it): the tile a CTA owns, what one pipeline step
    # reads, the steps in flight (the constants the emitters write), the rules' shared memory.
    tq, tk, tb = gpu_lower.TQ, m.tk, gpu_backward.TB

    def cta(wgs: int, what: str) -> str:
        return f"{tb * wgs} {what} ({wgs} x {tb})" if wgs > 1 else f"{tb} {what}"

    plan = {
        "attention_kernel": {"kernel": "forward", "cta_tile": f"{tq * m.warpgroups} rows ({m.warpgroups} x {tq})" if m.warpgroups > 1 else f"{tq} rows",
                             "step": f"{tk} keys", "stages": gpu_lower.STAGES,
                             "smem_estimate": m.smem_bytes},
        "attention_dq_kernel": {"kernel": "dq", "cta_tile": cta(m.backward.dq.warpgroups, "rows"), "step": f"{tb} keys",
                                "stages": gpu_backward.STAGES, "smem_estimate": m.backward_smem[0]},
        "attention_dkv_kernel": {"kernel": "dk/dv", "cta_tile": cta(m.backward.dkv.warpgroups, "keys"), "step": f"{tb} rows",
                                 "stages": gpu_backward.STAGES, "smem_estimate": m.backward_smem[1]},
    }
    return job, plan


def run_child(python: str, jobs: list[dict]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="gpu-attention-static-") as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(json.dumps(jobs))
        run = subprocess.run([python, __file__, "--child", str(request)], capture_output=True, text=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
    outcomes = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    last = (run.stderr.strip().splitlines() or ["the compile process printed nothing"])[-1]
    return outcomes + [{"error": last, "kernels": []}] * (len(jobs) - len(outcomes))


def gpu_python(chosen: str | None) -> str:
    if chosen:
        return chosen
    sys.path.insert(0, str(ROOT))
    from sparsegen.gpu.verify import gpu_python as find

    python, why = find()
    if python is None:
        sys.exit(f"gpu_attention_static: {why}")
    return python


def rows_of(outcomes: list[dict], plan: dict) -> list[dict]:
    rows = []
    for outcome in outcomes:
        side = outcome["side"]
        if outcome.get("error"):
            rows.append({"side": side, "kernel": outcome.get("what", ""), "error": outcome["error"]})
            continue
        for kk in outcome["kernels"]:
            rows.append({"side": side, **kk, **(plan if side == "sparsegen" else outcome.get("plan", {})).get(kk["name"], {})})
    order = ["forward", "dq", "dk/dv"]  # ptxas compiles a job's kernels in an order of its own
    return sorted(rows, key=lambda r: (r["side"] != "sparsegen", order.index(r["kernel"]) if r.get("kernel") in order else len(order)))


COLUMNS = [("side", "side"), ("kernel", "kernel"), ("registers", "registers (ptxas)"), ("setmaxnreg", "setmaxnreg"),
           ("spill_bytes", "spill bytes"), ("smem_bytes", "shared memory (bytes)"), ("threads", "threads"),
           ("grid", "grid"), ("cta_tile", "CTA tile"), ("step", "a step reads"), ("stages", "stages")]


def table(rows: list[dict]) -> str:
    def cell(row, key):
        value = row.get(key)
        if key == "setmaxnreg":
            return ", ".join(value) if value else "-"
        if isinstance(value, list):
            return " x ".join(map(str, value))
        return "" if value is None else f"{value:,}" if isinstance(value, int) and key == "smem_bytes" else str(value)

    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for row in rows:
        if row.get("error"):
            lines.append(f"| {row['side']} | {row['kernel']} | not compiled: {row['error']} |" + " |" * (len(COLUMNS) - 3))
        else:
            lines.append("| " + " | ".join(cell(row, key) for key, _ in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="a Python with jax, the jax-cuda13 plugin, ptxas and tokamax")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "gpu_attention_static.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    python = gpu_python(args.python)
    with tempfile.TemporaryDirectory(prefix="sparsegen-static-") as tmp:
        job, plan = sparsegen_job(Path(tmp))
        jobs = [job, {"side": "tokamax", "what": "forward", "target_config": job["target_config"]},
                {"side": "tokamax", "what": "backward", "target_config": job["target_config"]}]
        start = time.perf_counter()
        outcomes = run_child(python, jobs)
    for outcome, j in zip(outcomes, jobs):
        outcome.setdefault("side", j["side"])
        outcome.setdefault("what", j.get("what", "forward and backward"))
    rows = rows_of(outcomes, plan)
    versions = {k: v for o in outcomes for k, v in o.get("versions", {}).items()}
    result = {"shapes": {"B": 1, "H": H, "S": S, "D": D, "dtype": "bfloat16", "mask": "causal"}, "target": "h200 (sm_90a, compile-only)",
              "versions": versions, "seconds": round(time.perf_counter() - start, 1), "rows": rows,
              "configs": {o["side"] + " " + o["what"]: o.get("config") for o in outcomes if o.get("config")}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"causal attention, H = {H}, S = {S}, D = {D}, bf16; H200 (sm_90a), compile-only; {versions}")
    print(table(rows))
    for row in rows:  # the rules' estimate is exact where Mosaic GPU allocates as they assume
        if row.get("smem_estimate") not in (None, row.get("smem_bytes")):
            print(f"note: sparsegen {row['kernel']}: shared memory {row['smem_bytes']} allocated, {row['smem_estimate']} estimated")
    return 1 if any(row.get("error") and row["side"] == "sparsegen" for row in rows) else 0


# ------------------------------------------------------- child (the plugin's environment)
# Imports only jax, numpy, tokamax and the generated module.

def child(path: str) -> int:
    os.environ["JAX_PLATFORMS"] = "cpu"  # the plugin would stop at cuDNN without a GPU
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"  # ptxas -v, on the C-level stdout
    os.environ["MOSAIC_GPU_DUMP_PTX"] = "1"  # the PTX: .maxntid and setmaxnreg
    with open(path) as f:
        jobs = json.load(f)
    for job in jobs:
        print(json.dumps(compile_job(job)), flush=True)
    return 0


def compile_job(job: dict) -> dict:
    import jax

    out = {"side": job["side"], "what": job.get("what", "forward and backward"), "versions": {"jax": jax.__version__}}
    launches: list[dict] = []
    log = tempfile.TemporaryFile()
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:  # a failing job is reported as its own; the next ones still run
        with spying(launches):
            fn, structs, config = build_job(job, out)
            jax.jit(fn).lower(*structs).compile()
        error = None
    except Exception as exc:  # reported to the parent
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        config = None
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    log.seek(0)
    text = log.read().decode(errors="replace")
    out.update(error=error, config=config, kernels=kernels_of(text, launches) if error is None else [])
    if error is None and not out["kernels"]:
        out["error"] = "ptxas said nothing (is nvidia-cuda-nvcc installed?)"
    return out


class spying:
    """Record each Mosaic GPU kernel as it is lowered: its name, grid, block (threads) and
    the shared memory its launch allocates (Mosaic GPU's own count, as `sparsegen verify`)."""

    def __init__(self, launches: list[dict]):
        self.launches = launches

    def __enter__(self):
        import functools

        from jax.experimental.mosaic.gpu import core
        from jax.experimental.pallas import mosaic_gpu as plgpu

        self.core, self.lower, self.launch = core, core._lower_as_gpu_kernel, core._launch
        self.plgpu, self.kernel = plgpu, plgpu.kernel
        launches = self.launches

        def kernel(body, *args, kernel_name=None, **kwargs):
            # A kernel without a name (tokamax's dq and dk/dv: both "anonymous") is named after
            # its body function, so that ptxas's entries can be told apart; the code is the same.
            if kernel_name is None:
                kernel_name = getattr(body.func if isinstance(body, functools.partial) else body, "__name__", None)
            return self.kernel(body, *args, kernel_name=kernel_name, **kwargs)

        def lower(body, grid, cluster, block, *args, **kwargs):
            name = kwargs.get("kernel_name", args[7] if len(args) > 7 else None)
            launches.append({"name": name, "grid": list(grid), "threads": block[0] * block[1] * block[2]})
            return self.lower(body, grid, cluster, block, *args, **kwargs)

        def launch(token, grid, cluster, block, smem_buffers, *args, **kwargs):
            if launches:
                launches[-1]["smem_bytes"] = core._smem_tree_size(smem_buffers)
            return self.launch(token, grid, cluster, block, smem_buffers, *args, **kwargs)

        core._lower_as_gpu_kernel, core._launch, plgpu.kernel = lower, launch, kernel
        return self

    def __exit__(self, *exc):
        self.core._lower_as_gpu_kernel, self.core._launch, self.plgpu.kernel = self.lower, self.launch, self.kernel


def kernels_of(text: str, launches: list[dict]) -> list[dict]:
    """Per kernel ptxas compiled: its figures from ptxas -v and the PTX, and its launch."""
    ptx = {}
    for name, body in re.findall(r"\.entry (\w+)\((.*?)(?=\.visible \.entry |\Z)", text, re.S):
        ptx[name] = {"maxntid": re.findall(r"\.maxntid (\d+), (\d+), (\d+)", body),
                     "setmaxnreg": re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32 (\d+);", body)}
    kernels = []
    for name, body in re.findall(r"Compiling entry function '(\w+)' for 'sm_\w+'(.*?)(?=Compiling entry function|\Z)", text, re.S):
        regs = re.search(r"Used (\d+) registers", body)
        spill = re.search(r"bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", body)
        base = name.removesuffix("_mosaic_gpu_kernel")
        launch = next((la for la in launches if la["name"] == base), {})
        seen = ptx.get(name, {})
        kernels.append({"name": base, "registers": int(regs.group(1)) if regs else None,
                        "spill_bytes": int(spill.group(1)) + int(spill.group(2)) if spill else None,
                        "setmaxnreg": [f"{'+' if op == 'inc' else '-'}{n}" for op, n in dict.fromkeys(seen.get("setmaxnreg", []))],
                        "smem_bytes": launch.get("smem_bytes"), "threads": launch.get("threads"), "grid": launch.get("grid")})
    return kernels


def build_job(job: dict, out: dict):
    """The function to compile, its arguments (on a compile-only H200) and the config."""
    import importlib.util

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    topology = topologies.get_topology_desc(platform="cuda", target_config=job["target_config"], topology="1x1x1")
    sharding = NamedSharding(Mesh(np.array(topology.devices), ("x",)), PartitionSpec())

    def struct(shape, dtype):
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)

    if job["side"] == "sparsegen":
        spec = importlib.util.spec_from_file_location("static_module", job["module"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, job["function"])
        keywords = job["keywords"]

        def loss(*a):
            return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(fn(*a, **keywords)))

        return jax.grad(loss, argnums=tuple(job["argnums"])), [struct(s, d) for s, d in job["args"]], None
    return tokamax_job(job["what"], struct, out)


def tokamax_job(what: str, struct, out: dict):
    """tokamax's sm90 forward, or its backward (dq, then dk/dv), with the configs its
    heuristics give at these shapes; inputs laid out as tokamax's kernels take them (T, H, D)."""
    import dataclasses
    from importlib.metadata import version

    import jax
    import jax.numpy as jnp
    import numpy as np
    from tokamax._src.ops.attention import base
    from tokamax._src.ops.attention import pallas_mosaic_gpu as fwd_op
    from tokamax._src.ops.attention import pallas_mosaic_gpu_kernel_sm90 as sm90
    from tokamax._src.ops.attention import pallas_mosaic_gpu_vjp as vjp_op
    from tokamax._src.ops.attention import pallas_mosaic_gpu_vjp_kernel_sm90 as vjp_sm90

    out["versions"]["tokamax"] = version("tokamax")
    scale = D ** -0.5
    x = jax.ShapeDtypeStruct((1, S, H, D), jnp.bfloat16)
    if what == "forward":
        config = sm90.get_heuristics_config(fwd_op.PallasMosaicGpuFlashAttention().bind(x, x, x, is_causal=True),
                                            fold_q_sequence_heads=False)

        def fn(q, k, v):  # the training forward: it returns the softmax residuals for the backward
            return sm90.flash_attention_kernel(q, k, v, None, None, None, None, is_causal=True, logits_soft_cap=None, logits_scale=scale,
                                               out_dtype=np.dtype(jnp.bfloat16), normalize_output=True, return_residuals=True,
                                               use_stable_softmax=True, rescale_threshold=1.0, config=config)

        structs = [struct((S, H, D), "bfloat16")] * 3
        # Two compute warpgroups of block_q rows each and one that issues the TMA copies;
        # block_kv keys a step through a ring of num_stages buffers.
        out["plan"] = {"flash_attention_sm90": {"kernel": "forward", "cta_tile": f"{2 * config.block_q} rows (2 x {config.block_q})",
                                                "step": f"{config.block_kv} keys", "stages": config.num_stages}}
    else:
        r = jax.ShapeDtypeStruct((1, H, S), jnp.float32)
        bound = vjp_op.PallasMosaicGpuFlashAttentionVjp().bind(
            (r, r), x, x, x, x, x, mask=base.Mask(is_causal=True), precision=(jax.lax.DotAlgorithmPreset.DEFAULT,) * 2,
            logits_dtype=jnp.float32, logits_scale=scale, bias=None, logits_soft_cap=None, dropout_mask=None, dropout_rate=0.0,
            paging_info=None, q_indices=None, k_indices=None, normalize_output=True)
        config = vjp_sm90.get_heuristics_config(bound)

        def fn(q, k, v, o, do, m, l):
            return vjp_sm90.flash_attention_vjp_kernel(q, k, v, (m, l), o, do, None, None, None, None, logits_scale=scale,
                                                       logits_soft_cap=None, is_causal=True, ds_dtype=None, config=config)[:3]

        structs = [struct((S, H, D), "bfloat16")] * 5 + [struct((H, S), "float32")] * 2
        # `emit_pipeline_warp_specialized`: compute_wgs warpgroups and a memory one; steps in
        # flight min(num_stages, tiles).
        wgs = config.compute_wgs
        out["plan"] = {
            "kernel_dq": {"kernel": "dq", "cta_tile": f"{wgs * config.block_q_dq} rows ({wgs} x {config.block_q_dq})",
                          "step": f"{config.block_kv_dq} keys", "stages": min(config.num_stages, S // config.block_kv_dq)},
            "kernel_dkv": {"kernel": "dk/dv", "cta_tile": f"{wgs * config.block_kv_dkv} keys ({wgs} x {config.block_kv_dkv})",
                           "step": f"{config.block_q_dkv} rows", "stages": min(config.num_stages, S // config.block_q_dkv)},
        }
    return fn, structs, dataclasses.asdict(config)


if __name__ == "__main__":
    sys.exit(main())
