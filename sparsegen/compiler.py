"""One way through: source -> syntax -> check (IR) -> schedule + TPU lowering -> target rules -> emit.

Every command goes through `lower_source` (build, check, plan, verify, variants), so a
rule checked here is checked for all of them.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from pathlib import Path

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
from .tpu.targets import DEFAULT_TARGET, TARGETS
from .gpu import GPU_TARGETS, GpuError, GpuModule, is_gpu, lower_gpu
from .gpu.emit import emit_gpu
from .source import Diagnostic


@dataclass(frozen=True)
class Module:
    kernel: str
    code: str
    plan: TpuModule


def load(path: str | Path) -> tuple[SourceFile, list[Kernel]]:
    """Parse and check a spec file (SpecError on any problem)."""
    source = SourceFile.read(path)
    return source, check(parse(source))


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
            raise SpecError(sorted(errors, key=lambda d: (d.span.line, d.span.col) if d.span else (0, 0)), source)
        return result
    chip = TARGETS[target]
    for kernel in kernels:
        problems = check_kernel(kernel, chip)
        if problems:
            errors += problems
            continue
        if is_row_kernel(kernel):
            try:
                m = lower_attention(kernel, row_plan(kernel), chip)
            except ScheduleError as exc:
                errors.append(exc.diagnostic)
                continue
            errors += check_attention(m)
            result.append(m)
            continue
        try:
            m = lower(kernel, chip)
        except LayoutError as exc:
            errors += exc.diagnostics
            continue
        errors += check_module(m)
        result.append(m)
    if errors:
        raise SpecError(sorted(errors, key=lambda d: (d.span.line, d.span.col) if d.span else (0, 0)), source)
    return result


@contextlib.contextmanager
def _no_cycle_collection():
    """Compiling allocates millions of small acyclic objects (syntax trees, terms, lines of
    code); the cyclic collector would rescan all live ones again and again, which made a long
    spec's build superlinear. Reference counting still frees them; cycles wait until the end."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def lower_source(source: SourceFile, target: str = DEFAULT_TARGET) -> list[TpuModule]:
    with _no_cycle_collection():
        return lower_kernels(source, check(parse(source)), target)


def plans(path: str | Path, target: str = DEFAULT_TARGET) -> list[TpuModule]:
    return lower_source(SourceFile.read(path), target)


def compile_source(source: SourceFile, target: str = DEFAULT_TARGET, *, origin: str | None = None) -> list[Module]:
    """Every kernel of a spec as generated module source; `origin` is how the generated header
    names the spec (default: the source's name)."""
    with _no_cycle_collection():
        return compile_kernels(source, check(parse(source)), target, origin=origin)


def compile_kernels(source: SourceFile, kernels: list[Kernel], target: str = DEFAULT_TARGET, *, origin: str | None = None) -> list[Module]:
    """Checked kernels of a spec as generated module source (`sparsegen check` compiles each
    kernel for the target its module records, so several calls may share one parse)."""
    origin = source.name if origin is None else origin
    with _no_cycle_collection():
        return [Module(m.name, emit_gpu(m, origin) if isinstance(m, GpuModule) else emit(m, origin), m) for m in lower_kernels(source, kernels, target)]


def compile_file(path: str | Path, target: str = DEFAULT_TARGET, *, origin: str | None = None) -> list[Module]:
    """Every kernel of a spec file as generated module source (SpecError on any problem)."""
    return compile_source(SourceFile.read(path), target, origin=origin)
