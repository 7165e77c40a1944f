"""The condition walk: a statement whose `where` selects terms (language v2, section 1).

The condition is classified over the blocks of the indices it uses: those of the output
(its *rows*) and the summed ones (its *columns*), as empty, partial or full, by the
row walk's classifier (exact for affine comparisons and their `and`, sorted ids compared
for equality, masks; partial where unsure). The grid walks, per output block of the
other indices (parallel axes), one flat axis of steps over the non-empty (row, column)
pairs in row order, each row's run a consecutive revisit of its output block, a row
with none getting one step that writes zeros; summed indices the condition does not use
are walked inside each step. In a partial step the absent terms are selected out of the
factor that holds the condition's indices (or, for a condition on the output's indices
alone, out of the value written).

The number of steps: known at trace time when the classification depends on sizes only
(numpy); with traced operands, the dense count, or for grouped ids (`gid[m] == g`, `g`
walked one value at a time) the bound `row blocks + groups - 1` that sorted ids meet,
with a fallback to the dense walk where the data needs more (unsorted ids: correct,
slower), in calls over as many rows as SMEM holds the tables of (both branches compile).
"""

from __future__ import annotations

import dataclasses

from ..expr import Const, Expr, Load, Var, render
from ..ir import Read, Term
from ..source import Diagnostic
from .attention import Point
from .classify import Classifier, Conditions
from .build import ScheduleError
from .core import Block, Body, Fallback, FlushCase, HostFunction, Pass, Select
from .steps import StepWalk



def condition_indices(cond: Term) -> list[str]:
    """The indices a condition uses (its index terms and its reads' subscripts), in order."""
    out: list[str] = []
    for t in cond.walk():
        names = [t.name] if t.op == "index" else list(t.read.indices) if t.read is not None else []
        out += [i for i in names if i not in out]
    return out


def condition_axes(st) -> tuple[list[str], list[str], list[str]]:
    """The indices a statement's condition uses, and the axes it is classified over: the
    output's it uses (rows) and the summed ones (columns). A condition on output indices
    alone takes every summed index as its columns (each full), so an output block the
    condition empties takes one step that writes zeros, not one per block of the sum."""
    used = condition_indices(st.condition)
    out_c = [i for i in st.out_indices if i in used]
    sum_c = [i for i in st.summed if i in used]
    if not sum_c and out_c:
        sum_c = list(st.summed)
    return used, out_c, sum_c


@dataclasses.dataclass(frozen=True)
class Selection:
    """Where a condition's absent terms are selected out, so that nothing an absent term's
    factors hold (NaN, Inf) reaches a result (language v3, section 0):

    - "flush": the condition uses no summed index: the value written (every term of an
      output element is present or none is);
    - "product": every index of the condition a block spans is an output index (a summed
      one it uses is walked one value at a time, a scalar at a step): each partial step's
      product, before it is accumulated (each step with its own value of that index);
    - "group": the condition spans a summed index: the group of the sum `group`, which holds
      all the indices it spans. The other group, `exposed`, if any, may hold a NaN or Inf
      that meets an absent term (0 * NaN): a step where it does is recomputed over the
      present terms (`_present_step`). Where both groups hold those indices, one is
      selected and the other checked so (one select per step, not two)."""

    target: str  # "flush" | "product" | "group"
    group: int | None = None
    exposed: int | None = None


def selection(st, tile: dict[str, int], used: list[str]) -> Selection:
    """The rule (`Selection`) for a statement whose condition uses `used` (tiles by index)."""
    if not any(i in st.summed for i in used):
        return Selection("flush")
    spanned = {i for i in used if tile[i] > 1}
    if spanned <= set(st.out_indices):
        return Selection("product")
    mains = [set(st.factors[grp.main].indices) for grp in st.summed_groups]
    holders = [g for g, held in enumerate(mains) if spanned <= held]
    if not holders:
        names = ", ".join(sorted(spanned))
        raise ScheduleError(Diagnostic(st.span, f"not supported yet: no factor holds every index of the condition ({names}) "
                                                "that a block spans; a condition on summed indices needs one factor with all of them"))

    def first_own(g: int) -> int:
        """The first output index (with a tile above 1) that group g holds and the other does
        not: the exposed group is checked on one slice of the product along it (a block's
        row, where it is the output's first)."""
        own = mains[g] - set().union(*(m for n, m in enumerate(mains) if n != g))
        return min((n for n, i in enumerate(st.out_indices) if i in own and tile[i] > 1), default=len(st.out_indices))

    group = min(holders, key=lambda g: (first_own(g), g))
    exposed = next((g for g in range(len(st.summed_groups)) if g != group), None)
    return Selection("group", group, exposed)


