"""The pipeline simulator and cost model behind `sparsegen plan --pattern` and `variants`.

It walks a generated kernel's grid in order with the module's own `_prefetch` and index
map functions (evaluated on numpy arrays of every grid step at once) and counts, per
operand, block copies HBM->VMEM (a copy whenever the block index differs from the
previous step's, as the Pallas pipeline does), output write-backs, the steps whose compute
runs, and wasted copies (a copy whose block no consuming step uses before the operand's
next copy). The ideal is one copy per run of consecutive uses; the first step's copy is
made even when no step uses the block (the pipeline's prologue), so it is not counted
as waste. A roofline turns the counts into time on each target.

Needs jax (the generated code is jax); imported lazily by the CLI.
"""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass, field

import numpy as np

from ..callconv import operand_indices
from ..expr import Bin, Call, Const, Expr, Load, Max, Min, Var, Where, evaluate
from ..ir import Kernel
from ..patterns import LazyMask

from .arguments import pattern_args
from .lower import TpuModule, TpuPass, block_bytes, lower
from .targets import TARGETS, Target

# Fixed cost of one grid step of a Pallas TPU pipeline (JAX docs, "Pipelining": about 0.35 us).
STEP_SECONDS = 0.35e-6


@dataclass
class Traffic:
    operand: str
    block_bytes: int
    copies: int = 0
    ideal: int = 0
    wasted: int = 0


@dataclass
class Simulation:
    grid: tuple[int, ...]
    steps: int
    block_products: int
    flops: int
    write_backs: int
    out_block_bytes: int
    prefetch_bytes: int
    traffic: dict[str, Traffic]
    trace: dict[str, np.ndarray] = field(default_factory=dict)  # per-step arrays, for pictures

    @property
    def wasted_copies(self) -> int:
        return sum(t.wasted for t in self.traffic.values())

    @property
    def hbm_bytes(self) -> int:
        reads = sum(t.copies * t.block_bytes for t in self.traffic.values())
        return reads + self.write_backs * self.out_block_bytes + self.prefetch_bytes


# ------------------------------------------------------------------ modules


def load_module(plan: TpuModule, name: str | None = None, host: bool = True, backward: bool = False):
    """The plan's generated module, executed in memory (not black-formatted: faster).

    With `host`, its `jnp` and `lax` are numpy stand-ins: the module's own `_prefetch` and
    index maps then run on numpy arrays of every grid step at once, with no XLA compile
    per array shape (which made variants slow), and the same code path as on a TPU. With
    `backward`, the backward passes' functions are there too.
    """
    import dataclasses

    from .emit import _Emitter

    if not backward:  # the forward is what usually runs here: half the text
        plan = dataclasses.replace(plan, backward=None, backward_module=None, backward_error=None)
    code = _Emitter(plan).module("<memory>")
    module = types.ModuleType(name or f"sparsegen_sim_{plan.name}")
    exec(compile(code, f"<sparsegen {plan.name}>", "exec"), module.__dict__)
    if host:
        module.jnp, module.lax = _HOST_JNP, _HOST_LAX
        module.pl = _HOST_PL
        if hasattr(module, "_block_kinds"):
            module._block_kinds = _host_block_kinds(module)
    return module


def _host_block_kinds(module):
    """The module's `_block_kinds`, reading a `LazyMask`'s blocks where the pattern knows them
    (its elements are never made), else the module's own on the elements. What it returns is
    what the module's own returns (test_simulate's test_host_block_kinds_agree checks it)."""
    own = module._block_kinds

    def block_kinds(mask, tiles, ones):
        found = mask.blocks(tiles) if isinstance(mask, LazyMask) else None
        if found is None:
            return own(np.asarray(mask), tiles, ones)
        nonzero, all_ones = found
        kind = np.where(nonzero, module._PARTIAL, module._EMPTY)
        if ones:
            kind = np.where(all_ones, module._FULL, kind)
        return kind.astype(np.int32)

    return block_kinds


