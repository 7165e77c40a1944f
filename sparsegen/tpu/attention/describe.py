"""`sparsegen plan` for the row walk: what each step computes, which blocks it visits, and
what it costs, in words."""

from __future__ import annotations

import textwrap


def describe_attention(m) -> list[str]:
    p, k, w = m.plan, m.kernel, m.walk
    tile = {i.name: i.tile for i in k.indices}
    lines = []
    lead = ", ".join(p.lead) or "nothing"
    grid = ", ".join(a.index or "steps" for a in w.axes)
    parallel = ", ".join(a.index or "steps" for a in w.axes if a.parallel)
    lines.append(f"walk: rows of '{p.score}' (one {p.query} block of {tile[p.query]} at a time, per {lead}),")
    lines.append(f"  reducing over {p.key} in blocks of {tile[p.key]}: grid ({grid}),")
    lines.append(f"  {parallel}{' parallel, ' if parallel else ''}steps arbitrary")
    if not p.conditions:
        lines.append("blocks: every block is full (no condition)")
    else:
        exact = "traced operands (classified under jit; the walk has the dense count, empty steps trailing)" if p.data_dependent else \
            "sizes only (classified with numpy at trace time; the walk visits exactly the non-empty blocks)"
        if len(p.points) == 1:
            lines.append(f"condition: {p.condition.text}")
        else:
            lines.append("conditions (a block is visited if some score has an element there, full if every score has all):")
            lines += [f"  {pt.name}: {pt.condition.text if pt.condition is not None else 'none'}" for pt in p.points]
        lines.append(f"  per ({', '.join(p.class_axes)}) block: empty (skipped: no step), partial (evaluated from iota")
        lines.append(f"  and operand blocks) or full (not evaluated); depends on {exact}")
    if p.stored_score:
        lines.append("step: the scores read from stored operands (no product)")
    else:
        lines.append(f"step: s = {p.q.text} . {p.k.text} over {p.summed}" + (f" x {p.scale!r}" if p.scale is not None else "") + " (MXU, f32)")
    for name, term in p.chain:
        lines.append(f"  then {name} = {term.text}")
    for c in p.consumers:
        if c.kind == "softmax_product":
            lines.append(f"{c.output}: softmax rows times {c.value.text}, online (running max and sum, rescaled accumulator)")
        else:
            of = f" of {p.points[c.point].name}" if len(p.points) > 1 else ""
            lines.append(f"{c.output}: {c.kind} of each row{of}, from the running statistics")
    lines.append("rows with no present element: outputs 0 (logsumexp and max: -inf)")
    lines.append(f"VMEM: {m.vmem_bytes / 1024:.0f} KiB estimated")
    for item in m.vmem:
        lines.append(f"  {item.what}: {item.bytes / 1024:.0f} KiB")
    from ...autodiff import Partial, gradient_lines
    from ...walks.flash_gradients import derived_outputs

    derived = derived_outputs(p) if not m.backward_error else []
    if derived and p.stored_score:
        lines.append(f"backward (jax.grad), through {', '.join(derived)}: the chain's operands over the same walk (a stored score per block,")
        lines.append("  placed after), the values and per-key operands over the key-side walk (the transposed classification,")
        lines.append("  key x row blocks); run only where a gradient is needed")
    elif derived:
        bw = m.backward_walk  # lower.backward_walk: the rule and its reason
        text = f"backward (jax.grad), through {', '.join(derived)}: {bw.why}"
        if not bw.fused or bw.max_rows is not None:
            text += (f"; {'' if not bw.fused else 'beyond that, '}two passes: d{p.q.operand} and the chain's per-row, per-block "
                     f"and per-walk operands over the same walk, d{p.k.operand} and the values over the key-side walk "
                     "(the transposed classification, key x row blocks)")
        text += "; run only where a gradient is needed"
        lines += textwrap.wrap(text, 100, subsequent_indent="  ")
    values = {c.value.operand: c.output for c in p.consumers if c.kind == "softmax_product"}
    partials = [Partial(op, "", out) for out in derived for op in dict.fromkeys(p.score_operands() + [v for v, o in values.items() if o == out])]
    return lines + gradient_lines(k, partials, m.refused)
