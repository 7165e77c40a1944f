"""The backend-neutral schedule: which blocks each statement's pass visits, and what each step does.

One walk per module: `dense` (every block), `coo_input` (the stored blocks of a coo
input), `masked` (a dense grid whose cells have kinds: a mask operand, offsets on the
left), `coo_output` (the requested output blocks; with a mask or coo input, kinds again).
"""

from __future__ import annotations

from ..callconv import Convention
from ..ir import Einsum, Kernel
from ..names import ModuleNames
from ..source import Diagnostic
from .build import ScheduleError
from .coo_input import CooInputWalk
from .condition import ConditionWalk
from .coo_output import CooOutputWalk
from .core import Pass, Schedule
from .dense import DenseWalk
from .masked import MaskedWalk

__all__ = ["Schedule", "Pass", "ScheduleError", "schedule"]


def walk_of(kernel: Kernel, st: Einsum):
    out = kernel.operand(st.target.operand)
    kinds = {kernel.operand(r.operand).sparsity for r in st.factors}
    if st.condition is not None:
        return ConditionWalk
    if out.sparsity == "coo":
        return CooOutputWalk
    if "coo" in kinds:
        if any(s.offset for s in st.target.subs):
            raise ScheduleError(Diagnostic(st.target.span, "offsets on the left side of a statement with a coo input are not supported yet"))
        return CooInputWalk
    if "mask" in kinds or any(s.offset for s in st.target.subs):
        return MaskedWalk
    return DenseWalk


def schedule(kernel: Kernel, conv: Convention, names: ModuleNames) -> tuple[Schedule | None, list[Diagnostic]]:
    """Every statement's pass, or the diagnostics of those no walk can run."""
    passes, errors = [], []
    outputs: dict[str, str] = {}
    several = len(kernel.statements) > 1
    for st in kernel.statements:
        prefix = f"{st.target.operand}_" if several else ""
        try:
            p = walk_of(kernel, st)(kernel, conv, names.scope(), st, prefix, outputs).build()
        except ScheduleError as exc:
            errors.append(exc.diagnostic)
            continue
        outputs[st.target.operand] = names.local(st.target.operand)
        passes.append(p)
    if errors:
        return None, errors
    return Schedule(kernel, tuple(passes), tuple(outputs.items())), []
