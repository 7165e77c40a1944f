"""The GPU plan in words: for `sparsegen plan --target h200` and the generated docstring."""

from __future__ import annotations

from ..autodiff import gradient_lines
from ..expr import render
from .plan import ElementwisePass, GpuModule, GpuPass


def _walk(p: GpuPass) -> str:
    k = p.a.col
    return {
        "dense": f"every block along {k}",
        "rows": f"the blocks of {p.sparse} in its row of output blocks (a table per row: first step, count; per step: "
                + ("the stored block and its " + k + ")" if p.a.stored else f"the non-empty {p.sparse} block's {k})"),
        "cols": f"the blocks of {p.sparse} in its column of output blocks (a table per column: first step, count; per step: "
                + ("the stored block and its " + k + ")" if p.b.stored else f"the non-empty {p.sparse} block's {k})"),
        "coo output": f"every block along {k}, for each requested block of {p.output} (padding entries: no step, zeros)",
        "output mask": f"every block along {k} where the {p.sparse} block is not empty (empty: no step, zeros; all ones: no read)",
        "condition": f"the blocks the condition `{p.statement.condition.text if p.statement.condition else ''}` leaves, classified as on every "
                     "target (a table per row of the condition: first step, count; per step: its column and kind); a partial step "
                     + ("computes its product apart and zeroes it where the condition is false before adding it"
                        if p.selection and p.selection.on == "step" else
                        f"zeroes the {p.a.operand if p.selection and p.selection.on == 'a' else p.b.operand} tile where the condition is false "
                        "in shared memory before its WGMMA"),
        "condition output": f"every block along {k} where the condition `{p.statement.condition.text if p.statement.condition else ''}` "
                            "leaves any element (empty: no step, zeros); the accumulator is zeroed where it is false",
    }[p.walk]


def persistent_ctas(p: GpuPass, target) -> int:
    """CTAs of a product's persistent grid along its first axis: one per SM, a block's tiles
    each a CTA (a product CTA's shared memory leaves an SM room for no second). The wrapper
    takes fewer where there are fewer steps."""
    t = p.tiles
    return max(1, target.sms // ((t.bm // t.tm) * (t.bn // t.cta_n)))


def describe_elementwise(p: ElementwisePass, target) -> list[str]:
    factors = ", ".join(f["operand"] for f in p.factors)
    return [
        f"statement: {p.statement.text}",
        f"  elementwise: one CTA per {p.tm}x{p.tn} tile of each {p.bm}x{p.bn} output block ({render(p.cells, 'text')} blocks); "
        f"TMA copies of the tiles of {factors} into shared memory, multiplied in registers, stored through shared memory",
        *(["  a window: the statement writes the blocks its offsets reach; the others are written as zeros"] if p.inside else []),
        f"  shared memory: {p.smem} bytes per CTA (limit {target.smem_bytes} on {target.name})",
    ]


def describe_pass(p: GpuPass, target) -> list[str]:
    if isinstance(p, ElementwisePass):
        return describe_elementwise(p, target)
    t = p.tiles
    mat = lambda x: (f"{x.operand}" + (" (stored blocks)" if x.stored else "") + (" read MN-major" if x.transposed else "")  # noqa: E731
                     + (f" (copied transposed by the wrapper: {'tf32' if p.in_dtype.is_float else 's8'} reads K-major tiles)" if x.copied else ""))
    lines = [
        f"statement: {p.statement.text}",
        f"  walk: {p.walk} — each output block takes {_walk(p)}",
        f"  grid: persistent, ({persistent_ctas(p, target)}, {t.bm // t.tm}, {t.bn // t.cta_n}) CTAs at most ({target.sms} SMs), "
        f"each a {t.tm}x{t.cta_n} tile of a {t.bm}x{t.bn} block; steps of {t.tk} along {p.a.col} ({t.ksub} per block)",
        *([f"  warp-specialized: a producer warpgroup issues the TMA copies, {t.wgs} consumer warpgroups each multiply a "
           f"{t.tm}x{t.tn} tile (its own accumulator), storing it {t.epi} columns at a time"] if t.wgs > 1 else []),
        f"  work list: the steps of the {render(p.cells, 'text')} output blocks, laid end to end, dealt in equal runs to the CTAs; "
        f"a block shared by several CTAs stores each piece's {p.acc_dtype.name} partial sum, added in a fixed order by the wrapper",
        f"  per step: TMA copies of a {t.tm}x{t.tk} tile of {mat(p.a)} and a {t.tk}x{t.cta_n} tile of {mat(p.b)} into shared memory "
        f"({t.stages} in flight), one WGMMA{' per consumer' if t.wgs > 1 else ''} into an {p.acc_dtype.name} accumulator in registers",
        *(f"  {line}" for line in p.covered),
        *([f"  a partial step: {p.selection.about}" + ("" if p.selection.on == "step" else ", in shared memory before its WGMMA")]
          if p.selection is not None and p.selection.about else []),
        "  flush: the accumulator" + (f" times {p.scale}" if p.scale is not None else "")
        + "".join(f" times {v.operand} along the tile's {'rows' if v.axis == 'rows' else 'columns'} ({v.length} elements, broadcast)"
                  for v in p.vectors)
        + (f" times the {p.end.operand} tile" + (" where its block is partial" if p.end_mask else "") if p.end else "")
        + f", as {p.out_dtype.name}, through shared memory to {p.output} (TMA)",
        f"  shared memory: {p.smem} bytes per CTA (limit {target.smem_bytes} on {target.name})",
        f"  work: at most {render(p.block_products, 'text')} block products of {p.flops_per_product} FLOPs ({p.in_dtype.name} in, {p.acc_dtype.name} accumulated)",
    ]
    if p.tables:
        lines.append("  tables (int32, in GMEM, computed by the wrapper):")
        lines += [f"    {name}: {about}" for name, about in p.tables]
    return lines


def describe(m: GpuModule) -> list[str]:
    ws = any(not isinstance(p, ElementwisePass) and p.tiles.wgs > 1 for p in m.passes)
    lines = [f"target: {m.target.name} (Mosaic GPU: TMA copies, WGMMA, " + ("warp-specialized products" if ws else "one warpgroup per CTA") + ")"]
    for p in m.passes:
        lines += describe_pass(p, m.target)
    partials = m.backward.partials if m.backward is not None and m.backward_module is not None else ()
    return lines + gradient_lines(m.kernel, partials, m.refused)
