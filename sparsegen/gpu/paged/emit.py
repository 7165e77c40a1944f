"""Emission of a paged walk's module on Mosaic GPU (templates/gpu/paged.py.j2): the paged
walk's host side of every target (`walks/paged.py`: the classification per page, page
bounds and `reference` through the table), with a Mosaic GPU kernel.

The kernel, one CTA (one warpgroup) per (lead values, row block): the query rows copied
once into a tile of WGMMA's 64 rows (the rest zeros, never stored); then a loop over the
steps of `tk` keys between the first and the last page the condition reaches, the copies
double-buffered by hand (emit_pipeline's BlockSpecs cannot gather): a step's pages land in
one of two shared-memory buffers, one TMA copy per page and operand (a page larger than
the step: the step's part of it), all on the slot's barrier, which expects them all (its
arrivals are the step's copies: every copy is issued, its page clamped into the bounds, so
that no page past the length is read). The next step's copies are issued before this step
waits for its own. Per step the score tile (WGMMA), the chain, the condition with the
bounds (keys outside them were not fetched from their own pages), the online softmax, the
probabilities through shared memory into a WGMMA per value. Where the row blocks are too
few to fill the SMs, each walks its steps in parts, a CTA each (flash decoding: `splits`,
chosen at call time by `_key_splits`, templates/helpers.py.j2, as the row walk's); a part
stores its rows' outputs and logsumexps, merged on the host (`_merge_splits`).
"""

from __future__ import annotations

from ...expr import Var, flat, render
from ...formatting import format_module
from ...pytext import py_tuple
from ...terms import ScoreTerms
from ...wrapper import Glue
from ...walks.paged import PagedHost
from ..attention.emit import row_lse
from ..attention.lower import SCRATCH_KEYS, out_through_q, scratch_width
from .describe import describe_gpu_paged
from .lower import GpuPagedModule

F32 = "jnp.float32"


