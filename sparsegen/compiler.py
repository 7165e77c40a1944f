"""One way through: source -> syntax -> check -> plan (+ budget) -> emit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .budget import check_budget
from .check import check
from .emit import emit
from .model import Kernel
from .plan import Plan, plan as make_plan
from .source import SourceFile, SpecError
from .syntax import parse
from .targets import DEFAULT_TARGET, TARGETS


@dataclass(frozen=True)
class Module:
    kernel: str
    code: str
    plan: Plan


def load(path: str | Path) -> tuple[SourceFile, list[Kernel]]:
    """Parse and check a spec file (SpecError on any problem)."""
    source = SourceFile.read(path)
    return source, check(parse(source))


def plans(path: str | Path, target: str = DEFAULT_TARGET) -> list[Plan]:
    source, kernels = load(path)
    result, errors = [], []
    for kernel in kernels:
        p = make_plan(kernel, TARGETS[target])
        errors += check_budget(p)
        result.append(p)
    if errors:
        raise SpecError(errors, source)
    return result


def compile_source(source: SourceFile, target: str = DEFAULT_TARGET, *, origin: str | None = None) -> list[Module]:
    """`origin`: how the generated header names the spec (default: the source's name)."""
    kernels = check(parse(source))
    modules, errors = [], []
    for kernel in kernels:
        p = make_plan(kernel, TARGETS[target])
        errors += check_budget(p)
        modules.append(Module(kernel.name, emit(p, source.name if origin is None else origin), p))
    if errors:
        raise SpecError(errors, source)
    return modules


def compile_file(path: str | Path, target: str = DEFAULT_TARGET, *, origin: str | None = None) -> list[Module]:
    """Every kernel of a spec file as generated module source (SpecError on any problem)."""
    return compile_source(SourceFile.read(path), target, origin=origin)
