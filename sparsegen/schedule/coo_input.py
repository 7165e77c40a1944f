"""The coo-input walk: the grid walks the stored blocks of the sparse input.

The stored blocks are sorted by the output block (row) they feed and each row's run ends
with its last block, which also writes the row's output block, so every output block is
written exactly once — a row that no stored block reaches takes one *flush step* that
writes zeros — with no look-ahead and no output aliased to an input. Output indices the
coo operand does not carry are parallel grid axes before the walk. Flush steps hold the
next stored block, so they start no copy. The grid runs exactly the steps the data needs
(a traced extent): padding entries (every coordinate -1) sort past them.
"""

from __future__ import annotations

import dataclasses

from ..expr import Const, Load, Max, Var, Where, flat, render
from .build import PassBuilder
from .core import Body, Fallback, FlushCase, Pass, Product


class CooInputWalk(PassBuilder):
    walk = "coo input"

    def build(self) -> Pass:
        st, k = self.st, self.k
        n_coo = self.choice.of("coo")[0].factor
        coo_read = st.factors[n_coo]
        coo = k.operand(coo_read.operand)
        carried = [i for i in st.out_indices if i in coo_read.indices]
        for i in st.out_indices:
            if i not in carried:
                self.axis("blocks", i, self.blocks_along(i), True, f"output blocks along {i}")
        nb = self.local("nb")
        rows = Const(1)
        for i in carried:
            rows = rows * self.blocks_along(i)
        n_steps, n_run = self.local("n_steps"), self.local("n_run")
        steps = self.axis("steps", None, Var(n_run), False,
                          f"the stored blocks of {coo.name} in output-block order (a run's last one writes its output block), "
                          "plus a step per output block none reaches (zeros)", var=self.local("step"))
        step = Var(steps.var)
        # Summed indices the coo operand lacks are walked inside each step.
        inner = [self.axis("reduce", i, self.blocks_along(i), False, f"the sum over {i}, which {coo.name} lacks, inside each step")
                 for i in st.summed if i not in coo_read.indices]
        blocks_param = self.conv.param(coo.name, "blocks").internal
        coords = {i: self.conv.param(coo.name, "coords", d).internal for d, i in enumerate(coo_read.indices)}
        self.kinds = ["_SKIP", "_BLOCK", "_FLUSH", "_LAST"]
        length = Var(nb) + rows
        kind = self.table("step_kind", length, "_BLOCK: multiply a stored block, _LAST: the same, then write the output block, _FLUSH: write zeros (no stored block), _SKIP: padding, past the steps run")
        block = self.table("step_block", length, f"the stored block of {coo.name} a step reads (flush steps hold the next one, so they start no copy)")
        row = self.table("step_row", length, "the output block a step accumulates into, row-major over " + ", ".join(carried)) if carried else None
        # Compute steps read the coordinates of their stored block; the other operands follow them.
        compute = [n for g in st.summed_groups for n in g.members] if st.summed else list(range(len(st.factors)))
        needed = [i for n in compute if n != n_coo for i in st.factors[n].indices if i in coords]
        needed += [i for i in st.summed if self.ragged(i) and i in coords]
        held = {}
        for i in coo_read.indices:
            if i in needed:
                held[i] = self.table(f"step_{i}", length, f"coordinate {i} of the stored block a step reads")
        row_coords = flat([Var(coords[i]) for i in carried], [self.blocks_along(i) for i in carried]) if carried else Const(0)
        self.host.append("# Sort the stored blocks by the output block they feed; a run's last block writes it.")
        targets = ", ".join([kind, block, row] if row else [kind, block, "_"])
        pad = self.conv.pad(coo.name)
        rows_text = render(row_coords, "host") if carried else f"jnp.zeros({pad}.shape, jnp.int32)"  # one output row
        self.host.append(f"{targets} = _coo_steps({rows_text}, {render(rows, 'host')}, {pad})")
        for i, var in held.items():
            self.host.append(f"{var} = jnp.maximum({coords[i]}[{block}], 0)  # 0 if every entry is padding")
        statics = {}
        for i in carried:
            static = self.local(f"n_{i}")
            statics[i] = Var(static)
            self.statics[static] = self.blocks_along(i)

        def decode_row(index):
            # Position of `index` inside the flattened row number.
            pos = carried.index(index)
            value = Load(row, step)
            later = Const(1)
            for n in carried[pos + 1 :]:
                later = later * statics[n]
            value = value.div(later)
            if pos > 0:
                value = value.rem(statics[index])
            return value

        def compute_coord(index):
            if index in held:
                return Load(held[index], step)
            axis = self.axis_of(index)
            if axis in inner:
                # Walked while the step computes; flush and padding steps hold the last block.
                return Where((Load(kind, step) & Var("_BLOCK")).ne(0), Var(axis.var), Var(axis.static) - 1)
            return Var(axis.var)

        def tail_coord(index):
            return Load(held[index], step) if index in held else Var(self.axis_of(index).var)

        def flush_coord(index):
            return decode_row(index) if index in carried else Var(self.axis_of(index).var)

        blocks = {}
        for n, read in enumerate(st.factors):
            if n == n_coo:
                b = self.factor_block(n, (Load(block, step),) + (Const(0),) * len(self.stored_dims(read)),
                                      "The stored block this step multiplies (flush steps hold the next one).")
            elif n in compute:
                b = self.natural_block(n, compute_coord, "The block the stored block of this step meets (flush steps hold the next one).")
            else:
                b = self.natural_block(n, flush_coord, "Read when the output block is flushed.")
            blocks[b.key] = b
        blocks["out"] = self.out_block(self.coords(st.target, flush_coord))
        # Kinds are bits: _BLOCK multiplies, _FLUSH writes (_LAST does both).
        init = step.eq(0) | (Load(kind, Max(step - 1, 0)) & Var("_FLUSH")).ne(0)
        computes = (Load(kind, step) & Var("_BLOCK")).ne(0)
        flushes = (Load(kind, step) & Var("_FLUSH")).ne(0)
        for a in inner:
            init = init & Var(a.var).eq(0)
            flushes = flushes & Var(a.var).eq(Var(a.static) - 1)
        summed, end = self.products(blocks)
        # A coo operand outside the sum's groups is still read at its own steps (at a flush
        # the coo block is the next one): it multiplies each step's sum, so duplicates add up.
        step_end = tuple(q for q in end if q.factors[0].block == f"f{n_coo}") if st.summed else ()
        end = tuple(q for q in end if q not in step_end)
        out = blocks["out"]
        note = ("A run of steps accumulates one output block; it starts after a flush step.",)
        about = "Write the finished block (zeros if no stored block reached it)."
        if st.summed:
            acc_live, acc_shape = self.acc_layout(out, summed)
            body = Body(True, init, computes, summed, step_end, flushes, (FlushCase(None, end, "flush", about),), st.summed, acc_live,
                        acc_shape, out.live, tails=self.tails(tail_coord), notes=note)
        else:
            # No sum: the product is accumulated per stored block, so duplicates add up.
            factors = tuple(f for p in end for f in p.factors)
            acc_live, acc_shape = self.acc_layout(out, ())
            body = Body(True, init, computes, (), (Product(factors),), flushes, (FlushCase(None, (), "flush", about),), (), acc_live,
                        acc_shape, out.live, notes=note)
        self.counts.append((nb, f"{blocks_param}.shape[0]"))
        self.counts.append((n_steps, f"{nb} + {render(rows, 'host')}"))
        self.fallback = Fallback(n_steps, n_run, self.local("needed"), f"_coo_run({rows_text}, {render(rows, 'host')}, {pad})", None,
                                 f"{nb} + {render(rows, 'host')}")
        self.guard += [f"if {nb} == 0:", "    # Nothing is stored: the result is all zeros."]
        products = Var(nb)
        for a in self.axes:
            if a.role == "blocks":
                products = products * a.extent
        # The stored blocks' operand first in the call: libtpu's static profiler (`verify
        # --cycles`) aborts on a walk whose output block moves along the steps when another
        # operand comes first ("No DMA issue node found for sync flag"); the kernel is the
        # same either way (its body names each ref).
        ordered = [blocks[f"f{n_coo}"]] + [b for key, b in blocks.items() if key != f"f{n_coo}"]
        p = self.finish(ordered, body, "the grid walks the stored blocks", self.dense_out_shape(), products)
        return dataclasses.replace(p, fallback=self.fallback)

    def stored_dims(self, read):
        return [s for s in read.subs if self.tile[s.index] != 1]
