"""The paged walk's host side, the same on every target (language v2, sections 2-3): the
condition classified per page, sizes and extents of packed rows, `reference` through the
table, the keys inside a step's pages. The TPU and GPU paged emitters stand on it; each
target writes its kernel."""

from __future__ import annotations

from ..expr import Const, Var, flat, render
from ..ir import Read
from ..pytext import py_tuple
from ..schedule.classify import Classifier
from .row import RowHost


class PagedHost(RowHost):
    origin_supported = False  # `sharded` does not split its key index

    def __init__(self, m):
        super().__init__(m)
        self.pg = m.paged
        page = self.pg.page
        self.page = str(page) if isinstance(page, int) else m.conv.size_var(page)
        self.page_expr = Const(page) if isinstance(page, int) else Var(self.page)
        self.tj = self.pg.key_tile
        self.ti = self.tile[self.p.query]
        self.gathered = {g.read.operand for g in self.pg.gathers}
        self.packed = self.pg.packed  # lead indices whose blocks join the rows
        self.rows = self.ti
        for i in self.packed:
            self.rows *= self.tile[i]

    def extent(self, index: str):
        """The grid's extent along a lead index: its values, or its blocks when packed."""
        size = self.size_expr(index)
        return size.cdiv(self.tile[index]) if index in self.packed else size

    def ragged(self, index: str) -> bool:
        # The key index ranges over whole pages (NP * T): classified per page, never ragged.
        return False if index == self.p.key else super().ragged(index)

    def visit_tiles(self) -> tuple[str, str]:
        return str(self.ti), self.page

    def size_expr(self, index: str):
        return self.m.conv.size(self.k.index(index).size)

    # -------------------------------------------------------- classification
    def classify(self):
        """The condition's kinds per (group, row block, page): a page is the key block here."""
        p = self.p
        scope = self.n.scope()
        tile_of = lambda i: self.page_expr if i == p.key else self.tile[i]  # noqa: E731
        cl = Classifier(p, self.m.conv, scope.local, tile_of, self.size_expr)
        lines = cl.kinds([i for i in (p.query,) if self.ragged(i)])
        reads = []
        for r in (r for cond in p.conditions for r in cond.reads):
            param = self.m.conv.param(r.operand).internal
            if param not in reads:
                reads.append(param)
        return self.n.function("_classify_pages"), reads, lines

    # ------------------------------------------------------------- reference
    def reference_view(self, r: Read) -> str:
        """A read through the table as a dense array over `r.indices`: the pages gathered
        (entries clamped: a page past a length is never visited), pages and offsets merged."""
        g = next((g for g in self.pg.gathers if g.read == r), None)
        if g is None:
            return super().reference_view(r)
        conv = self.m.conv
        v = conv.param(r.operand).internal
        table = conv.param(g.table.operand).internal
        d = g.page_dim
        n_table = len(g.table.subs)
        size = self.dim_size(r, d)
        v = f"jnp.take({v}, jnp.clip({table}, 0, {size} - 1), axis={d})"
        # The table's last axis (pages) and the page's offsets become the key index.
        shape = ([self.dim_size(r, a) for a in range(d)] + [self.dim_size(g.table, a) for a in range(n_table - 1)] + ["-1"]
                 + [self.dim_size(r, a) for a in range(d + 2, len(r.subs))])
        v = f"{v}.reshape({py_tuple(shape)})"
        for a, s in enumerate(g.heads):
            if s.divisor != 1:
                v = f"jnp.repeat({v}, {s.divisor}, axis={a})"
        return v

    # ------------------------------------------------------------- the kernel
    def flat_read(self, r: Read, lead_vars: dict[str, str]) -> str:
        """A read over lead indices as a position in its flattened array."""
        op = self.k.operand(r.operand)
        return render(flat([Var(lead_vars[s.index]) for s in r.subs], [self.m.conv.size(dim) for dim in op.dims]), "py")

    def inside_pages(self, kpos: str, lo: str, hi: str, scalar) -> list[str]:
        """The keys inside the pages [lo, hi) a row block's step copied (the others' buffer rows
        hold anything, or repeat a page): `scalar` makes a scalar the comparisons' operand."""
        return [f"({kpos} >= {scalar(f'{lo} * {self.page}')})", f"({kpos} < {scalar(f'{hi} * {self.page}')})"]