class _HostNumpy(types.ModuleType):
    """`jnp` for host evaluation: numpy, with jnp's spellings where they differ."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def argsort(a, axis=-1, stable=False):
        return np.argsort(a, axis=axis, kind="stable" if stable else None)


class _HostLax(types.ModuleType):
    """The few `lax` functions generated code uses, for non-negative integers on the host."""

    @staticmethod
    def div(a, b):
        return np.floor_divide(a, b)

    @staticmethod
    def rem(a, b):
        return np.remainder(a, b)

    @staticmethod
    def cummin(x, reverse=False):
        return np.minimum.accumulate(x[::-1])[::-1] if reverse else np.minimum.accumulate(x)

    @staticmethod
    def cummax(x, axis=0, reverse=False):
        x = np.flip(x, axis) if reverse else x
        out = np.maximum.accumulate(x, axis=axis)
        return np.flip(out, axis) if reverse else out

    @staticmethod
    def cond(pred, true_fn, false_fn, *operands):
        return true_fn(*operands) if pred else false_fn(*operands)


class _HostPallas(types.ModuleType):
    @staticmethod
    def cdiv(a, b):
        return -(-a // b)


_HOST_JNP = _HostNumpy("jnp (numpy on the host)")
_HOST_LAX = _HostLax("lax (numpy on the host)")
_HOST_PL = _HostPallas("pl (numpy on the host)")


def dense_kernel(kernel: Kernel) -> Kernel:
    """The same statement and tiles with no sparse operand: the baseline a sparse kernel beats."""
    operands = tuple(dataclasses.replace(op, sparsity="dense") if op.sparsity in ("coo", "mask") else op for op in kernel.operands)
    # A condition on a product's terms is dropped too: the dense product is the baseline.
    statements = tuple(dataclasses.replace(st, condition=None) if getattr(st, "condition", None) is not None and kernel.einsums_only else st
                       for st in kernel.statements)
    return dataclasses.replace(kernel, operands=operands, statements=statements, name=f"{kernel.name}_dense")


# ----------------------------------------------------------------- simulate


def _evaluate(e: Expr, env: dict):
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Load):
        return np.asarray(env[e.array])[np.asarray(_evaluate(e.index, env))]
    if isinstance(e, Max):
        return np.maximum(_evaluate(e.a, env), _evaluate(e.b, env))
    if isinstance(e, Min):
        return np.minimum(_evaluate(e.a, env), _evaluate(e.b, env))
    if isinstance(e, Where):
        return np.where(_evaluate(e.cond, env), _evaluate(e.a, env), _evaluate(e.b, env))
    if isinstance(e, Call):
        (arg,) = e.args
        d = _evaluate(arg, env)
        return env["__axes__"][d] if e.fn == "pl.program_id" else env["__grid__"][d]
    if isinstance(e, Bin):
        a, b = _evaluate(e.a, env), _evaluate(e.b, env)
        ops = {
            "+": np.add, "-": np.subtract, "*": np.multiply, "//": np.floor_divide, "%": np.remainder,
            "==": np.equal, "!=": np.not_equal, "<": np.less, ">": np.greater, "<=": np.less_equal, ">=": np.greater_equal,
            "&": np.logical_and, "|": np.logical_or, "cdiv": lambda a, b: -(-a // b),
        }  # fmt: skip
        return ops[e.op](a, b)
    raise TypeError(e)


def _runs(keys, steps: int | None = None) -> np.ndarray:
    """Per step: does its key differ from the previous step's (a new run). `keys`: one row
    per coordinate (a 2-D array, or 1-D arrays of `steps`), compared row by row: a row
    broadcast from one value (strides 0) never changes and is not compared."""
    rows = list(keys)
    changed = np.zeros(len(rows[0]) if steps is None else steps, bool)
    changed[:1] = True
    for row in _varying(rows):
        changed[1:] |= row[1:] != row[:-1]
    return changed


def _varying(rows: list[np.ndarray]) -> list[np.ndarray]:
    """The rows that may change from step to step (not broadcast from one value)."""
    return [row for row in rows if len(row) > 1 and row.strides[0] != 0]


def _coordinate(c, steps: int) -> np.ndarray:
    """An index map's coordinate at every step (a scalar broadcast, not copied), as integers."""
    a = np.asarray(c)
    return np.broadcast_to(a if a.dtype.kind in "iub" else a.astype(np.int64), (steps,))


def impl_args(plan: TpuModule, module, args: list) -> list:
    """The arrays `_prepare` hands the kernel (params, padding flags, offsets), in the order
    its passes take them; `args` holds one array (or None) per non-index param."""
    conv = plan.conv
    params = [q for q in conv.params if q.kind != "index"]
    by_name = {p.internal: a for p, a in zip(params, args)}
    for operand, var in conv.pads:
        coords = [(p.public, by_name[p.internal]) for p in params if p.operand == operand and p.kind in ("coords", "out_coords")]
        by_name[var] = module._check_padding(*zip(*coords))
    if conv.offsets:
        by_name[conv.offsets] = np.zeros(len(conv.offset_uses), np.int32)
    return [by_name.get(name) for name in conv.impl_args]


