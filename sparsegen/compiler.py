"""One way through, for every family and target: source -> syntax -> check (IR) -> the
target's lowering (schedule, gradients, lowering) and rules -> emit.

Every command goes through `check_source` and `lower_kernels` (build, check, plan, verify,
variants, the simulator), so a rule checked here is checked for all of them; which stages
run for a kernel is `backends.TABLE`'s business, by (target, family).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .allocation import no_cycle_collection
from .backends import chip_of, emit_module, lower_kernel
from .check import check
from .ir import Kernel
from .source import Diagnostic, SourceFile, SpecError
from .syntax import parse
from .tpu.lower import TpuModule
from .targets import DEFAULT_TARGET


@dataclass(frozen=True)
class Module:
    kernel: str
    code: str
    plan: TpuModule | None  # None where it was lowered in a worker process (`emit_in_parallel`)
    target: str  # the chip it was lowered for (the plan's)


def _in_order(errors: list[Diagnostic], source: SourceFile) -> SpecError:
    """Every problem found, in the order of the spec."""
    return SpecError(sorted(errors, key=lambda d: (d.span.line, d.span.col) if d.span else (0, 0)), source)


def load(path: str | Path) -> tuple[SourceFile, list[Kernel]]:
    """Parse and check a spec file (SpecError on any problem)."""
    source = SourceFile.read(path)
    return source, check_source(source)


def check_source(source: SourceFile) -> list[Kernel]:
    """Parse and check a spec (SpecError listing every problem)."""
    with no_cycle_collection():
        return check(parse(source))


def lower_for_tpu(kernel: Kernel, chip) -> tuple[TpuModule | None, list[Diagnostic]]:
    """One kernel through a TPU's lowering and rules (the module, or None, and every problem)."""
    return lower_kernel(kernel, chip.name, chip)


def lower_kernels(source: SourceFile, kernels: list[Kernel], target: str = DEFAULT_TARGET) -> list:
    """Lower and check every kernel against the target (SpecError listing every problem)."""
    chip_of(target)  # an unknown target is the caller's to report
    result, errors = [], []
    for kernel in kernels:
        m, problems = lower_kernel(kernel, target)
        errors += problems
        if m is not None and not problems:
            result.append(m)
    if errors:
        raise _in_order(errors, source)
    return result


def lower_source(source: SourceFile, target: str = DEFAULT_TARGET) -> list[TpuModule]:
    with no_cycle_collection():
        return lower_kernels(source, check_source(source), target)


def plans(path: str | Path, target: str = DEFAULT_TARGET) -> list[TpuModule]:
    return lower_source(SourceFile.read(path), target)


def compile_source(source: SourceFile, target: str = DEFAULT_TARGET, *, origin: str | None = None) -> list[Module]:
    """Every kernel of a spec as generated module source; `origin` is how the generated header
    names the spec (default: the source's name)."""
    return compile_for_targets(source, lambda _: target, origin=origin)


def compile_for_targets(source: SourceFile, target_of: Callable[[str], str], *, origin: str | None = None,
                        kernels: list[Kernel] | None = None) -> list[Module]:
    """Every kernel of a spec as generated module source, each for the target
    `target_of(kernel name)` (`sparsegen check` compiles each for the target its module
    records), in the spec's order; SpecError listing every problem of every target.
    `kernels`: the spec's, checked already (`check_source`)."""
    origin = source.name if origin is None else origin
    with no_cycle_collection():
        kernels = check_source(source) if kernels is None else kernels
        by_target: dict[str, list[Kernel]] = {}
        for kernel in kernels:
            by_target.setdefault(target_of(kernel.name), []).append(kernel)
        compiled: dict[str, Module] = {}
        errors: list[Diagnostic] = []
        for target, group in by_target.items():
            try:
                lowered = lower_kernels(source, group, target)
            except SpecError as exc:
                errors += exc.diagnostics
                continue
            compiled.update((m.name, Module(m.name, emit_module(m, origin), m, m.target.name)) for m in lowered)
    if errors:
        raise _in_order(errors, source)
    return [compiled[k.name] for k in kernels]


def compile_file(path: str | Path, target: str = DEFAULT_TARGET, *, origin: str | None = None) -> list[Module]:
    """Every kernel of a spec file as generated module source (SpecError on any problem)."""
    return compile_source(SourceFile.read(path), target, origin=origin)


# ------------------------------------------------------------------ many kernels at once

_WORK: list[tuple[Kernel, str, str]] = []  # what the worker processes lower and emit (inherited, not sent)


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def can_fork(requested: int | None) -> bool:
    """Whether worker processes may lower and emit (`requested` jobs; None: the cores this
    process may use). They are forked, inheriting the checked kernels: safe only in a process
    without threads (jax, once imported, may have some), and fork is the default on Linux only."""
    import multiprocessing
    import sys
    import threading

    if (requested if requested is not None else _cores()) <= 1 or sys.platform != "linux":
        return False
    return "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1 and "jax" not in sys.modules


def parallel_jobs(requested: int | None, units: int) -> int:
    """Processes to lower and emit `units` kernels in: `requested` (None: the cores), at most
    one per 4 kernels; one (this process) for fewer than 8."""
    jobs = min(requested if requested is not None else _cores(), units // 4)
    return 1 if units < 8 or jobs < 2 or not can_fork(jobs) else jobs


def emit_in_parallel(work: list[tuple[Kernel, str, str]], jobs: int) -> list[tuple[str, str] | None]:
    """(code, target chip) of each (checked kernel, target, origin), lowered and emitted in
    `jobs` forked processes (the kernels dealt round-robin: neighbours cost alike); None for
    a kernel with problems (the caller compiles its spec again in the usual way, which
    reports them). The code is what `compile_for_targets` gives: the same functions make it."""
    import multiprocessing

    global _WORK
    _WORK = work
    try:
        # The first here: the workers inherit what it warmed (templates, black's layouts of
        # the chunks modules share) instead of each making it again.
        found = dict(_emit_share((0, 1, 1)))
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            for share in pool.map(_emit_share, [(1 + n, jobs, len(work)) for n in range(jobs)]):
                found.update(share)
    finally:
        _WORK = []
    return [found[n] for n in range(len(work))]


def _emit_share(share: tuple[int, int, int]) -> list[tuple[int, tuple[str, str] | None]]:
    first, step, end = share
    out = []
    with no_cycle_collection():
        for n in range(first, end, step):
            kernel, target, origin = _WORK[n]
            m, problems = lower_kernel(kernel, target)
            out.append((n, None if m is None or problems else (emit_module(m, origin), m.target.name)))
    return out
