"""TPU lowering: a schedule becomes Pallas TPU terms, without deciding anything again.

Per pass: the grid and `dimension_semantics` (parallel axes, then arbitrary ones), the
tables as scalar-prefetch operands (SMEM), one BlockSpec per block — squeezed dimensions
as `None`, arrays viewed with unit dimensions where the layout rule needs them
(`layout.view`) — the accumulator in VMEM scratch, the VMEM estimate and limit, and the
work for `pl.CostEstimate`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..callconv import Convention, convention
from ..expr import Const, Expr, names as expr_names
from ..ir import Kernel
from ..lowered import LoweredModule
from ..names import ModuleNames
from ..schedule import Pass, Schedule, schedule
from ..schedule.core import Block
from ..source import Diagnostic
from .layout import LayoutProblem, View, view
from .targets import Target
from .vmem import VmemItem, einsum_vmem, vmem_limit

@dataclass(frozen=True)
class Spec:
    """One BlockSpec: a block of the schedule over its array's TPU view."""

    block: Block
    fn: str  # the index map function
    ref: str  # the kernel's ref
    view: View
    index: tuple[Expr, ...]  # block coordinates over the view's dimensions
    statics: tuple[tuple[str, Expr], ...]  # extents bound with functools.partial

    @property
    def shape(self) -> tuple[int | None, ...]:
        return self.view.block


@dataclass(frozen=True)
class TpuPass:
    p: Pass
    kernel_fn: str
    prefetch_fn: str
    call_fn: str  # the function that runs this pass's pallas_call ("" when _impl runs the only pass)
    specs: tuple[Spec, ...]  # inputs in block order, then the output
    acc_ref: str
    sizes: tuple[str, ...]  # size variables the kernel reads (ragged tails)
    vmem: tuple[VmemItem, ...]
    vmem_limit_override: int | None = None

    @property
    def in_specs(self) -> tuple[Spec, ...]:
        return tuple(s for s in self.specs if not s.block.is_output)

    @property
    def out_spec(self) -> Spec:
        return next(s for s in self.specs if s.block.is_output)

    @property
    def vmem_bytes(self) -> int:
        return sum(item.bytes for item in self.vmem)

    @property
    def dimension_semantics(self) -> tuple[str, ...]:
        return tuple("parallel" if a.parallel else "arbitrary" for a in self.p.axes)

    def vmem_limit(self, target: Target) -> int | None:
        """vmem_limit_bytes for the compiler (`vmem.vmem_limit`; its estimate holds Mosaic's scratch)."""
        return vmem_limit(self.vmem_bytes, target, self.vmem_limit_override)


@dataclass(frozen=True)
class TpuModule(LoweredModule):
    """Everything the emitter, `plan`, `verify` and the simulator need to know about one kernel."""

    target: Target
    schedule: Schedule
    passes: tuple[TpuPass, ...]
    backward: object | None = None  # autodiff.Backward: how the gradients are derived
    backward_module: "TpuModule | None" = None  # its passes, lowered like any kernel's

    def with_vmem_limit(self, limit: int) -> "TpuModule":
        """The module compiled with `vmem_limit_bytes=limit` in every pass (verify's probe)."""
        return dataclasses.replace(self, passes=tuple(dataclasses.replace(tp, vmem_limit_override=limit) for tp in self.passes))

    @property
    def vmem_bytes(self) -> int:
        """The largest pass's footprint (passes run one after another)."""
        return max(p.vmem_bytes for p in self.passes)

    @property
    def vmem(self) -> tuple[VmemItem, ...]:
        return max(self.passes, key=lambda p: p.vmem_bytes).vmem

    @property
    def walks(self) -> tuple[str, ...]:
        """The walk of each pass, once each (`plan` and `make run` name them)."""
        return tuple(dict.fromkeys(tp.p.walk for tp in self.passes))

    def must_span(self) -> list[tuple[str, int, str, str]]:
        """(index, tile, size symbol, why) for each tile that must span a symbolic dimension
        (`spans`: the dimension's own symbol, which a read through `// n` makes another)."""
        from ..callconv import operand_indices

        out = []
        for operand, d, tile in self.spans:
            dim = self.kernel.operand(operand).dims[d]
            if dim.symbol is not None:
                index = operand_indices(self.kernel, self.kernel.operand(operand))[d]
                out.append((index, tile, dim.symbol, f"'{operand}' breaks the TPU layout rule otherwise"))
        return out

    def block_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(operand, the block shape its kernel sees) of every pass's blocks."""
        return [(s.block.operand, tuple(s.view.ref_shape)) for tp in self.passes for s in tp.specs]

    @property
    def spans(self) -> tuple[tuple[str, int, int], ...]:
        """(operand, dim, tile): tiles that must span a symbolic dimension, checked at call time."""
        out = []
        for tp in self.passes:
            for s in tp.specs:
                if s.block.stored:
                    continue
                for dim, tile in s.view.spans:
                    item = (s.block.operand, dim, tile)
                    if item not in out:
                        out.append(item)
        return tuple(out)


class LayoutError(Exception):
    def __init__(self, diagnostics):
        self.diagnostics = diagnostics