def simulate(plan: TpuModule, module, args: list, sizes: dict[str, int], keep_trace: bool = False) -> Simulation:
    """Walk the grid of every pass of `plan` (whose generated module is `module`) for these
    arguments (`pattern_args`), adding up the passes."""
    full = impl_args(plan, module, args)
    sims = [_simulate_pass(plan, tp, module, full, sizes, keep_trace) for tp in plan.passes]
    if len(sims) == 1:
        return sims[0]
    total = sims[0]
    for sim in sims[1:]:
        traffic = dict(total.traffic)
        for name, t in sim.traffic.items():
            key = name if name not in traffic else f"{name} ({len(traffic)})"
            traffic[key] = t
        total = Simulation(total.grid, total.steps + sim.steps, total.block_products + sim.block_products, total.flops + sim.flops,
                           total.write_backs + sim.write_backs, total.out_block_bytes, total.prefetch_bytes + sim.prefetch_bytes, traffic, total.trace)
    return total


def _simulate_pass(plan: TpuModule, tp: TpuPass, module, args: list, sizes: dict[str, int], keep_trace: bool) -> Simulation:
    conv, p = plan.conv, tp.p
    by_name = dict(zip(conv.impl_args, args))
    env = p.count_values({s.internal: sizes[s.symbol] for s in conv.sizes}, {**vars(module), **by_name},
                         lambda name: np.shape(by_name[name])[0])
    k = plan.kernel
    out_bytes = block_bytes(k, tp.out_spec)
    traffic = {s.block.operand: Traffic(s.block.operand, block_bytes(k, s)) for s in tp.in_specs}
    if any(env[var] == 0 for var, _ in p.counts):  # the generated function returns early: no grid at all
        return Simulation((), 0, 0, 0, 0, out_bytes, 0, traffic)
    if p.fallback is not None:  # the grid runs the steps the data needs (a traced extent in the module)
        needed = int(eval(p.fallback.needed_value, {**vars(module), **env, **by_name}))
        env[p.fallback.run] = min(needed, env[p.fallback.count])
    grid = tuple(int(evaluate(a.extent, env)) for a in p.axes)
    steps = math.prod(grid)
    axes = np.indices(grid, dtype=np.int32).reshape(len(grid), steps)
    sizes_tuple = tuple(sizes[s.symbol] for s in conv.sizes)
    prefetch = [np.asarray(a) for a in getattr(module, tp.prefetch_fn)(*args, sizes_tuple)] if p.tables else []
    statics = {name: int(evaluate(value, env)) for s in tp.specs for name, value in s.statics}
    names = {t.var: arr for t, arr in zip(p.tables, prefetch)}
    body_env = {**names, "__axes__": axes, "__grid__": grid}
    for d, a in enumerate(p.axes):
        body_env[a.var] = axes[d]
        body_env[a.static] = grid[d]
    for const in ("_BLOCK", "_FLUSH", "_LAST", "_SKIP", "_EMPTY", "_PARTIAL", "_FULL"):
        if hasattr(module, const):
            body_env[const] = getattr(module, const)
    body = p.body
    for name, value in body.lets:
        body_env[name] = _evaluate(value, body_env)

    def condition(e):
        return np.ones(steps, bool) if e is None else np.broadcast_to(np.asarray(_evaluate(e, body_env), bool), (steps,))

    compute = condition(body.compute_when) if body.accumulator else np.zeros(steps, bool)
    flush = condition(body.flush_when)
    computing = {f.block for q in (*body.summed, *body.step) for f in q.factors}
    consumers = {}
    for s in tp.in_specs:
        if s.block.key in computing and body.accumulator:
            consumers[s.block.key] = compute
            if body.split is not None and s.block.operand == body.split.mask:
                consumers[s.block.key] = compute & condition(body.split.partial)  # not read where all ones
        else:
            used = np.zeros(steps, bool)
            for case in body.flush_cases:
                if case.products is not None and any(f.block == s.block.key for q in case.products for f in q.factors):
                    used |= flush & condition(case.when)
            consumers[s.block.key] = used
    trace = {"compute": compute, "flush": flush} if keep_trace else {}
    write_backs = 0
    for s in tp.specs:
        fn = getattr(module, s.fn)
        kwargs = {name: statics[name] for name, _ in s.statics}
        coords = fn(*axes, *prefetch, **kwargs)
        keys = [_coordinate(c, steps) for c in coords]  # one row per coordinate
        new = _runs(keys, steps)
        if s.block.is_output:
            write_backs = int(new.sum())
            if keep_trace:
                trace["out"] = np.stack(keys).astype(np.int64)
            continue
        t = traffic[s.block.operand]
        used = consumers[s.block.key]
        wasted = count_copies(t, keys, used, per_step=keep_trace)
        if keep_trace:
            trace[f"copy:{s.block.operand}"] = new
            trace[f"wasted:{s.block.operand}"] = wasted
            trace[f"use:{s.block.operand}"] = used
    products = int(compute.sum()) if body.accumulator else int(flush.sum())
    prefetch_bytes = sum(a.nbytes for a in prefetch)
    return Simulation(grid, steps, products, products * p.flops_per_product, write_backs, out_bytes, prefetch_bytes, traffic, trace)


