"""Emission of the paged walk's module (templates/tpu/paged.py.j2): the condition classified
per page, each row block's page bounds, the kernel (page copies double-buffered, the
flash softmax over key blocks in a loop), the table checks and `reference` through the table.

The row walk's emitter supplies what is the same: the argument checks, docstrings, the
reference of the scores, the chain and softmax products."""

from __future__ import annotations

from ...expr import Const, Var, flat, render
from ...ir import Read
from ...pytext import py_tuple, words
from ...terms import ScoreTerms
from ...wrapper import Glue
from ...walks.paged import PagedHost
from ..attention.emit import AttentionEmitter
from .describe import describe_paged
from .lower import PagedModule


class PagedEmitter(PagedHost, AttentionEmitter):
    def lead_block(self, index: str) -> str:
        """A lead index's block in a BlockSpec: squeezed, or its tile when packed."""
        return str(self.tile[index]) if index in self.packed else "None"

    # ------------------------------------------------------------- the kernel
    def scalar_ref(self, r: Read) -> str:
        return self.n.local(f"{r.operand}_smem")

    def kernel_lines(self, n, refs: dict) -> list[str]:
        p, pg, acc = self.p, self.pg, self.acc
        ti, tj, page = self.ti, self.tj, self.page
        lines = ["if pieces:",
                 "    # The table is too large for scalar memory: it stays in HBM, and each step copies its row.",
                 f"    {', '.join(refs['pieces_signature'])}, = refs",
                 "else:",
                 f"    {', '.join(refs['signature'])}, = refs"]
        lead_vars = {i: n.local(i) for i in p.lead}
        row = n.local("row")
        ppb = n.local("per_block")
        lines.append(f"{ppb} = {tj} // {page}  # pages a key block gathers")
        groups = [i for i in p.class_axes[:-2]]
        n_rows = self.size_expr(p.query).cdiv(ti)
        at_expr = flat([Var(lead_vars[i]) for i in groups] + [Var(row)], [self.size_expr(i) for i in groups] + [n_rows])
        at, lo, hi, first, last = (n.local(x) for x in ("at", "lo", "hi", "first", "last"))
        step_params = ", ".join(list(lead_vars.values()) + [row])
        lines += ["", f"def _bounds({step_params}):",
                  "    # A step's pages [lo, hi) (those the condition may reach) and the key blocks holding them.",
                  f"    {at} = {render(at_expr, 'py')}",
                  f"    {lo}, {hi} = {refs['first']}[{at}], {refs['end']}[{at}]",
                  f"    return {lo}, {hi}, {lo} // {ppb}, ({hi} + {ppb} - 1) // {ppb}"]
        # Each page inside the bounds: one copy per cached operand, started or waited for.
        kb, slot, start, pi, entry = n.local("block"), n.local("slot"), n.local("start"), n.local("p"), n.local("entry")
        table = pg.gathers[0].table
        table_op = self.k.operand(table.operand)
        row_coords = [lead_vars[s.index] for s in table.subs[:-1]]
        base = n.local("base")
        row_ref = f"{refs['table_hbm']}.at[{', '.join(row_coords)}]" if row_coords else refs["table_hbm"]
        # The step's row of the table as a position in the flattened table (a tree: a
        # coordinate rendering as a sum keeps its brackets).
        flat_row = flat([Var(c) for c in row_coords], [self.m.conv.size(dim) for dim in table_op.dims[:-1]]) if row_coords else Const(0)
        row_start = render(flat_row * self.m.conv.size(table_op.dims[-1]), "py")
        page_var = n.local("page")
        def copies(indent: str, entry_at: str, action: str) -> list[str]:
            out = [f"{indent}{entry} = {refs['table']}[{entry_at}]"]
            for g in pg.gathers:
                heads = []
                for s_ in g.heads:
                    if s_.index in self.packed:  # a block of heads packed into the rows shares one
                        t_ = self.tile[s_.index]
                        heads.append(lead_vars[s_.index] if s_.divisor == t_ else f"{lead_vars[s_.index]} * {t_} // {s_.divisor}")
                    elif s_.index in p.lead:
                        heads.append(f"{lead_vars[s_.index]} // {s_.divisor}" if s_.divisor != 1 else lead_vars[s_.index])
                    else:  # the row block's heads share one (the tile divides the divisor)
                        heads.append(row if s_.divisor == ti else f"{row} * {ti} // {s_.divisor}")
                src = ", ".join(heads + [entry])
                buf, sem = refs["bufs"][g.read.operand], refs["sems"][g.read.operand]
                copy = f"pltpu.make_async_copy({refs['hbm'][g.read.operand]}.at[{src}], {buf}.at[{slot}, {pi}], {sem}.at[{slot}])"
                out += [f"{indent}{copy}.start()"] if action == "start" else [f"{indent}copy = {copy}", f"{indent}copy.start() if {start} else copy.wait()"]
            return out

        whole = n.local("whole")
        lines += ["", "", f"def _pages({step_params}, {lo}, {hi}, {kb}, {slot}, {start}):",
                  "    # The copies of a key block's pages (start: begun; else: waited for).",
                  f"    {base} = 0 if pieces else {row_start}  # the step's row of the table",
                  f"    {whole} = ({kb} * {ppb} >= {lo}) & ({kb} * {ppb} + {ppb} <= {hi})",
                  "",
                  f"    @pl.when({whole})",
                  "    def _whole_block():",
                  "        # Every page inside the bounds: no guard per page, one wait per operand.",
                  f"        if {start}:",
                  f"            for {pi} in range({ppb}):"]
        lines += copies("                ", f"{base} + {kb} * {ppb} + {pi}", "start")
        lines.append("        else:")
        for g in pg.gathers:
            buf, sem = refs["bufs"][g.read.operand], refs["sems"][g.read.operand]
            lines.append(f"            pltpu.make_async_copy({buf}.at[{slot}], {buf}.at[{slot}], {sem}.at[{slot}]).wait()")
        lines += ["",
                  f"    @pl.when(jnp.logical_not({whole}))",
                  "    def _edge_block():",
                  "        # The first or last block: only its pages inside the bounds, each waited for.",
                  f"        for {pi} in range({ppb}):",
                  f"            {page_var} = {kb} * {ppb} + {pi}",
                  "",
                  f"            @pl.when(({page_var} >= {lo}) & ({page_var} < {hi}))",
                  "            def _copy():"]
        lines += copies("                ", f"{base} + {page_var}", "either")
        value_bufs = [refs["bufs"][c.value.operand] for c in p.consumers if c.kind == "softmax_product"]
        lines += ["",
                  f"            if not {start}:",
                  "",
                  f"                @pl.when(({page_var} < {lo}) | ({page_var} >= {hi}))",
                  "                def _zero():",
                  "                    # A page not copied holds anything: its values are zeroed (0 x NaN is NaN)."]
        lines += [f"                    {buf}[{slot}, {pi}] = jnp.zeros({buf}.shape[2:], {buf}.dtype)" for buf in value_bufs]
        lines.append("")
        lines.append("")
        for d, i in enumerate(p.lead):
            lines.append(f"{lead_vars[i]} = pl.program_id({d})")
        lines.append(f"{row} = pl.program_id({len(p.lead)})  # the row block")
        lines += ["if pieces:", f"    pltpu.sync_copy({row_ref}, {refs['table']})"]
        lines.append(f"{lo}, {hi}, {first}, {last} = _bounds({step_params})")
        # Chained (one core walks the steps in order): a step's last block starts the copies
        # of the next step's first block; `state` passes its slot on.
        state, slot0, started = refs["state"], n.local("slot0"), n.local("started")
        grid_extents = [self.extent(i) for i in p.lead] + [n_rows]
        step_flat = render(flat([Var(v) for v in lead_vars.values()] + [Var(row)], grid_extents), "py")
        n_steps = grid_extents[0]
        for e in grid_extents[1:]:
            n_steps = n_steps * e
        first_step = " & ".join(f"({v} == 0)" for v in list(lead_vars.values()) + [row])
        lines += ["if chained:",
                  "    # One core walks the steps in order: the last block of a step starts the copies",
                  "    # of the next step's first block, and `state` tells that step (its slot, started).",
                  "",
                  f"    @pl.when({first_step})",
                  "    def _start():",
                  f"        {state}[0] = 0",
                  f"        {state}[1] = 0",
                  "",
                  f"    {slot0}, {started} = {state}[0], {state}[1]",
                  f"    {state}[1] = 0",
                  "else:",
                  f"    {slot0}, {started} = 0, 0",
                  "",
                  "",
                  f"@pl.when(({first} < {last}) & ({started} == 0))",
                  "def _prefetch_first():",
                  f"    _pages({step_params}, {lo}, {hi}, {first}, {slot0}, True)",
                  ""]
        # The next step's coordinates, row-major over the grid.
        nxt = n.local("step")
        next_vars = [n.local(f"next_{v}") for v in list(lead_vars.values()) + [row]]
        decompose = []
        rest = Var(nxt)
        for v, e in reversed(list(zip(next_vars, grid_extents))):
            decompose.append(f"{v} = lax.rem({render(rest, 'py')}, {render(e, 'py')})")
            rest = rest.div(e)
        decompose.reverse()
        nlo, nhi, nfirst, nlast = (n.local(f"next_{x}") for x in ("lo", "hi", "first", "last"))
        chained_lines = ["",
                         "    if chained:",
                         "",
                         f"        @pl.when({kb} + 1 == {last})",
                         "        def _prefetch_next_step():",
                         f"            {nxt} = {step_flat} + 1",
                         "",
                         f"            @pl.when({nxt} < {render(n_steps, 'py')})",
                         "            def _next_step():"]
        chained_lines += [f"                {line}" for line in decompose]
        chained_lines += [f"                {nlo}, {nhi}, {nfirst}, {nlast} = _bounds({', '.join(next_vars)})",
                          "",
                          f"                @pl.when({nfirst} < {nlast})",
                          "                def _copy_next():",
                          f"                    _pages({', '.join(next_vars)}, {nlo}, {nhi}, {nfirst}, 1 - {slot}, True)",
                          f"                    {state}[0] = 1 - {slot}",
                          f"                    {state}[1] = 1"]
        self._chained_lines = chained_lines
        qv = n.local(f"{p.q.operand}_blk")
        rows, summed_tile = self.rows, self.tile[p.summed]
        if self.packed:
            # Heads (and tokens) packed into one block of rows: (heads, tokens, d) as (rows, d),
            # through f32, whose (8, 128) tiles the merge keeps.
            lines.append(f"{qv} = {refs['q']}[...].astype(jnp.float32).reshape({rows}, {summed_tile}).astype({refs['q']}.dtype)")
        else:
            lines.append(f"{qv} = {refs['q']}[...]")
        # The loop body.
        carry_m, carry_l = n.local("m_prev"), n.local("l_prev")
        values = [c for c in p.consumers if c.kind == "softmax_product"]
        accs = [n.local(f"{c.output}_prev") for c in values]
        body = [f"def _block({kb}, carry):",
                f"    {', '.join([carry_m, carry_l] + accs)} = carry",
                f"    {slot} = lax.rem({slot0} + {kb} - {first}, 2)",
                "",
                f"    @pl.when({kb} + 1 < {last})",
                "    def _prefetch_next():",
                "        # The next block's pages are copied while this one is computed.",
                f"        _pages({step_params}, {lo}, {hi}, {kb} + 1, 1 - {slot}, True)",
                *self._chained_lines,
                "",
                f"    _pages({step_params}, {lo}, {hi}, {kb}, {slot}, False)  # this block's pages have arrived"]
        kg = pg.gathers[0]
        kv = n.local(f"{kg.read.operand}_blk")
        inner_k = self.tile[kg.inner.index]
        body.append(f"    {kv} = {refs['bufs'][kg.read.operand]}[{slot}].reshape({tj}, {inner_k})")
        raw = n.local("raw_scores")
        (qa, ka), prec = self.score_factors(self.m.operands[0], self.m.operands[1])
        qa, ka = qa.replace(self.m.operands[0].var, qv), ka.replace(self.m.operands[1].var, kv)
        qd = [s.index for s in p.q.subs if s.index not in p.lead].index(p.summed)
        body.append(f"    {raw} = lax.dot_general({qa}, {ka}, ((({qd},), (1,)), ((), ())), preferred_element_type={acc.jnp}{prec})")
        if p.scale is not None:
            body.append(f"    {raw} = {raw} * {p.scale!r}")
        qpos, kpos = n.local(f"{p.query}_pos"), n.local(f"{p.key}_pos")
        ppos = {}
        if self.packed:
            lane = n.local("r")
            body.append(f"    {lane} = lax.broadcasted_iota(jnp.int32, ({self.rows}, 1), 0)  # a row of the block")
            body.append(f"    {qpos} = {row} * {ti} + {lane} % {ti}")
            stride = ti
            for i in reversed(self.packed):
                t_ = self.tile[i]
                ppos[i] = n.local(f"{i}_pos")
                body.append(f"    {ppos[i]} = {lead_vars[i]} * {t_} + {lane} // {stride} % {t_}")
                stride *= t_
        else:
            body.append(f"    {qpos} = {row} * {ti} + lax.broadcasted_iota(jnp.int32, ({ti}, 1), 0)")
        body.append(f"    {kpos} = {kb} * {tj} + lax.broadcasted_iota(jnp.int32, (1, {tj}), 1)")
        scalar = lambda r: f"{refs['scalars'][r.operand]}[{self.flat_read(r, lead_vars)}]"  # noqa: E731  (from scalar memory)
        terms = ScoreTerms({p.query: qpos, p.key: kpos, **ppos}, lead_vars, str, scalar, acc.jnp, self.m.conv.size_var, {p.score: raw})
        body += terms.chain(p.chain, n.local, "    ")
        s = terms.point(p.points[0])
        # Pages outside the bounds were not copied: their buffer rows hold anything.
        inside = n.local("copied")
        body.append(f"    {inside} = {' & '.join(self.inside_pages(kpos, lo, hi, str))}")
        conds = [inside]
        if p.points[0].condition is not None:
            conds.append(f"({terms.test(p.points[0].condition)})")
        if self.ragged(p.query):
            conds.append(f"({qpos} < {self.size_of(p.query)})")
        conds += [f"({ppos[i]} < {self.size_of(i)})" for i in self.packed if self.ragged(i)]
        scores, present = n.local("scores"), n.local("present")
        body += [f"    {present} = {' & '.join(conds)}", f"    {scores} = jnp.where({present}, {s}, -jnp.inf)"]
        m_new, m_safe, alpha, probs, l_new = (n.local(x) for x in ("m_new", "m_safe", "alpha", "probs", "l_new"))
        body += [f"    {m_new} = jnp.maximum({carry_m}, jnp.max({scores}, axis=1, keepdims=True))",
                 "    # A row with nothing present yet keeps minus infinity; exp then gives zeros.",
                 f"    {m_safe} = jnp.where(jnp.isneginf({m_new}), 0.0, {m_new})",
                 f"    {alpha} = jnp.exp({carry_m} - {m_safe})",
                 f"    {probs} = jnp.exp({scores} - {m_safe})",
                 f"    {l_new} = {alpha} * {carry_l} + jnp.sum({probs}, axis=1, keepdims=True)"]
        news = []
        for c, a in zip(values, accs):
            g = next(g for g in pg.gathers if g.read == c.value)
            vv = n.local(f"{c.value.operand}_blk")
            e = self.tile[g.inner.index]
            body.append(f"    {vv} = {refs['bufs'][c.value.operand]}[{slot}].reshape({tj}, {e})")
            computed, block, vprec = self.mxu(probs, vv, self.k.operand(c.value.operand).dtype)
            new, part, x = n.local(f"{c.output}_new"), n.local(f"{c.output}_part"), n.local("x")
            dot = "lax.dot_general({}, {}, " + f"(((1,), (0,)), ((), ())), preferred_element_type={acc.jnp}{vprec})"
            # A slot the condition leaves out (past `lens`, before a window) holds anything (a
            # reused cache, fp8 NaN patterns): its weight 0 must not meet its value. A NaN or
            # Inf of the block reaches every row of the product, row 0 included.
            body += [f"    {part} = {dot.format(computed, block)}",
                     f"    {part} = _present_value({part}[0:1], {part}, lambda: _present_dot(lambda {x}, y: {dot.format(x, 'y')}, "
                     f"{computed}, {probs}, {present}, {block}))",
                     f"    {new} = {alpha} * {a} + {part}"]
            news.append(new)
        body.append(f"    return {', '.join([m_new, l_new] + news)}")
        lines += body
        lines.append("")
        m, l_ = n.local("m"), n.local("l")
        outs = [n.local(f"{c.output}_sum") for c in values]
        init = [f"jnp.full(({self.rows}, 1), -jnp.inf, {acc.jnp})", f"jnp.zeros(({self.rows}, 1), {acc.jnp})"]
        for c in values:
            g = next(g for g in pg.gathers if g.read == c.value)
            init.append(f"jnp.zeros(({self.rows}, {self.tile[g.inner.index]}), {acc.jnp})")
        lines.append(f"{', '.join([m, l_] + outs)} = lax.fori_loop({first}, {last}, _block, ({', '.join(init)}))")
        total, nothing = n.local("total"), n.local("nothing")
        lines.append(f"{nothing} = {l_} == 0.0  # no element present: the output is 0")
        lines.append(f"{total} = jnp.where({nothing}, 1.0, {l_})")
        for c, o in zip(values, outs):
            ref = refs["outs"][c.output]
            scale = f" * {c.scale!r}" if c.scale is not None else ""
            value = f"{o} * jnp.where({nothing}, 0.0, 1.0 / {total}){scale}"
            if self.packed:  # the rows back as (heads, tokens, e)
                value = f"({value}).reshape({ref}.shape)"
            lines.append(f"{ref}[...] = ({value}).astype({ref}.dtype)")
        return lines

    # ------------------------------------------------------------------ module
    def module(self, source_name: str, formatted: bool = True) -> str:
        from ...formatting import format_module

        m, k, p, pg, conv = self.m, self.k, self.p, self.pg, self.m.conv
        classify_fn, classify_reads, classify_lines = self.classify()
        self.classify_fn, self.classify_reads = classify_fn, classify_reads
        n = self.n.scope()
        refs = {
            "first": n.local("first_page"), "end": n.local("end_page"), "table": n.local(f"{pg.table}_smem"),
            "table_hbm": n.local(f"{pg.table}_hbm"),
            "scalars": {r.operand: self.scalar_ref(r) for r in pg.scalars},
            "q": n.local(f"{p.q.operand}_ref"),
            "hbm": {g.read.operand: n.local(f"{g.read.operand}_hbm") for g in pg.gathers},
            "outs": {c.output: n.local(f"{c.output}_ref") for c in p.consumers},
            "bufs": {g.read.operand: n.local(f"{g.read.operand}_pages") for g in pg.gathers},
            "sems": {g.read.operand: n.local(f"{g.read.operand}_copies") for g in pg.gathers},
            "state": n.local("state"),
        }
        self.refs_signatures(refs)
        body = self.kernel_lines(n, refs)
        used = set().union(*(words(line) for line in body))
        statics = [v for v in self.sizes if v in used]
        lead = list(p.lead)
        grid = [render(self.extent(i), "host") for i in lead] + [render(self.size_expr(p.query).cdiv(self.ti), "host")]
        maps = n.scope()
        grid_vars = [maps.local(i) for i in lead] + [maps.local("row")]
        q_coords = [grid_vars[lead.index(s.index)] if s.index in lead else grid_vars[-1] if s.index == p.query else "0" for s in p.q.subs]
        q_block = py_tuple(self.lead_block(s.index) if s.index in lead else str(self.tile[s.index]) for s in p.q.subs)
        outs = []
        for c in p.consumers:
            target = k.statement_of(c.output).target
            op = k.operand(c.output)
            coords = [grid_vars[lead.index(i)] if i in lead else grid_vars[-1] if i == p.query else "0" for i in target.indices]
            block = py_tuple(self.lead_block(i) if i in lead else str(self.tile[i]) for i in target.indices)
            shape = py_tuple(self.size_of(i) for i in target.indices)
            outs.append({"var": self.n.local(c.output), "block": block, "coords": coords, "shape": shape, "dtype": op.dtype.jnp})
        scratch = []
        for g in pg.gathers:
            op = k.operand(g.read.operand)
            inner = self.tile[g.inner.index]
            scratch.append(f"pltpu.VMEM((2, {self.tj} // {self.page}, {self.page}, {inner}), {op.dtype.jnp})")
        scratch += ["pltpu.SemaphoreType.DMA((2,))" for _ in pg.gathers]
        scratch.append("pltpu.SMEM((2,), jnp.int32)")  # chained steps: the next step's first slot, and whether started
        table_param = conv.param(pg.table).internal
        sizes_of_page = [self.dim_size(g.read, g.page_dim) for g in pg.gathers]
        clamp = sizes_of_page[0] if len(set(sizes_of_page)) == 1 else f"min({', '.join(sizes_of_page)})"
        scalar_args = [f"{conv.param(r.operand).internal}.reshape(-1).astype(jnp.int32)" for r in pg.scalars]
        groups = list(p.class_axes[:-2])
        letters = {i: chr(97 + x) for x, i in enumerate(lead)}
        table_read = pg.gathers[0].table
        check = {
            "groups": "".join(letters[i] for i in groups) + "z",
            "table": "".join(letters[s.index] for s in table_read.subs[:-1]) + "z",
            "lead": "".join(letters[i] for i in lead) + "z",
            "param": table_param,
            "name": conv.param(pg.table).public,
            "size": clamp,
            "text": table_read.text,
        }
        page_checks = []
        for g in pg.gathers:
            dim = k.operand(g.read.operand).dims[g.page_dim + 1]
            line = f'_check_page_size({self.page}, {self.tj}, "{g.read.operand} dim {g.page_dim + 1} ({dim.text})")'
            if line not in page_checks and not isinstance(pg.page, int):
                page_checks.append(line)
        doc, call_doc = self.docstring()
        glue = Glue(
            args=list(conv.impl_args), statics=["sizes", "interpret"], tables=self.gradient_tables({}, []),
            n_outputs=len(k.outputs), cotangents=[], residuals_about=["The residuals: the arguments, with which are differentiated."],
            residuals=list(conv.impl_args), derived=False, bargs=[], partials=[], returns=[], prelude=[], wanted=False,
            kept=[], declared=[], zeros=False,
        )
        prepare = self.prepare_lines()
        prepare = prepare[:-1] + page_checks + prepare[-1:]
        text = self.wrapper.module(
            "tpu/paged.py.j2", source_name, m.target.name, doc, call_doc, glue, prepare, self.reference_lines(),
            smem=m.target.smem_bytes,
            classify_fn=classify_fn, classify_params=classify_reads, classify_lines=classify_lines,
            kernel_fn=self.n.function(f"_{k.name}_kernel" if not k.name.startswith("_") else "_paged_kernel"),
            kernel_statics=statics, kernel_lines=body,
            grid=py_tuple(grid), grid_vars=grid_vars, q_block=q_block, q_coords=q_coords, q_map=self.n.function(f"_{p.q.operand}_map"),
            out_map=self.n.function("_row_block_map"), outs=outs, scratch=scratch, q_param=conv.param(p.q.operand).internal,
            hbm_params=[conv.param(g.read.operand).internal for g in pg.gathers], scalar_args=scalar_args,
            table_param=table_param, table_length=render(self.m.conv.size(k.operand(pg.table).dims[-1]), "host"), clamp=clamp, check=check,
            vmem_limit=m.vmem_limit(), class_axes=list(p.class_axes), data=p.data_dependent,
            flops=self.flops_per_row(), key_bytes=self.bytes_per_key(), rows=self.rows, page=self.page,
            out_bytes=" + ".join(f"int(np.prod({o['shape']})) * jnp.dtype({o['dtype']}).itemsize" for o in outs), key=p.key, single_core=m.target.cores == 1,
        )
        return format_module(text, names=(m.name,)) if formatted else text

    def refs_signatures(self, refs: dict) -> None:
        """The kernel's refs in order: the table in scalar memory (prefetched), or in HBM with
        a row of it copied into scalar memory per step (`pieces`)."""
        rest = list(refs["hbm"].values()) + list(refs["outs"].values()) + list(refs["bufs"].values()) + list(refs["sems"].values()) + [refs["state"]]
        scalars = list(refs["scalars"].values())
        refs["signature"] = [refs["first"], refs["end"], refs["table"]] + scalars + [refs["q"]] + rest
        refs["pieces_signature"] = [refs["first"], refs["end"]] + scalars + [refs["q"], refs["table_hbm"]] + rest + [refs["table"]]

    def flops_per_row(self) -> str:
        """The MXU work of a row block and one key position: the score and each product."""
        inner = [self.tile[g.inner.index] for g in self.pg.gathers]
        return str(2 * self.rows * sum(inner))

    def bytes_per_key(self) -> str:
        """HBM bytes a key position costs: its row of each cached operand."""
        return str(sum(self.tile[g.inner.index] * self.k.operand(g.read.operand).dtype.itemsize for g in self.pg.gathers))

    def docstring(self):
        signature = self.wrapper.signature()[0]
        args = ["    interpret: False compiles for the TPU; True runs the CPU interpreter;",
                "        pltpu.InterpretParams() runs the TPU simulator."]
        return self.wrapper.docstrings("a Pallas TPU kernel", args,
                                       "Bad shapes and dtypes raise a ValueError naming the argument and dimension; a table entry "
                                       "a present element reaches outside its dimension too (clamped under jax.jit).",
                                       describe_paged(self.m), self.m.target.name, signature)


def emit_paged(m: PagedModule, source_name: str, formatted: bool = True) -> str:
    return PagedEmitter(m).module(source_name, formatted)
