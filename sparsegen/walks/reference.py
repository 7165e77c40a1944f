"""`reference` for the row walk: the same computation in plain jax.numpy over whole arrays
(O(rows x keys) memory: for tests)."""

from __future__ import annotations

from ..ir import Read, Term
from ..pytext import py_tuple
from ..terms import ScoreTerms, render_term


class ReferenceWriter:
    """`_reference`'s lines (a mixin of AttentionEmitter)."""

    # ------------------------------------------------------------- reference
    def reference_view(self, r: Read) -> str:
        """An operand as a read sees it, over `r.indices` (`h // n` repeats each head n times)."""
        v = self.m.conv.param(r.operand).internal
        for d, s in enumerate(r.subs):
            if s.divisor != 1:
                v = f"jnp.repeat({v}, {s.divisor}, axis={d})"
        return v

    def visit_tiles(self) -> tuple[str, str]:
        """The (row, key) block the classification and `_visited_product` work in."""
        return str(self.tile[self.p.query]), str(self.tile[self.p.key])

    def reference_lines(self) -> list[str]:
        """The kernel in plain jax.numpy over whole arrays (O(rows x keys) memory: for tests)."""
        p, k, conv = self.p, self.k, self.m.conv
        scope = self.n.scope()
        acc = k.accumulate
        rows = p.lead + (p.query, p.key)
        letters = {i: chr(97 + n) for n, i in enumerate([*rows, *sorted(set(x.name for x in k.indices) - set(rows))])}
        lines = []

        view = self.reference_view

        def spec(r: Read) -> str:
            return "".join(letters[i] for i in r.indices)

        dst = "".join(letters[i] for i in rows)
        widen = lambda r: f"{view(r)}.astype({acc.jnp})"
        prec = ", precision=lax.Precision.HIGHEST" if acc.is_float else ""
        values = {}  # a local's variable, by its name
        if not p.stored_score:
            s = values[p.score] = scope.local("s")
            lines.append(f'{s} = jnp.einsum("{spec(p.q)},{spec(p.k)}->{dst}", {widen(p.q)}, {widen(p.k)}, preferred_element_type={acc.jnp}{prec})')
            if p.scale is not None:
                lines.append(f"{s} = {s} * {p.scale!r}")

        # An index's positions: a range along its axis of the scores.
        positions = {x.name: f"jnp.arange({self.size_of(x.name)}).reshape({py_tuple('-1' if i == x.name else '1' for i in rows)})"
                     for x in k.indices}
        terms = ScoreTerms(positions, {}, str, lambda r: f'_expand({view(r)}, "{spec(r)}", "{dst}")', acc.jnp, conv.size_var, values)
        leaf = terms.leaf
        lines += terms.chain(p.chain, scope.local)
        finals = []  # per point: its scores, minus infinity where absent
        for pt in p.points:
            if pt.local is None:
                final = scope.local(pt.read.operand)
                lines.append(f"{final} = {leaf(Term('read', read=pt.read), True)}")
            elif len(p.points) == 1 and pt.local == (p.chain[-1][0] if p.chain else p.score):
                final = values[pt.local]  # the last local, masked in place
            else:
                final = scope.local(f"{pt.local}_present")
                lines.append(f"{final} = {values[pt.local]}")
            if pt.condition is not None:
                lines.append(f"{final} = jnp.where({render_term(pt.condition, lambda x: leaf(x, False))}, {final}, -jnp.inf)")
            # A score of minus infinity is absent: no gradient reaches its chain (the softmax's
            # is 0 x NaN there in a row whose statistics are NaN).
            lines.append(f"{final} = jnp.where(jnp.isneginf({final}), -jnp.inf, {final})")
            finals.append(final)
        stats = {}
        for pt in sorted({c.point for c in p.consumers if c.kind in ("softmax_product", "logsumexp", "softmax_out")}):
            probs, lse = scope.local("probs"), scope.local("lse")
            lines.append(f"{probs}, {lse} = _softmax_rows({finals[pt]})")
            stats[pt] = (probs, lse)
        visited = None
        if any(c.kind == "softmax_product" and p.query not in c.value.indices for c in p.consumers):
            # Which (row block, key block) the walk visits, over the score's axes.
            visits = scope.local("visits")
            classes = "".join(letters[i] for i in p.class_axes)
            lines.append(f"{visits} = {self.classify_fn}(jnp, {', '.join(self.classify_reads + ['sizes'])})")
            visited = f'_expand({visits} != _EMPTY, "{classes}", "{dst}")'
        results = {}
        for c in p.consumers:
            out = k.operand(c.output)
            var = scope.local(c.output)
            final = finals[c.point]
            probs, lse = stats.get(c.point, (None, None))
            if c.kind == "softmax_product" and p.query in c.value.indices:
                # Values per row (grouped-query heads packed in rows, read through `// n`):
                # an absent element's value takes no part, whatever it holds.
                keyed = "".join(letters[i] for i in p.lead + (p.query, p.key, self.e_of(c)))
                vals = f'_expand({widen(c.value)}, "{spec(c.value)}", "{keyed}")'
                e = letters[self.e_of(c)]
                lines.append(f"{var} = jnp.einsum(\"{dst},{keyed}->{dst[:-1]}{e}\", {probs}, "
                             f"jnp.where(jnp.isneginf({final})[..., None], 0.0, {vals}){prec})")
                if c.scale is not None:
                    lines.append(f"{var} = {var} * {c.scale!r}")
            elif c.kind == "softmax_product":
                # Summed over the blocks the walk visits only, as the kernel sums it.
                keyed = "".join(letters[i] for i in p.lead + (p.key, self.e_of(c)))
                vals = widen(c.value) if spec(c.value) == keyed else f'_expand({widen(c.value)}, "{spec(c.value)}", "{keyed}")'
                tiles = py_tuple(self.visit_tiles())
                lines.append(f"{var} = _visited_product({probs}, {vals}, {visited}, {tiles}, jnp.logical_not(jnp.isneginf({final})))")
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