def count_copies(t: Traffic, keys, used: np.ndarray, per_step: bool = False) -> np.ndarray | None:
    """Set `t`'s copies, ideal and wasted copies from an operand's block index at every step
    (`keys`, one row per coordinate: `_runs`) and the steps that use its block; with
    `per_step`, return per step whether it starts a wasted copy (for pictures)."""
    rows = list(keys)
    steps = len(used)
    new = _runs(rows, steps)
    starts = np.flatnonzero(new)  # each run's first step: a copy
    t.copies = len(starts)
    # A run is used where any of its steps is (one pass over the steps, not one per run).
    used_runs = np.logical_or.reduceat(used, starts) if steps else np.zeros(0, bool)
    t.wasted = int(t.copies - used_runs.sum())
    if not used.any():
        t.wasted -= 1  # the prologue copy: made even when no step uses the block
    t.ideal = max(1, int(_runs([row[used] for row in _varying(rows)], int(used.sum())).sum())) if used.any() else 1
    return new & ~np.repeat(used_runs, np.diff(starts, append=steps)) if per_step else None


# ------------------------------------------------------------------- costs


def peak_ops(target: Target, kernel: Kernel) -> float:
    """Peak multiply-add throughput for the kernel's operand dtypes (f32 matmuls take about
    three bf16 passes at full precision)."""
    dtypes = {o.dtype.name for o in kernel.data_inputs}
    if dtypes <= {"bf16"}:
        return target.bf16_flops
    if dtypes & {"i8", "u8"} and target.int8_ops:
        return target.int8_ops
    return target.bf16_flops / 3


def roofline(sim: Simulation, kernel: Kernel, target: Target, parallel: bool) -> dict:
    """Seconds as the larger of compute and HBM time, plus the per-step overhead."""
    cores = target.cores if parallel else 1
    compute = sim.flops / (peak_ops(target, kernel) * cores / target.cores)
    memory = sim.hbm_bytes / target.hbm_bytes_per_s
    seconds = max(compute, memory) + sim.steps * STEP_SECONDS / cores
    return {"seconds": seconds, "compute_seconds": compute, "memory_seconds": memory, "bound": "compute" if compute >= memory else "memory"}


@dataclass
class Report:
    plan: TpuModule
    sizes: dict[str, int]
    pattern: str
    sim: Simulation
    dense: Simulation
    estimates: dict[str, dict]
    blocks: np.ndarray | None = None  # the sparse operand's block pattern (kinds or counts), for pictures
    notes: tuple[str, ...] = ()  # what the figures assume (a row walk: how the pattern was used)
    products: str = "block products"  # what `sim.block_products` counts, in words

    def to_json(self) -> dict:
        sim = self.sim
        return {
            "kernel": self.plan.name,
            "pattern": self.pattern,
            "shapes": self.sizes,
            "grid": list(sim.grid),
            "grid_steps": sim.steps,
            "block_products": sim.block_products,
            "dense_block_products": self.dense.block_products,
            "copies": {t.operand: t.copies for t in sim.traffic.values()},
            "ideal_copies": {t.operand: t.ideal for t in sim.traffic.values()},
            "wasted_copies": sim.wasted_copies,
            "write_backs": sim.write_backs,
            "hbm_bytes": sim.hbm_bytes,
            "dense_hbm_bytes": self.dense.hbm_bytes,
            "flops": sim.flops,
            "dense_flops": self.dense.flops,
            "vmem_bytes": self.plan.vmem_bytes,
            "estimate": self.estimates,
            **({"notes": list(self.notes)} if self.notes else {}),
        }


