"""`make run`: every generated kernel against its reference in the TPU simulator, as a table;
then every kernel the GPU backend takes, built for h200, in the Mosaic GPU interpreter.

    python scripts/run_examples.py [--all] [--targets v5e,v6e] [--jobs N] [KERNEL ...]

names some kernels (and their specs) only, and the TPU targets compiled ahead of time
(tests/test_run_examples.py runs one kernel so). The work (per spec: the simulator, the
ahead-of-time compiles, the GPU stages) is independent, and runs in one worker process per
core (`--jobs`); the tables are printed in the specs' order when all is done.

The simulator fills uninitialised memory with NaN and raises on out-of-bounds reads and on
non-consecutive output revisits, so a pass here is the closest thing to a TPU run. The GPU
table adds each kernel's lowering under an abstract H200 and, where `make gpu-venv` made
the plugin's environment, its ptxas compile for sm_90a.

`make run` compiles each spec ahead of time for one TPU target, the targets taken in turn
(the next where one refuses the spec: v4 has no int8 matmul), and runs ptxas for one
example of each GPU walk (PTXAS_EXAMPLES), lowering every one: every kernel still runs in
the simulator and the GPU interpreter. `make run-all` (`--all`) compiles every spec for every
target and runs ptxas on every GPU kernel (tests/test_verify.py and the GPU tests do both).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

from sparsegen.jaxenv import interpreter_threads, quiet_libtpu, unoptimised_cpu_compiles  # noqa: E402

quiet_libtpu()
interpreter_threads()  # warp-specialized CTAs in the GPU interpreter: a thread per warpgroup (inherited by workers)

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from sparsegen.compiler import plans  # noqa: E402
from sparsegen.testing import example_args, resolve_sizes, tolerance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Two to three blocks along each index at the spec's own tiles: small enough for the simulator.
BLOCKS = 2
TARGETS = ("v5e", "v6e", "v4")
# ptxas in `make run`: one example of each GPU walk (a coo input, a coo output, a mask, a
# condition on the terms, a grouped walk, the row walk, the paged walk); `--all`: every one.
PTXAS_EXAMPLES = {"dsd_matmul", "sdd_matmul", "masked_matmul", "tril_matmul", "grouped_matmul", "causal_attention", "paged_decode"}


def sizes_for(kernel) -> dict[str, int]:
    sizes = {}
    summed = {i for st in kernel.statements for i in getattr(st, "summed", ())}
    for index in kernel.indices:
        if index.size.symbol is not None and index.size.literal is None:
            sizes[index.size.symbol] = index.tile * (BLOCKS + (1 if index.name in summed else 0))
    for rel in kernel.relations:  # `h // n`: the smaller size follows
        big = kernel.index(rel.index).size.symbol
        sizes[big] = max(sizes.get(big, 1), rel.divisor) // rel.divisor * rel.divisor
        sizes.pop(rel.dim.symbol, None)
    return sizes


def matches(kernel, out, ref, env) -> tuple[float, bool]:
    """The largest error over the kernel's outputs, and whether each is within its tolerance."""
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    worst, ok = 0.0, True
    for op, o, r in zip(kernel.outputs, outs, refs):
        o, r = np.asarray(o).astype(np.float64), np.asarray(r).astype(np.float64)
        if not o.size:
            continue
        rtol, atol = tolerance(kernel, op.name, env)
        scale = max(1.0, float(np.sqrt(np.mean(r**2))))
        worst = max(worst, float(np.abs(o - r).max()))
        ok &= bool(np.allclose(o, r, rtol=rtol, atol=atol * scale)) and not np.isnan(o).any()
    return worst, ok


