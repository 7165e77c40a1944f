"""Static cycle estimates of Splash Attention (JAX's and tokamax's), weighted the way
`sparsegen verify --cycles` weights sparsegen's kernels (sparsegen/tpu/cycles.py).

Used by bench/bench_attention.py; runs as a helper process because libtpu reads
`--xla_jf_dump_static_llo_profile_to` when it loads:

    LIBTPU_INIT_ARGS=--xla_jf_dump_static_llo_profile_to=DIR python bench/attention_cycles.py REQUEST.json

REQUEST.json: a list of jobs {"impl": "splash"|"tokamax", "kind", "H", "S", "D", "block",
"chip", "backward", "variant"}; one JSON line per job on stdout ("starting" first, so that
the parent knows which job libtpu aborted on).

How: each side's `pallas_call`s are recorded (not run) while its function and its gradient
run eagerly on the host with the real MaskInfo (bench/bench_grouped_matmul.py's way for
megablox). Splash passes `None` for the operands it does not use (segment ids, sinks, the
mask blocks of a lazy mask), and libtpu's profiler wants every scalar-prefetch table as an
argument, so each call is flattened (`flat_call`: the `None`s dropped from the arguments,
BlockSpecs, outputs and the kernel's parameters, put back by a wrapper). Then
`sparsegen.tpu.cycles.pass_cycles` does exactly what it does for a generated kernel: the
kernel's own code runs on the host over every grid step to give each `pl.when` region's
condition for the real tables (Splash's `should_run` reads `block_mask` from SMEM, which
the estimator reads as zeros: on its own it counts no block product at all), three
profiled compiles (raw, walk, zero-table), and the estimate `walk + raw - zero`.
Regions whose conditions read only `program_id` (Splash's init and end) need no
weighting: the estimator resolves them itself.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

WINDOW, CHUNK = 1024, 2048


# ------------------------------------------------------------------ the two sides


def splash_fn(kind: str, H: int, S: int, D: int, block: int, variant: str | None = None):
    """JAX's Splash (jax.experimental.pallas.ops.tpu.splash_attention), as bench/splash_side.py builds it."""
    import splash_side

    return splash_side.splash_kernel(H, S, D, block, kind)


def tokamax_available() -> str | None:
    """None if tokamax imports here, else why not."""
    try:
        import tokamax  # noqa: F401
        from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel  # noqa: F401,F811
    except Exception as exc:  # ImportError, or tokamax failing to import against this jax
        return f"{type(exc).__name__}: {exc}"
    return None


TOKAMAX_VARIANTS = {
    # libtpu's static profiler aborts walking tokamax's default kernel (an LLO type check on the
    # repack of `q *= LOG2E`, a bf16 multiply, in every computing region: "Expected vector-int16,
    # got vector-bf16packed"), so the default cannot be estimated. `prescaled`: q arrives
    # multiplied by log2(e) (tokamax's own q_prescaled_log2e: the kernel keeps exp2 and drops
    # only that multiply of the q tile; the caller pays it outside the kernel).
    "prescaled": dict(q_prescaled_log2e=True),
    # tokamax's qk/sv diagonal skip (causal only): the products above the diagonal inside
    # diagonal blocks skipped, on a 2 x 2 sub-grid.
    "diag_skip": dict(qk_diag_skip=True, sv_diag_skip=True, qk_diag_grid=2),
    "exp": dict(use_base2_exp=False),
}


def tokamax_config(block: int, variant: str | None = None):
    """tokamax's SplashConfig at one square block everywhere, its defaults otherwise (fused
    backward: tokamax has no other); `variant`: names in TOKAMAX_VARIANTS joined by '+'."""
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as tk

    extra = {}
    for name in filter(None, (variant or "").split("+")):
        extra.update(TOKAMAX_VARIANTS[name])
    return tk.SplashConfig(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
                           block_kv_dkv_compute=block, use_fused_bwd_kernel=True, **extra)


