"""Step tables: a walk over the non-empty (row, column) pairs of a block classification.

Shared by the condition walk (a `where` condition's blocks) and the mask walk (a mask
operand's blocks). The classification is over the blocks of the output indices it uses
(its *rows*) and the summed ones (its *columns*; all of the sum when it uses none, every
column then of its row's kind). The grid walks, per output block of the other output
indices (parallel axes), one flat axis of steps over the non-empty pairs in row order:
each row's run a consecutive revisit of its output block, a row with none one step that
writes zeros. Summed indices it does not use are walked inside each step. The tables
(`_row_walk`): per step the row it writes, the row and column it reads (steps that
compute nothing hold the last ones read, so they start no copy), its kind and its flags
(1: the row's first step, init; 2: its last, flush).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..expr import Const, Expr, Load, Var, Where
from .build import PassBuilder
from .core import Axis


@dataclass
class Steps:
    """A pass's step tables and how a block's coordinates are read from them."""

    out_c: list[str]  # output indices classified (rows), in order
    sum_c: list[str]  # summed indices classified (columns), in order
    n_steps: str  # the tables' length
    step: Var  # the step axis's coordinate
    inner: list[Axis]  # summed indices walked inside each step
    row: str | None  # table: the output block a step writes
    read_row: str | None  # table: the output block whose inputs a step reads
    col: str | None  # table: the column block a step reads
    kind: str  # table: _EMPTY, _PARTIAL, _FULL
    flags: str  # table: 1 first, 2 last
    statics: dict[str, str]  # index -> the name of its block count
    builder: PassBuilder

    def decode(self, table: str, group: list[str], index: str, at: Expr | None = None) -> Expr:
        """`index`'s block in a row-major number over `group` read from `table` (at the step)."""
        value = Load(table, self.step if at is None else at)
        later = Const(1)
        for n in group[group.index(index) + 1:]:
            later = later * Var(self.statics[n])
        value = value.div(later)
        if group.index(index) > 0:
            value = value.rem(Var(self.statics[index]))
        return value

    @property
    def live(self) -> Expr:
        return Load(self.kind, self.step).ne(Var("_EMPTY"))

    def read_coord(self, index: str) -> Expr:
        """An input's block at the step: steps that compute nothing hold the last one read."""
        if index in self.out_c:
            return self.decode(self.read_row, self.out_c, index)
        if index in self.sum_c:
            return self.decode(self.col, self.sum_c, index)
        axis = self.builder.axis_of(index)
        if axis in self.inner:
            # Walked while the step computes; other steps hold the last block.
            return Where(self.live, Var(axis.var), Var(axis.static) - 1)
        return Var(axis.var)

    def read_at(self, at: Expr, index: str) -> Expr:
        """An input's block at the step `at` (a table of steps ahead: the next partial one)."""
        if index in self.out_c:
            return self.decode(self.read_row, self.out_c, index, at)
        if index in self.sum_c:
            return self.decode(self.col, self.sum_c, index, at)
        return self.read_coord(index)

    def compute_coord(self, index: str) -> Expr:
        """At a step that computes (the inner axes walk)."""
        axis = next((a for a in self.inner if a.index == index), None)
        return Var(axis.var) if axis is not None else self.read_coord(index)

    def write_coord(self, index: str) -> Expr:
        """The output block the step writes."""
        return self.decode(self.row, self.out_c, index) if index in self.out_c else Var(self.builder.axis_of(index).var)

    @property
    def first(self) -> Expr:
        value = (Load(self.flags, self.step) & Const(1)).ne(0)
        for a in self.inner:
            value = value & Var(a.var).eq(0)
        return value

    @property
    def last(self) -> Expr:
        value = (Load(self.flags, self.step) & Const(2)).ne(0)
        for a in self.inner:
            value = value & Var(a.var).eq(Var(a.static) - 1)
        return value


class StepWalk(PassBuilder):
    def step_walk(self, out_c: list[str], sum_c: list[str], run: str | None, source: str, inner_about: str, kind_about: str) -> Steps:
        """The axes, tables and block counts of a walk over the non-empty (out_c x sum_c)
        blocks of `source` (for comments); `run`: the grid's traced extent, if any."""
        st = self.st
        for i in st.out_indices:
            if i not in out_c:
                self.axis("blocks", i, self.blocks_along(i), True, f"output blocks along {i}")
        n_steps = self.local("n_steps")
        what = " x ".join(f"{i} blocks" for i in out_c + sum_c)
        if run is not None:
            run = self.local(run)
        step_axis = self.axis("steps", None, Var(run or n_steps), False,
                              f"the non-empty ({what}) of {source}, each output block's in a run", var=self.local("step"))
        inner = [self.axis("reduce", i, self.blocks_along(i), False, f"the sum over {i}, which {inner_about}, inside each step")
                 for i in st.summed if i not in sum_c]
        length = Var(n_steps)
        row = self.table("step_row", length, "the output block a step writes, row-major over " + ", ".join(out_c)) if out_c else None
        read_row = self.table("step_read", length, "the output block whose inputs a step reads (steps that compute nothing hold the last one read)") if out_c else None
        col = self.table("step_col", length, "the block of the summed " + ", ".join(sum_c) + " a step reads, row-major") if sum_c else None
        kind = self.table("step_kind", length, kind_about)
        flags = self.table("step_flags", length, "1: the first step of its output block (init), 2: the last (flush)")
        self.kinds = ["_EMPTY", "_PARTIAL", "_FULL"]
        statics = {}
        for i in out_c + sum_c:
            statics[i] = self.local(f"n_{i}")
            self.statics[statics[i]] = self.blocks_along(i)
        self.n_run = run
        return Steps(out_c, sum_c, n_steps, Var(step_axis.var), inner, row, read_row, col, kind, flags, statics, self)

    def block_counts(self, s: Steps):
        """(rows, columns): the classification's row and column block counts."""
        rows = Const(1)
        for i in s.out_c:
            rows = rows * self.blocks_along(i)
        cols = Const(1)
        for i in s.sum_c:
            cols = cols * self.blocks_along(i)
        return rows, cols

    def tables_names(self, s: Steps) -> str:
        """The targets `_row_walk`'s tables are assigned to (`_` for those the walk lacks)."""
        return ", ".join(x if x else "_" for x in (s.row, s.col, s.read_row, s.kind, s.flags))


__all__ = ["StepWalk", "Steps"]
