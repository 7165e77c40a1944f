"""The dense grid with block kinds: a `mask` operand, or offsets on the left side.

Grid: the output's blocks (parallel) — along an index written at an offset, all of the
output's blocks, since those outside the statement's window are written as zeros — then
the summed indices. Kinds (see `kinds`) decide which cells compute.
"""

from __future__ import annotations

from ..expr import Const, Load, Var, clip
from .core import Pass
from .kinds import KindsMixin


class MaskedWalk(KindsMixin):
    walk = "mask"

    def build(self) -> Pass:
        st = self.st
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
