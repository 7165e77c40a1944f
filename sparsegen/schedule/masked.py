"""The mask walk: a `mask` operand's block kinds, or offsets on the left side.

With a sum (and no offsets on the left), the condition walk's step tables (`steps`): the
mask's blocks are classified over the output indices it uses (rows) and the summed ones
(columns; the whole sum when it uses none), and the grid walks, per output block of the
other output indices, only the non-empty (row, column) pairs, each output block's in a
consecutive run; an output block whose mask blocks are all zero takes one step that writes
zeros. The grid's extent is the steps the data needs (traced: the mask is an operand),
over tables of the dense count. A partial step applies the mask; a full one (all ones,
where it can be left out: see `kinds`) does not read it.

Without a sum, or with offsets on the left, a dense grid with block kinds (see `kinds`):
the output's blocks (parallel) — along an index written at an offset, all of the output's
blocks, since those outside the statement's window are written as zeros — then the summed
indices; each cell is its output block's only step there, so empty cells cost no extra
steps.
"""

from __future__ import annotations

import dataclasses

from ..expr import Const, Load, Var, Where, clip, render
from ..pytext import py_tuple as _tuple
from .core import Body, Fallback, FlushCase, MaskSplit, Pass, Product
from .kinds import KindsMixin
from .steps import StepWalk


