"""sparsegen's grouped matmul (generated/grouped_matmul.py) side by side with JAX's megablox
(gmm; its backward gmm(transpose_rhs=True) and tgmm), in one run, with no TPU:

    .venv/bin/python bench/bench_grouped_matmul.py [--quick] [--no-cycles] [--no-aot] [--cycles-cases E:groups:pass,...] [--json FILE]

Shapes: M = 16384 (--quick: 2048), K = N = 4096, E = 8 and 64 experts, bf16, tiles
512 x 512 x 512 on both sides; group sizes uniform (M / E each) or skewed (group 0 holds
half the rows, the other E - 1 share the rest, so their boundaries fall inside row blocks).

1. The walk, per pass (forward o; backward dx and dw): grid, grid steps, steps that run a
   block product, and block copies per operand (a copy whenever an operand's block index
   differs from the previous grid step's: the Pallas pipeline rule), from both sides'
   tables evaluated in numpy: sparsegen's index-map functions over `_prefetch`'s tables
   (the branch sorted ids take under jit: tables of row blocks + E - 1 steps, the grid
   running the steps the data needs, a traced extent as megablox's), megablox's
   index maps over `make_group_metadata`. Megablox's grid is (tiles_n, num_active_tiles,
   tiles_k) for gmm, (tiles_n, tiles_k, num_active_tiles) for tgmm.
2. Ahead-of-time compiles for v5e and v6e (get_topology_desc; no execution), forward and
   forward+backward: scoped VMEM of each Mosaic kernel, from the compiled HLO
   (bench/splash_side.py's kernel_vmem). sparsegen's program holds two kernels per pass (the
   bounded walk and the dense fallback of its lax.cond); megablox's grid is dynamic.
3. libtpu's static cycle estimate (v5e) of each pass, compiled with the real walk's grid
   as numbers on both sides (`--xla_jf_dump_static_llo_profile_to`, in a subprocess: libtpu
   reads the flag when it loads). The estimator reads scalar-prefetch tables as zeros;
   sparsegen/tpu/cycles.py's weighting (raw + walk - zero, the `pl.when` conditions looked
   up from constants by shifts and masks of the step, which the estimator evaluates) gives
   the real path for sparsegen's kernels and for tgmm (sparsegen's partial steps counted at
   a full step's cost: libtpu's profiler aborts walking the partial region, see
   `weighted`); gmm's conditions depend only on program_id, so its raw estimate is its real
   one. For sparsegen this is the branch sorted ids take. Index maps still read the
   tables as zeros there (the estimator sees fewer copies than the walk makes), so HBM
   cycles of the real copies are printed beside it: where they exceed the estimate the pass
   is memory-bound and the estimate optimistic.
   Before the weighting's fixes (see sparsegen.tpu.cycles._lookup and _static_grid) the
   sparsegen figures were about 1.6x megablox's: the estimator ran step 0's regions at
   every step and walked a grid of its own size for the traced extent.

No timed assertion anywhere: this prints tables and writes bench/results/grouped_matmul.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas.ops.tpu import megablox  # noqa: E402
import jax.experimental.pallas.ops.tpu.megablox.gmm  # noqa: E402

# The module (gmm, tgmm, make_group_metadata): the package's `gmm` is ops.gmm, the custom_vjp.
mb = sys.modules["jax.experimental.pallas.ops.tpu.megablox.gmm"]

TILE = 512
TILING = (TILE, TILE, TILE)
K = N = 4096
BF16 = jnp.bfloat16
CLOCK_V5E = 197e12 / 131072  # v5e: peak bf16 FLOP/s over MXU FLOPs per cycle (sparsegen/tpu/cycles.py)
HBM_V5E = 819e9


def load_generated():
    path = ROOT / "generated" / "grouped_matmul.py"
    spec = importlib.util.spec_from_file_location("grouped_matmul_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GEN = load_generated()


def group_sizes(M: int, E: int, dist: str) -> np.ndarray:
    if dist == "uniform":
        sizes = np.full(E, M // E)
        sizes[-1] += M - sizes.sum()
    else:  # skewed: group 0 holds half the rows
        rest = M - M // 2
        sizes = np.concatenate([[M // 2], np.full(E - 1, rest // (E - 1))])
        sizes[1 : 1 + rest % (E - 1)] += 1
    assert sizes.sum() == M
    return sizes.astype(np.int32)


def gid_of(sizes: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)


def runs(keys: list[np.ndarray]) -> int:
    """Copies of one operand: steps whose block index differs from the previous step's."""
    k = np.stack([np.asarray(a, np.int64).reshape(-1) for a in keys])
    return int(1 + np.count_nonzero(np.any(k[:, 1:] != k[:, :-1], axis=0)))


