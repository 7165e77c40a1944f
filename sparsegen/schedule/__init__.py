"""The backend-neutral schedule: which blocks each statement's pass visits, and what each step does.

One walk per module: `dense` (every block), `coo_input` (the stored blocks of a coo
input), `masked` (a dense grid whose cells have kinds: a mask operand, offsets on the
left), `coo_output` (the requested output blocks; with a mask or coo input, kinds again),
`condition` (a `where` condition on the terms). Which one a statement takes, and which
operands' blocks decide it, is `choice.choose_walk`: the GPU lowering takes it from there too.
"""

from __future__ import annotations

from ..callconv import Convention
from ..ir import Einsum, Kernel
from ..names import ModuleNames
from ..source import Diagnostic
from .build import ScheduleError
from .choice import Source, Walk, choose_walk
from .coo_input import CooInputWalk
from .condition import ConditionWalk
from .coo_output import CooOutputWalk
from .core import Pass, Schedule
from .dense import DenseWalk
from .masked import MaskedWalk

__all__ = ["Schedule", "Pass", "ScheduleError", "Source", "Walk", "choose_walk", "schedule", "walk_of"]


WALKS = {"condition": ConditionWalk, "coo output": CooOutputWalk, "coo input": CooInputWalk, "masked": MaskedWalk, "dense": DenseWalk}


def walk_of(kernel: Kernel, st: Einsum):
    """The walk class that builds the statement's pass: the walk `choose_walk` names (the
    GPU lowering takes the same decision)."""
    walk = choose_walk(kernel, st)
    if walk.name == "coo input" and walk.window:
        raise ScheduleError(Diagnostic(st.target.span, "offsets on the left side of a statement with a coo input are not supported yet"))
    return WALKS[walk.name]


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