def tokamax_fn(kind: str, H: int, S: int, D: int, block: int, variant: str | None = None):
    """tokamax's Splash kernel (tokamax/_src/ops/experimental/tpu/splash_attention), the same
    masks as JAX's: lazy causal / local / chunked masks; documents as a causal mask plus
    segment ids (tokamax then drops the blocks between documents from its grid)."""
    from tokamax._src.ops.experimental.tpu.splash_attention import base
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as tk
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as tm

    shape = (S, S)
    if kind in ("causal", "document"):
        mask = tm.CausalMask(shape)
    elif kind == "local":
        mask = tm.LocalMask(shape, window_size=(WINDOW - 1, 0), offset=0)
    elif kind == "chunked":
        mask = tm.ChunkedCausalMask(shape, chunk_size=CHUNK)
    else:
        raise ValueError(kind)
    kernel = tk.make_splash_mha_single_device(mask, config=tokamax_config(block, variant))
    if not getattr(tk._not, "host_walk", False):
        # tokamax's `_not` takes `not x` of anything that is not a jax.Array: on the host walk
        # (sparsegen/tpu/cycles.py's region_conditions) its conditions are numpy arrays.
        real_not = tk._not

        def _not(x):
            return np.logical_not(x) if isinstance(x, np.ndarray) else real_not(x)

        _not.host_walk = True
        tk._not = _not
    if kind != "document":
        return lambda q, k, v: kernel(q, k, v)
    return lambda q, k, v, seg_q, seg_kv: kernel(q, k, v, segment_ids=base.SegmentIds(q=seg_q, kv=seg_kv))


def module_fn(path: str, kind: str):
    """A generated module's function, loaded from `path` (a scratch copy with a change to measure)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"scratch_{kind}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, f"{kind}_bench")


def generated_arguments(kind: str, H: int, S: int, D: int):
    """The generated kernels' arguments: q, k, v of [B=1, H, S, D] (and seg [1, S])."""
    import jax.numpy as jnp
    import splash_side

    q = jnp.zeros((1, H, S, D), jnp.bfloat16)
    return [q, q, q] + ([jnp.asarray(splash_side.document_ids(S)[None])] if kind == "document" else [])


def arguments(kind: str, H: int, S: int, D: int):
    import jax.numpy as jnp
    import splash_side

    q = jnp.zeros((H, S, D), jnp.bfloat16)
    args = [q, q, q]
    if kind == "document":
        ids = jnp.asarray(splash_side.document_ids(S))
        args += [ids, ids]
    return args


# ------------------------------------------------------------------ recording and flattening