def grid_axes(grid):
    steps = math.prod(grid)
    return list(np.indices(grid, dtype=np.int64).reshape(len(grid), steps))


def block_bytes(shape, dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


# ------------------------------------------------------------------ 1. the walk


def ours_walk(M: int, E: int, gid: np.ndarray, side: str) -> dict:
    """Grid, steps, computing steps and copies per operand of one sparsegen pass (the walk sorted
    ids take: tables of row blocks + E - 1 steps, the grid running the steps the data needs)."""
    sizes = (M, K, E, N)
    n_steps = pl.cdiv(M, TILE) + E - 1
    prefetch = {"fwd": GEN._prefetch, "dx": GEN._d_x_prefetch, "dw": GEN._d_w_prefetch}[side]
    if side == "fwd":
        tables = prefetch(None, None, jnp.asarray(gid), sizes, n_steps)
    else:
        tables = prefetch(None, None, jnp.asarray(gid), None, sizes, n_steps)
    tables = [np.asarray(t) for t in tables]
    # A pass whose condition is the forward's over the same axes calls the forward's classify
    # (one function per distinct body in a module): dx has none of its own.
    classify = getattr(GEN, {"fwd": "_classify", "dx": "_d_x_classify", "dw": "_d_w_classify"}[side], GEN._classify)
    kinds = np.asarray(classify(jnp, jnp.asarray(gid), sizes))
    needed = int(GEN._row_walk(np, kinds.reshape((1,) + kinds.shape))[1])
    run = min(needed, n_steps)  # the grid's traced extent: the steps the data needs
    nk, nn = K // TILE, N // TILE
    if side == "fwd":
        grid = (nn, run, nk)
        maps = {"x": (functools.partial(GEN._x_index_map, n_k=nk), (TILE, TILE)),
                "w": (functools.partial(GEN._w_index_map, n_k=nk), (TILE, TILE)),
                "gid": (GEN._gid_index_map, (TILE, 128), np.int32),
                "o": (GEN._o_index_map, (TILE, TILE))}
        step_axis = 1
    elif side == "dx":
        grid = (nk, run, nn)
        maps = {"g_o": (functools.partial(GEN._d_x_g_o_index_map, n_n=nn), (TILE, TILE)),
                "w": (functools.partial(GEN._d_x_w_index_map, n_n=nn), (TILE, TILE)),
                "gid": (GEN._d_x_gid_index_map, (TILE, 128), np.int32),
                "dx": (GEN._d_x_d_x_index_map, (TILE, TILE))}
        step_axis = 1
    else:
        grid = (nk, nn, run)
        maps = {"g_o": (GEN._d_w_g_o_index_map, (TILE, TILE)),
                "x": (GEN._d_w_x_index_map, (TILE, TILE)),
                "gid": (GEN._d_w_gid_index_map, (TILE, 128), np.int32),
                "dw": (GEN._d_w_d_w_index_map, (TILE, TILE))}
        step_axis = 2
    axes = grid_axes(grid)
    kind = tables[3][axes[step_axis]]
    copies, nbytes = {}, 0
    for name, (fn, shape, *dtype) in maps.items():
        idx = [np.broadcast_to(np.asarray(c), axes[0].shape) for c in fn(*axes, *tables)]
        copies[name] = runs(idx)
        nbytes += copies[name] * block_bytes(shape, dtype[0] if dtype else BF16)
    return {"grid": list(grid), "steps": math.prod(grid), "walk_steps": n_steps, "needed_walk_steps": needed,
            "dense_walk_steps": pl.cdiv(M, TILE) * E, "computing": int((kind != 0).sum()),
            "partial": int((kind == 1).sum()), "copies": copies, "hbm_bytes": nbytes}


def metadata(M: int, sizes: np.ndarray, visit_empty: bool):
    (offsets, ids, tiles), active = mb.make_group_metadata(
        group_sizes=jnp.asarray(sizes), m=M, tm=TILE, start_group=jnp.int32(0),
        num_nonzero_groups=len(sizes), visit_empty_groups=visit_empty)
    return np.asarray(offsets), np.asarray(ids), np.asarray(tiles), int(active)


def megablox_walk(M: int, sizes: np.ndarray, side: str) -> dict:
    """megablox's grid and copies per operand, from its metadata and index maps (gmm.py)."""
    nk, nn = K // TILE, N // TILE
    offsets, ids, tiles, active = metadata(M, sizes, visit_empty=side == "dw")
    if side in ("fwd", "dx"):  # gmm: grid (tiles_n, active, tiles_k); dx: n is K, k is N (transpose_rhs)
        t_n, t_k = (nn, nk) if side == "fwd" else (nk, nn)
        grid = (t_n, active, t_k)
        n_i, g, k_i = grid_axes(grid)
        rhs = [ids[g], k_i, n_i] if side == "fwd" else [ids[g], n_i, k_i]
        index = {"x" if side == "fwd" else "g_o": [tiles[g], k_i], "w": rhs, "o" if side == "fwd" else "dx": [tiles[g], n_i]}
        computing = math.prod(grid)  # every step runs its product (the store is masked)
    else:  # tgmm: grid (tiles_n, tiles_k, active)
        grid = (nn, nk, active)
        n_i, k_i, g = grid_axes(grid)
        index = {"x": [tiles[g], k_i], "g_o": [tiles[g], n_i], "dw": [ids[g], k_i, n_i]}
        computing = int((offsets[ids[g] + 1] - offsets[ids[g]] > 0).sum())
    copies = {name: runs(idx) for name, idx in index.items()}
    nbytes = sum(copies.values()) * block_bytes((TILE, TILE), BF16)
    return {"grid": list(grid), "steps": math.prod(grid), "num_active_tiles": active, "computing": computing,
            "copies": copies, "hbm_bytes": nbytes}


# ------------------------------------------------------------------ 1b. many experts


@contextlib.contextmanager
def shaped(gen, tile: int, k: int, n: int):
    """The walk functions above at another module, tile and K = N (they read these globals)."""
    g = globals()
    saved = {name: g[name] for name in ("GEN", "TILE", "TILING", "K", "N")}
    g.update(GEN=gen, TILE=tile, TILING=(tile,) * 3, K=k, N=n)
    try:
        yield
    finally:
        g.update(saved)


def module_with_tiles(tile: int):
    """specs/grouped_matmul.spk retiled (m, k, n = tile), built in memory."""
    import re
    import types

    from sparsegen.compiler import compile_source
    from sparsegen.source import SourceFile

    text = re.sub(r"tile m = \d+, k = \d+, n = \d+", f"tile m = {tile}, k = {tile}, n = {tile}", (ROOT / "specs" / "grouped_matmul.spk").read_text())
    (built,) = compile_source(SourceFile("grouped_matmul.spk", text), "v5e")
    mod = types.ModuleType(f"grouped_matmul_{tile}")
    exec(compile(built.code, f"<grouped_matmul tile {tile}>", "exec"), mod.__dict__)
    return mod


def many_experts() -> list[dict]:
    """Issue 37's case: 256 sorted rows over 4,096 experts, 250 of them used, tiles of 128
    (two row blocks), K = N = 128: per pass, both walks' grid steps and block copies. Before
    the classification counted each (row block, expert) pair's rows, the forward ran every
    expert between a block's least and greatest id (4,059 steps and weight copies here)."""
    rng = np.random.default_rng(37)
    E, M = 4096, 256
    used = np.sort(rng.choice(E, 250, replace=False))
    sizes = np.zeros(E, np.int32)
    sizes[used] = 1 + np.bincount(rng.choice(250, M - 250), minlength=250)
    rows = []
    with shaped(module_with_tiles(128), 128, 128, 128):
        for side in ("fwd", "dx", "dw"):
            rows.append({"E": E, "M": M, "used": 250, "side": side, "sparsegen": ours_walk(M, E, gid_of(sizes), side),
                         "megablox": megablox_walk(M, sizes, side)})
    return rows


# ------------------------------------------------------------------ 2. AOT


def structs(M: int, E: int):
    return [jax.ShapeDtypeStruct((M, K), BF16), jax.ShapeDtypeStruct((E, K, N), BF16), jax.ShapeDtypeStruct((M,) if True else (), jnp.int32)]


def ours_fn(backward: bool):
    def fwd(x, w, gid):
        return GEN.grouped_matmul(x, w, gid)

    def both(x, w, gid):
        return jax.grad(lambda x, w: jnp.sum(GEN.grouped_matmul(x, w, gid).astype(jnp.float32)), argnums=(0, 1))(x, w)

    return both if backward else fwd


def megablox_fn(backward: bool):
    def fwd(x, w, sizes):
        return megablox.gmm(x, w, sizes, BF16, TILING)

    def both(x, w, sizes):
        return jax.grad(lambda x, w: jnp.sum(megablox.gmm(x, w, sizes, BF16, TILING).astype(jnp.float32)), argnums=(0, 1))(x, w)

    return both if backward else fwd


def aot(M: int, E: int, chips) -> list[dict]:
    import splash_side as splash

    rows = []
    for chip in chips:
        for backward in (False, True):
            row = {"E": E, "chip": chip, "pass": "fwd+bwd" if backward else "fwd"}
            for impl, fn, shapes in (("sparsegen", ours_fn(backward), structs(M, E)),
                                     ("megablox", megablox_fn(backward), structs(M, E)[:2] + [jax.ShapeDtypeStruct((E,), jnp.int32)])):
                try:
                    r = splash.aot_compile(fn, shapes, chip)
                    row[impl] = {"compile_s": round(r.compile_s, 2), "vmem": r.kernel_vmem, "max_vmem": r.vmem_bytes,
                                 "hbm_temp_bytes": r.temp_bytes}
                except Exception as exc:  # reported, the others still run
                    row[impl] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            rows.append(row)
    return rows


# ------------------------------------------------------------------ 3. cycles (helper process)


def _zeros(shape, dtype):
    """A zero array that takes no memory (the captured calls only need shapes)."""
    return np.broadcast_to(np.zeros((), dtype), shape)


def record(fn):
    """The pallas_calls `fn()` makes, run eagerly on the host with concrete tables."""
    from sparsegen.tpu.cycles import Call

    calls = []
    real = pl.pallas_call

    def recorded(kernel, **kwargs):
        def run(*a):
            calls.append(Call(kernel, kwargs, a))
            return jax.tree.map(lambda s: _zeros(s.shape, s.dtype), kwargs["out_shape"])

        return run

    pl.pallas_call = recorded
    try:
        with jax.disable_jit(), jax.default_device(jax.devices("cpu")[0]):
            fn()
    finally:
        pl.pallas_call = real
    return calls


class _FlatKernel:
    """megablox's kernel with its scalar prefetch (group_metadata tuple, group_offset)
    flattened to four tables and no existing_out, so that sparsegen/tpu/cycles.py can
    compile it and run its conditions on the host. `__wrapped__` points cycles at the
    megablox module's globals (its `pl`, `lax`, `jnp`)."""

    def __init__(self, inner):
        self.__wrapped__ = inner
        P = inspect.Parameter
        self.__signature__ = inspect.Signature([P(n, P.POSITIONAL_ONLY) for n in
                                                ("group_offsets", "group_ids", "m_tile_ids", "group_offset", "lhs", "rhs", "out", "acc")])

    def __call__(self, go, gi, mt, goff, lhs, rhs, out, acc):
        return self.__wrapped__((go, gi, mt), goff, lhs, rhs, None, out, acc)


def _flat_map(inner):
    def index_map(a, b, c, go, gi, mt, goff):
        return inner(a, b, c, (go, gi, mt), goff)

    return index_map


def flat_call(call):
    """A megablox Call with flat tables (see _FlatKernel)."""
    from jax.experimental.pallas import tpu as pltpu
    from sparsegen.tpu.cycles import Call

    gs = call.grid_spec
    (go, gi, mt), goff, lhs, rhs, existing = call.args
    assert existing is None
    in_specs = [dataclasses.replace(s, index_map=_flat_map(s.index_map)) for s in gs.in_specs if s is not None]
    out_specs = dataclasses.replace(gs.out_specs, index_map=_flat_map(gs.out_specs.index_map))
    grid = tuple(int(g) for g in gs.grid)
    spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=4, grid=grid, in_specs=in_specs, out_specs=out_specs,
                                        scratch_shapes=gs.scratch_shapes)
    kwargs = {**call.kwargs, "grid_spec": spec, "input_output_aliases": {}}
    return Call(_FlatKernel(call.kernel), kwargs, (np.asarray(go), np.asarray(gi), np.asarray(mt), np.asarray(goff), lhs, rhs))


