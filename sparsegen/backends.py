"""Targets and kernel families, in one table: what lowers, checks, emits and describes a
kernel of a family for a target.

A *backend* (TPU: Pallas Mosaic TPU; GPU: Mosaic GPU) owns its chips; a *family* is how a
kernel is walked: `einsum` (products of operands, with or without conditions on their
terms: the einsum walks of `schedule/`) or `row` (attention-like kernels: local tensors,
softmax and reductions, the row walk). Each (backend, family) entry lowers a checked kernel
for a chip and applies the target's rules, returning the module or every problem found;
its module knows how to be emitted and described. A pair the table lacks is refused in one
form, at the kernel's name, saying what to do instead. The compiler, `verify`, `plan`,
`variants` and the simulator all go through `lower_kernel`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .ir import Kernel, Read, Term
from .source import Diagnostic
from .targets import backend_of


@dataclass(frozen=True)
class Entry:
    lower: Callable[[Kernel, object], tuple[object | None, list[Diagnostic]]]  # (kernel, chip) -> (module, problems)
    emit: Callable[[object, str, bool], str]  # (module, origin, formatted) -> source
    describe: Callable[[object], list[str]]
    analyse: Callable | None = None  # (module, sizes, pattern, targets, seed, ...) -> a report: `plan --pattern`, `variants`


def family_of(kernel: Kernel) -> str:
    """`einsum` (products of operands, conditions included), `row` (attention-like) or
    `paged` (attention-like, its keys and values read through a table)."""
    from .callconv import reads_through_tables

    if kernel.einsums_only:
        return "einsum"
    return "paged" if reads_through_tables(kernel) else "row"


def chip_of(target: str):
    """A target's chip facts, from its backend (a KeyError for a name that is no target)."""
    from .gpu.targets import GPU_TARGETS
    from .tpu.targets import TARGETS

    return {"tpu": TARGETS, "gpu": GPU_TARGETS}[backend_of(target)][target]


# ------------------------------------------------------------------ entries


def _tpu_einsum(kernel, chip):
    from .schedule.build import ScheduleError
    from .tpu.lower import LayoutError, lower
    from .tpu.rules import check_kernel, check_module
    from .tpu.suggest import suggest_tiles

    problems = check_kernel(kernel, chip)
    if problems:
        return None, problems
    try:
        m = lower(kernel, chip)
    except ScheduleError as exc:
        return None, [exc.diagnostic]
    except LayoutError as exc:
        return None, list(exc.diagnostics)
    return m, check_module(m, lambda: suggest_tiles(m.kernel, m.target))


def _tpu_row(kernel, chip):
    from .schedule.attention import row_plan
    from .schedule.build import ScheduleError
    from .tpu.attention import lower_attention
    from .tpu.rules import check_attention, check_kernel
    from .tpu.suggest import suggest_attention_tiles

    problems = check_kernel(kernel, chip)
    if problems:
        return None, problems
    try:
        m = lower_attention(kernel, row_plan(kernel), chip)
    except ScheduleError as exc:
        return None, [exc.diagnostic]
    return m, check_attention(m, lambda: suggest_attention_tiles(m.kernel, m.target))


def _tpu_paged(kernel, chip):
    from .schedule.attention import row_plan
    from .schedule.build import ScheduleError
    from .schedule.paged import paged_plan
    from .tpu.paged import lower_paged
    from .tpu.rules import check_attention, check_kernel

    problems = check_kernel(kernel, chip)
    if problems:
        return None, problems
    try:
        plan = row_plan(kernel, packed_rows=True)
        m = lower_paged(kernel, plan, paged_plan(kernel, plan), chip)
    except ScheduleError as exc:
        return None, [exc.diagnostic]
    return m, check_attention(m)


def _paged_emit(m, origin, formatted=True):
    from .tpu.paged import emit_paged

    return emit_paged(m, origin, formatted)


def _paged_describe(m):
    from .tpu.paged.describe import describe_paged

    return [f"kernel {m.kernel.name}"] + ["  " + line for line in describe_paged(m)]