class GpuPagedEmitter(PagedHost):
    def __init__(self, m: GpuPagedModule):
        super().__init__(m)

    # ------------------------------------------------------------- the kernel
    def kernel(self) -> tuple[list[str], list[str], list[str]]:
        """The kernel's parameters, its lines and the arrays passed (after the tables)."""
        m, p, pg, k = self.m, self.p, self.pg, self.k
        n = self.n.scope()
        tq, tk, rows, ti = m.tq, m.tk, m.rows, self.ti
        page = self.page
        first_ref, end_ref, table_ref = n.local("first_page"), n.local("end_page"), n.local(f"{pg.table}_gmem")
        scalar_refs = {r.operand: n.local(f"{r.operand}_gmem") for r in pg.scalars}
        qo = m.operands[0]
        gathers = list(zip(pg.gathers, m.operands[1:]))
        products = [c for c in p.consumers if c.kind == "softmax_product"]
        out_refs = {c.output: n.local(f"{c.output}_gmem") for c in products}
        lse_ref = n.local("row_lse_gmem")
        params = ([first_ref, end_ref, table_ref] + list(scalar_refs.values()) + [qo.ref] + [o.ref for _, o in gathers]
                  + list(out_refs.values()) + [lse_ref])
        lines = []
        if self.sizes:
            lines.append(f"{', '.join(self.sizes)}{',' if len(self.sizes) == 1 else ''} = sizes")
        lead_vars = {i: n.local(i) for i in p.lead}
        cell, row, part = n.local("cell"), n.local("row"), n.local("part")
        n_rows = self.size_expr(p.query).cdiv(ti)
        lines += [f'{cell} = lax.axis_index("cell")',
                  f"{part} = {cell} % splits  # which part of the row block's keys (flash decoding)",
                  f"{cell} = {cell} // splits",
                  f"{row} = {cell} % ({render(n_rows, 'py')})  # the row block: {rows} rows, padded to {tq}"]
        stride = n_rows
        for d in reversed(range(len(p.lead))):
            i = p.lead[d]
            value = f"{cell} // ({render(stride, 'py')})" + (f" % ({render(self.extent(i), 'py')})" if d else "")
            lines.append(f"{lead_vars[i]} = {value}" + (f"  # a block of {self.tile[i]} '{i}', packed into the rows" if i in self.packed else ""))
            stride = stride * self.extent(i)
        groups = list(p.class_axes[:-2])
        at = render(flat([Var(lead_vars[i]) for i in groups] + [Var(row)], [self.size_expr(i) for i in groups] + [n_rows]), "py")
        lo, hi, first, last = (n.local(x) for x in ("lo", "hi", "first", "last"))
        chunk = n.local("chunk")
        lines += [f"{lo}, {hi} = {first_ref}[{at}], {end_ref}[{at}]  # the pages [lo, hi) the condition reaches in the row block",
                  f"{first}, {last} = {lo} * {page} // {tk}, ({hi} * {page} + {tk - 1}) // {tk}  # the steps of {tk} keys holding them",
                  "# This CTA's part of those steps (flash decoding: the parts are merged by their rows' logsumexps).",
                  f"{chunk} = ({last} - {first} + splits - 1) // splits",
                  f"{first} = {first} + {part} * {chunk}",
                  f"{last} = jnp.minimum({last}, {first} + {chunk})"]
        table = pg.gathers[0].table
        table_op = k.operand(table.operand)
        row_coords = [lead_vars[s.index] for s in table.subs[:-1]]
        base = n.local("base")
        flat_row = render(flat([Var(c) for c in row_coords], [self.m.conv.size(dim) for dim in table_op.dims[:-1]]), "py") if row_coords else "0"
        lines.append(f"{base} = {flat_row} * {render(self.m.conv.size(table_op.dims[-1]), 'py')}  # the row of '{pg.table}'")
        scalars = {}
        for r in pg.scalars:
            var = n.local(f"{r.operand}_value")
            lines.append(f"{var} = {scalar_refs[r.operand]}[{self.flat_read(r, lead_vars)}]")
            scalars[r.operand] = var

        def heads(g) -> list[str]:
            out = []
            for s_ in g.heads:
                if s_.index in self.packed:  # a block of heads packed into the rows shares one
                    t_ = self.tile[s_.index]
                    out.append(lead_vars[s_.index] if s_.divisor == t_ else f"{lead_vars[s_.index]} * {t_} // {s_.divisor}")
                elif s_.index in p.lead:
                    out.append(f"{lead_vars[s_.index]} // {s_.divisor}" if s_.divisor != 1 else lead_vars[s_.index])
                else:  # the row block's heads share one (the tile divides the divisor)
                    out.append(f"{row} * {ti} // {s_.divisor}")
            return out

        # Shared memory: the row walk's layout (gpu/attention/lower.py `smem_bytes`): the
        # query tile, probabilities and outputs with one barrier; then the pages' buffers
        # with a barrier per slot.
        dtype = k.operand(qo.read.operand).dtype.jnp
        q_tile = py_tuple([str(tq), str(self.tile[p.summed])])
        q_smem, probs_smem, barrier = qo.smem, n.local("probs_smem"), n.local("barrier")
        through_q = out_through_q(k, p, m.operands)
        out_smem = {}
        scoped = [f"{q_smem}=plgpu.SMEM({q_tile}, {dtype})", f"{probs_smem}=plgpu.SMEM(({tq}, {tk}), {dtype})"]
        for c in products:
            if c.output == through_q:
                out_smem[c.output] = q_smem
            else:
                out_smem[c.output] = n.local(f"{c.output}_smem")
                e = self.tile[next(g.inner.index for g in pg.gathers if g.read == c.value)]
                scoped.append(f"{out_smem[c.output]}=plgpu.SMEM(({tq}, {e}), {k.operand(c.output).dtype.jnp})")
        lse_smem = n.local("row_lse_smem")
        scoped.append(f"{lse_smem}=plgpu.SMEM(({tq},), {F32})")
        # The walk taken again where a step's product met a NaN or Inf at an absent element
        # (`_present_values`): a tile of 64 keys of the values' columns, and each product's row sums.
        scratch = {}
        for c in products:
            vd = k.operand(c.value.operand).dtype
            key = (vd.jnp, scratch_width(self.tile[next(g.inner.index for g in pg.gathers if g.read == c.value)], vd))
            if key not in scratch:
                scratch[key] = n.local("values_scratch")
                scoped.append(f"{scratch[key]}=plgpu.SMEM(({key[1]}, {SCRATCH_KEYS}), {key[0]})")
        probe_smem = n.local("probe_smem")
        scoped += [f"{probe_smem}=plgpu.SMEM(({len(products)}, {tq}), {F32})", f"{barrier}=plgpu.Barrier()"]
        copies = n.local("copies")
        per_step = n.local("per_step")
        bufs = [f"{o.smem}=plgpu.SMEM((2, {tk}, {self.tile[g.inner.index]}), {k.operand(g.read.operand).dtype.jnp})" for g, o in gathers]
        bufs.append(f"{copies}=plgpu.Barrier(num_arrivals={len(gathers)} * {per_step}, num_barriers=2)")
        lines += [f"{per_step} = max({tk} // {page}, 1)  # copies a step per operand: its pages (or its part of one page)"]

        # The copies of a step's pages.
        sn = n.scope()
        t, slot, pi, pg_var, entry = sn.local("t"), sn.local("slot"), sn.local("p"), sn.local("page"), sn.local("entry")
        fetch, step_fn, walk_fn, shared_fn = n.local("_fetch"), n.local("_key_step"), n.local("_over_steps"), n.local("_shared")
        issue = ["", f"def {fetch}({t}, {slot}):",
                 f"    # Step {t}'s keys into buffer {slot}: one TMA copy per page and operand, each page clamped into",
                 f"    # [{lo}, {hi}) (a page past the length is never read; keys outside the bounds are masked).",
                 f"    if {page} >= {tk}:  # the step is a part of one page",
                 f"        {pg_var} = jnp.clip({t} * {tk} // {page}, {lo}, {hi} - 1)",
                 f"        {entry} = {table_ref}[{base} + {pg_var}]"]
        for g, o in gathers:
            src = ", ".join(heads(g) + [entry, f"pl.ds({t} * {tk} % {page}, {tk})"])
            issue.append(f"        plgpu.copy_gmem_to_smem({o.ref}.at[{src}], {o.smem}.at[{slot}], {copies}.at[{slot}])")
        issue += ["    else:  # whole pages",
                  f"        for {pi} in range({per_step}):",
                  f"            {pg_var} = jnp.clip({t} * {per_step} + {pi}, {lo}, {hi} - 1)",
                  f"            {entry} = {table_ref}[{base} + {pg_var}]"]
        for g, o in gathers:
            src = ", ".join(heads(g) + [entry])
            issue.append(f"            plgpu.copy_gmem_to_smem({o.ref}.at[{src}], {o.smem}.at[{slot}, pl.ds({pi} * {page}, {page})], "
                         f"{copies}.at[{slot}])")

        # The step.
        carry, m_prev, l_prev = sn.local("carry"), sn.local("m_prev"), sn.local("l_prev")
        accs = {c.output: sn.local(f"{c.output}_acc") for c in products}
        carried = [m_prev, l_prev] + list(accs.values())
        step = ["", f"def {step_fn}({t}, {carry}, exact=False):", f"    {', '.join(carried)} = {carry}", f"    {slot} = lax.rem({t} - {first}, 2)", "",
                f"    @pl.when({t} + 1 < {last})", "    def _next():", "        # The next step's pages are copied while this one is computed.",
                f"        {fetch}({t} + 1, 1 - {slot})", "", f"    plgpu.barrier_wait({copies}.at[{slot}])  # this step's pages have arrived"]
        kg, ko = gathers[0]
        score_fn, acc_ref, s = sn.local("_score"), sn.local("acc_ref"), sn.local("s")
        shape = f"({tq}, {tk})"
        body = ["", f"def {score_fn}({acc_ref}):", f"    plgpu.wgmma({acc_ref}, {q_smem}, {ko.smem}.at[{slot}].T)", f"    return {acc_ref}[...]", "",
                f"{s} = pl.run_scoped({score_fn}, plgpu.ACC({shape}, {F32}))"]
        if p.scale is not None:
            body.append(f"{s} = {s} * {p.scale!r}")
        qpos, kpos = sn.local(f"{p.query}_pos"), sn.local(f"{p.key}_pos")
        cond = p.points[0].condition
        by_row = any(t_.op == "index" and t_.name == p.query for t_ in cond.walk()) if cond is not None else False
        in_chain = any(t_.op == "index" for _, term in p.chain for t_ in term.walk())
        # The condition over the keys alone (no query position: decoding) is evaluated on a
        # vector of the step's keys and added to the scores as 0 or minus infinity (a tile of
        # positions would take 64 registers a thread); else on the tile.
        cshape = f"({tq}, {tk})" if by_row or in_chain else f"({tk},)"
        ppos = {}
        if cshape == shape and self.packed:
            # Rows (packed heads, query) in order: row r is head r // ti of the block, position r % ti.
            lane = sn.local("r")
            body += [f"{lane} = lax.broadcasted_iota(jnp.int32, {shape}, 0)",
                     f"{qpos} = jnp.full({shape}, {row} * {ti}, jnp.int32) + {lane} % jnp.full({shape}, {ti}, jnp.int32)",
                     f"{kpos} = lax.broadcasted_iota(jnp.int32, {shape}, 1) + jnp.full({shape}, {t} * {tk}, jnp.int32)"]
            stride_ = ti
            used = {t_.name for term in [cond] + [tm for _, tm in p.chain] if term is not None for t_ in term.walk() if t_.op == "index"}
            for i in reversed(self.packed):
                t_ = self.tile[i]
                if i not in used:
                    stride_ *= t_
                    continue
                ppos[i] = sn.local(f"{i}_pos")
                body.append(f"{ppos[i]} = jnp.full({shape}, {lead_vars[i]} * {t_}, jnp.int32) + {lane} // jnp.full({shape}, {stride_}, jnp.int32) "
                            f"% jnp.full({shape}, {t_}, jnp.int32)")
                stride_ *= t_
        elif cshape == shape:
            body += [f"{qpos} = lax.broadcasted_iota(jnp.int32, {shape}, 0) + jnp.full({shape}, {row} * {ti}, jnp.int32)",
                     f"{kpos} = lax.broadcasted_iota(jnp.int32, {shape}, 1) + jnp.full({shape}, {t} * {tk}, jnp.int32)"]
        else:
            body.append(f"{kpos} = lax.broadcasted_iota(jnp.int32, {cshape}, 0) + jnp.full({cshape}, {t} * {tk}, jnp.int32)")
        tiled = lambda v: f"jnp.full({cshape}, {v}, jnp.int32)"  # noqa: E731  (a scalar as the terms' operand)
        terms = ScoreTerms({p.query: qpos, p.key: kpos, **ppos}, lead_vars, tiled, lambda r: tiled(scalars[r.operand]), F32,
                           self.m.conv.size_var, {p.score: s})
        body += terms.chain(p.chain, sn.local)
        sv = terms.point(p.points[0])
        # The keys of the pages inside the bounds (a step may run past the last: its copies
        # repeat that page), and the condition; the rows past the block are never stored.
        conds = self.inside_pages(kpos, lo, hi, tiled)
        if cond is not None:
            conds.append(f"({terms.test(cond)})")
        present = sn.local("present")
        body.append(f"{present} = {' & '.join(conds)}")
        if cshape == shape:
            body.append(f"{s} = jnp.where({present}, {sv}, jnp.full({shape}, -jnp.inf, {F32}))")
        else:
            # Selected, not added: a key's NaN or Inf score (a cache slot past `lens` holds
            # anything) is absent too.
            bias = sn.local("bias")
            body += [f"{bias} = lax.broadcast_in_dim(jnp.where({present}, jnp.full({cshape}, 0.0, {F32}), "
                     f"jnp.full({cshape}, -jnp.inf, {F32})), {shape}, [1])",
                     f"{s} = jnp.where({bias} == jnp.full({shape}, 0.0, {F32}), {sv}, {bias})"]
        row_shape = f"({tq},)"
        m_new, m_safe, alpha, probs, l_new = (sn.local(x) for x in ("m_new", "m_safe", "alpha", "probs", "l_new"))
        body += [f"{m_new} = jnp.maximum({m_prev}, {s}.max(axis=1))",
                 "# A row with nothing present yet keeps minus infinity; exp then gives zeros.",
                 f"{m_safe} = jnp.where({m_new} == jnp.full({row_shape}, -jnp.inf, {F32}), jnp.full({row_shape}, 0.0, {F32}), {m_new})",
                 f"{alpha} = jnp.exp({m_prev} - {m_safe})",
                 f"{probs} = jnp.exp({s} - lax.broadcast_in_dim({m_safe}, {shape}, [0]))",
                 "if exact:  # absent elements' weights -0.0: `_present_values` tells them from present ones rounded to 0",
                 f"    {probs} = jnp.where({s} == jnp.full({shape}, -jnp.inf, {F32}), jnp.full({shape}, -0.0, {F32}), {probs})",
                 f"{l_new} = {l_prev} * {alpha} + {probs}.sum(axis=1)",
                 f"{probs_smem}[...] = {probs}.astype({dtype})", "plgpu.commit_smem()  # the probabilities, as WGMMA's A"]
        news = []
        for n_c, c in enumerate(products):
            g, o = next((g, o) for g, o in gathers if g.read == c.value)
            e = self.tile[g.inner.index]
            new, scaled = sn.local(f"{c.output}_new"), sn.local(f"{c.output}_scaled")
            vd = k.operand(c.value.operand).dtype
            restore = ", restore=True" if any(k.operand(d.value.operand).dtype == vd for d in products[n_c + 1:]) else ""
            body += [f"{scaled} = {accs[c.output]} * lax.broadcast_in_dim({alpha}, ({tq}, {e}), [0])",
                     "if exact:  # the walk taken again: the product over the present elements alone",
                     f"    {new} = _present_values({scaled}, {probs_smem}, {o.smem}.at[{slot}], "
                     f"{scratch[(vd.jnp, scratch_width(e, vd))]}, compiled{restore})",
                     "else:",
                     f"    {new} = _mma_add({scaled}, {probs_smem}, {o.smem}.at[{slot}], compiled)  # acc * alpha + P . V"]
            news.append(new)
        body.append(f"return {', '.join([m_new, l_new] + news)}")
        step += ["    " + line for line in body]

        walk = issue + ["", f"@pl.when({first} < {last})", "def _prefetch():", f"    {fetch}({first}, 0)"] + step
        init = [f"jnp.full({row_shape}, -jnp.inf, {F32})", f"jnp.zeros({row_shape}, {F32})"]
        for c in products:
            e = self.tile[next(g.inner.index for g in pg.gathers if g.read == c.value)]
            init.append(f"jnp.zeros(({tq}, {e}), {F32})")
        mm, ll = sn.local("m"), sn.local("l")
        res = [mm, ll] + [sn.local(f"{c.output}_sum") for c in products]
        walked, again, start = sn.local("walked"), n.local("_again"), sn.local("start")
        walk += ["", f"{start} = ({', '.join(init)})",
                 f"{walked} = lax.fori_loop({first}, {last}, {step_fn}, {start})",
                 "# A NaN or Inf an absent element's weight met in a step's product reached every row of it and stays:",
                 "# the first row's sums decide (finite data pay them once); where not finite, the walk is taken again,",
                 "# its steps over the present elements alone."]
        walk += [f"{probe_smem}.at[{n_c}][...] = {walked}[{2 + n_c}].sum(axis=1)" for n_c in range(len(products))]
        walk += ["plgpu.commit_smem()", "", f"def {again}():", f"    @pl.when({first} < {last})", "    def _prefetch_again():",
                 f"        {fetch}({first}, 0)", "",
                 f"    return lax.fori_loop({first}, {last}, functools.partial({step_fn}, exact=True), {start})", "",
                 f"return lax.cond({' | '.join(f'_not_finite({probe_smem}[{n_c}, 0])' for n_c in range(len(products)))}, "
                 f"{again}, lambda: {walked})"]

        def rows_of(o_read_subs_indices, ref, lead=()) -> str:
            """The row block of an array (packed heads merged with the query's rows on the host)."""
            parts = list(lead)
            start = f"{row} * {ti}"
            for i in self.packed:
                start = f"{lead_vars[i]} * {self.tile[i] * ti} + {start}"
            for i in o_read_subs_indices:
                if i in self.packed:
                    continue
                parts.append(lead_vars[i] if i in p.lead else f"pl.ds({start}, {rows})" if i == p.query else f"pl.ds(0, {self.tile[i]})")
            return f"{ref}.at[{', '.join(parts)}]"

        inner = ["# The rows past the block's "
                 f"{rows} (WGMMA's M is {tq}) are zeros, never stored: each output row depends only on its own score row.",
                 f"{q_smem}[...] = jnp.zeros({q_tile}, {dtype})",
                 "plgpu.commit_smem()  # before the copy into its first rows",
                 f"plgpu.copy_gmem_to_smem({rows_of([s_.index for s_ in qo.read.subs], qo.ref)}, {q_smem}.at[pl.ds(0, {rows})], {barrier})",
                 f"plgpu.barrier_wait({barrier})", "",
                 f"@functools.partial(pl.run_scoped, {', '.join(bufs)})",
                 f"def {walk_fn}({', '.join([o.smem for _, o in gathers] + [copies])}):"]
        inner += ["    " + line for line in walk]
        safe = sn.local("l_safe")
        inner += ["", f"{', '.join(res)} = {walk_fn}", f"{safe} = jnp.where({ll} == jnp.full({row_shape}, 0.0, {F32}), "
                  f"jnp.full({row_shape}, 1.0, {F32}), {ll})  # a row with nothing present: outputs 0"]
        for c, acc in zip(products, res[2:]):
            e = self.tile[next(g.inner.index for g in pg.gathers if g.read == c.value)]
            value = f"{acc} / lax.broadcast_in_dim({safe}, ({tq}, {e}), [0])" + (f" * {c.scale!r}" if c.scale is not None else "")
            inner.append(f"{out_smem[c.output]}[...] = ({value}).astype({k.operand(c.output).dtype.jnp})")
        inner.append(f"{lse_smem}[...] = {row_lse(mm, ll, safe, row_shape)}  # the part's logsumexp per row, for the merge")
        inner.append("plgpu.commit_smem()")
        for c in products:
            target = k.statement_of(c.output).target.indices
            inner.append(f"plgpu.copy_smem_to_gmem({out_smem[c.output]}.at[pl.ds(0, {rows})], {rows_of(target, out_refs[c.output], [part])})")
        inner.append(f"plgpu.copy_smem_to_gmem({lse_smem}.at[pl.ds(0, {rows})], "
                     f"{rows_of([i for i in self.lse_indices()], lse_ref, [part])})")
        inner.append("plgpu.wait_smem_to_gmem(0, wait_read_only=True)")
        lines += ["", f"@functools.partial(pl.run_scoped, {', '.join(scoped)})",
                  f"def {shared_fn}({', '.join(s_.split('=')[0] for s_ in scoped)}):"]
        lines += ["    " + line for line in inner]
        self.n_rows = render(n_rows, "host")
        arrays = [self.host_q(qo)] + [self.m.conv.param(g.read.operand).internal for g, _ in gathers]
        return params, lines, arrays

    def value_index(self, c) -> str:
        """The index of a softmax product's output that its values carry (`e`)."""
        return next(g.inner.index for g in self.pg.gathers if g.read == c.value)

    def lse_indices(self) -> list[str]:
        """The indices of the rows' logsumexps (each key part's, for the merge): a softmax
        product's output's but its values' (every product's alike: the lowering's rule)."""
        c = next(c for c in self.p.consumers if c.kind == "softmax_product")
        return [i for i in self.k.statement_of(c.output).target.indices if i != self.value_index(c)]

    def host_q(self, o) -> str:
        """The query rows, padded with zeros to whole row blocks where ragged (a copy never
        reads past the array's end)."""
        x = self.m.conv.param(o.read.operand).internal
        if self.packed:
            (i,) = self.packed
            a = [s_.index for s_ in o.read.subs].index(i)
            if self.ragged(i):
                pads = [f"(0, -{self.size_of(i)} % {self.tile[i]})" if s_.index == i else "(0, 0)" for s_ in o.read.subs]
                x = f"jnp.pad({x}, {py_tuple(pads)})"
            # ('i', query) merged: one dimension of rows
            dims = [self.size_of(s_.index) for s_ in o.read.subs]
            return f"{x}.reshape({py_tuple(dims[:a] + ['-1'] + dims[a + 2:])})"
        if not self.ragged(self.p.query):
            return x
        pads = [f"(0, -{self.size_of(s.index)} % {self.tile[s.index]})" if s.index == self.p.query else "(0, 0)" for s in o.read.subs]
        return f"jnp.pad({x}, {py_tuple(pads)})"

    # ------------------------------------------------------------------ module
    def module(self, source_name: str, formatted: bool = True) -> str:
        m, k, p, pg, conv = self.m, self.k, self.p, self.pg, self.m.conv
        classify_fn, classify_reads, classify_lines = self.classify()
        self.classify_fn, self.classify_reads = classify_fn, classify_reads
        params, lines, arrays = self.kernel()
        products = [c for c in p.consumers if c.kind == "softmax_product"]
        outs, merges, finish = [], [], []
        lse_var, lse_shape = self.n.local("row_lse"), None
        for c in products:
            target = k.statement_of(c.output).target.indices
            shape = [f"-(-{self.size_of(i)} // {self.ti}) * {self.ti}" if i == p.query and self.ragged(i) else self.size_of(i) for i in target]
            var = self.n.local(c.output)
            kept = list(target)  # the kernel's output: each dimension's index (packed heads merged with the rows)
            if self.packed:
                (i,) = self.packed
                a = list(target).index(i)
                whole = [f"-(-{self.size_of(i)} // {self.tile[i]}) * {self.tile[i]}" if x == i else s_ for x, s_ in zip(target, shape)]
                shape = whole[:a] + [f"{whole[a]} * {whole[a + 1]}"] + whole[a + 2:]
                kept = kept[:a] + kept[a + 1:]
                finish.append(f"{var} = {var}.reshape({py_tuple(whole)})  # the rows back as ('{i}', '{p.query}')")
                if self.ragged(i):
                    cut = ", ".join(f":{self.size_of(x)}" if x == i else ":" for x in target)
                    finish.append(f"{var} = {var}[{cut}]  # the heads past the end (padding) dropped")
            elif self.ragged(p.query):
                cut = ", ".join(f":{self.size_of(i)}" if i == p.query else ":" for i in target)
                finish.append(f"{var} = {var}[{cut}]  # the rows past the end (padding) dropped")
            e = kept.index(self.value_index(c))
            outs.append((var, py_tuple(["splits"] + shape), k.operand(c.output).dtype.jnp))
            lse_shape = lse_shape or ["splits"] + shape[:e] + shape[e + 1:]
            merges.append(f"{var} = _merge_splits({var}, {lse_var}, {e}) if splits > 1 else {var}[0]")
        outs.append((lse_var, py_tuple(lse_shape), F32))
        finish = merges + finish
        ctas = " * ".join([f"({render(self.extent(i), 'host')})" if i in self.packed else self.size_of(i) for i in p.lead] + [f"({self.n_rows})"])
        table_param = conv.param(pg.table).internal
        sizes_of_page = [self.dim_size(g.read, g.page_dim) for g in pg.gathers]
        clamp = sizes_of_page[0] if len(set(sizes_of_page)) == 1 else f"min({', '.join(sizes_of_page)})"
        scalar_args = [f"{conv.param(r.operand).internal}.reshape(-1).astype(jnp.int32)" for r in pg.scalars]
        lead = list(p.lead)
        letters = {i: chr(97 + x) for x, i in enumerate(lead)}
        table_read = pg.gathers[0].table
        check = {
            "groups": "".join(letters[i] for i in p.class_axes[:-2]) + "z",
            "table": "".join(letters[s.index] for s in table_read.subs[:-1]) + "z",
            "lead": "".join(letters[i] for i in lead) + "z",
            "param": table_param, "name": conv.param(pg.table).public, "size": clamp, "text": table_read.text,
        }
        page_checks = []
        for g in pg.gathers:
            dim = k.operand(g.read.operand).dims[g.page_dim + 1]
            line = f'_check_page_size({self.page}, {self.tj}, "{g.read.operand} dim {g.page_dim + 1} ({dim.text})")'
            gpu_line = f'_check_gpu_page({self.page}, {m.tk}, "{g.read.operand} dim {g.page_dim + 1} ({dim.text})")'
            if not isinstance(pg.page, int):
                for x in (line, gpu_line):
                    if x not in page_checks:
                        page_checks.append(x)
        signature = self.wrapper.signature()[0]
        doc, call_doc = self.wrapper.docstrings(
            "a Pallas Mosaic GPU kernel (Hopper: TMA, WGMMA)",
            ["    interpret: False compiles for the GPU; True runs the Mosaic GPU interpreter",
             "        on the CPU (or pass plgpu.InterpretGPUParams(...))."],
            "Bad shapes and dtypes raise a ValueError naming the argument and dimension; a table entry "
            "a present element reaches outside its dimension too (clamped under jax.jit).",
            describe_gpu_paged(m), m.target.name, signature)
        glue = Glue(
            args=list(conv.impl_args), statics=["sizes", "interpret"], tables=self.gradient_tables({}, []),
            n_outputs=len(k.outputs), cotangents=[], residuals_about=["The residuals: the arguments, with which are differentiated."],
            residuals=list(conv.impl_args), derived=False, bargs=[], partials=[], returns=[], prelude=[], wanted=False,
            kept=[], declared=[], zeros=False,
        )
        prepare = self.prepare_lines()
        prepare = prepare[:-1] + page_checks + prepare[-1:]
        text = self.wrapper.module(
            "gpu/paged.py.j2", source_name, m.target.name, doc, call_doc, glue, prepare, self.reference_lines(),
            classify_fn=classify_fn, classify_params=classify_reads, classify_lines=classify_lines,
            kernel_fn=self.n.function("_paged_kernel"), kernel_params=params, kernel_lines=lines, arrays=arrays,
            outs=outs, results=[v for v, _, _ in outs[:-1]], finish=finish, ctas=ctas, steps=f"-(-{self.size_of(p.key)} // {m.tk})", sms=m.target.sms,
            table_param=table_param, clamp=clamp, check=check,
            scalar_args=scalar_args, rows=m.rows, tk=m.tk, data=p.data_dependent,
        )
        return format_module(text, names=(m.name,))


def emit_gpu_paged(m: GpuPagedModule, source_name: str) -> str:
    return GpuPagedEmitter(m).module(source_name)
