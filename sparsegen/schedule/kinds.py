"""Block kinds: which cells of a grid compute, and how skipped ones avoid copies.

A kind *source* classifies the blocks along some grid axes as _EMPTY (nothing to do),
_PARTIAL or _FULL: a `mask` operand's blocks (all zero / mixed / all ones), the window a
left-side offset writes (inside / outside), the stored blocks of a coo input that a coo
output's block meets (stored / not). Sources combine by their minimum. Empty cells skip
their compute, and every operand's index map follows a table to the block of the *next*
cell that computes (the tutorial's `k_fetch`, generalised), so a skipped step starts no
copy; past the last computing cell, maps hold its blocks. An all-ones mask block needs no
mask read, so the mask's own map follows only the partial blocks: a mask applied after the
sum is left out of a full block's flush, one inside the sum (covered by another factor of
its group) out of a full step's product.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..expr import Const, Expr, Load, Var, Where, clip, flat, render
from ..pytext import py_tuple as _tuple
from .build import PassBuilder
from .core import Axis, Block, Body, FlushCase, MaskSplit, Product

_KINDS = ["_EMPTY", "_PARTIAL", "_FULL"]


@dataclass
class KindSource:
    about: str  # for comments: what it classifies
    axes: list[Axis]  # the grid axes it spans, in grid order
    host: list[str]  # wrapper lines that compute `var`: kinds over `axes`
    var: str
    mask: str | None = None  # a mask operand applied after the sum: _FULL blocks need no read of it
    in_sum: str | None = None  # a mask operand inside the sum: _FULL steps multiply without it
    extra_tables: list[str] = field(default_factory=list)


def _host(e: Expr) -> str:
    return render(e, "host")


class KindsMixin(PassBuilder):
    def source_of(self, index: str) -> tuple[Axis, str | None]:
        """The grid axis that determines an index's block, and the table it is read through."""
        return self.axis_of(index), None

    def gather(self, indices, axes: list[Axis]) -> str:
        """Index arrays that pick, for every cell of `axes`, the block each index refers to."""
        pos = {a.var: p for p, a in enumerate(axes)}
        parts = []
        for i in indices:
            axis, through = self.source_of(i)
            shape = ["1"] * len(axes)
            shape[pos[axis.var]] = "-1"
            base = through if through is not None else f"jnp.arange({_host(axis.extent)})"
            parts.append(base if len(axes) == 1 else f"{base}.reshape({_tuple(shape)})")
        return ", ".join(parts)

    def axes_of(self, indices) -> list[Axis]:
        used = {self.source_of(i)[0].var for i in indices}
        return [a for a in self.axes if a.var in used]

    def mask_kinds(self, n: int, applied_after_sum: bool) -> tuple[str, bool]:
        """The host expression of a mask factor's block kinds (over its indices' blocks, in
        its order), and whether its all-ones blocks go unread (_FULL)."""
        read = self.st.factors[n]
        param = self.conv.param(read.operand).internal
        tiles = _tuple(str(self.tile[i]) for i in read.indices)
        # Inside the sum, an all-ones block is skipped where another factor covers the mask in
        # its group (that factor keeps the product's dtype; the mask alone is never dropped).
        skippable = not applied_after_sum and sum(f.operand == read.operand for f in self.st.factors) == 1 and any(
            n in g.extras for g in self.st.summed_groups)
        ones = "True" if applied_after_sum or skippable else "False"
        return f"_block_kinds({param}, {tiles}, {ones})", skippable

    def mask_source(self, n: int, applied_after_sum: bool) -> KindSource:
        read = self.st.factors[n]
        axes = self.axes_of(read.indices)
        var = self.local("kind")
        kinds, skippable = self.mask_kinds(n, applied_after_sum)
        host = [f"# Classify the blocks of {read.operand}; skipped steps follow a map to the next step that computes."]
        natural = [self.source_of(i)[0].var for i in read.indices]
        if all(self.source_of(i)[1] is None for i in read.indices) and len(set(natural)) == len(natural):
            order = [natural.index(a.var) for a in axes]
            host.append(f"{var} = {kinds}" + (f".transpose({_tuple(map(str, order))})" if order != sorted(order) else ""))
        else:
            host.append(f"{var} = {kinds}[{self.gather(read.indices, axes)}]")
        return KindSource(f"{read.operand} block", axes, host, var, read.operand if applied_after_sum else None,
                          read.operand if skippable else None)

    def window_source(self, index: str, slot: int) -> KindSource:
        axis = self.axis_of(index)
        var = self.local(f"inside_{index}")
        count = self.blocks_along(index)
        host = [f"# The blocks of {self.out.name} the statement writes along {index}; the others are zeros.",
                f"{var} = _window({_host(axis.extent)}, {self.conv.offsets}[{slot}], {_host(count)})"]
        return KindSource(f"place in the window along {index}", [axis], host, var)

    def apply_kinds(self, sources: list[KindSource], out_block: Block, custom: dict[int, object] | None = None):
        """Blocks and body over this pass's grid, skipping the cells the sources call empty.

        `custom[n](cell_var, nxt_var)` gives factor n's coordinates where its block is not
        given by the indices (a coo join's stored block)."""
        custom = custom or {}
        axes = self.axes
        pos = {a.var: p for p, a in enumerate(axes)}
        kind_axes = [a for a in axes if any(a.var in {b.var for b in s.axes} for s in sources)]
        last = max(pos[a.var] for a in kind_axes)
        prefix, after = axes[: last + 1], axes[last + 1 :]
        for s in sources:
            self.host += s.host
        self.kinds = list(_KINDS)
        if len(sources) == 1 and [a.var for a in sources[0].axes] == [a.var for a in kind_axes]:
            kind = sources[0].var
        else:
            kind = self.local("kind")
            parts = [self.broadcast(s.var, s.axes, kind_axes) for s in sources]
            value = parts[0]
            for p in parts[1:]:
                value = f"jnp.minimum({value}, {p})"
            self.host.append(f"{kind} = {value}  # the smallest kind of every source")
        size_kind = Const(1)
        for a in kind_axes:
            size_kind = size_kind * a.extent
        size_prefix = Const(1)
        for a in prefix:
            size_prefix = size_prefix * a.extent
        mask = next((s.mask for s in sources if s.mask), None)
        in_sum = next((s.in_sum for s in sources if s.in_sum), None)
        skipped = [m for m in (mask, in_sum) if m]  # masks whose all-ones blocks are not read
        next_var = self.local("next_step")
        partial_var = self.local(f"next_{skipped[0]}") if skipped else None
        about = "; ".join(s.about for s in sources)
        kinds_about = "_EMPTY (skip), _PARTIAL" + (", _FULL (all ones: no mask read)" if skipped else ", _FULL") + f": per cell, the kind of its {about}"
        self.tables.append(_table(kind, size_kind, kinds_about))
        self.tables.append(_table(next_var, size_prefix, "per grid cell over " + ", ".join(a.var for a in prefix)
                                  + ": the next cell that computes (the last one after it), so skipped steps fetch nothing new"))
        self.host.append(f"{next_var} = _next_live({self.broadcast(f'{kind} != _EMPTY', kind_axes, prefix)}.reshape(-1))")
        if skipped:
            self.tables.append(_table(partial_var, size_prefix, f"per grid cell: the next cell whose {' and '.join(skipped)} block is partial, the only blocks the kernel reads"))
            self.host.append(f"{partial_var} = _next_live({self.broadcast(f'{kind} == _PARTIAL', kind_axes, prefix)}.reshape(-1))")
        for s in sources:
            for line in s.extra_tables:
                self.host.append(line.format(next_step=next_var, prefix=self.broadcast_shape(prefix)))
        self.host.append(f"{kind} = {kind}.reshape(-1)")

        cell = flat([Var(a.var) for a in prefix], [Var(a.static) for a in prefix])
        kind_cell = flat([Var(a.var) for a in kind_axes], [Var(a.static) for a in kind_axes])

        def decode(nxt: Expr, axis_pos: int) -> Expr:
            value = nxt
            later = Const(1)
            for a in prefix[axis_pos + 1 :]:
                later = later * Var(a.static)
            value = value.div(later)
            if axis_pos > 0:
                value = value.rem(Var(prefix[axis_pos].static))
            return value

        cell_var, nxt_var, live_var = self.local("cell"), self.local("nxt"), self.local("live")
        after_vars = {a.var for a in after}

        def follow(n: int, array: str, about: str) -> Block:
            read = self.st.factors[n]
            nxt = Var(nxt_var)
            lets = [(cell_var, cell), (nxt_var, Load(array, Var(cell_var)))]
            if n in custom:
                return self.factor_block(n, custom[n](Var(cell_var), nxt), about, lets)
            if any(self.source_of(i)[0].var in after_vars for i in read.indices):
                same = [a.var for a in kind_axes] == [a.var for a in prefix]
                lets.append((live_var, Load(kind, Var(cell_var) if same else kind_cell).ne(Var("_EMPTY"))))

            def coord(index):
                axis, through = self.source_of(index)
                if axis.var in after_vars:
                    # Past the kind axes: walk them while computing; otherwise park at the
                    # first (next computing cell ahead) or last (none ahead) block.
                    value = Where(Var(live_var), Var(axis.var), Where(nxt.gt(Var(cell_var)), 0, Var(axis.static) - 1))
                else:
                    value = decode(nxt, pos[axis.var])
                return Load(through, value) if through is not None else self.index_coord(index, value)

            return self.factor_block(n, self.coords(read, coord), about, lets)

        # Where kinds vary along the sum, every output block is flushed whatever its kind, so the
        # factors applied after the sum are read at their own blocks (once per output block).
        along_sum = any(a.role == "reduce" for a in kind_axes)
        ends = {g.main for g in self.st.end_groups}
        blocks = {}
        for n, read in enumerate(self.st.factors):
            if along_sum and n in ends and n not in custom:
                b = self.factor_block(n, self.coords(read, lambda i: self.natural_coord(i)), "Read when the output block is flushed.")
            elif read.operand in skipped:
                b = follow(n, partial_var, "Only partial mask blocks are read: every other step holds the next partial one.")
            else:
                b = follow(n, next_var, "Skipped steps hold the block of the next step that computes, so they start no copy.")
            blocks[b.key] = b
        blocks["out"] = out_block
        here = self.local("block_kind")
        kernel_kind_cell = kind_cell
        body = self.reduction_body(blocks, compute_when=Var(here).ne(Var("_EMPTY")))
        summed, end = self.products(blocks)
        if along_sum:
            # Kinds vary along the sum: the accumulator holds what the computing steps added
            # (zeros if none did), so the flush always writes it.
            cases = [FlushCase(None, end, "flush", "Write the block.")]
        else:
            cases = [FlushCase(Var(here).eq(Var("_EMPTY")), None, "flush_empty", f"Nothing to compute here ({about}): the block is zero.")]
            if mask:
                others = tuple(p for p in end if p.factors[0].operand != mask)
                cases += [FlushCase(Var(here).eq(Var("_PARTIAL")), end, "flush_partial", f"Apply {mask}."),
                          FlushCase(Var(here).eq(Var("_FULL")), others, "flush_full", f"{mask} is all ones here: no need to read it.")]
            else:
                cases.append(FlushCase(Var(here).ne(Var("_EMPTY")), end, "flush", "Write the block."))
        notes = (f"Steps whose {about} is empty skip the compute (and their copies).",)
        self.kind_about = about
        split = None
        if in_sum and body.accumulator:
            # A full step's product leaves the mask out (all ones there): not read, not multiplied.
            full = tuple(Product(tuple(f for f in q.factors if f.operand != in_sum)) for q in body.summed)
            split = MaskSplit(in_sum, Var(here).eq(Var("_PARTIAL")), Var(here).eq(Var("_FULL")), full)
        body = Body(body.accumulator, body.init_when, body.compute_when, body.summed, body.step, body.flush_when, tuple(cases),
                    body.summed_indices, body.acc_live, body.acc_shape, body.out_live, body.tails, body.out_tails, notes,
                    lets=((here, Load(kind, kernel_kind_cell)),), split=split)
        return blocks, body

    def natural_coord(self, index: str) -> Expr:
        """An index's block at the current cell."""
        axis, through = self.source_of(index)
        return Load(through, Var(axis.var)) if through is not None else self.index_coord(index, Var(axis.var))

    def index_coord(self, index: str, axis_value: Expr) -> Expr:
        """An index's block coordinate from its axis's coordinate (windows shift it)."""
        return axis_value

    def broadcast_shape(self, axes: list[Axis]) -> str:
        return _tuple(_host(a.extent) for a in axes)

    def broadcast(self, value: str, have: list[Axis], want: list[Axis]) -> str:
        """`value`, an array over the axes `have` (grid order), broadcast over `want` (a superset)."""
        if [a.var for a in have] == [a.var for a in want]:
            return f"({value})" if " " in value else value
        names = {a.var for a in have}
        shape = _tuple(_host(a.extent) if a.var in names else "1" for a in want)
        return f"jnp.broadcast_to(({value}).reshape({shape}), {self.broadcast_shape(want)})"


def _table(var, length, about):
    from .core import Table

    return Table(var, length, about)


__all__ = ["KindSource", "KindsMixin", "clip"]