def _gpu_einsum(kernel, chip):
    from .gpu import GpuError, lower_gpu

    try:
        return lower_gpu(kernel, chip), []
    except GpuError as exc:
        return None, list(exc.diagnostics)


def _gpu_row(kernel, chip):
    from .gpu import GpuError
    from .gpu.attention import lower_gpu_attention
    from .schedule.attention import row_plan
    from .schedule.build import ScheduleError

    try:
        return lower_gpu_attention(kernel, row_plan(kernel), chip), []
    except ScheduleError as exc:
        return None, [exc.diagnostic]
    except GpuError as exc:
        return None, list(exc.diagnostics)


def _tpu_emit(m, origin, formatted=True):
    from .tpu.emit import emit_einsum

    return emit_einsum(m, origin, formatted)


def _row_emit(m, origin, formatted=True):
    from .tpu.attention import emit_attention

    return emit_attention(m, origin, formatted)


def _gpu_emit(m, origin, formatted=True):
    from .gpu.emit import emit_gpu

    del formatted  # GPU modules are always formatted
    return emit_gpu(m, origin)


def _gpu_paged(kernel, chip):
    from .gpu import GpuError
    from .gpu.paged import lower_gpu_paged
    from .schedule.attention import row_plan
    from .schedule.build import ScheduleError
    from .schedule.paged import paged_plan

    try:
        plan = row_plan(kernel, packed_rows=True)
        return lower_gpu_paged(kernel, plan, paged_plan(kernel, plan), chip), []
    except ScheduleError as exc:
        return None, [exc.diagnostic]
    except GpuError as exc:
        return None, list(exc.diagnostics)


def _gpu_paged_emit(m, origin, formatted=True):
    from .gpu.paged import emit_gpu_paged

    del formatted  # GPU modules are always formatted
    return emit_gpu_paged(m, origin)


def _gpu_paged_describe(m):
    from .gpu.paged.describe import describe_gpu_paged

    return [f"kernel {m.kernel.name}"] + ["  " + line for line in describe_gpu_paged(m)]


def _gpu_row_emit(m, origin, formatted=True):
    from .gpu.attention import emit_gpu_attention

    del formatted  # GPU modules are always formatted
    return emit_gpu_attention(m, origin)


def _gpu_row_describe(m):
    from .gpu.attention.describe import describe_gpu_attention

    return [f"kernel {m.kernel.name}"] + ["  " + line for line in describe_gpu_attention(m)]


def _tpu_describe(m):
    from .tpu.describe import describe_einsum

    return describe_einsum(m)


def _row_describe(m):
    from .tpu.attention.describe import describe_attention

    return [f"kernel {m.kernel.name}"] + ["  " + line for line in describe_attention(m)]


def _gpu_describe(m):
    from .gpu.describe import describe

    return describe(m)


def _tpu_analyse(m, sizes, pattern, targets=("v5e",), seed=0, **kw):
    from .tpu.simulate import analyse_einsum

    kw.pop("strict", None)  # an einsum's walk models every layout

    return analyse_einsum(m, sizes, pattern, targets, seed, **kw)


def _row_analyse(m, sizes, pattern, targets=("v5e",), seed=0, **kw):
    from .tpu.attention.simulate import analyse_attention

    if kw.get("trace"):
        raise ValueError(f"--png draws the einsum walks; '{m.name}' is attention-like (its walk is not drawn yet: leave out --png)")
    return analyse_attention(m, sizes, pattern, targets, seed, strict=kw.get("strict", False))


TABLE: dict[tuple[str, str], Entry] = {
    ("tpu", "einsum"): Entry(_tpu_einsum, _tpu_emit, _tpu_describe, _tpu_analyse),
    ("tpu", "row"): Entry(_tpu_row, _row_emit, _row_describe, _row_analyse),
    ("tpu", "paged"): Entry(_tpu_paged, _paged_emit, _paged_describe),
    ("gpu", "einsum"): Entry(_gpu_einsum, _gpu_emit, _gpu_describe),
    ("gpu", "row"): Entry(_gpu_row, _gpu_row_emit, _gpu_row_describe),
    ("gpu", "paged"): Entry(_gpu_paged, _gpu_paged_emit, _gpu_paged_describe),
}