class ConditionWalk(StepWalk):
    walk = "condition"

    def __init__(self, *args):
        super().__init__(*args)
        self.functions: list[HostFunction] = []  # the classification (unless a pass before wrote the same)
        self.fallback: Fallback | None = None  # the traced walk length
        self.n_run: str | None = None  # the grid's traced extent
        self.cond_step: str | None = None  # table: the next partial step (condition operands' blocks)
        self.scalar_tables: dict[str, str] = {}  # operand -> its SMEM table (reads one element per step)

    def build(self) -> Pass:
        st = self.st
        cond = st.condition
        self.refuse_unsupported()
        used, out_c, sum_c = condition_axes(st)
        # Traced operands in the condition: the grid runs exactly the steps the data needs.
        traced = any(self.k.operand(r.operand).sparsity == "dense" for r in cond.reads)
        s = self.step_walk(out_c, sum_c, "n_run" if traced else None, "the condition", "the condition does not use",
                           "_EMPTY (nothing present: no compute), _PARTIAL (the condition is evaluated), _FULL")
        n_steps, step, length = s.n_steps, s.step, Var(s.n_steps)
        row, read_row, col, kind, flags = s.row, s.read_row, s.col, s.kind, s.flags
        read_coord, compute_coord, write_coord = s.read_coord, s.compute_coord, s.write_coord

        def cond_coord(index: str) -> Expr:
            """A condition operand's block: read at partial steps only, so every other step
            holds the block of the next partial one (no copy where the condition is not evaluated)."""
            if self.cond_step is None:
                self.cond_step = self.table("step_cond", length, "the next step that evaluates the condition (the last one after it)")
            return s.read_at(Load(self.cond_step, step), index)

        blocks: dict[str, Block] = {}
        for n in range(len(st.factors)):
            b = self.natural_block(n, read_coord, "Steps that compute nothing hold the blocks of the last step that did: no copy.")
            blocks[b.key] = b
        rule = self.selection(used)
        reads, scalars = [], []
        for n, r in enumerate(dict.fromkeys(cond.reads)):
            if any(sub.shift and self.tile[sub.index] != 1 for sub in r.subs):
                raise ScheduleError(Diagnostic(r.span, f"not supported yet: '{r.text}' reads at an index plus an integer along an index "
                                                       "with a tile above 1; such an index is walked one value at a time (tile 1)"))
            if all(self.tile[i] == 1 for i in r.indices):
                # One element per step (`lens[b]`, `lo[g]`): read from scalar memory.
                scalars.append((r, self.scalar_read(r, read_coord)))
                continue
            b = self.condition_block(n, r, cond_coord, rule, blocks)
            blocks[b.key] = b
            reads.append((r, b.key))
        blocks["out"] = self.out_block(self.coords(st.target, write_coord))

        # Where each of the condition's indices is at a computing step (element positions).
        coord_at = tuple((i, read_coord(i)) for i in used)
        first, last = s.first, s.last
        here = self.local("step_kind_here")
        partial = Var(here).eq(Var("_PARTIAL"))
        sizes = tuple((t.name, self.conv.size_var(t.name)) for t in cond.walk() if t.op == "size")
        select = Select(cond, rule.target, rule.group, rule.exposed, coord_at, tuple(reads), tuple(scalars), partial, Var(here).eq(Var("_FULL")), Var(here).ne(Var("_PARTIAL")), tuple(dict.fromkeys(sizes)))
        summed, end = self.products(blocks)
        out = blocks["out"]
        acc_live, acc_shape = self.acc_layout(out, summed)
        notes = ("A run of steps accumulates one output block; a step with nothing present computes nothing.",)
        if st.summed:
            cases = (FlushCase(None, end, "flush", "Write the block (zeros if nothing was present).", select=rule.target == "flush"),)
            body = Body(True, first, Var(here).ne(Var("_EMPTY")), summed, (), last, cases, st.summed, acc_live, acc_shape, out.live,
                        tails=self.tails(compute_coord), notes=notes, lets=((here, Load(kind, step)),), select=select)
        else:
            cases = (FlushCase(Var(here).eq(Var("_EMPTY")), None, "flush_empty", "Nothing present: zeros."),
                     FlushCase(Var(here).ne(Var("_EMPTY")), end, "flush", "Write the block; in a partial one the absent elements are zeros.",
                               select=True))
            body = Body(False, None, None, (), (), last, cases, (), acc_live, acc_shape, out.live,
                        notes=notes, lets=((here, Load(kind, step)),), select=select)

        self.classify_host(cond, out_c, sum_c, n_steps, (row, col, read_row, kind, flags))
        products = Var(n_steps)
        for a in self.axes:
            if a.role != "steps":
                products = products * a.extent
        about = f"the non-empty blocks of the condition `{cond.text}`"
        p = self.finish(list(blocks.values()), body, about, self.dense_out_shape(), products)
        return dataclasses.replace(p, functions=tuple(self.functions), fallback=self.fallback)

    # ------------------------------------------------------------ refusals
    def refuse_unsupported(self) -> None:
        st, k = self.st, self.k
        for r in st.factors:
            op = k.operand(r.operand)
            if op.sparsity in ("coo", "mask"):
                raise ScheduleError(Diagnostic(r.span, f"not supported yet: a condition on a statement with a {op.sparsity} operand ('{op.name}'); "
                                                       "read a mask in the condition instead (`where keep[m, k]`)"))
            if op.direction == "out":
                raise ScheduleError(Diagnostic(r.span, f"not supported yet: a condition on a statement that reads another output ('{op.name}')"))
        for r in (st.target, *st.factors):
            if any(s.offset is not None for s in r.subs):
                raise ScheduleError(Diagnostic(r.span, "not supported yet: offsets in a statement with a condition"))
        if self.out.sparsity == "coo":
            raise ScheduleError(Diagnostic(st.target.span, "not supported yet: a condition on a statement with a coo output"))

    def selection(self, used: list[str]) -> Selection:
        """The rule; where both groups of the sum hold the condition's spanned indices, the one
        selected is one the matrix product takes as it lies (its summed index last if it is
        the left operand, first if the right): measured (libtpu's estimate, grouped_matmul's
        d_w on v6e, ids straddling blocks), a transposed left operand selected cost 5% more
        per pass, the right one nothing. Either gives the same result (`Selection`)."""
        rule = selection(self.st, self.tile, used)
        if rule.target != "group" or rule.exposed is None:
            return rule
        spanned = {i for i in used if self.tile[i] > 1}
        other = self.st.factors[self.st.summed_groups[rule.exposed].main]
        if spanned <= set(other.indices) and not self.as_it_lies(rule.group) and self.as_it_lies(rule.exposed):
            return Selection("group", rule.exposed, rule.group)
        return rule

    def as_it_lies(self, group: int) -> bool:
        """Does the matrix product take this group's block as it lies (no transpose)?"""
        st = self.st
        live = [i for i in st.factors[st.summed_groups[group].main].indices if self.tile[i] > 1]
        rows = [i for i in st.out_indices if self.tile[i] > 1][:1]
        summed = [i for i in live if i in st.summed]
        if not live or not summed:
            return True
        left = bool(rows) and rows[0] in live
        return live[-1] in summed if left else live[0] in summed

    def scalar_read(self, r: Read, coord) -> Expr:
        """An integer operand every index of whose read walks one value at a time: a table
        (the operand flattened, in SMEM) read at the step's element."""
        op = self.k.operand(r.operand)
        if op.name not in self.scalar_tables:
            length = Const(1)
            for d in op.dims:
                length = length * self.conv.size(d)
            var = self.table(f"{op.name}_smem", length, f"{op.name}, flattened: read one element per step by the condition")
            self.host.append(f"{var} = {self.conv.param(op.name).internal}.reshape(-1).astype(jnp.int32)")
            self.scalar_tables[op.name] = var
        at = Const(0)
        for d, c in enumerate(self.coords(r, coord)):
            at = at * self.conv.size(op.dims[d]) + c if d else c
        return Load(self.scalar_tables[op.name], at)

    def condition_block(self, n: int, r: Read, coord, rule: Selection, blocks) -> Block:
        """The block of an integer operand a condition reads, laid out as the values it selects
        in see it: its own layout when it has their indices in order; a 1-index read as a
        column (lane-broadcast copy) or a row (sublane-broadcast copy)."""
        st, k = self.st, self.k
        op = k.operand(r.operand)
        if rule.target == "group":
            values = [blocks[f"f{st.summed_groups[rule.group].main}"].live]
        else:  # the step's product or the value written: the output block's indices
            values = [tuple(i for i in st.out_indices if self.tile[i] > 1)]
        live = tuple(i for i in r.indices if self.tile[i] > 1)
        dims = self.dims(r)
        coords = self.coords(r, coord)
        param = self.conv.param(op.name).internal
        layouts = set()
        for axes in values:
            if live == axes or not live:
                layouts.add("natural")
            elif len(live) == 1 and len(axes) >= 2 and live[0] == axes[-2]:
                layouts.add("rows")
            elif len(live) == 1 and len(axes) >= 2 and live[0] == axes[-1]:
                layouts.add("cols")
            else:
                raise ScheduleError(Diagnostic(r.span, f"not supported yet: the condition reads '{op.name}' with indices that are not "
                                                       f"those of the block it selects in ({', '.join(axes)})"))
        if len(layouts) > 1:
            raise ScheduleError(Diagnostic(r.span, f"not supported yet: the condition reads '{op.name}' along an index that the "
                                                   "factors it selects in lay out differently"))
        (layout,) = layouts
        array = param
        if layout != "natural":
            array = self.local(f"{op.name}_{layout}")
            if len(r.indices) != 1:
                raise ScheduleError(Diagnostic(r.span, f"not supported yet: the condition reads '{op.name}' with several indices, one of them spanned"))
            size = self.conv.size(op.dims[0])
            n_el = render(size, "host")
            if layout == "rows":
                self.pre.append(f"{array} = jnp.broadcast_to({param}.astype(jnp.int32)[:, None], ({n_el}, 128))  # {r.text} per row: a column in the kernel")
            else:
                self.pre.append(f"{array} = jnp.broadcast_to({param}.astype(jnp.int32)[None, :], (8, {n_el}))  # {r.text} per column: a row in the kernel")
        return Block(f"c{n}", op.name, array, False, dims, coords, (), f"{r.text}, read by the condition", layout=layout)

    # ------------------------------------------------------------ host
    def classify_host(self, cond: Term, out_c: list[str], sum_c: list[str], n_steps: str, tables) -> None:
        """The classification function, the walk's length and its tables."""
        scope = self.names.scope()
        axes = tuple(out_c + sum_c)
        cl = Classifier(Conditions((Point(None, None, cond),), axes, self.k), self.conv, scope.local, lambda i: self.tile[i],
                        self.size)
        lines = cl.kinds([])
        reads = list(dict.fromkeys(self.conv.param(r.operand).internal for r in cond.reads))
        sizes = [s.internal for s in self.conv.sizes]
        head = [f"{', '.join(sizes)}{',' if len(sizes) == 1 else ''} = sizes"] if sizes else ["del sizes"]
        params, body = ("xp", *reads, "sizes"), tuple(head + lines)
        # A gradient's pass with the same condition over the same axes calls the forward's.
        fn, new = self.names.host_function(f"_{self.prefix}classify", (params, body))
        if new:
            self.functions.append(HostFunction(fn, params, "Per (row block, column block) of the condition: empty, partial or "
                                               "full (xp: numpy when only sizes matter, jax.numpy for traced operands).", body))
        rows = Const(1)
        for i in out_c:
            rows = rows * self.blocks_along(i)
        cols = Const(1)
        for i in sum_c:
            cols = cols * self.blocks_along(i)
        shape = f"(1, {render(rows, 'host')}, {render(cols, 'host')})"
        data = bool(reads)
        xp = "jnp" if data else "np"
        kinds = self.local("kinds")
        # The sizes as a tuple of their variables: counts are also evaluated where `sizes` is not bound.
        size_tuple = "(" + ", ".join(sizes) + ("," if len(sizes) == 1 else "") + ")"
        call = f"{fn}({xp}, {', '.join(reads + [size_tuple])}).reshape({shape})"
        row, col, read_row, kind, flags = tables
        names = ", ".join(x if x else "_" for x in (row, col, read_row, kind, flags))
        if not data:
            # Known at trace time: exactly the non-empty steps.
            self.counts.append((n_steps, f"int(_row_walk(np, {call})[1])"))
            self.host += ["# The walk's steps, from the condition's blocks (known at trace time).",
                          f"{kinds} = {call}",
                          f"({names}), _, _ = _row_walk(np, {kinds})"]
            self.cond_host(kind)
            return
        dense = f"{render(rows, 'host')} * {render(cols, 'host')}"
        bound = self.grouped_bound(cond, out_c, sum_c)
        self.counts.append((n_steps, bound or dense))
        # With a bound, the dense walk runs in pieces of rows (`piece`: the rows of one).
        self.host += [f"# The walk's steps, from the condition's blocks (traced: tables of {n_steps} steps; the grid runs those needed).",
                      f"{kinds} = {call}",
                      f"({names}), _, _ = _row_walk(jnp, {kinds}, {n_steps}{', piece' if bound else ''})"]
        self.cond_host(kind)
        steps = [t for t in self.tables if isinstance(t.length, Var) and t.length.name == n_steps]
        other = [render(t.length, "host") for t in self.tables if t not in steps]
        self.fallback = Fallback(n_steps, self.n_run, self.local("needed"), f"_row_walk(jnp, {call}, 1)[2][0]", bound, dense,
                                 render(rows, "host"), render(cols, "host"), len(steps), " + ".join(other) or "0",
                                 self.local("walk_kinds"), call)

    def cond_host(self, kind: str) -> None:
        if self.cond_step is not None:
            self.host.append(f"{self.cond_step} = _next_live({kind} == _PARTIAL)")

    def other_blocks(self, indices: list[str], pair: tuple[str, str]) -> Expr:
        out = Const(1)
        for i in indices:
            if i not in pair:
                out = out * self.blocks_along(i)
        return out

    def grouped_bound(self, cond: Term, out_c: list[str], sum_c: list[str]) -> str | None:
        """`row blocks + groups - 1` (times the other classified blocks) for a condition that is,
        or is and-ed with, sorted ids compared for equality with an index walked one value at a
        time (`gid[m] == g`); None for any other."""
        conjuncts = list(cond.args) if cond.op == "and" else [cond]
        # Chains (`lo[g] <= m < lo[g + 1]`) as their comparisons.
        conjuncts = [Term("cmp", (c.args[n], c.args[n + 1]), ops=(op,)) if c.op == "cmp" else c
                     for c in conjuncts for n, op in enumerate(c.ops if c.op == "cmp" else (None,))]
        # Group offsets: `lo[g] <= m` and `m < lo[g + 1]` (sorted offsets: each row block meets a run of groups).
        lows = {(c.args[0].read.operand, c.args[0].read.subs[0].index, c.args[1].name) for c in conjuncts
                if c.op == "cmp" and c.ops[0] == "<=" and c.args[0].op == "read" and c.args[1].op == "index"
                and len(c.args[0].read.subs) == 1 and not c.args[0].read.subs[0].shift}
        for c in conjuncts:
            if c.op == "cmp" and c.ops[0] in ("<", "<=") and c.args[0].op == "index" and c.args[1].op == "read" and len(c.args[1].read.subs) == 1:
                sub = c.args[1].read.subs[0]
                m, lo, g = c.args[0].name, c.args[1].read.operand, sub.index
                if sub.shift == 1 and (lo, g, m) in lows and self.tile[g] == 1 and m != g:
                    pairs = self.blocks_along(m) + self.blocks_along(g) - 1
                    return render(pairs * self.other_blocks(out_c + sum_c, (m, g)), "host")
        for c in conjuncts:
            if c.op != "cmp" or c.ops != ("==",):
                continue
            a, b = c.args
            for ids, g in ((a, b), (b, a)):
                if ids.op == "read" and len(ids.read.indices) == 1 and g.op == "index" and self.tile[g.name] == 1:
                    m = ids.read.indices[0]
                    if m == g.name or self.k.operand(ids.read.operand).dtype.is_float:
                        continue
                    pairs = self.blocks_along(m) + self.blocks_along(g.name) - 1
                    return render(pairs * self.other_blocks(out_c + sum_c, (m, g.name)), "host")
        return None


__all__ = ["ConditionWalk", "Selection", "condition_axes", "condition_indices", "selection"]