def load_generated(name: str):
    spec = importlib.util.spec_from_file_location(f"generated_{name}", ROOT / "generated" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def chosen_specs(only: set[str] | None) -> list[Path]:
    """The example specs, those defining a kernel of `only` where given."""
    specs = sorted((ROOT / "specs").glob("*.spk"))
    if only is None:
        return specs
    chosen = [s for s in specs if only & {p.kernel.name for p in plans(s)}]
    known = {p.kernel.name for s in specs for p in plans(s)}
    if only - known:
        raise SystemExit(f"run_examples: no example kernel {', '.join(sorted(only - known))} (known: {', '.join(sorted(known))})")
    return chosen


def aot_cells(spec: Path, targets: tuple[str, ...], turn: int | None = None) -> dict:
    """Ahead-of-time compiles through libtpu of a spec's kernels, one cell per target
    (sparsegen verify --quick): {(kernel, target): (cell, compiled)}. `turn`: one target
    only, `targets[turn % len]` (the next where it refuses the spec), the others' cells "·"."""
    from sparsegen import verify

    def refused(r) -> bool:  # the target's rule, at the spec (v4: no int8 matmul)
        return not r.compiled and r.error is not None and r.raw_error is None

    def cell(r):
        if r.compiled:
            return f"[green]ok[/green] {r.compile_seconds:.1f}s", True
        if refused(r):
            return f"[yellow]refused[/yellow]: {r.error.message}", True
        return "[red]fails[/red]", False

    if turn is None:
        return {(r.kernel, r.target): cell(r) for r in verify.verify_file(spec, targets, probe=False)[1]}
    results = []
    for n in range(len(targets)):
        results = verify.verify_file(spec, (targets[(turn + n) % len(targets)],), probe=False)[1]
        if not all(refused(r) for r in results):
            break
    cells = {(r.kernel, r.target): cell(r) for r in results}
    return {(k, t): cells.get((k, t), ("·", True)) for k, _ in cells for t in targets}


def simulator_rows(spec: Path, only: set[str] | None) -> list[tuple[str, list[str], bool]]:
    """A spec's kernels against their references in the TPU simulator: (kernel, the row's
    first cells, ok) per kernel and pattern."""
    import jax
    from jax.experimental.pallas import tpu as pltpu

    rows = []
    for plan in plans(spec):
        kernel = plan.kernel
        if only is not None and kernel.name not in only:
            continue
        walk = " + ".join(plan.walks)
        module = load_generated(kernel.name)
        sizes = sizes_for(kernel)
        env = resolve_sizes(kernel, sizes)
        patterns = {"mask": ("tril", "random"), "dense": ("random",)}.get(walk, ("random", "all_empty"))
        for pattern in patterns:
            args, keywords = example_args(kernel, sizes, pattern, np.random.default_rng(0))
            ref = module.reference(*args, **keywords)
            start = time.perf_counter()
            try:
                out = getattr(module, kernel.name)(*args, **keywords, interpret=pltpu.InterpretParams())
                out = jax.block_until_ready(out)
                error, ok = matches(kernel, out, ref, env)
                result = "[green]ok[/green]" if ok else "[red]MISMATCH[/red]"
            except Exception as exc:  # report and go on: the table is the point
                pltpu.reset_tpu_interpret_mode_state()
                error, ok, result = float("nan"), False, f"[red]{type(exc).__name__}[/red]"
            elapsed = time.perf_counter() - start
            shapes = ", ".join(f"{k}={env[k]}" for k in sizes) or "fixed"
            rtol = max(tolerance(kernel, o.name, env)[0] for o in kernel.outputs)
            rows.append((kernel.name, [kernel.name, walk, shapes, pattern, f"{error:.3g}", f"rtol {rtol:.2g}", f"{elapsed:.2f} s", result], ok))
    return rows


def _job(kind: str, spec: Path, only: set[str] | None, targets: tuple[str, ...], every: bool = False):
    """One piece of the run, in a worker process (they are independent: spread over the
    cores): its result, and the CPU seconds it took (ptxas's process included)."""
    before = _cpu()
    turn = None if every else chosen_specs(None).index(spec)
    result = {"aot": lambda: aot_cells(spec, targets, turn), "simulator": lambda: simulator_rows(spec, only),
              "gpu": lambda: gpu_rows(spec, only, every)}[kind]()
    return result, _cpu() - before


def _cpu() -> float:
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))


def _init_worker() -> None:
    quiet_libtpu()
    unoptimised_cpu_compiles()  # the simulator's and GPU interpreter's compiles; AOT unchanged


def run_all(only: set[str] | None, targets: tuple[str, ...], jobs: int, every: bool = False) -> dict:
    """Every job's result, {(kind, spec): result}: in `jobs` worker processes (spawned: jax
    does not survive a fork), or in this one where `jobs` is 1."""
    work = [(kind, spec) for spec in chosen_specs(only) for kind in ("gpu", "simulator", "aot")]
    if jobs <= 1:
        unoptimised_cpu_compiles()
        return {(kind, spec): _job(kind, spec, only, targets, every) for kind, spec in work}
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # each worker loads libtpu (compiles only)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker) as pool:
        futures = {(kind, spec): pool.submit(_job, kind, spec, only, targets, every) for kind, spec in work}
        return {key: future.result() for key, future in futures.items()}


def main(only: set[str] | None = None, targets: tuple[str, ...] = TARGETS, jobs: int = 1, every: bool = False) -> int:
    start = time.perf_counter()
    done = run_all(only, targets, jobs, every)
    table = Table(title="generated kernels vs reference in the TPU simulator; ahead-of-time compiles per TPU target")
    for column in ("kernel", "walk", "shapes", "pattern", "max |err|", "tolerance", "sim time", "result", *targets):
        table.add_column(column, justify="right" if column in ("max |err|", "sim time") else "left")
    failures = 0
    cpu = {}
    for (kind, _), (_, seconds) in done.items():
        cpu[kind] = cpu.get(kind, 0.0) + seconds
    done = {key: result for key, (result, _) in done.items()}
    for spec in chosen_specs(only):
        compiles = done["aot", spec]
        failures += sum(not compiled for _, compiled in compiles.values())
        seen = set()
        for name, cells, ok in done["simulator", spec]:
            failures += not ok
            aot = [compiles[name, t][0] if name not in seen else "" for t in targets]  # on the kernel's first row
            seen.add(name)
            table.add_row(*cells, *aot)
    Console(width=170).print(table)
    if not every and len(targets) > 1:
        print("·: compiled for one TPU target a spec, in turn (make run-all: every target)")
    failures += print_gpu(only, [done["gpu", spec] for spec in chosen_specs(only)])
    spent = ", ".join(f"{kind} {cpu[kind]:.0f}" for kind in ("simulator", "aot", "gpu"))
    print(f"{time.perf_counter() - start:.0f} s in {jobs} process{'es' if jobs > 1 else ''}; CPU seconds: {spent}")
    return 1 if failures else 0


