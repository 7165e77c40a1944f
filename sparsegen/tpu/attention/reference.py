"""`reference` for the row walk: the same computation in plain jax.numpy over whole arrays
(O(rows x keys) memory: for tests)."""

from __future__ import annotations

from ...ir import Read, Term
from .lower import py_tuple as _tuple
from .lower import render_term


class ReferenceWriter:
    """`_reference`'s lines (a mixin of AttentionEmitter)."""

    # ------------------------------------------------------------- reference
    def reference_lines(self) -> list[str]:
        """The kernel in plain jax.numpy over whole arrays (O(rows x keys) memory: for tests)."""
        p, k, conv = self.p, self.k, self.m.conv
        scope = self.n.scope()
        acc = k.accumulate
        rows = p.lead + (p.query, p.key)
        letters = {i: chr(97 + n) for n, i in enumerate([*rows, *sorted(set(x.name for x in k.indices) - set(rows))])}
        lines = []

        def view(r: Read) -> str:
            v = conv.param(r.operand).internal
            for d, s in enumerate(r.subs):
                if s.divisor != 1:
                    v = f"jnp.repeat({v}, {s.divisor}, axis={d})"
            return v

        def spec(r: Read) -> str:
            return "".join(letters[i] for i in r.indices)

        dst = "".join(letters[i] for i in rows)
        s = scope.local("s")
        widen = lambda r: f"{view(r)}.astype({acc.jnp})"
        prec = ", precision=lax.Precision.HIGHEST" if acc.is_float else ""
        lines.append(f'{s} = jnp.einsum("{spec(p.q)},{spec(p.k)}->{dst}", {widen(p.q)}, {widen(p.k)}, preferred_element_type={acc.jnp}{prec})')
        if p.scale is not None:
            lines.append(f"{s} = {s} * {p.scale!r}")

        def leaf(t: Term, float_ctx: bool) -> str:
            if t.op == "index":
                shape = _tuple("-1" if i == t.name else "1" for i in rows)
                v = f"jnp.arange({self.size_of(t.name)}).reshape({shape})"
                return f"{v}.astype({acc.jnp})" if float_ctx else v
            if t.op == "size":
                v = conv.size_var(t.name)
                return f"float({v})" if float_ctx else v
            if t.op == "local":
                return current[0]
            v = f'_expand({view(t.read)}, "{spec(t.read)}", "{dst}")'
            if t.op == "truth":
                return f"({v} != 0)"
            return f"{v}.astype({acc.jnp})" if float_ctx else v

        current = [s]
        for name, term in p.chain:
            var = scope.local(name)
            lines.append(f"{var} = {render_term(term, lambda x: leaf(x, True))}")
            current[0] = var
        final = current[0]
        if p.condition is not None:
            lines.append(f"{final} = jnp.where({render_term(p.condition, lambda x: leaf(x, False))}, {final}, -jnp.inf)")
        probs, lse = scope.local("probs"), scope.local("lse")
        visited = None
        if any(c.kind == "softmax_product" for c in p.consumers):
            # Which (row block, key block) the walk visits, over the score's axes.
            visits = scope.local("visits")
            classes = "".join(letters[i] for i in p.class_axes)
            lines.append(f"{visits} = {self.classify_fn}(jnp, {', '.join(self.classify_reads + ['sizes'])})")
            visited = f'_expand({visits} != _EMPTY, "{classes}", "{dst}")'
        results = {}
        needs_softmax = any(c.kind in ("softmax_product", "logsumexp", "softmax_out") for c in p.consumers)
        if needs_softmax:
            lines.append(f"{probs}, {lse} = _softmax_rows({final})")
        for c in p.consumers:
            out = k.operand(c.output)
            var = scope.local(c.output)
            st = k.statement_of(c.output)
            if c.kind == "softmax_product":
                # Summed over the blocks the walk visits only, as the kernel sums it.
                keyed = "".join(letters[i] for i in p.lead + (p.key, self.e_of(c)))
                values = widen(c.value) if spec(c.value) == keyed else f'_expand({widen(c.value)}, "{spec(c.value)}", "{keyed}")'
                tiles = _tuple(str(self.tile[i]) for i in (p.query, p.key))
                lines.append(f"{var} = _visited_product({probs}, {values}, {visited}, {tiles})")
                if c.scale is not None:
                    lines.append(f"{var} = {var} * {c.scale!r}")
            elif c.kind == "logsumexp":
                lines.append(f"{var} = {lse}")
            elif c.kind == "max":
                lines.append(f"{var} = jnp.max({final}, axis=-1)")
            elif c.kind == "softmax_out":
                lines.append(f"{var} = {probs}")
            elif c.kind == "scores_out":
                value = render_term(c.term, lambda t: final if t.op == "local" else leaf(t, True))
                lines.append(f"{var} = jnp.where(jnp.isneginf({final}), 0.0, {value})")
            else:
                lines.append(f"{var} = jnp.sum(jnp.where(jnp.isneginf({final}), 0.0, {final}), axis=-1)")
            lines.append(f"{var} = {var}.astype({out.dtype.jnp})")
            results[c.output] = var
        out = [results[o.name] for o in k.outputs]
        lines.append(f"return {', '.join(out)}")
        return lines
