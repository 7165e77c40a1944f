"""The coo-output walk: the grid walks the requested output blocks, then the summed indices.

Only the blocks whose coordinates the caller gives are computed, and they come back
stacked. With a `mask` input, its block kinds are gathered at the requested blocks (a
masked SDDMM); with a `coo` input, the stored block each cell meets is looked up in a
table over the input's block grid (a sparse product kept on a sparse topology: repeated
coordinates of the input are summed first). Either way empty cells skip their compute.
"""

from __future__ import annotations

from ..expr import Const, Load, Var
from ..pytext import py_tuple
from .core import Pass, Tail
from .kinds import KindSource, KindsMixin


class CooOutputWalk(KindsMixin):
    walk = "coo output"

    def build(self) -> Pass:
        st = self.st
        out = self.out
        coords = tuple(self.conv.param(out.name, "out_coords", d).internal for d in range(out.rank))
        nb = self.local("nb")
        b = self.axis("out_blocks", None, Var(nb), True, f"the requested blocks of {out.name}", var=self.local("b"))
        self.reduce_axes()
        # Padding entries (every coordinate -1) read block 0 of their operands, if anything.
        at = tuple(self.table(f"{out.name}_at_{d}", Var(nb), f"requested block coordinate along {out.name} dim {d} (0 for padding)")
                   for d in range(out.rank))
        self.host.append("# Where the requested blocks are (padding entries: block 0, and skipped).")
        for var, c in zip(at, coords):
            self.host.append(f"{var} = jnp.maximum({c}, 0)")
        self.through = {s.index: at[d] for d, s in enumerate(st.target.subs)}
        self.out_coords = at
        stored_out = self.out_block((Var(b.var),) + (Const(0),) * sum(1 for s in st.target.subs if self.tile[s.index] != 1),
                                    "Block b of the stacked output.", stored=True)
        self.counts.append((nb, f"{coords[0]}.shape[0]"))
        self.guard += [f"if {nb} == 0:", "    # No block requested."]
        requested = self.local(f"requested_{out.name}")
        sources = [KindSource(f"requested {out.name} block", [b],
                              [f"{requested} = jnp.where({self.conv.pad(out.name)}, _EMPTY, _FULL).astype(jnp.int32)"], requested)]
        custom = {}
        about = "the grid walks the requested output blocks (padding entries are written as zeros)"
        for s in self.choice.sources:
            if s.place == "output":
                continue
            n, read = s.factor, s.read
            if s.sparsity == "mask":
                sources.append(self.mask_source(n, applied_after_sum=s.place == "after"))
                about = f"the grid walks the requested output blocks; empty blocks of {read.operand} are skipped"
            else:
                source, custom = self.join_source(n)
                sources.append(source)
                self.walk = "coo join"
                about = f"the grid walks the requested output blocks and looks up the stored blocks of {read.operand} they meet"
        blocks, body = self.apply_kinds(sources, stored_out, custom)
        products = Var(nb)
        for a in self.axes[1:]:
            products = products * a.extent
        return self.finish(list(blocks.values()), body, about, self.out_shape(nb), products)

    def coord(self, index):
        return Load(self.through[index], Var(self.axes[0].var)) if index in self.through else Var(self.axis_of(index).var)

    def source_of(self, index):
        if index in self.through:
            return self.axes[0], self.through[index]
        return self.axis_of(index), None

    def out_shape(self, nb):
        return (Var(nb), *(Const(self.tile[s.index]) for s in self.st.target.subs if self.tile[s.index] != 1))

    def out_tails(self, out):
        # Requested blocks are returned whole: elements past a ragged end are zeros.
        tails = []
        for d, s in enumerate(self.st.target.subs):
            if self.ragged(s.index):
                size = self.conv.size_var(self.k.index(s.index).size.symbol)
                tails.append(Tail(s.index, Load(self.out_coords[d], Var(self.axes[0].var)), size, self.tile[s.index]))
        return tuple(tails)

    def join_source(self, n: int):
        """The stored block of coo input n at each cell: a table over its block grid, gathered."""
        read = self.st.factors[n]
        op = self.k.operand(read.operand)
        blocks_param = self.conv.param(op.name, "blocks").internal
        coords = [self.conv.param(op.name, "coords", d).internal for d in range(op.rank)]
        grid = py_tuple(_host(self.blocks_along(i)) for i in read.indices)
        axes = self.axes_of(read.indices)
        slots, stored, block = self.local("slot"), self.local("stored"), self.local("step_block")
        host = [
            f"# The stored block of {op.name} each cell meets (-1: none), over the block grid of {op.name}.",
            f"{slots} = _block_slots({py_tuple(coords)}, {self.conv.pad(op.name)}, {grid})",
            f"{stored} = {slots}[{self.gather(read.indices, axes)}]",
            f"kind_{op.name} = jnp.where({stored} >= 0, _FULL, _EMPTY).astype(jnp.int32)",
        ]
        var = self.local(f"kind_{op.name}")
        host[-1] = host[-1].replace(f"kind_{op.name} =", f"{var} =")
        size = _Length(self)
        self.tables.append(_table(block, size.prefix_of(axes), f"per grid cell: the stored block of {op.name} the next computing cell reads"))
        extra = [f"{block} = jnp.maximum({self.broadcast(stored, axes, self.axes[: self.last_pos(axes) + 1])}.reshape(-1)[{{next_step}}], 0)"]
        # Repeated coordinates add up: their blocks are summed into the first before the call.
        self.pre = [f"{blocks_param} = _sum_duplicates({blocks_param}, {py_tuple(coords)}, {self.conv.pad(op.name)}, {grid})"]

        def custom(cell, nxt):
            return (Load(block, cell),) + (Const(0),) * sum(1 for s in read.subs if self.tile[s.index] != 1)

        return KindSource(f"{op.name} block", axes, host, var, None, extra_tables=extra), {n: custom}

    def last_pos(self, axes):
        pos = {a.var: p for p, a in enumerate(self.axes)}
        return max(pos[a.var] for a in axes)


class _Length:
    def __init__(self, builder):
        self.b = builder

    def prefix_of(self, axes):
        last = self.b.last_pos(axes)
        size = Const(1)
        for a in self.b.axes[: last + 1]:
            size = size * a.extent
        return size


def _host(e):
    from ..expr import render

    return render(e, "host")


def _table(var, length, about):
    from .core import Table

    return Table(var, length, about)
