"""The plan in words a kernel author understands: for `sparsegen plan` and docstrings."""

from __future__ import annotations

from ..dtypes import after_sum_dtype
from ..expr import render
from .lower import TpuModule, TpuPass
from .rules import smem_entries
from .targets import format_bytes


def _shape(block: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("squeezed" if s is None else str(s) for s in block) + ")"


def _index_map(spec) -> str:
    lets = "; ".join(f"{name} = {render(e, 'text')}" for name, e in spec.block.lets)
    coords = "(" + ", ".join(render(e, "text") for e in spec.index) + ")"
    return f"{lets}; -> {coords}" if lets else coords


def _calls(tp: TpuPass) -> list[str]:
    body = tp.p.body
    lines = []
    if body.accumulator:
        if body.init_when is not None:
            lines.append(f"init accumulator when {render(body.init_when, 'text')}")
        if body.summed:
            groups = ["(" + " * ".join(f.operand for f in q.factors) + ")" if len(q.factors) > 1 else q.factors[0].operand for q in body.summed]
            what = " and ".join(groups)
            what = f"the product of {what} summed over {', '.join(body.summed_indices)}" if len(groups) > 1 else f"{what} summed over {', '.join(body.summed_indices)}"
            if body.step:
                what += ", times " + " * ".join(f.operand for q in body.step for f in q.factors)
        else:
            what = "the product " + " * ".join(f.operand for q in body.step for f in q.factors)
        when = f" when {render(body.compute_when, 'text')}" if body.compute_when is not None else " every step"
        lines.append(f"accumulate {what}{when}")
        if body.matrix_product:
            for q in body.summed:
                fed, why = q.fed
                if why is not None:
                    lines.append(f"  {' * '.join(f.operand for f in q.factors)} for the matrix unit: {why}")
        for t in body.tails:
            lines.append(f"  past {t.size} along {t.index} (a partial last block) the factors are zero")
        if body.split is not None:
            lines.append(f"  in a full step ({render(body.split.full, 'text')}) {body.split.mask} is all ones: not read, not multiplied")
    if body.select is not None:
        sel = body.select
        on = {"flush": "the value written", "product": "the step's product"}.get(sel.target) or \
            " * ".join(f.operand for f in body.summed[sel.group].factors)
        lines.append(f"in a partial step ({render(sel.when, 'text')}) the terms where not ({sel.condition.text}) are selected out of {on}")
        if sel.exposed is not None:
            other = " * ".join(f.operand for f in body.summed[sel.exposed].factors)
            lines.append(f"  where {other} holds a NaN or Inf there (one slice of the product checked), the step is recomputed over the present terms")
    for case in body.flush_cases:
        when = [render(e, "text") for e in (body.flush_when, case.when) if e is not None]
        cond = " and ".join(when) if when else "every step"
        if case.products is None:
            value = "zeros"
        else:
            acc = "accumulator"
            if body.accumulator:
                wide = after_sum_dtype(tp.p.accumulate, tuple(f.dtype for q in case.products for f in q.factors))
                if wide != tp.p.accumulate:  # an exact integer sum meeting a float scale
                    acc = f"accumulator ({tp.p.accumulate.name}, exact) as {wide.name}"
            parts = ([acc] if body.accumulator else []) + [f.operand for q in case.products for f in q.factors]
            if tp.p.scale is not None:
                parts.append(tp.p.scale.text)
            value = " * ".join(parts) if parts else "ones"
        lines.append(f"write output when {cond}: {value}")
    return lines


def describe_pass(m: TpuModule, tp: TpuPass) -> list[str]:
    p = tp.p
    out = [f"{p.statement.text}  ({p.walk}: {p.about})"]
    out.append(f"  grid ({', '.join(render(a.extent, 'text') for a in p.axes)})")
    if p.fallback is not None:
        f = p.fallback
        out.append(f"    {f.run}: the steps the data needs (traced), at most {f.count}, the tables' length")
        if f.bound is not None:
            out.append(f"    {f.count} = {f.bound} when the data allows (sorted group ids), else {f.dense}, in calls whose tables fit SMEM "
                       "(lax.cond: correct for any ids)")
        else:
            out.append(f"    {f.count} = {f.dense}")
    elif p.walk == "condition":
        var, value = p.counts[0]
        known = value.startswith("int(")  # counted with numpy at trace time
        out.append(f"    {var}: " + ("the non-empty blocks of the condition, counted at trace time" if known else
                                      f"{value} (the condition reads traced operands: unused steps trailing)"))
    for a in p.axes:
        out.append(f"    {a.var}: {a.about} [{'parallel' if a.parallel else 'arbitrary'}]")
    out.append(f"  dimension_semantics ({', '.join(tp.dimension_semantics)})")
    if p.tables:
        out.append("  scalar prefetch (SMEM, int32):")
        for t in p.tables:
            out.append(f"    {t.var}[{render(t.length, 'text')}]: {t.about}")
    out.append("  blocks:")
    for s in tp.specs:
        role = "out" if s.block.is_output else "in "
        view = " (viewed with unit dims)" if s.view.reshapes else ""
        out.append(f"    {role} {s.block.operand} block {_shape(s.shape)}{view}, index map {_index_map(s)}")
        if s.block.about:
            out.append(f"        {s.block.about}")
    out.append("  body:")
    out += [f"    {line}" for line in _calls(tp)]
    if p.walk == "coo input":
        out.append("    output blocks no stored block reaches are written as zeros by their flush step")
    target = m.target
    out.append(f"  VMEM estimate: {format_bytes(tp.vmem_bytes)} of {format_bytes(target.vmem_bytes)} on {target.name}")
    for item in tp.vmem:
        shape = "x".join(str(s) for s in item.shape)
        out.append(f"    {item.what}: {item.buffers} x {shape} {item.dtype.name} = {format_bytes(item.bytes)}")
    if p.tables:
        env = {s.internal: s.literal for s in m.conv.sizes}
        entries = smem_entries(tp, env)
        if entries is None:
            out.append(f"  SMEM: 4 bytes per prefetch entry; depends on the call's sizes (limit {format_bytes(target.smem_bytes)})")
        else:
            out.append(f"  SMEM estimate: {format_bytes(entries * 4)} of {format_bytes(target.smem_bytes)}")
    return out


def describe_einsum(m: TpuModule) -> list[str]:
    """Lines describing the plan (no trailing newlines), the backward kernel's too."""
    from ..autodiff import gradient_lines

    k = m.kernel
    several = len(m.passes) > 1
    lines = [f"kernel {k.name}" + (f": {len(m.passes)} passes, one per statement, in order" if several else "")]
    for n, tp in enumerate(m.passes):
        sub = describe_pass(m, tp)
        if several:
            lines.append(f"  pass {n + 1}: {sub[0]}")
            lines += ["  " + line for line in sub[1:]]
        else:
            lines.append(f"  {sub[0]}")
            lines += sub[1:]
    if m.backward_module is not None:
        bm = m.backward_module
        lines.append(f"backward (jax.grad): {len(bm.passes)} pass{'es' if len(bm.passes) != 1 else ''}, one per derived gradient "
                     "of a float input through a statement (each run only where its gradient is needed)")
        for n, tp in enumerate(bm.passes):
            sub = describe_pass(bm, tp)
            lines.append(f"  pass {n + 1}: {sub[0]}")
            lines += ["  " + line for line in sub[1:]]
    partials = m.backward.partials if m.backward is not None and m.backward_module is not None else ()
    return lines + gradient_lines(k, partials, m.refused)
