"""One way through: source -> syntax -> check (IR) -> schedule + TPU lowering -> target rules -> emit.

Every command goes through `lower_source` (build, check, plan, verify, variants), so a
rule checked here is checked for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .allocation import no_cycle_collection
from .check import check
from .ir import Kernel
from .source import SourceFile, SpecError
from .syntax import parse
from .schedule.attention import is_row_kernel, row_plan
from .schedule.build import ScheduleError
from .tpu.attention import lower_attention
from .tpu.emit import emit
from .tpu.lower import LayoutError, TpuModule, lower
from .tpu.rules import check_attention, check_kernel, check_module
from .tpu.suggest import suggest_attention_tiles, suggest_tiles
from .tpu.targets import DEFAULT_TARGET, TARGETS
from .gpu import GPU_TARGETS, GpuError, GpuModule, is_gpu, lower_gpu
from .gpu.emit import emit_gpu
from .source import Diagnostic


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
    return source, check(parse(source))


def lower_for_tpu(kernel: Kernel, chip) -> tuple[TpuModule | None, list[Diagnostic]]:
    """One kernel through a TPU's lowering (the row walk or the einsum passes) and its rules:
    the module (None where it could not be lowered) and every problem found."""
    problems = check_kernel(kernel, chip)
    if problems:
        return None, problems
    try:
        if is_row_kernel(kernel):
            m = lower_attention(kernel, row_plan(kernel), chip)
            return m, check_attention(m, lambda: suggest_attention_tiles(m.kernel, m.target))
        m = lower(kernel, chip)
    except ScheduleError as exc:
        return None, [exc.diagnostic]
    except LayoutError as exc:
        return None, list(exc.diagnostics)
    return m, check_module(m, lambda: suggest_tiles(m.kernel, m.target))


def lower_kernels(source: SourceFile, kernels: list[Kernel], target: str = DEFAULT_TARGET) -> list[TpuModule]:
    """Schedule, lower and check every kernel against the target (SpecError listing every problem)."""
    result, errors = [], []
    if is_gpu(target):
        for kernel in kernels:
            if is_row_kernel(kernel):
                errors.append(Diagnostic(kernel.name_span, f"attention-like kernels (softmax, `where`) are not lowered for GPUs yet; build '{kernel.name}' for a TPU target"))
                continue
            try:
                result.append(lower_gpu(kernel, GPU_TARGETS[target]))
            except GpuError as exc:
                errors += exc.diagnostics
        if errors:
            raise _in_order(errors, source)
        return result
    for kernel in kernels:
        m, problems = lower_for_tpu(kernel, TARGETS[target])
        errors += problems
        if m is not None:
            result.append(m)
    if errors:
        raise _in_order(errors, source)
    return result


def lower_source(source: SourceFile, target: str = DEFAULT_TARGET) -> list[TpuModule]:
    with no_cycle_collection():
        return lower_kernels(source, check(parse(source)), target)


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
        kernels = check(parse(source))
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
            compiled.update((m.name, Module(m.name, emit_gpu(m, origin) if isinstance(m, GpuModule) else emit(m, origin), m)) for m in lowered)
    if errors:
        raise _in_order(errors, source)
    return [compiled[k.name] for k in kernels]


def compile_file(path: str | Path, target: str = DEFAULT_TARGET, *, origin: str | None = None) -> list[Module]:
    """Every kernel of a spec file as generated module source (SpecError on any problem)."""
    return compile_source(SourceFile.read(path), target, origin=origin)
