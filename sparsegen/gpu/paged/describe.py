"""`sparsegen plan --target h200` for the paged walk: what a CTA computes, which pages it
copies, and its shared memory, in words (the module docstring too)."""

from __future__ import annotations

from ...autodiff import gradient_lines


def describe_gpu_paged(m) -> list[str]:
    p, pg, k = m.plan, m.paged, m.kernel
    tile = m.tile
    page = pg.page
    one = [i for i in p.lead if i not in pg.packed]
    per = f" per {', '.join(one)}" if one else ""
    what = " x ".join(f"{tile[i]} '{i}'" for i in (*pg.packed, p.query))
    lines = [
        f"target: {m.target.name} (Mosaic GPU: TMA copies, WGMMA; one warpgroup per CTA)",
        f"walk: rows of '{p.score}': one CTA per {m.rows} rows ({what}){per}, padded to WGMMA's "
        f"{m.tq} rows in shared memory (zeros, never stored)",
        f"  keys: '{p.key}' read through the table '{pg.table}' ({pg.gathers[0].table.text}), pages of {page}; a loop over the",
        f"  steps of {m.tk} keys between the first and the last page the condition reaches in the row block;",
        f"  a step gathers its pages ({m.tk} / {page}, or its part of one page), one TMA copy per page and operand",
        f"  ({', '.join(g.read.operand for g in pg.gathers)}), into one of two shared-memory buffers: the next step's copies are",
        "  issued before this one waits for its own; pages are clamped into the bounds: none past them is read",
        f"  flash decoding: where the row blocks' CTAs are fewer than the {m.target.sms} SMs, each row block's steps are",
        "  walked in parts (chosen at call time: enough CTAs to fill the SMs once, each part at least 4 steps), a CTA",
        "  each, merged by their rows' logsumexps (each part stores its rows' outputs and logsumexps)",
        f"  tables in GMEM: the page bounds per row block, '{pg.table}'" + "".join(f", '{r.operand}'" for r in pg.scalars),
    ]
    if p.condition is not None:
        lines.append(f"condition: {p.condition.text}")
        lines.append("  classified per (row block, page) at call time: the bounds; evaluated on every step inside them")
    lines.append(f"step: s = {p.q.text} . {p.k.text} over {p.summed}" + (f" x {p.scale!r}" if p.scale is not None else "")
                 + " (WGMMA, f32 accumulator in registers)")
    for name, term in p.chain:
        lines.append(f"  then {name} = {term.text}")
    for c in p.consumers:
        lines.append(f"{c.output}: softmax rows times {c.value.text}, online (running max and sum in registers; the probabilities")
        lines.append("  through shared memory into a second WGMMA)")
    lines.append("rows with no present element: outputs 0")
    lines.append(f"shared memory: {m.smem} bytes per CTA (limit {m.target.smem_bytes} on {m.target.name})")
    return lines + gradient_lines(k, [], m.refused)
