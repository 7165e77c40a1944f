"""`sparsegen plan --target h200` for the row walk: what a CTA computes, which blocks it
visits, and its shared memory, in words."""

from __future__ import annotations

from ...autodiff import Partial, gradient_lines
from .backward import TB


def describe_gpu_attention(m) -> list[str]:
    p, k = m.plan, m.kernel
    tile = m.tile
    ti, tj = tile[p.query], tile[p.key]
    lead = ", ".join(p.lead) or "nothing"
    wgs = m.warpgroups
    lines = [f"target: {m.target.name} (Mosaic GPU: TMA copies, WGMMA; "
             + ("warp-specialized: a producer warpgroup issues the copies)" if wgs > 1 else "one warpgroup per CTA)"),
             f"walk: rows of '{p.score}': one CTA per {m.rows * wgs} rows of an {p.query} block of {ti} (per {lead}),"
             + (f" padded to WGMMA's {m.tq} rows in shared memory (zeros, never stored)," if m.rows < m.tq else "")
             + (f" {wgs} consumer warpgroups of {m.tq} rows" if wgs > 1 else ""),
             f"  reducing over {p.key}: the row block's non-empty {p.key} blocks of {tj}, in order, {m.tk} keys a pipeline step",
             f"  (TMA copies of the key-side tiles, {2} in flight; each consumer's query tile copied once)"]
    if m.splits:
        lines += [f"  flash decoding: where the row blocks' CTAs are fewer than the {m.target.sms} SMs, each row block's steps are",
                  "  walked in parts (chosen at call time: enough CTAs to fill the SMs once, each part at least 4 steps), a CTA",
                  "  each, merged by their rows' logsumexps (each part stores its rows' outputs and logsumexps)"]
    if not p.conditions:
        lines.append("blocks: every block is full (no condition)")
    else:
        exact = "traced operands (classified under jit)" if p.data_dependent else "sizes only (classified with numpy at trace time)"
        lines.append(f"condition: {p.condition.text}")
        lines.append(f"  per ({', '.join(p.class_axes)}) block: empty (no step), partial (evaluated from iota and operand tiles)")
        lines.append(f"  or full (not evaluated); depends on {exact}; tables in GMEM: per row block its non-empty key blocks")
    lines.append(f"step: s = {p.q.text} . {p.k.text} over {p.summed}" + (f" x {p.scale!r}" if p.scale is not None else "")
                 + " (WGMMA, f32 accumulator in registers)")
    for name, term in p.chain:
        lines.append(f"  then {name} = {term.text}")
    for c in p.consumers:
        if c.kind == "softmax_product":
            lines.append(f"{c.output}: softmax rows times {c.value.text}, online (running max and sum in registers; the probabilities")
            lines.append("  through shared memory into a second WGMMA)")
        else:
            lines.append(f"{c.output}: {c.kind} of each row, from the running statistics")
    lines.append("rows with no present element: outputs 0 (logsumexp and max: -inf)")
    lines.append("products accumulate in place where compiled (a fresh accumulator added in the Mosaic GPU interpreter)")
    lines.append(f"shared memory: {m.smem} bytes per CTA (limit {m.target.smem_bytes} on {m.target.name})")
    b = m.backward
    if b is not None:
        lines.append("backward (jax.grad), FlashAttention-2 style: per row the forward's logsumexp and delta = rowsum(dO * O)")
        def cta(bk, what: str) -> str:
            wgs = bk.warpgroups
            return f"one CTA per {TB} {what}" if wgs == 1 else f"one CTA per {TB * wgs} {what} ({wgs} consumer warpgroups and a producer)"

        lines.append(f"  dq: {cta(b.dq, 'rows')} over the forward's tables, {TB} keys a step: the scores again, p = exp(s - lse),")
        lines.append("    dp = dO . V^T, ds = p * (dp - delta) through the chain's derivative, dq += ds . K "
                     f"({b.dq.smem} bytes of shared memory)")
        lines.append(f"  dk, dv: {cta(b.dkv, 'keys')} over the transposed classification (each key block's non-empty row")
        lines.append(f"    blocks), {TB} rows a step: dv += p^T . dO, dk += ds^T . Q ({b.dkv.smem} bytes of shared memory)")
    partials = [Partial(op, "", o) for op in (b.grads if b else ()) for o in (b.outputs if b else ())]
    return lines + gradient_lines(k, partials, m.refused)
