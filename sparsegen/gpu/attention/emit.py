"""Emission of a GPU attention module: the classification (the TPU's, `schedule/classify.py`),
the walk's tables, the Mosaic GPU kernel, `reference` and `block_kinds` (the TPU module's
own: one calling convention on every target); Jinja (templates/gpu/attention.py.j2), black.

The kernel, one CTA per row tile: the query tile (and per-row operands) copied to shared
memory once; `plgpu.emit_pipeline` over the steps of the row block's non-empty key blocks
(TMA copies of the key-side tiles, from GMEM tables); per step the score tile as a WGMMA
into a scoped accumulator, the chain, the condition on a partial block only (`lax.cond` on
the block's kind), the online softmax in registers, the probabilities through shared
memory into a second WGMMA per value; then each output's tile through shared memory.

`sharded`'s ring (templates/ring.py.j2, the TPU module's) calls `_impl` and `_run_backward`
with `origin=` (the kernels read it from GMEM and add it to the positions a condition or the
chain compares) and `keys=` (segment ids' key side, which every read along the key index
takes): sparsegen/ring.py.
"""

from __future__ import annotations

import re

from ...expr import render
from ...formatting import format_module
from ...mesh import mesh_plan
from ...pytext import py_tuple
from ...ring import RingSides
from ...schedule.attention import read_key
from ...terms import ScoreTerms
from ...wrapper import Glue, Wrapper, vjp_tables
from ...walks.reference import ReferenceWriter
from .backward_kernels import BackwardWriter
from .describe import describe_gpu_attention
from .lower import (MEMORY_REGISTERS, SCRATCH_KEYS, STAGES, GpuAttentionModule, GpuOperand, _free_index, out_through_q, partial_steps,
                    scratch_width)

F32 = "jnp.float32"


def row_lse(m: str, l: str, safe: str, row: str) -> str:
    """Each row's logsumexp from a walk's running max `m` and sum `l` (`safe`: `l`, 1 where
    it is 0), minus infinity for a row with nothing present: the row walk's `logsumexp`
    output and the residual its gradients read, and the weight of a key part's rows in
    flash decoding's merge (the row walk's and the paged walk's)."""
    return f"jnp.where({l} == jnp.full({row}, 0.0, {F32}), jnp.full({row}, -jnp.inf, {F32}), {m} + jnp.log({safe}))"


