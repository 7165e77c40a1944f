"""The paged walk's plan in words (`sparsegen plan`, the module docstring)."""

from __future__ import annotations


def describe_paged(m) -> list[str]:
    p, pg, k = m.plan, m.paged, m.kernel
    tile = {i.name: i.tile for i in k.indices}
    page = pg.page
    per_block = f"{pg.key_tile // page}" if isinstance(page, int) else f"{pg.key_tile} / {page}"
    one = [i for i in p.lead if i not in pg.packed]
    per = f", per {', '.join(one)}" if one else ""
    rows = " x ".join(f"{tile[i]} '{i}'" for i in (*pg.packed, p.query))
    axes = [i if i in one else f"{i} blocks" for i in p.lead] + [p.query + " blocks"]
    order = "parallel" if m.target.cores > 1 else "in order (one core: each step prefetches the next's first block)"
    lines = [
        f"walk: rows of '{p.score}' ({rows} at a time{per}): grid ({', '.join(axes)}), {order}",
        f"  keys: '{p.key}' read through the table '{pg.table}' ({pg.gathers[0].table.text}), pages of {page};",
        f"  a loop over the key blocks of {pg.key_tile} between the first and the last page the condition",
        f"  reaches in the row block; a block gathers its {per_block} pages, one copy per page and operand",
        f"  ({', '.join(g.read.operand for g in pg.gathers)}), into two VMEM buffers: the next block's copies start",
        "  before this one is computed; pages outside the bounds are never copied",
        f"  scalar memory: the page bounds per row block, '{pg.table}'" + "".join(f", '{r.operand}'" for r in pg.scalars),
    ]
    if p.condition is not None:
        lines.append(f"condition: {p.condition.text}")
        lines.append("  classified per (row block, page) at call time: the bounds; evaluated on every block inside them")
    lines.append(f"step: s = {p.q.text} . {p.k.text} over {p.summed}" + (f" x {p.scale!r}" if p.scale is not None else "") + " (MXU, f32)")
    for name, term in p.chain:
        lines.append(f"  then {name} = {term.text}")
    for c in p.consumers:
        lines.append(f"{c.output}: softmax rows times {c.value.text}, online (running max and sum, rescaled accumulator)")
    lines.append("rows with no present element: outputs 0")
    lines.append(f"VMEM: {m.vmem_bytes / 1024:.0f} KiB estimated")
    lines += [f"  {item.what}: {item.bytes / 1024:.0f} KiB" for item in m.vmem]
    lines.append("gradients: not derived yet (reads through tables, issue 19): jax.grad raises NotImplementedError")
    return lines
