"""The plan in words a kernel author understands: for `sparsegen plan` and docstrings."""

from __future__ import annotations

from .expr import render
from .plan import Plan, smem_entries
from .targets import format_bytes

_STRATEGY = {
    "dense": "dense: a plain tiled kernel over every block",
    "coo_input": "coo input: the grid walks the stored blocks",
    "mask": "mask: a dense grid that skips all-zero mask blocks",
    "coo_output": "coo output: the grid walks the requested output blocks",
}


def _shape(block: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("squeezed" if s is None else str(s) for s in block) + ")"


def _index_map(plan: Plan, b) -> str:
    lets = "; ".join(f"{name} = {render(e, 'text')}" for name, e in b.lets)
    coords = "(" + ", ".join(render(e, "text") for e in b.index) + ")"
    return f"{lets}; -> {coords}" if lets else coords


def _calls(plan: Plan) -> str:
    body = plan.body
    lines = []
    if body.scratch:
        if body.init_when is not None:
            lines.append(f"init accumulator when {render(body.init_when, 'text')}")
        what = "matmul" if body.contraction else "product"
        when = f" when {render(body.compute_when, 'text')}" if body.compute_when is not None else " every step"
        lines.append(f"accumulate the {what}{when}")
    for case in body.flush_cases:
        when = [render(e, "text") for e in (body.flush_when, case.when) if e is not None]
        cond = " and ".join(when) if when else "every step"
        if case.factors is None:
            value = "zeros"
        else:
            parts = (["accumulator"] if body.scratch else []) + [f.operand for f in case.factors]
            value = " * ".join(parts) if parts else "ones"
        lines.append(f"write output when {cond}: {value}")
    return lines


def describe(plan: Plan, nb: int | None = None) -> list[str]:
    """Lines describing the plan (no trailing newlines)."""
    k = plan.kernel
    out = [f"kernel {k.name} ({_STRATEGY[plan.strategy]})"]
    grid = ", ".join(render(a.extent, "text") for a in plan.axes)
    out.append(f"  grid ({grid})")
    for a in plan.axes:
        kind = "parallel" if a.parallel else "arbitrary"
        out.append(f"    {a.var}: {a.about} [{kind}]")
    out.append(f"  dimension_semantics ({', '.join(plan.dimension_semantics)})")
    if plan.prefetch:
        out.append("  scalar prefetch (SMEM, int32):")
        for p in plan.prefetch:
            out.append(f"    {p.var}[{render(p.length, 'text')}]: {p.about}")
    out.append("  blocks:")
    for b in plan.blocks:
        role = "out" if b.is_output else "in "
        out.append(f"    {role} {b.operand} block {_shape(b.shape)}, index map {_index_map(plan, b)}")
        if b.about:
            out.append(f"        {b.about}")
    out.append("  body:")
    out += [f"    {line}" for line in _calls(plan)]
    if plan.strategy == "coo_input":
        out.append("    output blocks no stored block reaches are written as zeros by their flush step")
    out.append(f"  VMEM estimate: {format_bytes(plan.vmem_bytes)} of {format_bytes(plan.target.vmem_bytes)} on {plan.target.name}")
    for item in plan.vmem:
        shape = "x".join(str(s) for s in item.shape)
        out.append(f"    {item.what}: {item.buffers} x {shape} {item.dtype.name} = {format_bytes(item.bytes)}")
    entries = smem_entries(plan, nb)
    if plan.prefetch:
        if entries is None:
            per = "nb" if "nb" in plan.names else "size"
            out.append(f"  SMEM: 4 bytes per prefetch entry; depends on {per} (limit {format_bytes(plan.target.smem_bytes)})")
        else:
            out.append(f"  SMEM estimate: {format_bytes(entries * 4)} of {format_bytes(plan.target.smem_bytes)}")
    return out
