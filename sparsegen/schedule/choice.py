"""Which walk a statement takes, and the operands whose blocks decide what it visits: one
decision, made here for every backend.

The TPU schedule builds the walk this names (`schedule.walk_of`); the GPU lowering maps it
to a strategy of its own (`gpu/product.py`: dense, rows, cols, coo output, output mask) or
refuses it at the statement. Neither decides again.

- `condition`: a `where` condition on the statement's terms (language v2 section 1);
- `coo output`: the output is coo, only its requested blocks are computed;
- `coo input`: a coo factor's stored blocks;
- `masked`: a mask factor's block kinds, or a window written at offsets on the left;
- `dense`: every block.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Einsum, Kernel, Read


@dataclass(frozen=True)
class Source:
    """An operand whose blocks decide which blocks a pass visits, and where the statement reads it."""

    read: Read  # the factor's read; for the output, the left side
    sparsity: str  # "coo" or "mask"
    place: str  # "output" (the left side), "sum" (a factor of a summed group) or "after" (applied after the sum, or no sum)
    factor: int | None = None  # its position in the statement's factors (None: the output)
    group: int | None = None  # its summed group: a position in `summed_groups` (place "sum" only)
    covered: bool = False  # multiplied into the group's covering factor (not the covering factor itself)

    @property
    def operand(self) -> str:
        return self.read.operand


@dataclass(frozen=True)
class Walk:
    """The walk a statement takes: `name` (see the module's list) and its sources, the output first."""

    name: str
    sources: tuple[Source, ...]
    window: bool  # offsets on the left side: the output is written outside the statement's window too (zeros)

    def of(self, sparsity: str) -> tuple[Source, ...]:
        return tuple(s for s in self.sources if s.sparsity == sparsity)


def sources_of(kernel: Kernel, st: Einsum) -> tuple[Source, ...]:
    """Every sparse operand of a statement: a coo output, then the coo and mask factors in order."""
    out: list[Source] = []
    if kernel.operand(st.target.operand).sparsity == "coo":
        out.append(Source(st.target, "coo", "output"))
    for n, read in enumerate(st.factors):
        sparsity = kernel.operand(read.operand).sparsity
        if sparsity not in ("coo", "mask"):
            continue
        group = next((g for g, grp in enumerate(st.summed_groups) if n in grp.members), None)
        if group is None:
            out.append(Source(read, sparsity, "after", n))
        else:
            out.append(Source(read, sparsity, "sum", n, group, n != st.summed_groups[group].main))
    return tuple(out)


def choose_walk(kernel: Kernel, st: Einsum) -> Walk:
    """The statement's walk; it refuses nothing (each backend says what it cannot run)."""
    sources = sources_of(kernel, st)
    window = any(s.offset for s in st.target.subs)
    kinds = {s.sparsity for s in sources if s.place != "output"}
    if st.condition is not None:
        name = "condition"
    elif any(s.place == "output" for s in sources):
        name = "coo output"
    elif "coo" in kinds:
        name = "coo input"
    elif "mask" in kinds or window:
        name = "masked"
    else:
        name = "dense"
    return Walk(name, sources, window)