def record(fn, args, backward: bool):
    """The pallas_calls of fn(*args), of its gradient (of sum(o)) whole, and of the gradient's
    backward kernels alone (its own forward calls left out), run eagerly on the host; each call
    gives zeros back and nothing runs."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from sparsegen.tpu.cycles import Call

    calls = []
    real = pl.pallas_call

    def recorded(kernel, **kwargs):
        def run(*a):
            calls.append(Call(kernel, kwargs, a))
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), kwargs["out_shape"])

        return run

    pl.pallas_call = recorded
    try:
        with jax.disable_jit(), jax.default_device(jax.devices("cpu")[0]):
            fn(*args)
            n = len(calls)
            if backward:
                jax.grad(lambda q, k, v, *rest: jnp.sum(fn(q, k, v, *rest).astype(jnp.float32)), argnums=(0, 1, 2))(*args)
    finally:
        pl.pallas_call = real
    # The gradient runs the forward again (with residuals: Splash's is another kernel) before
    # the backward kernels; sparsegen/tpu/cycles.py's capture leaves those out the same way.
    return calls[:n], calls[n:], calls[n + n :] if backward else []


class _Flat:
    """A kernel or index map taking only the non-None refs (tables) of the original, which it
    calls with the Nones put back. `__wrapped__` leads sparsegen's cycles code to the original's
    module globals (its `pl`, `jnp`, `lax`, swapped there for the host walk and the counting)."""

    def __init__(self, inner, present: list[bool], rest: int, lead: int = 0, name: str | None = None, shapes=None):
        self.__wrapped__ = inner
        self._present, self._lead, self._shapes = present, lead, shapes
        self.__name__ = name or getattr(getattr(inner, "func", inner), "__name__", "kernel")
        P = inspect.Parameter
        count = lead + sum(present) + rest
        self.__signature__ = inspect.Signature([P(f"a{i}", P.POSITIONAL_ONLY) for i in range(count)])

    def __call__(self, *a):
        if self._shapes is not None:  # the host walk: refs without contents, but with their block's shape
            from sparsegen.tpu.cycles import _Absent

            a = tuple(_ShapedAbsent(shape) if isinstance(x, _Absent) and shape is not None else x
                      for x, shape in zip(a, self._shapes))
        lead, it = a[: self._lead], iter(a[self._lead :])
        full = [next(it) if p else None for p in self._present]
        return self.__wrapped__(*lead, *full, *it)


def _shaped_absent():
    from sparsegen.tpu.cycles import _Absent

    class ShapedAbsent(_Absent):
        """A ref on the host walk (sparsegen/tpu/cycles.py's `_Absent`: its contents are absent) that
        knows its block's shape: tokamax's kernel computes its loop count from `k_ref.shape` outside
        every region."""

        def __init__(self, shape):
            self.__dict__["shape"] = tuple(shape)
            self.__dict__["ndim"] = len(shape)

    return ShapedAbsent


def _ShapedAbsent(shape):
    global _SHAPED
    if _SHAPED is None:
        _SHAPED = _shaped_absent()
    return _SHAPED(shape)


_SHAPED = None


def _block_shape(spec, array):
    """The kernel-side shape of a ref: the block with squeezed dimensions dropped (the whole array without a spec)."""
    block = getattr(spec, "block_shape", None)
    if block is None:
        return tuple(array.shape)
    out = []
    for b in block:
        if b is None or type(b).__name__ == "Squeezed":
            continue
        out.append(int(getattr(b, "block_size", b)))
    return tuple(out)


def flat_call(call):
    """The call with every None argument, BlockSpec, output and kernel parameter left out."""
    import dataclasses

    from jax.experimental.pallas import tpu as pltpu

    from sparsegen.tpu.cycles import Call

    gs = call.grid_spec
    n = gs.num_scalar_prefetch
    tables, operands = list(call.args[:n]), list(call.args[n:])
    in_specs = list(gs.in_specs)
    out_specs = list(gs.out_specs) if isinstance(gs.out_specs, (list, tuple)) else [gs.out_specs]
    out_shape = call.kwargs["out_shape"]
    out_shape = list(out_shape) if isinstance(out_shape, (list, tuple)) else [out_shape]
    assert len(in_specs) == len(operands) and len(out_specs) == len(out_shape)
    for a in tables + operands:
        assert a is None or hasattr(a, "shape"), type(a)
    t_present = [t is not None for t in tables]
    i_present = [a is not None for a in operands]
    o_present = [s is not None for s in out_shape]
    assert all((s is None) == (not p) for s, p in zip(in_specs, i_present)), "a None operand with a BlockSpec"
    grid = tuple(int(g) for g in gs.grid)

    def remap(spec):
        if spec is None or getattr(spec, "index_map", None) is None:
            return spec
        return dataclasses.replace(spec, index_map=_Flat(spec.index_map, t_present, 0, lead=len(grid), name="index_map"))

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=sum(t_present), grid=grid,
        in_specs=[remap(s) for s, p in zip(in_specs, i_present) if p],
        out_specs=[remap(s) for s, p in zip(out_specs, o_present) if p],
        scratch_shapes=[x for x in gs.scratch_shapes if x is not None])
    scratch = list(gs.scratch_shapes)
    s_present = [x is not None for x in scratch]
    shapes = ([None] * sum(t_present) + [_block_shape(s, a) for s, a in zip(in_specs, operands) if a is not None]
              + [_block_shape(s, a) for s, a in zip(out_specs, out_shape) if a is not None]
              + [tuple(x.shape) for x in scratch if x is not None])
    kernel = _Flat(call.kernel, t_present + i_present + o_present + s_present, 0, shapes=shapes)
    aliases = call.kwargs.get("input_output_aliases") or {}
    # Alias indices count the flattened operands and outputs, where a None is no leaf: unchanged.
    kwargs = {**call.kwargs, "grid_spec": spec, "out_shape": [s for s in out_shape if s is not None], "input_output_aliases": aliases}
    args = [np.asarray(t) for t in tables if t is not None] + [a for a in operands if a is not None]
    return Call(kernel, kwargs, tuple(args))


# ------------------------------------------------------------------ the helper process


def job_calls(job: dict) -> dict:
    """The job's passes: {"forward": [...], "forward_residuals": [...], "backward": [...]} of flat Calls."""
    if job["impl"] in ("module", "sparsegen"):  # a generated module: the bench's, or a scratch copy at `path`
        if job["impl"] == "module":
            fn = module_fn(job["path"], job["kind"])
        else:
            import bench_attention

            fn = getattr(bench_attention.module(job["kind"]), f"{job['kind']}_bench")
        args = generated_arguments(job["kind"], job["H"], job["S"], job["D"])
    else:
        make = {"splash": splash_fn, "tokamax": tokamax_fn}[job["impl"]]
        fn = make(job["kind"], job["H"], job["S"], job["D"], job["block"], job.get("variant"))
        args = arguments(job["kind"], job["H"], job["S"], job["D"])
    forward, grad, backward = record(fn, args, job["backward"])
    # The forward a training step runs (with residuals), where it is another kernel (Splash's).
    # (Named by the call's `name`, else by its kernel function: the generated primal call's
    # kernel writes no logsumexp, and a training step runs the forward's that does.)
    def name(c):
        kernel = c.kernel.func if isinstance(c.kernel, functools.partial) else c.kernel
        return c.kwargs.get("name") or getattr(kernel, "__name__", None)

    names = {name(f) for f in forward}
    residuals = [c for c in grad[: len(grad) - len(backward)] if name(c) not in names]
    return {side: [flat_call(c) for c in calls] for side, calls in
            (("forward", forward), ("forward_residuals", residuals), ("backward", backward))}


def fold_pair(names: list[str], impl: str) -> tuple[int, int] | None:
    """(partial, full): the regions of a partial block step and of a full block step, or None.
    sparsegen names them; tokamax's are both `_`, full first (should_not_mask), partial second."""
    if "_partial" in names and "_full" in names:
        return names.index("_partial"), names.index("_full")
    if impl == "tokamax" and names.count("_") >= 2:  # the fused dkv kernel has a third (the write)
        first = names.index("_")
        return names.index("_", first + 1), first
    return None


def pass_json(call, target, device, impl: str, fold: bool) -> dict:
    """sparsegen/tpu/cycles.py's pass_cycles; `fold`: partial block steps walked as full ones
    (libtpu's profiler aborted walking this pass's regions as they are), their count kept."""
    from sparsegen.tpu import cycles

    real_conditions = cycles.region_conditions
    folded = 0
    if fold:
        names = [n for n, _ in real_conditions(call)]
        pair = fold_pair(names, impl)
        if pair is None:
            raise RuntimeError("libtpu's profiler aborted and there is no partial region to fold")

        def folding(c, zero=False):
            nonlocal folded
            found = real_conditions(c, zero)
            if zero:
                return found
            (pn, pb), (fn_, fb) = found[pair[0]], found[pair[1]]
            folded = int(pb.sum())
            found[pair[1]] = (fn_, fb | pb)
            found[pair[0]] = (pn, pb & False)
            return found

        cycles.region_conditions = folding
    try:
        start = time.perf_counter()
        j = cycles.pass_cycles(call, target, device).to_json()
    finally:
        cycles.region_conditions = real_conditions
    j["kernel"] = call.kwargs.get("name") or j["kernel"]
    j["seconds"] = round(time.perf_counter() - start, 1)
    if fold:
        j["partial_folded_into_full"] = folded
        j["note"] = (f"{folded} partial block steps counted at a full step's cost: libtpu's static profiler "
                     "aborts walking this pass's partial/full regions (an LLO type check)")
    return j


def worker(request: str) -> None:
    """One JSON line before each pass ("starting", so that the parent knows which one libtpu
    aborted on) and one with its result."""
    from sparsegen.tpu import cycles
    from sparsegen.tpu.targets import TARGETS
    from sparsegen.tpu.verify import _device

    req = json.loads(Path(request).read_text())
    skip = {tuple(k) for k in req["skip"]}
    fold = {tuple(k) for k in req["fold"]}

    def emit(msg):
        print(json.dumps(msg), flush=True)

    for n, job in enumerate(req["jobs"]):
        try:
            target = TARGETS[job["chip"]]
            device = _device(target.topology)
            sides = job_calls(job)
        except Exception as exc:
            text = str(exc).strip()
            emit({"key": [n, "forward", -1], "error": f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"})
            continue
        for side, calls in sides.items():
            for i, call in enumerate(calls):
                key = (n, side, i)
                if key in skip:
                    continue
                emit({"starting": list(key)})
                try:
                    out = pass_json(call, target, device, job["impl"], key in fold)
                except cycles.NoProfile as exc:
                    emit({"no_profile": str(exc)})
                    return
                except Exception as exc:  # this pass only
                    text = str(exc).strip()
                    out = {"estimated_cycles": None, "note": f"not estimated: {type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"}
                emit({"key": list(key), "pass": out})


# ------------------------------------------------------------------ the parent side


def tokamax_python() -> tuple[str | None, str | None]:
    """An interpreter that imports tokamax (this one, else the benchmark-only venv
    `.bench-venv` of the checkout), or None and why not."""
    import subprocess

    why = tokamax_available()
    if why is None:
        return sys.executable, None
    venv = ROOT / ".bench-venv" / "bin" / "python"
    if not venv.exists():
        return None, (f"tokamax does not import here ({why}) and there is no {venv.relative_to(ROOT)}: "
                      "python -m venv .bench-venv && .bench-venv/bin/pip install -e '.[tpu]' tokamax")
    probe = subprocess.run([str(venv), "-c", "import tokamax._src.ops.experimental.tpu.splash_attention.splash_attention_kernel"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode:
        tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"tokamax does not import in {venv.relative_to(ROOT)}: {tail[:200]}"
    return str(venv), None


def _limit_memory():
    """libtpu's profiler, where it aborts on a kernel, can first grow past 20 GiB: cap the helper at 16 GiB."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))


def run_jobs(jobs: list[dict], python: str = sys.executable, timeout: float = 3600, log=print) -> list[dict]:
    """The helper process over `jobs`, restarted past a pass libtpu's profiler aborts on: the
    pass is tried again with its partial block steps folded into full ones (`pass_json`), and
    reported as not estimated if that aborts too. A result per job: its passes per side, and
    each side's total (None if a pass has none)."""
    import subprocess
    import tempfile

    from sparsegen.tpu.cycles import FLAG

    results = [{"forward": {}, "forward_residuals": {}, "backward": {}} for _ in jobs]
    done, fold, errors, aborts = set(), set(), {}, {}
    deadline = time.monotonic() + timeout
    for _ in range(64):
        with tempfile.TemporaryDirectory(prefix="attention-cycles-") as tmp:
            req = Path(tmp) / "jobs.json"
            req.write_text(json.dumps({"jobs": jobs, "skip": sorted(done), "fold": sorted(fold)}))
            env = {**os.environ, "LIBTPU_INIT_ARGS": f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {FLAG}={tmp}/profile".strip()}
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
            try:
                proc = subprocess.run([python, __file__, str(req)], capture_output=True, text=True, env=env,
                                      timeout=max(1.0, deadline - time.monotonic()), preexec_fn=_limit_memory)
                stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as exc:
                out = exc.stdout or ""
                stdout, stderr, rc = out.decode() if isinstance(out, bytes) else out, "", "timeout"
        started = None
        for line in stdout.splitlines():
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if "no_profile" in msg:
                return [{"error": f"no static profile: {msg['no_profile']}"} for _ in jobs]
            if "starting" in msg:
                started = tuple(msg["starting"])
                continue
            key = tuple(msg["key"])
            started = None
            done.add(key)
            if "error" in msg:
                errors[key[0]] = msg["error"]
                continue
            results[key[0]][key[1]][key[2]] = msg["pass"]
            p, job = msg["pass"], jobs[key[0]]
            log(f"   cycles {job['impl']:9s} {job['kind']:9s} {job['chip']} {key[1]:17s} {p.get('kernel', '?')}: "
                f"{p.get('estimated_cycles')} ({p.get('seconds')} s){' [' + p['note'][:60] + ']' if p.get('note') else ''}")
        if rc == 0:
            break
        if rc == "timeout":
            break
        if started is None:
            tail = " | ".join(stderr.strip().splitlines()[-3:])
            for n in range(len(jobs)):
                errors.setdefault(n, f"helper process stopped (exit {rc}): {tail[:300]}")
            break
        why = next((ln.split("] ", 1)[-1] for ln in stderr.splitlines() if ln.startswith("F") and "] " in ln), f"exit {rc}")
        aborts.setdefault(started, why)
        if started not in fold:
            fold.add(started)  # try again with partial steps folded into full ones
            log(f"   cycles {jobs[started[0]]['impl']} {jobs[started[0]]['kind']} {started[1]} {started[2]}: profiler aborted "
                f"({why[:120]}); again with partial steps folded into full ones")
        else:
            done.add(started)
            results[started[0]][started[1]][started[2]] = {"estimated_cycles": None, "note": f"not estimated: libtpu's static profiler aborted: {why[:300]}"}
    for key, why in aborts.items():  # a fold that could not help: say why the pass was not estimated
        p = results[key[0]][key[1]].get(key[2])
        if p is not None and p.get("estimated_cycles") is None and "no partial region" in (p.get("note") or ""):
            p["note"] = f"not estimated: libtpu's static profiler aborted: {why[:300]}"
    out = []
    for n, r in enumerate(results):
        job = {"error": errors.get(n)}
        for side, passes in r.items():
            job[side] = [passes[i] for i in sorted(passes)]
            job[f"{side}_cycles"] = (None if not job[side] or any(p.get("estimated_cycles") is None for p in job[side])
                                     else sum(p["estimated_cycles"] for p in job[side]))
        out.append(job)
    return out


if __name__ == "__main__":
    worker(sys.argv[1])