def capture_pass(impl: str, side: str, M: int, E: int, dist: str):
    sizes = group_sizes(M, E, dist)
    gid = gid_of(sizes)
    x, w, g_o = _zeros((M, K), BF16), _zeros((E, K, N), BF16), _zeros((M, N), BF16)
    if impl == "sparsegen":
        shape = (M, K, E, N)
        fn = {"fwd": lambda: GEN._impl(x, w, jnp.asarray(gid), shape, False),
              "dx": lambda: GEN._d_x_call(x, w, jnp.asarray(gid), g_o, shape, False),
              "dw": lambda: GEN._d_w_call(x, w, jnp.asarray(gid), g_o, shape, False)}[side]
    else:
        s = jnp.asarray(sizes)
        fn = {"fwd": lambda: mb.gmm(x, w, s, BF16, TILING),
              "dx": lambda: mb.gmm(g_o, w, s, BF16, TILING, transpose_rhs=True),
              "dw": lambda: mb.tgmm(_zeros((K, M), BF16), g_o, s, BF16, TILING, num_actual_groups=E)}[side]
    (call,) = record(fn)  # one kernel: lax.cond with concrete ids runs only the bounded walk
    return call if impl == "sparsegen" else flat_call(call)


def weighted(call, device, fold_partial: bool) -> dict:
    """sparsegen/tpu/cycles.py's weighting, walk + (raw - zero), the regions' conditions
    looked up from constants. fold_partial: sparsegen's `_compute_partial` steps are counted
    as `_compute_full` ones (the same product without the select): libtpu's static profiler
    aborts walking the partial region of this kernel (LLO type check: "Expected
    vector-bf16packed, got vector-int16" on the vmatmul after the bf16 select), though the
    kernel compiles without the profile. The select's cost on partial steps is left out."""
    from sparsegen.tpu import cycles

    real = cycles.region_conditions(call)
    assumed = cycles.region_conditions(call, zero=True)
    names = [n for n, _ in real]
    bits = [c.copy() for _, c in real]
    folded = 0
    if fold_partial and "_compute_partial" in names:
        p, f = names.index("_compute_partial"), names.index("_compute_full")
        folded = int(bits[p].sum())
        bits[f] |= bits[p]
        bits[p][:] = False
    raw = cycles.estimate(call, device)[0]
    if all(np.array_equal(c, z) for (_, c), (_, z) in zip(real, assumed)):
        walk = zero = None
        total = raw
    else:
        axes = [cycles.varying_axes(call.grid, c, z) for c, (_, z) in zip(bits, assumed)]
        walk = cycles.estimate(call, device, bits, axes)[0]
        zero = cycles.estimate(call, device, [z for _, z in assumed], axes)[0]
        total = walk + raw - zero
    return {"cycles": total, "raw": raw, "walk": walk, "zero": zero, "grid": list(call.grid), "partial_folded_into_full": folded,
            "regions": {n: int(c.sum()) for n, c in real}}


