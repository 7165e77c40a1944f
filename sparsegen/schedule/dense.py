"""The dense walk: a plain tiled kernel over every block.

Grid: the output's indices (parallel), then the summed indices (innermost, arbitrary),
so that each output block's visits are consecutive.
"""

from __future__ import annotations

from ..expr import Const, Var
from .build import PassBuilder
from .core import Pass


class DenseWalk(PassBuilder):
    walk = "dense"

    def build(self) -> Pass:
        for i in self.st.out_indices:
            self.axis("blocks", i, self.blocks_along(i), True, f"output blocks along {i}")
        self.reduce_axes()
        blocks = {}
        for n in range(len(self.st.factors)):
            blocks[f"f{n}"] = self.natural_block(n, lambda i: Var(self.axis_of(i).var))
        blocks["out"] = self.out_block(self.coords(self.st.target, lambda i: Var(self.axis_of(i).var)))
        body = self.reduction_body(blocks)
        products = Const(1)
        for a in self.axes:
            products = products * a.extent
        return self.finish(list(blocks.values()), body, "a plain tiled kernel over every block", self.dense_out_shape(), products)