class MaskedWalk(KindsMixin, StepWalk):
    walk = "mask"

    def build(self) -> Pass:
        st = self.st
        if st.summed and not any(sub.offset is not None for sub in st.target.subs):
            return self.build_steps()
        windows = {}
        for d, sub in enumerate(st.target.subs):
            if sub.offset is None:
                self.axis("blocks", sub.index, self.blocks_along(sub.index), True, f"output blocks along {sub.index}")
            else:
                windows[sub.index] = self.conv.offset_slot(self.out.name, self.out.name, d)
                extent = self.conv.size(self.out.dims[d]).cdiv(self.tile[sub.index])
                self.axis("blocks", sub.index, extent, True, f"every block of {self.out.name} dim {d} (outside the window: zeros)")
        self.reduce_axes()
        self.windows = windows
        self.window_counts: dict[str, str] = {}
        sources = [self.window_source(i, slot) for i, slot in windows.items()]
        for s in self.choice.of("mask"):
            sources.append(self.mask_source(s.factor, applied_after_sum=s.place == "after"))
        if windows:
            self.walk = "window" if len(sources) == len(windows) else "mask"
        # The output is written at every cell: its own blocks, zeros where nothing is computed.
        out = self.out_block(tuple(Var(self.axis_of(s.index).var) for s in st.target.subs))
        blocks, body = self.apply_kinds(sources, out)
        products = Const(1)
        for a in self.axes:
            products = products * a.extent
        about = f"a dense grid that skips the cells whose {self.kind_about} is empty"
        return self.finish(list(blocks.values()), body, about, self.dense_out_shape(), products)

    def index_coord(self, index, axis_value):
        if index in self.windows:
            # The axis walks the output's blocks; the index's block is the one inside the window.
            start = Load(self.conv.offsets, Const(self.windows[index]))
            if index not in self.window_counts:  # the index's own blocks, bound by name in index maps
                self.window_counts[index] = self.local(f"n_{index}_in_window")
                self.statics[self.window_counts[index]] = self.blocks_along(index)
            return clip(axis_value - start, 0, Var(self.window_counts[index]) - 1)
        return axis_value

    # ------------------------------------------------------------ step tables
    def build_steps(self) -> Pass:
        st = self.st
        masks = self.choice.of("mask")
        used = list(dict.fromkeys(i for m in masks for i in m.read.indices))
        out_c = [i for i in st.out_indices if i in used]
        sum_c = [i for i in st.summed if i in used]
        # Kinds vary along the sum: every output block is flushed whatever its kind.
        along_sum = bool(sum_c)
        if not sum_c:
            # A mask on output indices alone: the sum is walked as the steps' columns (each of
            # its row's kind), so an all-zero output block takes one step, not one per block of the sum.
            sum_c = list(st.summed)
        names = " and ".join(dict.fromkeys(m.operand for m in masks))
        kinds = []
        mask = in_sum = None  # masks whose all-ones blocks are not read (after the sum; inside it)
        for m in masks:
            text, skippable = self.mask_kinds(m.factor, applied_after_sum=m.place == "after")
            kinds.append(self.over_blocks(text, m.read.indices, out_c + sum_c))
            if m.place == "after":
                mask = mask or m.operand
            elif skippable:
                in_sum = in_sum or m.operand
        skipped = [x for x in (mask, in_sum) if x]
        kind_about = (f"_EMPTY (all-zero {names} block: no compute), _PARTIAL (mixed: applied)"
                      + (", _FULL (all ones: not read)" if skipped else ", _FULL"))
        s = self.step_walk(out_c, sum_c, "n_run", names, f"{names} does not use", kind_about)
        partial_step = None

        def partial_coord(index: str):
            """A mask read only at partial steps: every other step holds the next partial one's block."""
            nonlocal partial_step
            if partial_step is None:
                partial_step = self.table(f"next_{skipped[0]}", Var(s.n_steps),
                                          f"the next step whose {' and '.join(skipped)} block is partial (the last one after it), the only blocks the kernel reads")
            return s.read_at(Load(partial_step, s.step), index)

        outer = {a.index: a for a in self.axes if a.role == "blocks"}
        any_step = None

        def held(coord):
            """Along the parallel axes, a walk with no computing step holds block 0: no copy."""
            def at(index: str):
                nonlocal any_step
                if index not in outer:
                    return coord(index)
                if any_step is None:
                    any_step = self.table("any_step", Const(1), "1 if some step computes; else every step reads block 0 along "
                                          + ", ".join(outer) + " (no copy)")
                return Where(Load(any_step, Const(0)).ne(0), Var(outer[index].var), 0)
            return at

        ends = {g.main for g in st.end_groups}
        blocks = {}
        for n, read in enumerate(st.factors):
            if along_sum and n in ends:
                b = self.natural_block(n, s.write_coord, "Read when the output block is flushed.")
            elif read.operand in skipped:
                b = self.natural_block(n, held(partial_coord), "Only partial mask blocks are read: every other step holds the next partial one.")
            else:
                b = self.natural_block(n, held(s.read_coord), "Steps that compute nothing hold the blocks of the last step that did: no copy.")
            blocks[b.key] = b
        blocks["out"] = self.out_block(self.coords(st.target, s.write_coord))

        here = self.local("step_kind_here")
        summed, end = self.products(blocks)
        out = blocks["out"]
        acc_live, acc_shape = self.acc_layout(out, summed)
        if along_sum:
            # The accumulator holds what the computing steps added (zeros if none did).
            cases = (FlushCase(None, end, "flush", "Write the block (zeros if nothing was present)."),)
        else:
            cases = (FlushCase(Var(here).eq(Var("_EMPTY")), None, "flush_empty", f"An all-zero {names} block: the block is zero."),)
            if mask:
                others = tuple(p for p in end if p.factors[0].operand != mask)
                cases += (FlushCase(Var(here).eq(Var("_PARTIAL")), end, "flush_partial", f"Apply {mask}."),
                          FlushCase(Var(here).eq(Var("_FULL")), others, "flush_full", f"{mask} is all ones here: no need to read it."))
            else:
                cases += (FlushCase(Var(here).ne(Var("_EMPTY")), end, "flush", "Write the block."),)
        split = None
        if in_sum:
            # A full step's product leaves the mask out (all ones there): not read, not multiplied.
            full = tuple(Product(tuple(f for f in q.factors if f.operand != in_sum)) for q in summed)
            split = MaskSplit(in_sum, Var(here).eq(Var("_PARTIAL")), Var(here).eq(Var("_FULL")), full)
        notes = ("A run of steps accumulates one output block; an all-zero output block takes one step (zeros).",)
        body = Body(True, s.first, Var(here).ne(Var("_EMPTY")), summed, (), s.last, cases, st.summed, acc_live, acc_shape, out.live,
                    tails=self.tails(s.compute_coord), notes=notes, lets=((here, Load(s.kind, s.step)),), split=split)

        # The tables: the mask's kinds over (rows, columns), walked by `_row_walk` (traced).
        rows, cols = self.block_counts(s)
        grid = [self.host_blocks(i) for i in out_c + sum_c]
        value = kinds[0]
        for k in kinds[1:]:
            value = f"jnp.minimum({value}, {k})"
        call = f"jnp.broadcast_to({value}, {_tuple(grid)}).reshape((1, {render(rows, 'host')}, {render(cols, 'host')}))"
        dense = f"{render(rows, 'host')} * {render(cols, 'host')}"
        var = self.local("kinds")
        self.counts.append((s.n_steps, dense))
        self.host += [f"# The walk's steps, from the blocks of {names} (traced: tables of {s.n_steps} steps; the grid runs those needed).",
                      f"{var} = {call}",
                      f"({self.tables_names(s)}), _, _ = _row_walk(jnp, {var}, {s.n_steps})"]
        if partial_step is not None:
            self.host.append(f"{partial_step} = _next_live({s.kind} == _PARTIAL)")
        if any_step is not None:
            self.host.append(f"{any_step} = jnp.any({s.kind} != _EMPTY).astype(jnp.int32).reshape(1)")
        fallback = Fallback(s.n_steps, self.n_run, self.local("needed"), f"_row_walk(jnp, {call}, 1)[2][0]", None, dense)
        products = Var(s.n_steps)
        for a in self.axes:
            if a.role != "steps":
                products = products * a.extent
        about = f"the non-empty blocks of {names}, each output block's steps in a run"
        p = self.finish(list(blocks.values()), body, about, self.dense_out_shape(), products)
        return dataclasses.replace(p, fallback=fallback)

    def host_blocks(self, index: str) -> str:
        return render(self.blocks_along(index), "host")

    def over_blocks(self, kinds: str, indices, order: list[str]) -> str:
        """`kinds`, an array over the blocks of `indices`, as one over those of `order` (a
        superset), broadcastable: its dimensions in that order, 1 along the others."""
        if len(set(indices)) == len(indices):
            perm = sorted(range(len(indices)), key=lambda d: order.index(indices[d]))
            if perm != list(range(len(indices))):
                kinds = f"{kinds}.transpose({_tuple(map(str, perm))})"
            if len(indices) == len(order):
                return kinds
            return f"{kinds}.reshape({_tuple(self.host_blocks(i) if i in indices else '1' for i in order)})"
        # An index repeated (`mask[m, m]`): gathered, one index array per dimension.
        picks = []
        for i in indices:
            shape = _tuple("-1" if j == i else "1" for j in order)
            picks.append(f"jnp.arange({self.host_blocks(i)}).reshape({shape})")
        return f"{kinds}[{', '.join(picks)}]"
