"""The row walk's schedule (attention-like kernels), backend-neutral: its grid, its tables
and which block of each array a step reads or writes. `attention.row_plan` says what the
kernel computes; this says how the walk visits it, and a target lowers both.

The grid is the lead indices (batch, heads: one value a step, parallel) and one step axis
over the (row block, key block) pairs the classification keeps (`classify.py`), each row's
steps consecutive: its first step initialises the row's statistics, its last flushes them,
and a row with no pair gets one step that writes its empty result. The pairs are listed per
*group*, a value of the lead indices the condition reads (one group when it reads none), in
five tables of `steps` entries a group:

    rows       the row block the step accumulates into (held through a row's trailing
               empty steps, so its output block is written once)
    cols       the key block it reads
    read_rows  the row block it reads (the next computing step's on empty steps: no copy)
    kinds      EMPTY, PARTIAL or FULL
    flags      FIRST (1) and LAST (2) of its row

A second direction walks the same pairs key-major, for the gradients of key-side operands:
the same tables computed over the transposed block kinds, whose rows are key blocks.
A block coordinate is an `expr` tree over the lead indices' variables, the step and a
table entry `Load(role, SLOT)`; `Direction.arrays` names the table each role reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..expr import Const, Expr, Load, Var, flat, render, substitute
from ..ir import Kernel
from .attention import RowPlan
from .core import Axis, Table

# The roles a table plays for a step, and a step's entry in the tables.
ROW, QUERY, KEY = "row", "query", "key"
SLOT = "@slot"  # not a spec identifier: no index can take its name
STEP = "@step"


@dataclass(frozen=True)
class Direction:
    """One direction of the walk: the table holding, per step, the row block written, the
    query block read and the key block read."""

    name: str  # "rows" (the forward, stored outputs, dq) | "keys" (dk, dv)
    row: str
    query: str
    key: str

    @property
    def arrays(self) -> dict[str, str]:
        return {ROW: self.row, QUERY: self.query, KEY: self.key}


@dataclass(frozen=True)
class RowWalk:
    plan: RowPlan
    lead: tuple[Axis, ...]  # one per lead index, parallel
    step: Axis  # the (row block, key block) pairs of a group
    tables: tuple[Table, ...]  # rows, cols, read_rows, kinds, flags
    rows: Direction
    keys: Direction
    group_sizes: tuple[tuple[str, Expr], ...]  # the lead indices the condition reads, and their sizes

    @property
    def kinds(self) -> str:
        return self.tables[3].var

    @property
    def flags(self) -> str:
        return self.tables[4].var

    @property
    def axes(self) -> tuple[Axis, ...]:
        return self.lead + (self.step,)

    def slot(self) -> Expr:
        """A step's entry in its group's tables: `group * steps + t`, the group flat over the
        lead indices the condition reads (row-major, as the block kinds are laid out)."""
        if not self.group_sizes:
            return Var(STEP)
        group = flat([Var(i) for i, _ in self.group_sizes], [n for _, n in self.group_sizes])
        return group * Var(self.step.static) + Var(STEP)

    def coord(self, index: str, divisor: int = 1) -> Expr:
        """The block coordinate along `index` at a step: a lead index's value (read through
        `// divisor`), the query or key block from the tables, the whole extent (0) for any
        other index."""
        if index in self.plan.lead:
            return Var(index).div(divisor)
        if index == self.plan.query:
            return Load(QUERY, Var(SLOT))
        if index == self.plan.key:
            return Load(KEY, Var(SLOT))
        return Const(0)

    def lead_coords(self) -> list[Expr]:
        return [Var(i) for i in self.plan.lead]

    @staticmethod
    def row() -> Expr:
        """The row block the step accumulates into (its outputs' block)."""
        return Load(ROW, Var(SLOT))

    @staticmethod
    def step_coord() -> Expr:
        """The step itself (an array with a block per step)."""
        return Var(STEP)

    def resolve(self, e: Expr, direction: Direction, names: dict[str, str]) -> Expr:
        """A coordinate for a kernel or an index map: the roles' tables of `direction`, and
        the lead indices and the step as the target's variables (`names`: index or STEP ->
        variable)."""
        values = {i: Var(v) for i, v in names.items()}
        values[SLOT] = substitute(self.slot(), values)
        return substitute(e, values, direction.arrays)


def row_walk(kernel: Kernel, plan: RowPlan, conv, names) -> RowWalk:
    """The walk's grid and tables (named in the module's `names`)."""
    # Not an index's name either: the kernels and index maps rename index variables (a
    # lead index named `steps` would take the walk's static step count's place).
    indices = {i.name for i in kernel.indices}
    tables, steps = [], None
    for x in ("rows", "cols", "read_rows", "kinds", "flags", "steps"):
        name = names.local(x)
        while name in indices:
            name = names.local(x)
        if x == "steps":
            steps = name
        else:
            tables.append(name)
    size = {i: conv.size(kernel.index(i).size) for i in plan.lead}
    lead = tuple(Axis(i, "blocks", i, size[i], render(size[i], "host"), True, f"the values of {i}, one a step") for i in plan.lead)
    group_sizes = tuple((i, size[i]) for i in plan.class_axes[:-2])  # the lead indices the condition reads
    groups = Const(1)
    for _, n in group_sizes:
        groups = groups * n
    length = groups * Var(steps)  # `steps` entries per group
    about = ("the row block each step accumulates into", "the key block each step reads", "the row block each step reads",
             "each step's kind: EMPTY, PARTIAL or FULL", "each step's FIRST and LAST of its row")
    return RowWalk(
        plan,
        lead,
        Axis(STEP, "steps", None, length, steps, False, "the (row block, key block) pairs of the group, each row's consecutive"),
        tuple(Table(var, length, what) for var, what in zip(tables, about)),
        Direction("rows", row=tables[0], query=tables[2], key=tables[1]),
        Direction("keys", row=tables[0], query=tables[1], key=tables[2]),  # its rows are key blocks, its columns row blocks
        group_sizes,
    )