# Why a pair is missing, and what to do instead.
UNSUPPORTED: dict[tuple[str, str], str] = {}


# Language v2 forms the front end parses and checks but no schedule or target handles yet:
# every lowering refuses them here, before any stage reads a `Sub` it does not know.
NOT_LOWERED = "not supported yet: {what} ('{text}') {verb} checked but not lowered for {backend} targets (issue 19)"


def _reads_of(st) -> list[Read]:
    """Every read of a statement: its target, operands, locals, and its terms' reads."""
    reads: list[Read] = [st.target]
    for name in ("factors", "arg", "scores", "value"):
        part = getattr(st, name, None)
        if isinstance(part, Read):
            reads.append(part)
        elif isinstance(part, tuple):
            reads += [r for r in part if isinstance(r, Read)]
    for name in ("value", "condition"):
        term = getattr(st, name, None)
        if isinstance(term, Term):
            reads += [t.read for t in term.walk() if t.read is not None]
    return reads


def not_lowered(kernel: Kernel, target: str) -> Diagnostic | None:
    """The first language-v2 form (in the spec's order) that the front end checks and no
    target lowers yet: a read through a table, `%` or a size as divisor in a subscript.
    One diagnostic at it; None for a kernel without one."""
    found = []

    def visit(read: Read) -> None:
        for sub in read.subs:
            if sub.table is not None:
                found.append((sub.span or read.span, "reads through tables", sub.table.text, "are"))
                visit(sub.table)
            elif sub.modulus is not None:
                found.append((sub.span or read.span, "'%' in a subscript", sub.text, "is"))
            elif isinstance(sub.divisor, str):
                found.append((sub.span or read.span, "a size as a subscript's divisor", sub.text, "is"))

    for st in kernel.statements:
        for read in _reads_of(st):
            visit(read)
        condition = getattr(st, "condition", None)
        for read in condition.reads if condition is not None else ():
            if kernel.operand(read.operand).sparsity == "index":  # also offsets or a table (check.py)
                found.append((read.span, "an index operand read both in a condition and as offsets or a table", read.text, "is"))
    if not found:
        return None
    span, what, text, verb = min(found, key=lambda f: (f[0].line, f[0].col))
    return Diagnostic(span, NOT_LOWERED.format(what=what, text=text, verb=verb, backend=backend_of(target).upper()))


def entry(target: str, kernel: Kernel) -> Entry | None:
    return TABLE.get((backend_of(target), family_of(kernel)))


def lower_kernel(kernel: Kernel, target: str, chip=None) -> tuple[object | None, list[Diagnostic]]:
    """One kernel through its target's lowering and rules: the module (None where it could
    not be lowered) and every problem found. `chip`: the target's chip as given (a probe may
    pass a variant of it), default the named one."""
    # The paged walk lowers reads through tables, `%` and size divisors where it walks them
    # (on TPU and GPU); it refuses them anywhere else itself.
    refused = None if family_of(kernel) == "paged" else not_lowered(kernel, target)
    if refused is not None:
        return None, [refused]
    e = entry(target, kernel)
    if e is None:
        key = (backend_of(target), family_of(kernel))
        return None, [Diagnostic(kernel.name_span, UNSUPPORTED[key].format(name=kernel.name))]
    return e.lower(kernel, chip if chip is not None else chip_of(target))


def emit_module(m, origin: str, formatted: bool = True) -> str:
    """A lowered module's source (any backend, any family)."""
    return entry(m.target.name, m.kernel).emit(m, origin, formatted)


def describe_module(m) -> list[str]:
    """A lowered module's plan in words (no trailing newlines)."""
    return entry(m.target.name, m.kernel).describe(m)


def analyse_module(m, sizes, pattern, targets=("v5e",), seed=0, **kw):
    """A lowered module's walk on a sparsity pattern (`plan --pattern`, `variants`)."""
    e = entry(m.target.name, m.kernel)
    if e is None or e.analyse is None:
        raise ValueError(f"no pattern analysis for {m.target.name} kernels of this kind")
    return e.analyse(m, sizes, pattern, targets, seed, **kw)