def gpu_rows(spec: Path, only: set[str] | None = None, every: bool = True) -> list[tuple[list[str], bool, str | None]]:
    """A spec built for h200 (nothing where the GPU rules refuse it: a stored score, a
    kernel over the shared-memory budget), one block along each symbolic index, in the
    Mosaic GPU interpreter; lowering and ptxas: (row, ok, why ptxas was skipped) per kernel."""
    import importlib.util as util
    import tempfile

    from sparsegen.compiler import compile_source
    from sparsegen.verify import verify_gpu_module
    from sparsegen.source import SourceFile, SpecError

    rows = []
    folder = Path(tempfile.mkdtemp(prefix="sparsegen-gpu-"))
    source = SourceFile.read(spec)
    try:
        built = compile_source(source, "h200", origin=spec.name)
    except SpecError:
        return rows  # refused for GPUs (README, "GPUs")
    for m in built:
        kernel = m.plan.kernel
        if only is not None and kernel.name not in only:
            continue
        path = folder / f"{m.kernel}.py"
        path.write_text(m.code)
        loader = util.spec_from_file_location(f"gpu_{m.kernel}", path)
        module = util.module_from_spec(loader)
        loader.loader.exec_module(module)
        # One block along each blocked index; lead indices (tile 1: batch, heads) keep
        # their sizes, which relations such as `h // 4` constrain.
        tiles = {i.size.symbol: i.tile for i in kernel.indices if i.size.symbol}
        sizes = {k: v if tiles.get(k) == 1 else v // BLOCKS for k, v in sizes_for(kernel).items()}
        env = resolve_sizes(kernel, sizes)
        args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(0))
        start = time.perf_counter()
        try:
            out = getattr(module, kernel.name)(*args, **keywords, interpret=True)
            error, ok = matches(kernel, out, module.reference(*args, **keywords), env)
            result = "[green]ok[/green]" if ok else "[red]MISMATCH[/red]"
        except Exception as exc:  # report and go on: the table is the point
            error, ok, result = float("nan"), False, f"[red]{type(exc).__name__}[/red]"
        elapsed = time.perf_counter() - start
        ptxas = every or spec.stem in PTXAS_EXAMPLES  # else lowered only (`--all`: ptxas too)
        r = verify_gpu_module(m.plan, source, "h200", stage3=ptxas)
        ok &= r.ok
        registers = "unknown" if r.registers is None else max(r.registers)
        spilled = "unknown" if r.spill_bytes is None else f"{r.spill_bytes} B"
        skipped = None if r.compiled is not None else str(r.stage3) if ptxas else "make run compiles one example of each walk (make run-all: every kernel)"
        ptxas = (f"{registers} registers, {spilled} spilled" if r.compiled else "[red]fails[/red]" if r.compiled is False else "skipped")
        walks = getattr(m.plan, "walks", None) or dict.fromkeys(p.walk for p in m.plan.passes)  # a row walk, or einsum passes
        rows.append(([kernel.name, " + ".join(walks), ", ".join(f"{k}={env[k]}" for k in sizes) or "fixed",
                      f"{error:.3g}", f"{elapsed:.2f} s", result, "[green]yes[/green]" if r.lowered else "[red]no[/red]",
                      f"{r.smem_used} B", ptxas], ok, skipped))
    return rows


def print_gpu(only: set[str] | None, per_spec: list) -> int:
    """The GPU table; why ptxas was skipped is said once under it (it is the same for every row)."""
    table = Table(title="the same specs built for h200: Mosaic GPU interpreter; lowering under an abstract H200; ptxas (sm_90a)")
    for column in ("kernel", "walk", "shapes", "max |err|", "interpreter", "result", "lowers", "shared memory", "ptxas"):
        table.add_column(column, justify="right" if column in ("max |err|", "interpreter", "shared memory") else "left")
    failures, notes = 0, {}
    for rows in per_spec:
        for cells, ok, skipped in rows:
            failures += not ok
            if skipped is not None:
                number = notes.setdefault(skipped, len(notes) + 1)
                cells = [*cells[:-1], f"skipped (note {number})"]
            table.add_row(*cells)
    Console(width=170).print(table)
    for note, number in notes.items():
        print(f"note {number}: ptxas skipped: {note}")
    return failures


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", nargs="*", metavar="KERNEL", help="run these example kernels only (default: all)")
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"TPU targets compiled ahead of time (default: {','.join(TARGETS)})")
    parser.add_argument("--all", action="store_true", help="every spec for every TPU target, ptxas for every GPU kernel (make run-all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: one per core)")
    args = parser.parse_args()
    sys.exit(main(set(args.kernels) or None, tuple(args.targets.split(",")), args.jobs, args.all))
