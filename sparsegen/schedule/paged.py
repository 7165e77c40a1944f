"""The paged walk (language v2, sections 2-3), backend-neutral: a row walk whose key and
value operands are read through a table (`kc[h // 8, pages[b, j // T], j % T, d]`), as a
paged key/value cache is in decoding.

What each step computes is the row plan's (`attention.row_plan`: scores, elementwise
chain, condition, flash softmax). The walk differs: one grid step per (lead values, row
block), and inside it a loop over the key blocks between the first and the last page the
condition may reach for that row block (`bounds`, from the condition classified per page);
a key block gathers its pages, one copy per page, and only pages inside those bounds are
copied: pages past a sequence's length are never read. Tables live in scalar memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Kernel, Read, Sub
from ..source import Diagnostic
from .attention import RowPlan
from .build import ScheduleError


@dataclass(frozen=True)
class Gather:
    """A read through a table along the key index: `kc[h // 8, pages[b, j // T], j % T, d]`.
    The table entry addresses dimension `page_dim`; `j % T` the next one, the offset in the page."""

    read: Read
    table: Read  # pages[b, j // T]
    page_dim: int

    @property
    def heads(self) -> tuple[Sub, ...]:
        """The subscripts before the page: lead or row indices, maybe through `// n`."""
        return self.read.subs[: self.page_dim]

    @property
    def inner(self) -> Sub:
        return self.read.subs[self.page_dim + 2]


@dataclass(frozen=True)
class PagedPlan:
    row: RowPlan
    gathers: tuple[Gather, ...]  # the key factor's, then each value's
    table: str  # the table operand
    page: int | str  # the page size (T): a literal or a size symbol
    scalars: tuple[Read, ...]  # reads of the condition and chain over lead indices only (`lens[b]`): scalar memory

    @property
    def packed(self) -> tuple[str, ...]:
        """Lead indices with a tile above 1: packed into the rows with the row index (language
        v2, section 3: `tile h = 8` and new tokens `i` in one block of rows), outermost first."""
        k = self.row.kernel
        return tuple(i for i in self.row.lead if k.index(i).tile != 1)

    @property
    def key_tile(self) -> int:
        return self.row.kernel.index(self.row.key).tile


def _values(st) -> tuple[Read, ...]:
    v = getattr(st, "value", None)
    return (v,) if isinstance(v, Read) else ()


def paged_plan(kernel: Kernel, row: RowPlan) -> PagedPlan:
    """The paged walk of a row plan whose key factor (and values) read through one table;
    a ScheduleError at the first form it does not walk."""

    def fail(span, message):
        raise ScheduleError(Diagnostic(span, message))

    p = row
    if p.stored_score:
        fail(kernel.statements[0].span, "not supported yet: a paged walk computes its scores as a product (q . k through the table)")
    gathered = [p.k] + [c.value for c in p.consumers if c.kind == "softmax_product"]
    for c in p.consumers:
        if c.kind != "softmax_product":
            fail(kernel.statement_of(c.output).span, "not supported yet: a paged walk feeds softmax products only")
    for st in kernel.statements:
        for r in (*st.reads, *_values(st)):
            if any(s.table is not None for s in r.subs) and r not in gathered:
                fail(r.span, f"not supported yet: '{r.operand}' is read through a table; only the score's key factor and "
                             "the softmax product's values may be (a paged key/value cache)")
    gathers, tables, pages = [], set(), set()
    for r in gathered:
        at = [d for d, s in enumerate(r.subs) if s.table is not None]
        if len(at) != 1:
            fail(r.span, f"not supported yet: '{r.operand}' in a paged walk reads one table, at its page dimension")
        d = at[0]
        table = r.subs[d].table
        if len(r.subs) != d + 3:
            fail(r.span, f"not supported yet: '{r.operand}' as a paged cache: [heads..., table[...], {p.key} % T, one inner index]")
        offset, inner = r.subs[d + 1], r.subs[d + 2]
        last = table.subs[-1]
        if last.index != p.key or last.divisor == 1 or last.modulus is not None:
            fail(table.span, f"not supported yet: a table's last subscript is the page of the key index: '{p.key} // T'")
        if offset.index != p.key or offset.modulus != last.divisor or offset.divisor != 1:
            fail(r.span, f"not supported yet: the dimension after the page is the offset in it: '{p.key} % {last.divisor}'")
        for s in table.subs[:-1]:
            if s.index not in p.lead or s.divisor != 1 or s.modulus is not None or kernel.index(s.index).tile != 1:
                fail(table.span, f"not supported yet: a table's other subscripts are batch or head indices walked one at a time ({', '.join(p.lead)})")
        for s in r.subs[:d]:
            if s.index == p.query:
                tile = kernel.index(p.query).tile
                if not isinstance(s.divisor, int) or s.divisor % tile:
                    fail(r.span, f"a row block of {tile} '{p.query}' must read one '{r.operand}' head: {s.text} needs "
                                 f"{p.query}'s tile to divide {s.divisor}")
            elif s.index in p.lead and kernel.index(s.index).tile != 1 and (not isinstance(s.divisor, int) or s.divisor % kernel.index(s.index).tile):
                tile = kernel.index(s.index).tile
                fail(r.span, f"a block of {tile} '{s.index}' packed into the rows must read one '{r.operand}' head: {s.text} needs "
                             f"{s.index}'s tile to divide {s.divisor}")
            elif s.index not in p.lead or not isinstance(s.divisor, int) or s.modulus is not None or s.table is not None:
                fail(r.span, f"not supported yet: '{r.operand}''s subscripts before the page are batch, head or row indices (maybe // n)")
            if s.index in table.indices:
                fail(r.span, f"not supported yet: '{s.index}' both in '{r.operand}''s heads and its table")
        if inner.index not in p.inner or inner.divisor != 1 or inner.modulus is not None:
            fail(r.span, f"not supported yet: '{r.operand}''s last subscript is the score's summed index or the value's own")
        tables.add(table.operand)
        pages.add(last.divisor)
        gathers.append(Gather(r, table, d))
    if len(tables) != 1 or len(pages) != 1:
        fail(p.k.span, "not supported yet: a paged walk's key and values read one table with one page size")
    for name, term in p.chain:
        for t in term.walk():
            if t.read is not None and t.op != "local":
                fail(t.read.span, "not supported yet: an elementwise step of a paged walk reads no operand (numbers, sizes, indices)")
    # A condition over a packed index: the page bounds are kept per value of each lead index
    # (and row block), and the condition's operands are read at one value of each per step,
    # while a block of rows holds `tile` values of a packed one.
    packed = [i for i in p.lead if kernel.index(i).tile != 1]
    instead = f"compare '{p.query}' (its positions), sizes, or operands at indices walked one at a time"
    for cond in p.conditions:
        for t in cond.walk():
            if t.op == "index" and t.name in packed:
                tile = kernel.index(t.name).tile
                fail(p.q.span, f"not supported yet: a paged walk's condition compares '{t.name}', packed into the rows "
                               f"(tile {t.name} = {tile}): the page bounds are kept per value of each batch or head index, "
                               f"and a block of rows holds {tile} '{t.name}'; {instead}")
            if t.read is not None and any(i in packed for i in t.read.indices):
                i = next(i for i in t.read.indices if i in packed)
                tile = kernel.index(i).tile
                fail(t.read.span, f"not supported yet: a paged walk's condition reads '{t.read.text}' at '{i}', packed into "
                                  f"the rows (tile {i} = {tile}): it is read once per step, and a block of rows holds "
                                  f"{tile} '{i}'; {instead}")
    scalars = []
    for cond in p.conditions:
        for r in cond.reads:
            op = kernel.operand(r.operand)
            if any(i not in p.lead or i in packed for i in r.indices) or not all(s.divisor == 1 and s.modulus is None and s.table is None and not s.shift for s in r.subs):
                fail(r.span, f"not supported yet: a paged walk's condition reads operands at batch or head indices only ('{r.text}')")
            if op.dtype.is_float:
                fail(r.span, f"not supported yet: a paged walk's condition reads integer operands ('{r.operand}' is {op.dtype.name})")
            if r.operand not in {x.operand for x in scalars}:  # one array in scalar memory per operand
                scalars.append(r)
    return PagedPlan(p, tuple(gathers), tables.pop(), pages.pop(), tuple(scalars))