def worker(request: str) -> None:
    """The helper process: one JSON line per job ("starting" first, so the parent knows
    which one libtpu aborted on)."""
    from sparsegen.tpu import cycles
    from sparsegen.tpu.targets import TARGETS
    from sparsegen.tpu.verify import _device

    target = TARGETS["v5e"]
    device = _device(target.topology)
    jobs = json.loads(Path(request).read_text())
    for job in jobs:
        print(json.dumps({"starting": job}), flush=True)
        start = time.perf_counter()
        try:
            call = capture_pass(job["impl"], job["side"], job["M"], job["E"], job["dist"])
            if job["impl"] == "megablox" and job["side"] != "dw":
                # gmm: its pl.when (k == 0) and lax.cond (k == tiles_k - 1) depend on program_id
                # alone, which the estimator resolves: the raw estimate is the real path.
                raw = cycles.estimate(call, device)[0]
                out = {"cycles": raw, "raw": raw, "walk": None, "zero": None, "grid": list(call.grid)}
            else:
                out = weighted(call, device, fold_partial=job["impl"] == "sparsegen")
        except cycles.NoProfile as exc:
            print(json.dumps({"job": job, "no_profile": str(exc)}), flush=True)
            return
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"}
        out["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps({"job": job, "result": out}), flush=True)


def _limit_memory():
    """The helper's address space is capped (16 GiB): libtpu's profiler, where it aborts on a
    kernel, first grew past 20 GiB on this shared machine."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))


def estimate_cycles(jobs: list[dict], timeout: float) -> list[dict]:
    """Run the helper process (restarted past a job libtpu aborts on); a result per job."""
    from sparsegen.tpu.cycles import FLAG

    results: dict[int, dict] = {}
    todo = list(range(len(jobs)))
    deadline = time.monotonic() + timeout
    while todo:
        with tempfile.TemporaryDirectory(prefix="gmm-cycles-") as tmp:
            req = Path(tmp) / "jobs.json"
            req.write_text(json.dumps([jobs[i] for i in todo]))
            env = {**os.environ, "LIBTPU_INIT_ARGS": f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {FLAG}={tmp}/profile".strip()}
            try:
                proc = subprocess.run([sys.executable, __file__, "--worker", str(req)], capture_output=True, text=True, env=env,
                                      timeout=max(1.0, deadline - time.monotonic()), preexec_fn=_limit_memory)
                stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as exc:
                stdout, stderr, rc = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or ""), "", "timeout"
        started = None
        for line in stdout.splitlines():
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if "starting" in msg:
                started = todo[0]
                continue
            i = todo.pop(0)
            started = None
            if "no_profile" in msg:
                results[i] = {"error": f"no static profile: {msg['no_profile']}"}
                for j in todo:
                    results[j] = {"error": "no static profile"}
                todo = []
                break
            results[i] = msg["result"]
            print(f"   cycles {jobs[i]['impl']:9s} {jobs[i]['side']} E={jobs[i]['E']:2d} {jobs[i]['dist']:7s}: "
                  f"{results[i].get('cycles') or results[i].get('error')} ({results[i].get('seconds')} s)", flush=True)
        if rc == 0 or not todo:
            break
        if rc == "timeout":
            for j in todo:
                results[j] = {"error": "not estimated: out of time"}
            break
        if started is None:
            tail = " | ".join(stderr.strip().splitlines()[-3:])
            for j in todo:
                results[j] = {"error": f"helper process stopped (exit {rc}): {tail[:300]}"}
            break
        why = next((ln.split("] ", 1)[-1] for ln in stderr.splitlines() if ln.startswith("F") and "] " in ln), f"exit {rc}")
        results[todo.pop(0)] = {"error": f"not estimated: libtpu's static profiler aborted: {why[:200]}"}
    return [results.get(i, {"error": "not run"}) for i in range(len(jobs))]


# ------------------------------------------------------------------ the report


def mxu_cycles(computing_steps: int) -> float:
    """The MXU minimum on v5e: 2 * 512^3 FLOPs per computing step at 131072 FLOPs a cycle."""
    return computing_steps * 2 * TILE**3 / 131072


def hbm_cycles(nbytes: int) -> int:
    return round(nbytes / HBM_V5E * CLOCK_V5E)


def print_tables(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=240)
    M = result["M"]
    t = Table(title=f"Grouped matmul, M = {M}, K = N = {K}, bf16, tiles 512: sparsegen (generated/grouped_matmul.py) vs megablox (ours / theirs)")
    for c in ("E", "groups", "pass", "grid", "grid steps", "computing", "partial", "block copies (per operand)", "HBM MiB",
              "cycles v5e (est.)", "ratio", "HBM cycles", "MXU min", "note"):
        t.add_column(c, justify="left" if c in ("groups", "pass", "grid", "block copies (per operand)", "note") else "right")
    for row in result["walk"]:
        o, m = row["sparsegen"], row["megablox"]
        oc, mc = row.get("cycles", {}).get("sparsegen", {}), row.get("cycles", {}).get("megablox", {})
        copies = " ".join(f"{k} {o['copies'][k]}/{m['copies'].get(k, '-')}" for k in o["copies"])
        cyc = (f"{oc['cycles']:,} / {mc['cycles']:,}" if oc.get("cycles") and mc.get("cycles")
               else f"{oc.get('cycles') or '-'} / {mc.get('cycles') or '-'}") if (oc or mc) else ""
        ratio = f"{oc['cycles'] / mc['cycles']:.2f}" if oc.get("cycles") and mc.get("cycles") else ""
        notes = []
        for who, c in (("sparsegen", oc), ("megablox", mc)):
            if c.get("error"):
                notes.append(f"{who}: {c['error'][:80]}")
        hb = (hbm_cycles(o["hbm_bytes"]), hbm_cycles(m["hbm_bytes"]))
        if oc.get("cycles") and hb[0] > oc["cycles"]:
            notes.append("sparsegen memory-bound")
        if mc.get("cycles") and hb[1] > mc["cycles"]:
            notes.append("megablox memory-bound")
        t.add_row(str(row["E"]), row["dist"], row["side"], f"{tuple(o['grid'])} / {tuple(m['grid'])}",
                  f"{o['steps']:,} / {m['steps']:,}", f"{o['computing']:,} / {m['computing']:,}", f"{o['partial']:,}",
                  copies, f"{o['hbm_bytes'] / 2**20:,.0f} / {m['hbm_bytes'] / 2**20:,.0f}", cyc, ratio,
                  f"{hb[0]:,} / {hb[1]:,}", f"{mxu_cycles(o['computing']):,.0f} / {mxu_cycles(m['computing']):,.0f}", "; ".join(notes))
    console.print(t)
    console.print("  grid steps: sparsegen's grid runs the steps the data needs (a traced extent, as megablox's num_active_tiles), over tables of row blocks + E - 1 steps "
                  "(sorted ids need at most that). partial: sparsegen steps that evaluate the "
                  "condition (megablox masks the store of every step). Cycles: the branch sorted ids take.")
    if result.get("many_experts"):
        e = Table(title="Many experts: M = 256 sorted rows, E = 4,096 (250 used), tiles 128, K = N = 128 (ours / theirs)")
        for c in ("pass", "grid steps", "computing", "block copies (per operand)"):
            e.add_column(c, justify="left" if c in ("pass", "block copies (per operand)") else "right")
        for row in result["many_experts"]:
            o, m = row["sparsegen"], row["megablox"]
            copies = " ".join(f"{k} {o['copies'][k]}/{m['copies'].get(k, '-')}" for k in o["copies"])
            e.add_row(row["side"], f"{o['steps']:,} / {m['steps']:,}", f"{o['computing']:,} / {m['computing']:,}", copies)
        console.print(e)
    if result.get("aot"):
        a = Table(title="Ahead-of-time compiles: scoped VMEM per Mosaic kernel (MiB), compile seconds (ours / theirs)")
        for c in ("E", "chip", "pass", "sparsegen VMEM", "megablox VMEM", "compile s"):
            a.add_column(c, justify="left" if c in ("chip", "pass") else "right")
        for r in result["aot"]:
            def vm(d):
                return d["error"][:60] if "error" in d else ", ".join(f"{v / 2**20:.2f}" for v in d["vmem"].values())
            cs = "/".join(f"{r[i]['compile_s']:.1f}" if "compile_s" in r[i] else "-" for i in ("sparsegen", "megablox"))
            a.add_row(str(r["E"]), r["chip"], r["pass"], vm(r["sparsegen"]), vm(r["megablox"]), cs)
        console.print(a)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="M = 2048, v5e only, forward cycles only")
    parser.add_argument("--no-cycles", action="store_true", help="skip the static cycle estimate")
    parser.add_argument("--no-aot", action="store_true")
    parser.add_argument("--cycles-cases", default=None,
                        help="E:groups:pass,... to estimate (default: 8:uniform:fwd,8:skewed:fwd; --quick: "
                             "8:uniform:fwd); 'all' for every row (hours at M = 16384: the profiled compiles grow with the grid)")
    parser.add_argument("--cycles-timeout", type=float, default=1800)
    parser.add_argument("--json", metavar="FILE", default=str(ROOT / "bench" / "results" / "grouped_matmul.json"))
    parser.add_argument("--worker", metavar="REQUEST", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        worker(a.worker)
        return 0
    started = time.perf_counter()
    M = 2048 if a.quick else 16384
    cases = [(E, dist) for E in (8, 64) for dist in ("uniform", "skewed")]
    result = {"M": M, "K": K, "N": N, "tiles": TILING, "dtype": "bf16", "jax": jax.__version__, "quick": a.quick,
              "group_sizes": {f"E={E} {d}": group_sizes(M, E, d).tolist() for E, d in cases}, "walk": []}
    print(f"1. The walk (M = {M})", flush=True)
    for E, dist in cases:
        sizes = group_sizes(M, E, dist)
        for side in ("fwd", "dx", "dw"):
            result["walk"].append({"E": E, "dist": dist, "side": side, "sparsegen": ours_walk(M, E, gid_of(sizes), side),
                                   "megablox": megablox_walk(M, sizes, side)})
    print("1b. Many experts (issue 37: 256 rows, 4,096 experts, 250 used, tiles 128)", flush=True)
    result["many_experts"] = many_experts()
    if not a.no_aot:
        print("2. Ahead-of-time compiles", flush=True)
        t0 = time.perf_counter()
        result["aot"] = []
        for E in ((8,) if a.quick else (8, 64)):
            result["aot"] += aot(M, E, ["v5e"] if a.quick else ["v5e", "v6e"])
        result["aot_s"] = round(time.perf_counter() - t0, 1)
    if not a.no_cycles:
        print("3. Static cycle estimates (v5e, helper process)", flush=True)
        t0 = time.perf_counter()
        jobs, where = [], []
        wanted = a.cycles_cases or ("8:uniform:fwd" if a.quick else "8:uniform:fwd,8:skewed:fwd")
        wanted = None if wanted == "all" else {tuple(c.split(":")) for c in wanted.split(",")}
        for n, row in enumerate(result["walk"]):
            if wanted is not None and (str(row["E"]), row["dist"], row["side"]) not in wanted:
                continue
            for impl in ("sparsegen", "megablox"):
                jobs.append({"impl": impl, "side": row["side"], "M": M, "E": row["E"], "dist": row["dist"]})
                where.append((n, impl))
        for (n, impl), r in zip(where, estimate_cycles(jobs, a.cycles_timeout)):
            result["walk"][n].setdefault("cycles", {})[impl] = r
        result["cycles_s"] = round(time.perf_counter() - t0, 1)
    result["total_s"] = round(time.perf_counter() - started, 1)
    print_tables(result)
    print(f"total {result['total_s']} s (AOT {result.get('aot_s', '-')} s, cycles {result.get('cycles_s', '-')} s)")
    if a.json:
        path = Path(a.json)
        if a.quick and path.name == "grouped_matmul.json":
            path = path.with_name("grouped_matmul_quick.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