class GpuAttentionEmitter(RingSides, BackwardWriter, ReferenceWriter):
    def __init__(self, m: GpuAttentionModule):
        self.m = m
        self.k = m.kernel
        self.p = m.plan
        self.n = m.names
        self.tile = m.tile
        self.wrapper = Wrapper(m.kernel, m.conv, (), m.names.local("size"), m.names)
        # A condition (or the chain) comparing query or key positions compares global ones:
        # `_impl(..., origin=...)` gives the first positions of the arrays passed (`sharded`'s
        # ring), an int32[2] each kernel reads; integers read along both indices take their
        # key side from `keys=` (sparsegen/ring.py).
        self.shard_sides(True)

    # Names and sizes (as ReferenceWriter reads them).
    def size_of(self, index: str) -> str:
        size = self.k.index(index).size
        return f"({render(self.m.conv.size(size), 'host')})" if size.literal is None and size.product else (
            str(size.literal) if size.literal is not None else self.m.conv.size_var(size.symbol))

    def ragged(self, index: str) -> bool:
        idx = self.k.index(index)
        return idx.size.literal is None or idx.size.literal % idx.tile != 0

    def e_of(self, c) -> str:
        return _free_index(self.k, self.p, c)

    def partial_conditions(self) -> bool:
        """Can a step hold absent elements (`lower.partial_steps`)? Its P . V is checked then."""
        return partial_steps(self.k, self.p)

    def scratch_width(self, c) -> int:
        """The values' columns a product's checked P . V takes at a time (`lower.scratch_width`)."""
        return scratch_width(self.tile[self.e_of(c)], self.k.operand(c.value.operand).dtype)

    def blocks(self, index: str) -> str:
        return f"(-(-{self.size_of(index)} // {self.tile[index]}))"

    # -------------------------------------------------------------- arrays
    def clipped(self, index: str) -> str | None:
        """The length of an array TMA alone reads or writes along `index`, a dimension other
        than its minor: its size where that is a multiple of 8 (TMA fills the last tile's rows
        past the end with zeros, and drops a store's), else padded to a multiple of 8 only
        (`_rows`: Mosaic GPU tiles swizzled shared memory in 8-row atoms and refuses a
        second-minor dimension of another size). None where that is the size itself, known now."""
        size, tile = self.k.index(index).size, self.tile[index]
        if size.literal is not None:
            rows = size.literal + -size.literal % min(tile, 8)
            return None if rows == size.literal else str(rows)
        return f"_rows({self.size_of(index)}, {tile})"

    def clips(self, o: GpuOperand, d: int) -> bool:
        """Is dimension `d` of the operand (the rows or keys) read unpadded? Where it is not
        the minor dimension of a query or key-side tile TMA copies (q, k, a value; the
        second-minor, or further out as in q[b, i, h, d]), not swapped: the kernel's
        ragged-row and ragged-key conditions mask what lies past the end. Elsewhere (the
        minor dimension, which TMA tiles by the swizzle width; a swapped copy; a mask, a
        per-row or per-key vector the condition reads) it is padded to whole blocks."""
        return o.role in ("q", "k", "value") and not o.swapped and d < len(o.read.subs) - 1

    def host_array(self, o: GpuOperand) -> str:
        """The array the kernel receives: the argument, its two tile dimensions swapped where
        WGMMA or the condition wants them the other way; its ragged rows and keys as they are
        where TMA reads them past the end as zeros (`clips`; to a multiple of 8 only), else
        padded with zeros to whole blocks (a tile never reads past an array's end)."""
        x = self.keyed(o.read) or self.m.conv.param(o.read.operand).internal
        subs = o.read.subs
        ragged = [d for d, s in enumerate(subs) if s.index in (self.p.query, self.p.key) and self.ragged(s.index) and s.divisor == 1]
        pads = [f"(0, -{self.size_of(s.index)} % {self.tile[s.index]})" if d in ragged and not self.clips(o, d)
                else "(0, 0)" for d, s in enumerate(subs)]
        if any(pad != "(0, 0)" for pad in pads):
            x = f"jnp.pad({x}, {py_tuple(pads)})"
        for d in ragged:
            rows = self.clipped(subs[d].index) if self.clips(o, d) else None
            if rows is not None:
                x = f"_pad_to({x}, {d}, {rows})"
        if o.swapped:
            a, b = [d for d, s in enumerate(subs) if s.index in o.live]
            x = f"jnp.swapaxes({x}, {a}, {b})"
        return x

    def dims(self, o: GpuOperand) -> list[str]:
        """The operand's indices in the order of the array the kernel receives."""
        idx = [s.index for s in o.read.subs]
        if o.swapped:
            a, b = [d for d, i in enumerate(idx) if i in o.live]
            idx[a], idx[b] = idx[b], idx[a]
        return idx

    def divisor(self, o: GpuOperand, index: str) -> int:
        return next(s.divisor for s in o.read.subs if s.index == index)

    def lead_coord(self, o: GpuOperand, index: str) -> str:
        d = self.divisor(o, index)
        if index == self.p.query:  # a key-side head of grouped rows (`h // 8`): the row block's, one per block
            return f"{self.row_block} * {self.tile[index]} // {d}"
        return self.lv[index] if d == 1 else f"{self.lv[index]} // {d}"

    def fixed(self, o: GpuOperand, index: str) -> bool:
        """Is the dimension a coordinate of the CTA (a lead index, or the row index read as a
        key-side head through `// n`), not a tile's?"""
        return index in self.p.lead or (index == self.p.query and self.divisor(o, index) != 1)

    def free(self, o: GpuOperand) -> list[str]:
        """The operand's tile dimensions, in the order of the array the kernel receives."""
        return [i for i in self.dims(o) if not self.fixed(o, i)]

    # -------------------------------------------------------------- kernel
    def kernel_lines(self) -> tuple[list[str], list[str], list[str]]:
        """The kernel's parameters, its lines, and the arrays passed (in order).

        Warp-specialized (FlashAttention-3's shape, docs/gpu-notes.md): a CTA owns
        `warpgroups` x 64 rows of one row block; each consumer warpgroup computes its 64 rows
        (the query tile, the online softmax, its outputs) while the last warpgroup only issues
        the TMA copies of the key-side tiles (`plgpu.emit_pipeline_warp_specialized`)."""
        m, p, k = self.m, self.p, self.k
        n = self.n.scope()
        tq, tk, wgs = m.tq, m.tk, m.warpgroups
        ti, tj = self.tile[p.query], self.tile[p.key]
        rows = m.rows  # rows a CTA stores: under `tq` (decoding), its tiles padded to `tq` in shared memory
        padded = rows < tq
        rsub, ksub = max(ti // (tq * wgs), 1), tj // tk
        tables = [n.local("cols"), n.local("kinds"), n.local("counts")]
        ops = m.operands
        out_refs = {c.output: n.local(f"{c.output}_gmem") for c in p.consumers}
        origins = n.local("origins_gmem") if self.positions else None
        params = tables + ([origins] if origins else []) + [o.ref for o in ops] + [out_refs[c.output] for c in p.consumers]
        # Each row's logsumexp: the gradients' residual, or a key part's weight in the merge.
        lse_ref = n.local("row_lse_gmem") if m.backward is not None or m.splits else None
        if lse_ref:
            params.append(lse_ref)
        lines = []
        if self.size_vars:
            lines.append(f"{', '.join(self.size_vars)}{',' if len(self.size_vars) == 1 else ''} = sizes")
        ws = wgs > 1  # warp-specialized; one warpgroup copies and computes otherwise
        cell, row_tile = n.local("cell"), n.local("row_tile")
        wg, rows_at = (n.local("wg"), n.local("rows_at")) if ws else (None, row_tile)
        n_tiles = f"{self.blocks(p.query)} * {rsub}" if rsub != 1 else self.blocks(p.query)
        lines.append(f'{cell} = lax.axis_index("cell")')
        part = n.local("part") if m.splits else None
        if part:
            lines += [f"{part} = {cell} % splits  # which part of the row block's keys (flash decoding)", f"{cell} = {cell} // splits"]
        lines.append(f"{row_tile} = {cell} % ({n_tiles})  # the CTA's {rows * wgs} rows" + (f" (padded to {tq} in shared memory)" if padded else ""))
        if ws:
            consumers = " and ".join(map(str, range(wgs))) if wgs == 2 else f"0 to {wgs - 1}"
            lines.append(f"# The warpgroup: {consumers} consumers ({tq} rows each), {wgs} the producer (TMA copies only)")
            lines.append(f'{wg} = lax.axis_index("wg")')
            lines.append(f"{rows_at} = {row_tile} * {wgs} + {wg}  # a consumer's rows, in tiles of {tq}")

        def mine(ref: str) -> str:
            """A consumer's part of a shared-memory allocation (each consumer has its own)."""
            return f"{ref}.at[{wg}]" if ws else ref
        self.lv = {i: n.local(i) for i in p.lead}
        stride = f"{n_tiles}"
        for d in reversed(range(len(p.lead))):
            i = p.lead[d]
            value = f"{cell} // ({stride})" + (f" % {self.size_of(i)}" if d else "")
            lines.append(f"{self.lv[i]} = {value}")
            stride = f"{stride} * {self.size_of(i)}"
        slot, count = n.local("slot"), n.local("count")
        group = ""
        gstride = ""
        for i in reversed(p.class_axes[:-2]):
            term = self.lv[i] + (f" * {gstride}" if gstride else "")
            group = term if not group else f"{term} + {group}"
            gstride = self.size_of(i) if not gstride else f"{gstride} * {self.size_of(i)}"
        row_block = f"{row_tile} // {rsub}" if rsub != 1 else row_tile
        self.row_block = f"({row_block})" if rsub != 1 else row_block
        lines.append(f"{slot} = " + (f"({group}) * {self.blocks(p.query)} + {row_block}" if group else row_block)
                     + "  # the row block's entry in the tables")
        n_cols = self.blocks(p.key)
        col_at = f"{slot} * {n_cols}"  # the row block's first entry in `cols`
        if part:
            chunk, start = n.local("chunk"), n.local("start")
            col_at = n.local("col_at")
            lines += [f"{count} = {tables[2]}[{slot}]  # the row block's non-empty key blocks",
                      "# This CTA's part of them (flash decoding: the parts are merged by their rows' logsumexps; a part",
                      "# past the row block's blocks walks none: its rows' logsumexps are minus infinity, weight 0).",
                      f"{chunk} = ({count} + splits - 1) // splits",
                      f"{start} = {part} * {chunk}",
                      # Once, not an offset per step (that cost 8 spilled bytes at d = 128).
                      f"{col_at} = {slot} * {n_cols} + {start}  # the part's first entry in `cols`",
                      f"{count} = jnp.maximum(jnp.minimum({count} - {start}, {chunk}), 0)  # key blocks (a walk's steps: {ksub} each)"]
        else:
            lines.append(f"{count} = {tables[2]}[{slot}]  # the non-empty key blocks (a walk's steps: {ksub} each)")
        firsts = self.origin_lines(n, origins, lines)

        # Scalars (operands read with lead indices only), read once.
        scalars = {}
        for o in ops:
            if o.layout == "scalar":
                var = n.local(f"{o.read.operand}_value")
                coords = ", ".join(self.lead_coord(o, s.index) for s in o.read.subs)
                lines.append(f"{var} = {o.ref}[{coords}]")
                scalars[read_key(o.read)] = var

        def at(o: GpuOperand, row: str) -> str:
            parts = []
            for i in self.dims(o):
                if self.fixed(o, i):
                    parts.append(self.lead_coord(o, i))
                elif i == p.query:
                    parts.append(f"pl.ds({row} * {rows}, {rows})")
                else:
                    parts.append(f"pl.ds(0, {self.tile[i]})")
            return ", ".join(parts)

        def block(o: GpuOperand, tkw: int) -> str:
            return py_tuple("None" if self.fixed(o, i) else str(tkw if i == p.key else tq * wgs if i == p.query else self.tile[i]) for i in self.dims(o))

        # The walk's scope, shared by the CTA's warpgroups: per consumer its query tile, its
        # per-row operands, its probabilities' tile and its outputs' tiles (indexed by `wg`).
        qo = m.operand("q")
        row_ops = [o for o in ops if o.layout == "rows"]
        pipe = [o for o in ops if o.role in ("k", "value") or (o.role == "extra" and o.layout in ("tile", "cols"))]
        products = [c for c in p.consumers if c.kind == "softmax_product"]
        value_dtypes = list(dict.fromkeys(k.operand(c.value.operand).dtype.jnp for c in products))
        probs_smem = {d: n.local("probs_smem") for d in value_dtypes}
        barrier = n.local("barrier")
        per = [str(wgs)] if ws else []  # the consumers' allocations side by side
        q_tile = py_tuple(per + [str(tq if i == p.query else self.tile[i]) for i in self.free(qo)])
        scoped = [f"{qo.smem}=plgpu.SMEM({q_tile}, {k.operand(qo.read.operand).dtype.jnp})"]
        scoped += [f"{o.smem}=plgpu.SMEM({py_tuple(per + [str(tq)])}, {k.operand(o.read.operand).dtype.jnp})" for o in row_ops]
        scoped += [f"{probs_smem[d]}=plgpu.SMEM({py_tuple(per + [str(tq), str(tk)])}, {d})" for d in value_dtypes]
        through_q = out_through_q(k, p, ops)
        out_smem = {}
        for c in p.consumers:
            out = k.operand(c.output)
            if c.output == through_q:
                out_smem[c.output] = qo.smem
                continue
            out_smem[c.output] = n.local(f"{c.output}_smem")
            shp = py_tuple(per + [str(tq), str(self.tile[self.e_of(c)])] if c.kind == "softmax_product" else per + [str(tq)])
            scoped.append(f"{out_smem[c.output]}=plgpu.SMEM({shp}, {out.dtype.jnp})")
        lse_smem = n.local("row_lse_smem") if lse_ref else None
        if lse_smem:
            scoped.append(f"{lse_smem}=plgpu.SMEM({py_tuple(per + [str(tq)])}, {F32})")
        # A partial step's checked product (`_checked_values`): per consumer a tile of 64 keys
        # of the values' columns and each product's row sums.
        scratch, probe_smem = {}, None
        if self.partial_conditions():
            for c in products:
                key = (k.operand(c.value.operand).dtype.jnp, self.scratch_width(c))
                if key not in scratch:
                    scratch[key] = n.local("values_scratch")
                    scoped.append(f"{scratch[key]}=plgpu.SMEM({py_tuple(per + [str(key[1]), str(SCRATCH_KEYS)])}, {key[0]})")
            probe_smem = n.local("probe_smem")
            scoped.append(f"{probe_smem}=plgpu.SMEM({py_tuple(per + [str(len(products)), str(tq)])}, {F32})")
        sync = None
        if self.partial_conditions() and ws:  # a barrier of every warpgroup: the consumers' sums read by all
            sync = n.local("verdicts")
            scoped.append(f"{sync}=plgpu.Barrier(num_arrivals={wgs + 1})")
        arrivals = 1 + len(row_ops)
        scoped.append(f"{barrier}=plgpu.Barrier(" + ", ".join(([f"num_arrivals={arrivals}"] if arrivals > 1 else [])
                                                                + ([f"num_barriers={wgs}"] if ws else [])) + ")")
        walk = n.local("_shared")
        scope_names = [s.split("=")[0] for s in scoped]
        checked = self.partial_conditions()  # a step may hold absent elements: its P . V is checked
        t = n.local("t")
        by_read = {read_key(o.read): o for o in ops}

        def walk_lines(tkw: int, mode: str) -> dict:
            """A walk of `tkw` keys a step: its tables' helpers, BlockSpecs and step function.
            `mode`: "plain" (a partial step's P . V over whole tiles, where an absent
            element's weight 0 meets its value) or "exact" (over the present elements alone:
            the walk taken again where a plain one's accumulator is not finite)."""
            ksub_w = tj // tkw
            defs = []
            key_block, key_tile = n.local("key_block"), n.local("key_tile")
            defs += ["", f"def {key_block}({t}):", f"    # The key block of step {t} (the row block's non-empty ones, in order)",
                     f"    return {tables[0]}[{col_at} + {t}" + (f" // {ksub_w}]" if ksub_w != 1 else "]"),
                     "", f"def {key_tile}({t}):", f"    # The {tkw} keys step {t} reads",
                     f"    return {key_block}({t}) * {ksub_w} + {t} % {ksub_w}" if ksub_w != 1 else f"    return {key_block}({t})"]
            maps = []
            for o in pipe:
                fn = n.local(f"_{o.read.operand}_tile")
                coords = []
                for i in self.dims(o):
                    coords.append(self.lead_coord(o, i) if self.fixed(o, i) else f"{key_tile}({t})" if i == p.key else row_tile if i == p.query else "0")
                defs += ["", f"def {fn}({t}):", f"    return ({', '.join(coords)},)"]
                maps.append(f"plgpu.BlockSpec({block(o, tkw)}, {fn})")
            step_def = []

            # The step, run by each consumer on its rows (the producer only copies).
            sn = n.scope()
            idx, carry = sn.local("idx"), sn.local("carry")
            step_fn = n.local("_key_step" if mode != "exact" else "_exact_step")
            m_prev, l_prev = sn.local("m_prev"), sn.local("l_prev")
            accs = {c.output: sn.local(f"{c.output}_acc") for c in products}
            sums = {c.output: sn.local(f"{c.output}_sum") for c in p.consumers if c.kind == "sum"}
            carried = [m_prev, l_prev] + list(accs.values()) + list(sums.values())
            step = [f"{', '.join(carried)} = {carry}", f"({t},) = {idx}"]
            if p.conditions or any(self.ragged(i) for i in (p.query, p.key)):
                kind = sn.local("kind")
                step.append(f"{kind} = {tables[1]}[{slot} * {n_cols} + {key_block}({t})]")
            else:
                kind = None
            q_mine = mine(qo.smem)
            qa = q_mine if self.free(qo) == [p.query, p.summed] else f"{q_mine}.T"
            ko = m.operand("k")
            klive = self.free(ko)
            kb = f"{ko.smem}.T" if klive == [p.key, p.summed] else ko.smem
            score_fn, acc_ref = sn.local("_score"), sn.local("acc_ref")
            s = sn.local("s")
            step += ["", f"def {score_fn}({acc_ref}):", f"    plgpu.wgmma({acc_ref}, {qa}, {kb})", f"    return {acc_ref}[...]", "",
                     f"{s} = pl.run_scoped({score_fn}, plgpu.ACC(({tq}, {tkw}), {F32}))"]
            if p.scale is not None:
                step.append(f"{s} = {s} * {p.scale!r}")
            shape = f"({tq}, {tkw})"
            qpos, kpos = sn.local(f"{p.query}_pos"), sn.local(f"{p.key}_pos")
            pos_lines = [f"{qpos} = lax.broadcasted_iota(jnp.int32, {shape}, 0) + jnp.full({shape}, {rows_at} * {rows}, jnp.int32)",
                         f"{kpos} = lax.broadcasted_iota(jnp.int32, {shape}, 1) + jnp.full({shape}, {key_tile}({t}) * {tkw}, jnp.int32)"]
            gpos = self.global_positions(sn, firsts, {p.query: qpos, p.key: kpos}, shape, pos_lines)

            def read(r) -> str:
                """An operand a term reads, as this consumer's tile."""
                o = by_read[read_key(r)]
                if o.layout == "tile":
                    # The CTA's tile spans every consumer's rows: this consumer's part.
                    return f"{o.smem}.at[pl.ds({wg} * {tq}, {tq})][...]" if ws else f"{o.smem}[...]"
                if o.layout == "rows":
                    return f"lax.broadcast_in_dim({mine(o.smem)}[...], {shape}, [0])"
                if o.layout == "cols":
                    return f"lax.broadcast_in_dim({o.smem}[...], {shape}, [1])"
                return f"jnp.full({shape}, {scalars[read_key(o.read)]}, {k.operand(o.read.operand).dtype.jnp})"

            terms = ScoreTerms(gpos, self.lv, lambda v: f"jnp.full({shape}, {v}, jnp.int32)", read, F32, self.m.conv.size_var, {p.score: s})
            uses_pos = any(t_.op == "index" and t_.name in (p.query, p.key) for _, term in p.chain for t_ in term.walk())
            if uses_pos:
                step += pos_lines
            step += terms.chain(p.chain, sn.local)
            pt = p.points[0]
            sv = terms.point(pt)
            conds = [terms.test(pt.condition)] if pt.condition is not None else []
            conds += [f"{pos} < {self.size_of(i)}" for i, pos in ((p.query, qpos), (p.key, kpos)) if self.ragged(i)]
            if conds:
                masked, x = sn.local("_masked"), sn.local("x")
                step += ["", f"def {masked}({x}):", "    # A partial block: the condition (and the ragged ends) evaluated; absent is minus infinity."]
                if not uses_pos:
                    step += ["    " + line for line in pos_lines]
                present = sn.local("present")
                cond = " & ".join(f"({c})" for c in conds) if len(conds) > 1 else conds[0]
                step += [f"    {present} = {cond}", f"    return jnp.where({present}, {x}, jnp.full({shape}, -jnp.inf, {F32}))", "",
                         "# A full block: every element present, the condition not evaluated.",
                         f"{sv} = lax.cond({kind} == _PARTIAL, {masked}, lambda {x}: {x}, {sv})"]
            row = f"({tq},)"
            m_new, m_safe, alpha, probs, l_new = (sn.local(x) for x in ("m_new", "m_safe", "alpha", "probs", "l_new"))
            step += [f"{m_new} = jnp.maximum({m_prev}, {sv}.max(axis=1))",
                     "# A row with nothing present yet keeps minus infinity; exp then gives zeros.",
                     f"{m_safe} = jnp.where({m_new} == jnp.full({row}, -jnp.inf, {F32}), jnp.full({row}, 0.0, {F32}), {m_new})",
                     f"{alpha} = jnp.exp({m_prev} - {m_safe})"]
            exp = f"jnp.exp({{}} - lax.broadcast_in_dim({m_safe}, {shape}, [0]))"
            if mode == "exact":
                # A partial step marks its absent elements' weights -0.0 (present ones are +0.0 or
                # more): the same product, and `_present_values` tells them from present weights
                # that round to 0.
                x = sn.local("x")
                step += [f"{probs} = lax.cond({kind} == _PARTIAL, lambda {x}: jnp.where({x} == jnp.full({shape}, -jnp.inf, {F32}), "
                         f"jnp.full({shape}, -0.0, {F32}), {exp.format(x)}), lambda {x}: {exp.format(x)}, {sv})"]
            else:
                step.append(f"{probs} = {exp.format(sv)}")
            step.append(f"{l_new} = {l_prev} * {alpha} + {probs}.sum(axis=1)")
            new = {m_prev: m_new, l_prev: l_new}
            stored_dtype = None

            def probs_of(vd: str) -> str:  # this consumer's probabilities' tile, its first `tkw` keys
                return mine(probs_smem[vd]) + (f".at[:, pl.ds(0, {tkw})]" if tkw != tk else "")

            for n_c, c in enumerate(products):
                vo = by_read[read_key(c.value)]
                vd = k.operand(c.value.operand).dtype.jnp
                e = self.e_of(c)
                if stored_dtype != vd:
                    step += [f"{probs_of(vd)}[...] = {probs}.astype({vd})", "plgpu.commit_smem()  # the probabilities, as WGMMA's A"]
                    stored_dtype = vd
                vlive = self.free(vo)
                vb = vo.smem if vlive == [p.key, e] else f"{vo.smem}.T"
                new_acc = sn.local(f"{c.output}_new")
                rescaled = f"{accs[c.output]} * lax.broadcast_in_dim({alpha}, ({tq}, {self.tile[e]}), [0])"
                plain = f"_mma_add({rescaled}, {probs_of(vd)}, {vb}, compiled)"
                if mode != "exact":
                    step.append(f"{new_acc} = {plain}  # acc * alpha + P . V")
                    new[accs[c.output]] = new_acc
                    continue
                scaled = sn.local(f"{c.output}_scaled")
                plain = f"_mma_add({scaled}, {probs_of(vd)}, {vb}, compiled)"
                step += [f"{scaled} = {rescaled}",
                         "# acc * alpha + P . V; on a partial step an absent element's weight (0) must not meet a NaN or Inf of"]
                # P read again by a later product of these values' dtype: written back after the codes.
                restore = ", restore=True" if any(k.operand(d.value.operand).dtype.jnp == vd for d in products[n_c + 1:]) else ""
                stored = f", stored={vo.smem}" if vb != vo.smem else ""  # the values lie columns by keys
                present_call = (f"_present_values({scaled}, {probs_of(vd)}, {vb}, {mine(scratch[(vd, self.scratch_width(c))])}, "
                                f"compiled{restore}{stored})")
                step += ["# its value: the product over the present elements alone (`_present_values`).",
                         f"{new_acc} = lax.cond({kind} == _PARTIAL, lambda: {present_call}, lambda: {plain})"]
                new[accs[c.output]] = new_acc
            for c in p.consumers:
                if c.kind == "sum":
                    new_sum = sn.local(f"{c.output}_new")
                    step.append(f"{new_sum} = {sums[c.output]} + jnp.where({sv} == jnp.full({shape}, -jnp.inf, {F32}), "
                                f"jnp.full({shape}, 0.0, {F32}), {sv}).sum(axis=1)")
                    new[sums[c.output]] = new_sum
            step.append(f"return {', '.join(new[x] for x in carried)}")
            pipe_smems = [o.smem for o in pipe]
            step_def += [f"def {step_fn}({', '.join([idx] + pipe_smems + [carry])}):"] + ["    " + line for line in step]
            return {"defs": defs, "step": step_def, "maps": maps, "fn": step_fn, "count": f"{count} * {ksub_w}" if ksub_w != 1 else count}

        first = walk_lines(tk, "plain")
        # Where the walk's accumulator holds a NaN or Inf in its first row (an absent element's
        # weight 0 met one in a value, which then reaches every row; or a present term holds one),
        # the row block is walked again, 64 keys a step (the exact product beside 128 keys'
        # scores spilled registers), partial steps over the present elements alone.
        exact = walk_lines(SCRATCH_KEYS, "exact") if checked else None
        lines += first["defs"] + (exact["defs"] if exact else [])
        body = ["", *first["step"]] + (["", *exact["step"]] if exact else [])
        sums = [c.output for c in p.consumers if c.kind == "sum"]

        # A consumer: its tiles copied once, the walk (the pipeline's steps), its outputs.
        cn = n.scope()
        consumer, over_keys = n.local("_consumer"), cn.local("over_keys")
        def head(ref: str) -> str:
            """The stored rows of a padded tile (its first `rows`)."""
            return f"{ref}.at[pl.ds(0, {rows})]" if padded else ref

        cons = []
        if padded:
            cons += [f"# The rows past the block's {rows} (WGMMA's M is {tq}) are zeros, never stored: each output row",
                     "# depends only on its own score row.",
                     f"{qo.smem}[...] = jnp.zeros({q_tile}, "
                     f"{k.operand(qo.read.operand).dtype.jnp})"]
            cons += [f"{o.smem}[...] = jnp.zeros(({tq},), {k.operand(o.read.operand).dtype.jnp})" for o in row_ops]
            cons.append("plgpu.commit_smem()  # before the copies into their first rows")
        cons += [f"plgpu.copy_gmem_to_smem({o.ref}.at[{at(o, rows_at)}], {head(mine(o.smem))}, {mine(barrier)})" for o in [qo] + row_ops]
        cons.append(f"plgpu.barrier_wait({mine(barrier)})")
        row = f"({tq},)"
        init = [f"jnp.full({row}, -jnp.inf, {F32})", f"jnp.zeros({row}, {F32})"]
        init += [f"jnp.zeros(({tq}, {self.tile[self.e_of(c)]}), {F32})" for c in products]
        init += [f"jnp.zeros({row}, {F32})" for _ in sums]
        results = [cn.local("m"), cn.local("l")] + [cn.local(f"{c.output}_acc") for c in products] + [cn.local(f"{c}_sum") for c in sums]
        exactly = cn.local("exactly")
        cons.append(f"{', '.join(results)} = {over_keys}(({', '.join(init)}))")
        if checked:
            # A NaN or Inf an absent element's weight met in a partial step reached every row of its
            # product and stays: the first row's sums decide (finite data pay them once a walk).
            cons.append(f"if not {exactly}:")
            probe = "{}.sum(axis=1)"
            if self.ragged(p.query):
                # A row past the end is never stored: its sums (0 x a NaN of a present key's
                # value, its rows seeing nothing) must not send the row block round again.
                stored = cn.local("stored")
                cons.append(f"    {stored} = lax.broadcasted_iota(jnp.int32, {row}, 0) + jnp.full({row}, {rows_at} * {rows}, "
                            f"jnp.int32) < jnp.full({row}, {self.size_of(p.query)}, jnp.int32)")
                probe = f"jnp.where({stored}, {{}}.sum(axis=1), jnp.zeros({row}, {F32}))"
            cons += [f"    {probe_smem}.at[{wg + ', ' if ws else ''}{n_c}][...] = {probe.format(res)}"
                     for n_c, res in enumerate(results[2:2 + len(products)])]
            if not ws:
                met = cn.local("met")
                cons += ["    plgpu.commit_smem()",
                         f"    {met} = " + " | ".join(f"_not_finite({probe_smem}[{n_c}, 0])" for n_c in range(len(products))),
                         "    # The row block walked again, its partial steps over the present elements alone.",
                         f"    {', '.join(results)} = lax.cond({met}, lambda: {over_keys}(({', '.join(init)}), exact=True), "
                         f"lambda: ({', '.join(results)},))"]
        mm, ll = results[0], results[1]
        res_acc = dict(zip([c.output for c in products], results[2:2 + len(products)]))
        res_sum = dict(zip(list(sums), results[2 + len(products):]))
        safe = cn.local("l_safe")
        empty = f"{ll} == jnp.full({row}, 0.0, {F32})"
        cons.append(f"{safe} = jnp.where({empty}, jnp.full({row}, 1.0, {F32}), {ll})  # a row with nothing present: outputs 0")
        finals = {}
        for c in p.consumers:
            var = cn.local(c.output)
            if c.kind == "softmax_product":
                e = self.tile[self.e_of(c)]
                value = f"{res_acc[c.output]} / lax.broadcast_in_dim({safe}, ({tq}, {e}), [0])"
                if c.scale is not None:
                    value += f" * {c.scale!r}"
            elif c.kind == "logsumexp":
                value = row_lse(mm, ll, safe, row)
            elif c.kind == "max":
                value = mm
            else:
                value = res_sum[c.output]
            cons.append(f"{var} = {value}")
            finals[c.output] = var
        copies = []
        for c in p.consumers:
            out = k.operand(c.output)
            target = self.k.statement_of(c.output).target
            parts = [part] if part else []
            for i in target.indices:
                parts.append(self.lv[i] if i in p.lead else f"pl.ds({rows_at} * {rows}, {rows})" if i == p.query else f"pl.ds(0, {self.tile[i]})")
            copies.append((out_smem[c.output], f"{finals[c.output]}.astype({out.dtype.jnp})", f"{out_refs[c.output]}.at[{', '.join(parts)}]"))
        if lse_ref:
            var = cn.local("row_lse")
            why = "the part's weight in the merge" if part else "kept for the gradients"
            cons.append(f"{var} = {row_lse(mm, ll, safe, row)}  # {why}")
            parts = ([part] if part else []) + [self.lv[i] for i in p.lead] + [f"pl.ds({rows_at} * {rows}, {rows})"]
            copies.append((lse_smem, var, f"{lse_ref}.at[{', '.join(parts)}]"))
        if through_q:
            cons.append(f"# '{through_q}' through the query tile: the walk has read it for the last time.")
        cons += [f"{mine(sm)}[...] = {value}" for sm, value, _ in copies]
        cons.append("plgpu.commit_smem()")
        cons += [f"plgpu.copy_smem_to_gmem({head(mine(sm))}, {dst})" for sm, _, dst in copies]
        cons.append("plgpu.wait_smem_to_gmem(0, wait_read_only=True)")
        body += ["", f"def {consumer}({over_keys}" + (f", {exactly}=False" if checked else "") + "):",
                 f"    # A consumer warpgroup's {rows} rows: its query tile, the walk (`{over_keys}` runs the pipeline's steps), its outputs."]
        body += ["    " + line for line in cons]
        if ws:
            def pipeline(walk: dict, context: str) -> list[str]:
                return ["plgpu.emit_pipeline_warp_specialized(", f"    {walk['fn']},", f"    grid=({walk['count']},),",
                        "    in_specs=[" + ", ".join(walk["maps"]) + "],", f"    max_concurrent_steps={STAGES},",
                        f"    memory_registers={MEMORY_REGISTERS},  # the producer's; the consumers take the rest (setmaxnreg)",
                        '    wg_axis="wg",', f"    num_compute_wgs={wgs},", f"    compute_context={context},",
                        f")({', '.join(o.ref for o in pipe)})"]
            body += [""] + pipeline(first, consumer)
            if checked:
                # A consumer's partial step met a NaN or Inf at an absent element: every warpgroup
                # reads the consumers' verdicts, and the CTA walks its rows again, exact.
                verdicts = " | ".join(f"_not_finite({probe_smem}[{w}, {n_c}, 0])" for w in range(wgs) for n_c in range(len(products)))
                body += ["plgpu.commit_smem()", f"plgpu.barrier_arrive({sync})", f"plgpu.barrier_wait({sync})", "",
                         f"@pl.when({verdicts})", "def _again():"]
                body += ["    " + line for line in pipeline(exact, f"functools.partial({consumer}, {exactly}=True)")]
        else:
            # One warpgroup copies and computes: a 64-row block gives a CTA one consumer only,
            # and a warp-specialized CTA claims the whole register file (one CTA an SM).
            pn = n.scope()
            driver, init_carry = n.local("_over_keys"), pn.local("carry")

            def pipeline(walk: dict) -> list[str]:
                return ["plgpu.emit_pipeline(", f"    {walk['fn']},", f"    grid=({walk['count']},),",
                        "    in_specs=[" + ", ".join(walk["maps"]) + "],", f"    max_concurrent_steps={STAGES},",
                        f"    init_carry={init_carry},", f")({', '.join(o.ref for o in pipe)})"]
            if checked:
                body += ["", f"def {driver}({init_carry}, exact=False):", "    if exact:"]
                body += ["        " + ("return " if i == 0 else "") + line for i, line in enumerate(pipeline(exact))]
                body += ["    " + ("return " if i == 0 else "") + line for i, line in enumerate(pipeline(first))]
            else:
                body += ["", f"def {driver}({init_carry}):"] + ["    " + ("return " if i == 0 else "") + line for i, line in enumerate(pipeline(first))]
            body += ["", f"{consumer}({driver})"]
        lines += ["", f"@functools.partial(pl.run_scoped, {', '.join(scoped)}" + (', collective_axes="wg")' if ws else ")"),
                  f"def {walk}({', '.join(scope_names)}):"]
        lines += ["    " + line for line in body]
        self.n_tiles = n_tiles
        return params, lines, ([self.origins] if origins else []) + [self.host_array(o) for o in ops]

    def origin_lines(self, n, origins: str | None, lines: list[str]) -> dict[str, str]:
        """A kernel's first global positions of its rows and keys (read from `origins`, where
        a condition or the chain compares positions): index -> its variable."""
        if origins is None:
            return {}
        p = self.p
        read = self.positions_read()
        firsts = {i: n.local(f"{i}_origin") for i in read}
        what = " and ".join({p.query: "rows", p.key: "keys"}[i] for i in read)
        lines.append(", ".join(firsts.values()) + " = " + ", ".join(f"{origins}[{(p.query, p.key).index(i)}]" for i in read)
                     + f"  # the first global position{'s' if len(read) > 1 else ''} of the {what} given")
        return firsts

    def positions_read(self) -> list[str]:
        """The indices (of the rows and the keys) whose positions a condition or the chain
        compares: only these are made global (a position no term reads would be a local
        assigned and never read)."""
        p = self.p
        terms = [term for _, term in p.chain] + list(p.conditions)
        named = {t.name for term in terms for t in term.walk() if t.op == "index"}
        return [i for i in (p.query, p.key) if i in named]

    def global_positions(self, scope, firsts: dict[str, str], local: dict[str, str], shape: str, pos_lines: list[str]) -> dict[str, str]:
        """The positions a condition or the chain compares (global: the local ones plus the
        first positions, added to `pos_lines`); the ragged ends compare the local ones."""
        out = dict(local)
        for index, first in firsts.items():
            out[index] = scope.local(f"{index}_at")
            pos_lines.append(f"{out[index]} = {local[index]} + jnp.full({shape}, {first}, jnp.int32)")
        return out

    # ------------------------------------------------------------------ backward
    def backward_glue(self, declared: list[str], row_lse: str, cot: dict[str, str]) -> dict:
        """`_run_backward`'s lines (per row: delta = rowsum(dO * O) minus the logsumexp's
        cotangent), `_backward`'s arguments, and each argument's gradient from the kernels'
        (`h // n` reads sum their group, a lead index the operand lacks sums away)."""
        p, k, conv = self.p, self.k, self.m.conv
        out_var = dict(zip([o.name for o in k.outputs], declared))
        delta = self.n.local("delta")
        parts = [f"jnp.sum({cot[c.output]}.astype({F32}) * {out_var[c.output]}.astype({F32}), axis=-1)"
                 for c in p.consumers if c.kind == "softmax_product"]
        parts += [f"-{cot[c.output]}.astype({F32})" for c in p.consumers if c.kind == "logsumexp"]
        lines = [f"{delta} = " + (" + ".join(parts) if parts else f"jnp.zeros({row_lse}.shape[:-1] + ({self.size_of(p.query)},), {F32})")]
        products = [c for c in p.consumers if c.kind == "softmax_product"]
        sums = [c for c in p.consumers if c.kind == "sum"]
        args = list(conv.impl_args) + [cot[c.output] for c in products] + [row_lse, delta] + [cot[c.output] for c in sums]
        vectors = {"lse": row_lse, "delta": delta}
        vectors.update({f"dsum:{c.output}": f"{cot[c.output]}.astype({F32})" for c in sums})
        return {"lines": lines, "args": args, "vectors": vectors, "cot": cot, "grads": {}, "returns": [], "made": {}}

    def made_once(self, arrays: list[str], made: dict[str, str]) -> tuple[list[str], list[str]]:
        """The backward kernels' arrays, each made once in `_backward` (`made`: expression ->
        its variable, across both kernels): a pad, cast or swap that dq's kernel and dk/dv's
        read alike (q, k, v, the cotangents, the logsumexps and delta to a multiple of 8 rows)
        is one array, not two. Returns the arrays as the call passes them and the lines
        that make the new ones."""
        out, lines, first = [], [], not made
        for x in arrays:
            if x.isidentifier():
                out.append(x)
                continue
            if x not in made:
                inner = re.search(r"(?<=\()[A-Za-z_]\w*(?=[,)])", x) or re.match(r"[A-Za-z_]\w*", x)
                made[x] = self.n.local(f"{inner.group(0)}_{'rows' if x.startswith('_pad_to(') else 'in'}")
                lines.append(f"{made[x]} = {x}")
            out.append(made[x])
        if first and lines:
            lines.insert(0, "# Each array the kernels read made once (a pad to a multiple of 8 rows, a cast, a swap): dq's and dk/dv's alike.")
        return out, lines

    def backward_call(self, bk, fn: str, glue: dict) -> dict:
        """One backward kernel's call in `_backward`: its tables, arrays, outputs and the gradients it adds."""
        p, k = self.p, self.k
        self.b_tiles = getattr(self, "b_tiles", {})
        params, lines = self.backward_kernel(bk)
        along = p.query if bk.which == "dq" else p.key
        arrays, before = self.made_once(([self.origins] if self.positions else [])
                                        + [self.b_host(a, glue["cot"], glue["vectors"]) for a in bk.arrays], glue["made"])
        outs, finish, results = [], [], []
        letters = {i.name: chr(97 + n) for n, i in enumerate(k.indices)}
        reads = {"dq": p.q, "dk": p.k}
        reads.update({f"dv:{c.value.operand}": c.value for c in p.consumers if c.kind == "softmax_product"})
        for name, over, dtype in bk.outs:
            var = self.n.local(f"{name.replace(':', '_')}_full")
            # Stored by TMA at its own size (to a multiple of 8: `clipped`), which drops the
            # rows (keys) past the end.
            rows = self.clipped(along) if self.ragged(along) else None
            shape = [self.size_of(i) for i in p.lead] + [rows or self.size_of(along), self.size_of(over[1])]
            outs.append((var, py_tuple(shape), dtype))
            if rows is not None:
                finish.append(f"{var} = {var}[..., :{self.size_of(along)}, :]  # the {'rows' if along == p.query else 'keys'} "
                              "past the end (to a multiple of 8) dropped")
            results.append(var)
            read = reads[name]
            src = "".join(letters[i] for i in p.lead + over)
            dst = "".join(letters[s.index] for s in read.subs)
            divided = py_tuple(f'("{letters[s.index]}", {s.divisor})' for s in read.subs if s.divisor != 1)
            glue["grads"].setdefault(read.operand, []).append(f'_to_operand({var}, "{src}", "{dst}", {divided})')
        glue["returns"] = []
        for a in self.m.conv.impl_args:
            param = next((q for q in self.m.conv.params if q.internal == a), None)
            op = k.operand(param.operand) if param is not None else None
            if op is not None and op.name in glue["grads"]:
                glue["returns"].append(f"({' + '.join(glue['grads'][op.name])}).astype({op.dtype.jnp})")
            else:
                glue["returns"].append("None")
        grid = " * ".join([self.size_of(i) for i in p.lead] + [f"({self.b_tiles[bk.which]})"])
        wgs = bk.warpgroups
        cta = f"{64 * wgs} {'rows' if bk.which == 'dq' else 'keys'}" + (f" ({wgs} consumer warpgroups of 64 and a producer)" if wgs > 1 else "")
        about = (f"dq over the rows walk: a CTA per {cta}, its row block's non-empty key blocks" if bk.which == "dq" else
                 f"dk and dv over the transposed classification: a CTA per {cta}, its key block's non-empty row blocks")
        return {"kernel_fn": fn, "params": params, "lines": lines, "before": before, "arrays": arrays, "outs": outs, "finish": finish,
                "results": results, "grid": grid, "transposed": bk.which == "dkv", "about": about, "warpgroups": wgs}

    # ------------------------------------------------------------------ module
    def module(self, source_name: str) -> str:
        m, k, p, conv = self.m, self.k, self.p, self.m.conv
        self.size_vars = [s.internal for s in conv.sizes]
        classify_fn, classify_reads, classify_lines = self.classify()
        self.classify_fn, self.classify_reads = classify_fn, classify_reads
        data = p.data_dependent
        xp = "jnp" if data else "np"
        kernel_fn = self.n.function("_attention_kernel")
        bfns = {"dq": self.n.function("_attention_dq_kernel"), "dkv": self.n.function("_attention_dkv_kernel")} if m.backward else {}
        params, lines, arrays = self.kernel_lines()
        kinds_var = self.n.local("block_kinds")
        outs = []
        finish = []
        for c in p.consumers:
            out = k.operand(c.output)
            target = k.statement_of(c.output).target
            # Stored by TMA, which drops the rows past the array's end: at the size itself, to
            # a multiple of 8 (`clipped`; an output is the score's lead indices, the rows and
            # a softmax product's columns, in that order: its rows are never the minor of a tile).
            rows = self.clipped(p.query) if self.ragged(p.query) else None
            shape = [rows if i == p.query and rows is not None else self.size_of(i) for i in target.indices]
            var = self.n.local(c.output)
            outs.append((var, py_tuple((["splits"] if m.splits else []) + shape), out.dtype.jnp))
            if rows is not None:
                cut = ", ".join(f":{self.size_of(i)}" if i == p.query else ":" for i in target.indices)
                finish.append(f"{var} = {var}[{cut}]  # the rows past the end (to a multiple of 8) dropped")
        declared = [dict((c.output, v) for c, (v, _, _) in zip(p.consumers, outs))[o.name] for o in k.outputs]
        if m.splits:
            # Flash decoding: each key part's outputs and its rows' logsumexps, merged.
            split_lse = self.n.local("row_lse")
            rows = self.clipped(p.query) if self.ragged(p.query) else None
            merges = []
            for c, (var, _, _) in zip(p.consumers, list(outs)):
                target = k.statement_of(c.output).target
                if c.kind == "softmax_product":
                    value = f"_merge_splits({var}, {split_lse}, {list(target.indices).index(self.e_of(c))})"
                elif c.kind == "logsumexp":
                    value = f"_split_lse({split_lse}).astype({var}.dtype)"
                elif c.kind == "max":
                    value = f"{var}.max(axis=0)"
                else:
                    value = f"{var}.astype({F32}).sum(axis=0).astype({var}.dtype)"
                merges.append(f"{var} = {value} if splits > 1 else {var}[0]")
            outs.append((split_lse, py_tuple(["splits"] + [self.size_of(i) for i in p.lead] + [rows or self.size_of(p.query)]), F32))
            finish = merges + finish
        if m.backward:
            row_lse = self.n.local("row_lse")
            rows = self.clipped(p.query) if self.ragged(p.query) else None
            outs.append((row_lse, py_tuple([self.size_of(i) for i in p.lead] + [rows or self.size_of(p.query)]), F32))
            if rows is not None:
                # Cut too (the backward takes it at its own size): laid out as the outputs'
                # rows, as `sharded`'s ring merges it with them.
                finish.append(f"{row_lse} = {row_lse}[..., :{self.size_of(p.query)}]  # the rows past the end (to a multiple of 8) dropped")
        grid = " * ".join([self.size_of(i) for i in p.lead] + [f"({self.n_tiles})"])
        ksub = self.tile[p.key] // m.tk
        steps = self.blocks(p.key) + (f" * {ksub}" if ksub != 1 else "")  # the most steps a row block walks
        reference_lines = self.reference_lines()
        doc, call_doc = self.wrapper.docstrings(
            "a Pallas Mosaic GPU kernel (Hopper: TMA, WGMMA)",
            ["    interpret: False compiles for the GPU; True runs the Mosaic GPU interpreter",
             "        on the CPU (or pass plgpu.InterpretGPUParams(...))."],
            "Bad shapes and dtypes raise a ValueError naming the argument and dimension.",
            describe_gpu_attention(m), m.target.name)
        args = list(conv.impl_args)
        arg_of = {q.operand: args.index(q.internal) for q in conv.params if q.internal in args}
        outputs = [o.name for o in k.outputs]
        cotangents = [self.n.local(f"g_{o.name}") for o in k.outputs]
        partials = [f"({arg_of[op]}, {outputs.index(o)})" for op in m.backward.grads for o in m.backward.outputs] if m.backward else []
        tables = vjp_tables(["# The gradients the backward computes: (argument, output whose cotangent carries it)."], partials,
                            m.refused, arg_of.__getitem__, outputs)
        calls_b = []
        if m.backward:
            backward = self.backward_glue(declared, row_lse, dict(zip(outputs, cotangents)))
            for bk in (m.backward.dq, m.backward.dkv):
                calls_b.append(self.backward_call(bk, bfns[bk.which], backward))
            glue = Glue(args=args, statics=["sizes", "interpret"], tables=tables, n_outputs=len(k.outputs), cotangents=cotangents,
                        residuals_about=["The residuals: the arguments, the outputs and each row's logsumexp, with which",
                                         "arguments are differentiated."],
                        residuals=args + declared + [row_lse], derived=True, bargs=backward["args"],
                        partials=[v for c in calls_b for v in c["results"]], returns=backward["returns"], prelude=backward["lines"],
                        wanted=False, kept=declared + [row_lse], declared=declared, zeros=True, keywords=self.shard_keywords)
        else:
            glue = Glue(args=args, statics=["sizes", "interpret"], tables=tables, n_outputs=len(k.outputs), cotangents=cotangents,
                        residuals_about=["No backward is lowered: the residuals are the arguments."], derived=False,
                        keywords=self.shard_keywords)
        # `sharded`'s plan, a ring where mesh.py allows one (the kernels take first positions;
        # the ring merges by the rows' logsumexp, which `_impl` returns where a backward is).
        ring = len(conv.impl_args) == len(conv.params)
        if ring and m.backward is None:
            ring = ("merges partial results by the rows' logsumexp, which this module keeps only with its backward, and "
                    f"its backward is not lowered ({m.backward_error})")
        mesh = mesh_plan(k, conv, self.wrapper.spans, ring=ring)
        by_output = {c.output: c for c in p.consumers}
        kinds_lines = self.kinds_call(kinds_var, classify_fn, classify_reads, xp, data)
        text = self.wrapper.module(
            "gpu/attention.py.j2", source_name, m.target.name, doc, call_doc, glue,
            # A block spans the summed index and the values' columns: the tile is their size.
            self.wrapper.prepare_lines(self.wrapper.whole_checks([o.read for o in m.operands], p.inner, self.tile)), reference_lines,
            classify_fn=classify_fn, classify_params=classify_reads, classify_lines=classify_lines,
            kernel_fn=kernel_fn, kernel_params=params, kernel_lines=lines, arrays=arrays, outs=outs, finish=finish, grid=grid,
            kinds_var=kinds_var, tables_var=self.n.local("tables"), xp=xp, data=data, class_axes=list(p.class_axes),
            results=glue.kept if glue.derived else declared, backward_calls=calls_b, mesh=mesh,
            ring_tables=self.ring_tables(glue, mesh.ring, "chunk, interpret", [by_output[o.name] for o in k.outputs],
                                         ("_gpu_interpret(interpret) is not None", "the Mosaic GPU interpreter")),
            positions=self.positions, shard_keywords=self.shard_keywords, kinds_lines=kinds_lines,
            warpgroups=m.warpgroups, rows=m.rows, splits=m.splits, sms=m.target.sms, steps=steps,
        )
        return format_module(text, names=(m.name,))


def emit_gpu_attention(m: GpuAttentionModule, source_name: str) -> str:
    return GpuAttentionEmitter(m).module(source_name)