def lower(kernel: Kernel, target: Target, names: ModuleNames | None = None, conv: Convention | None = None, backward: bool = True) -> TpuModule:
    """Schedule and lower a kernel, and the backward kernel its gradients need; LayoutError
    (diagnostics at the spec) where no walk or view serves the forward kernel."""
    names = names or ModuleNames(kernel)
    conv = conv or convention(kernel, names)
    sched, errors = schedule(kernel, conv, names)
    if sched is None:
        raise LayoutError(errors)
    passes, errors = [], []
    # A backward kernel's passes always get functions of their own (the forward has _kernel).
    several = len(sched.passes) > 1 or not backward
    for p in sched.passes:
        try:
            passes.append(_lower_pass(kernel, names, p, several, target))
        except LayoutError as exc:
            errors += exc.diagnostics
    if errors:
        raise LayoutError(_unique(errors))
    module = TpuModule(kernel, target, conv, names, sched, tuple(passes))
    return _with_backward(module) if backward else module


def _with_backward(m: TpuModule) -> TpuModule:
    """Derive and lower the backward kernel. A backward the target cannot run leaves the
    forward kernel as it is: asking for its gradient raises, saying why."""
    import dataclasses

    from ..autodiff import derive
    from .rules import check_kernel, check_module

    b = derive(m.kernel, m.conv, m.names)
    if not b.differentiable or b.kernel is None:
        return dataclasses.replace(m, backward=b, backward_error=b.error)
    try:
        bm = lower(b.kernel, m.target, m.names, b.conv, backward=False)
        problems = check_kernel(b.kernel, m.target) + check_module(bm)
    except LayoutError as exc:
        bm, problems = None, exc.diagnostics
    if problems:
        return dataclasses.replace(m, backward=b, backward_error=f"the backward kernel does not fit {m.target.name}: {problems[0].message}")
    return dataclasses.replace(m, backward=b, backward_module=bm)


def _unique(diags):
    """One report per spec token (a tile that breaks the layout rule names the first block it breaks)."""
    out, seen = [], set()
    for d in diags:
        if d.span not in seen:
            seen.add(d.span)
            out.append(d)
    return out


def _lower_pass(kernel: Kernel, names: ModuleNames, p: Pass, several: bool, target: Target) -> TpuPass:
    prefix = f"{p.output}_" if several else ""
    kernel_fn = names.function(f"_{prefix}kernel") if several else "_kernel"
    prefetch_fn = names.function(f"_{prefix}prefetch") if several else "_prefetch"
    call_fn = names.function(f"_{prefix}call") if several else ""
    statics = dict(p.statics)
    specs, errors = [], []
    for b in p.blocks:
        try:
            specs.append(_spec(kernel, names, p.names, b, statics, prefix))
        except LayoutError as exc:
            errors += exc.diagnostics
    if errors:
        raise LayoutError(_unique(errors))
    acc_ref = p.names.local("acc_ref")
    sizes = [t.size for t in (*p.body.tails, *p.body.out_tails)]
    if p.body.select is not None:
        # The condition's sizes, and those of the extents its block coordinates decode with.
        sizes += [var for _, var in p.body.select.sizes]
        for e in (*(e for _, e in p.body.select.coords), *(e for _, e in p.body.select.scalars), *(t.coord for t in p.body.tails)):
            for name in expr_names(e):
                if name in statics and name not in {a.static for a in p.axes}:
                    sizes += sorted(expr_names(statics[name]))
    sizes = tuple(dict.fromkeys(sizes))
    return TpuPass(p, kernel_fn, prefetch_fn, call_fn, tuple(specs), acc_ref, sizes, einsum_vmem(kernel, p, specs, target))


def _spec(kernel: Kernel, names: ModuleNames, local: ModuleNames, b: Block, statics: dict[str, Expr], prefix: str) -> Spec:
    op = kernel.operand(b.operand)
    block = tuple(None if d.extent == 1 else d.extent for d in b.dims)
    if b.stored:
        dims = tuple(d.extent for d in b.dims)  # stored blocks span their array
        dims = (None,) + dims[1:]
    else:
        dims = tuple(d.literal for d in op.dims)
    if b.layout == "rows":  # a lane-broadcast copy: the kernel reads a column
        block, dims = block + (128,), dims + (128,)
    elif b.layout == "cols":  # a sublane-broadcast copy: the kernel reads a row
        block, dims = block[:-1] + (8, block[-1]), dims[:-1] + (8, dims[-1])
    v = view(block, dims, op.dtype)
    if isinstance(v, LayoutProblem):
        d = b.dims[v.dim]
        index = kernel.index(d.index)
        raise LayoutError([Diagnostic(index.tile_span,
                                      f"tile {d.index} = {index.tile} breaks the TPU layout rule for '{op.name}' ({op.dtype.name}): its block dim {v.dim} {v.reason}")])
    index = list(b.coords)
    if b.layout == "rows":
        index.append(Const(0))
    elif b.layout == "cols":
        index.insert(len(index) - 1, Const(0))
    for pos in sorted(v.inserted):
        index.insert(pos, Const(0))
    used = set()
    for e in (*index, *(val for _, val in b.lets)):
        used |= expr_names(e)
    spec_statics = tuple((name, value) for name, value in statics.items() if name in used)
    fn = names.function(f"_{prefix}{op.name}_index_map")
    ref = local.local(f"{op.name}_ref")
    return Spec(b, fn, ref, v, tuple(index), spec_statics)


def block_bytes(kernel: Kernel, spec: Spec) -> int:
    op = kernel.operand(spec.block.operand)
    return math.prod(spec.view.ref_shape or (1,)) * op.dtype.itemsize