def dense_twin(plan: TpuModule) -> TpuModule:
    return lower(dense_kernel(plan.kernel), plan.target, backward=False)


def analyse_einsum(plan: TpuModule, sizes: dict[str, int], pattern: str, targets=("v5e",), seed: int = 0, module=None,
                   trace: bool = False) -> Report:
    """Simulate a plan on a pattern and its dense twin on everything; estimate both per target."""
    k = plan.kernel
    env = {s: (lit if lit is not None else sizes[s]) for s, lit in k.symbols}
    args, by_operand = pattern_args(plan, env, pattern, seed, lazy=module is None or getattr(module, "jnp", None) is _HOST_JNP)
    module = module or load_module(plan)
    sim = simulate(plan, module, args, env, keep_trace=trace)
    dense_plan = dense_twin(plan)
    dense_module = load_module(dense_plan)
    dense_args = [None for p in dense_plan.conv.params if p.kind != "index"]
    dense = simulate(dense_plan, dense_module, dense_args, env)
    estimates = {}
    parallel = any(a.parallel for tp in plan.passes for a in tp.p.axes)
    for name in targets:
        target = TARGETS[name]
        ours = roofline(sim, k, target, parallel)
        base = roofline(dense, k, target, any(a.parallel for tp in dense_plan.passes for a in tp.p.axes))
        estimates[name] = {
            "seconds": ours["seconds"],
            "dense_seconds": base["seconds"],
            "speedup": base["seconds"] / ours["seconds"] if ours["seconds"] else float("inf"),
            "bound": ours["bound"],
        }
    return Report(plan, env, pattern, sim, dense, estimates, _block_picture(plan, env, by_operand))


def _block_picture(plan: TpuModule, env: dict[str, int], by_operand: dict) -> np.ndarray | None:
    """Per block of the sparse operand: 0 empty, 1 partial, 2 full (a mask) or a count (coo)."""
    k = plan.kernel
    sparse = next((o for o in k.operands if o.sparsity in ("coo", "mask") and o.name in by_operand), None)
    if sparse is None or sparse.rank != 2:
        return None
    tiles = [k.index(i).tile for i in operand_indices(k, sparse)]
    shape = [d.literal if d.literal is not None else env[d.symbol] for d in sparse.dims]
    grid = [-(-s // t) for s, t in zip(shape, tiles)]
    if sparse.sparsity == "mask":
        found = by_operand[sparse.name].blocks(tiles) if isinstance(by_operand[sparse.name], LazyMask) else None
        if found is not None:
            return np.where(found[1], 2, found[0].astype(int))
        mask = np.pad(np.asarray(by_operand[sparse.name]), [(0, -s % t) for s, t in zip(shape, tiles)])
        blocks = mask.reshape(grid[0], tiles[0], grid[1], tiles[1])
        nonzero = (blocks != 0).any(axis=(1, 3))
        ones = (blocks == 1).all(axis=(1, 3))
        return np.where(ones, 2, nonzero.astype(int))
    counts = np.zeros(grid, int)
    np.add.at(counts, tuple(by_operand[sparse.name]), 1)
    return counts


def describe_report(report: Report) -> list[str]:
    from .targets import format_bytes

    sim, dense = report.sim, report.dense
    lines = [f"  pattern {report.pattern} at " + ", ".join(f"{k}={v}" for k, v in report.sizes.items())]
    lines.append(f"    grid {sim.grid}: {sim.steps} steps; {report.products} {sim.block_products} of {dense.block_products} dense")
    lines += [f"    note: {n}" for n in report.notes]
    for t in sim.traffic.values():
        lines.append(f"    {t.operand}: {t.copies} copies of {format_bytes(t.block_bytes)} (ideal {t.ideal}, wasted {t.wasted})")
    lines.append(f"    output write-backs {sim.write_backs}; HBM {format_bytes(sim.hbm_bytes)} (dense {format_bytes(dense.hbm_bytes)}); "
                 f"{sim.flops / 1e9:.2f} GFLOP (dense {dense.flops / 1e9:.2f})")
    for name, e in report.estimates.items():
        lines.append(f"    {name}: ~{e['seconds'] * 1e3:.3f} ms ({e['bound']}-bound), dense ~{e['dense_seconds'] * 1e3:.3f} ms: "
                     f"{e['speedup']:.2f}x")
    return lines
