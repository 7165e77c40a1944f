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
from .tpu.targets import DEFAULT_TARGET


@dataclass(frozen=True)
class Module:
    kernel: str
    code: str
    plan: TpuModule


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


def compile_for_targets(source: SourceFile, target_of: Callable[[str], str], *, origin: str | None = None) -> list[Module]:
    """Every kernel of a spec as generated module source, each for the target
    `target_of(kernel name)` (`sparsegen check` compiles each for the target its module
    records), in the spec's order; SpecError listing every problem of every target."""
    origin = source.name if origin is None else origin
    with no_cycle_collection():
        kernels = check_source(source)
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
            compiled.update((m.name, Module(m.name, emit_module(m, origin), m)) for m in lowered)
    if errors:
        raise _in_order(errors, source)
    return [compiled[k.name] for k in kernels]


def compile_file(path: str | Path, target: str = DEFAULT_TARGET, *, origin: str | None = None) -> list[Module]:
    """Every kernel of a spec file as generated module source (SpecError on any problem)."""
    return compile_source(SourceFile.read(path), target, origin=origin)
