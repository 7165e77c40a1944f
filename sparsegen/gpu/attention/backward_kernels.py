"""The GPU backward's kernels as lines of Python (a mixin of the emitter, whose names, tiles
and sizes they use): dq over the rows walk, dk and dv over the transposed classification
(backward.py decides what each reads). Both recompute the scores per step as the forward
does (a WGMMA, the chain, the condition on partial blocks only), then p = exp(s - lse),
ds = p * (dp - delta) through the chain's derivative (jax.vjp of the elementwise steps),
each gradient product a WGMMA from shared memory into a scoped accumulator, added to the
carried sums; the epilogue writes each gradient's tile through shared memory.
"""

from __future__ import annotations

from ...pytext import py_tuple
from ...schedule.attention import read_key
from ...terms import ScoreTerms
from .backward import MEMORY_REGISTERS, STAGES, TB, BArray, BKernel

F32 = "jnp.float32"


def _out_stem(name: str) -> str:
    """A gradient output's name stem ("dv:v" -> "dv_v")."""
    return name.replace(":", "_")


class BackwardWriter:
    """dq and dk/dv kernels (a mixin of GpuAttentionEmitter)."""

    # ------------------------------------------------------------- arrays
    def b_dims(self, a: BArray) -> list[str]:
        """Every index of the array the kernel receives, in order (lead indices included)."""
        p = self.p
        if a.source == "read":
            idx = [s.index for s in a.read.subs]
        elif a.source == "cotangent":
            idx = list(self.k.statement_of(a.output).target.indices)
        else:
            idx = list(p.lead) + [p.query]
        if a.swapped:
            x, y = [d for d, i in enumerate(idx) if i in a.dims]
            idx[x], idx[y] = idx[y], idx[x]
        return idx

    def b_host(self, a: BArray, cotangents: dict[str, str], vectors: dict[str, str]) -> str:
        """The array a backward kernel receives: cast (a cotangent to its values' dtype), its
        tile dimensions swapped; its ragged rows and keys as they are where TMA reads them
        past the end as zeros (as the forward's, `clips`: q, k, a value, a cotangent tile
        along a dimension other than their minor, the per-row vectors along their last; to
        a multiple of 8 only), else padded with zeros to whole blocks (a swapped copy, the
        condition's operands)."""
        p = self.p
        if a.source == "read":
            x, idx = self.keyed(a.read) or self.m.conv.param(a.read.operand).internal, [s.index for s in a.read.subs]
        elif a.source == "cotangent":
            x, idx = cotangents[a.output], list(self.k.statement_of(a.output).target.indices)
        else:
            x, idx = vectors[a.key], list(p.lead) + [p.query]
        divided = {s.index for s in a.read.subs if s.divisor != 1} if a.read is not None else set()
        ragged = [d for d, i in enumerate(idx) if i in (p.query, p.key) and self.ragged(i) and i not in divided]
        if a.swapped:
            clip = False
        elif a.source in ("lse", "delta", "dsum"):
            clip = True  # a vector along the rows: its last dimension
        else:
            tiles = a.source == "cotangent" or a.key in ("q", "k") or a.key.startswith("v:")
            clip = tiles and len(ragged) == 1 and ragged[0] < len(idx) - 1
        pads = [f"(0, -{self.size_of(idx[d])} % {self.tile[idx[d]]})" if d in ragged and not clip else "(0, 0)" for d in range(len(idx))]
        if any(pad != "(0, 0)" for pad in pads):
            x = f"jnp.pad({x}, {py_tuple(pads)})"
        for d in ragged if clip else ():
            rows = self.clipped(idx[d])
            if rows is not None:
                x = f"_pad_to({x}, {d}, {rows})"
        if a.source == "cotangent" and self.k.operand(a.output).dtype.jnp != a.dtype:
            x = f"{x}.astype({a.dtype})"
        if a.swapped:
            d0, d1 = [d for d, i in enumerate(idx) if i in a.dims]
            x = f"jnp.swapaxes({x}, {d0}, {d1})"
        return x

    def b_lead(self, a: BArray, index: str) -> str:
        d = next((s.divisor for s in a.read.subs if s.index == index), 1) if a.read is not None else 1
        return self.lv[index] if d == 1 else f"{self.lv[index]} // {d}"

    def b_array(self, bk: BKernel, key: str, fallback: str) -> BArray:
        """The array `key` (a second orientation, f32 only), else `fallback` (16-bit: one serves both)."""
        return next((a for a in bk.arrays if a.key == key), None) or bk.array(fallback)

    def has_chain(self) -> bool:
        """Are there elementwise steps between the product and the reduced scores?"""
        return self.p.points[0].local != self.p.score

    # ------------------------------------------------------------- kernels
    def backward_kernel(self, bk: BKernel):
        """(params, lines, arrays passed, outputs (var, shape, dtype), lines after the call)
        of the dq kernel (`bk.which == "dq"`) or the dk/dv one."""
        p, k = self.p, self.k
        dq = bk.which == "dq"
        n = self.n.scope()
        along, other = (p.query, p.key) if dq else (p.key, p.query)
        wgs = bk.warpgroups
        ws = wgs > 1  # warp-specialized: `wgs` consumers of TB rows (keys) and a producer
        csub, ssub = self.tile[along] // (TB * wgs), self.tile[other] // TB
        tables = [n.local("cols"), n.local("kinds"), n.local("counts")]
        refs = {a.key: n.local(f"{a.name}_gmem") for a in bk.arrays}
        smems = {a.key: n.local(f"{a.name}_smem") for a in bk.arrays}
        out_refs = {name: n.local(f"{_out_stem(name)}_gmem") for name, _, _ in bk.outs}
        origins = n.local("origins_gmem") if self.positions else None
        params = tables + ([origins] if origins else []) + [refs[a.key] for a in bk.arrays] + [out_refs[name] for name, _, _ in bk.outs]
        lines = []
        if self.size_vars:
            lines.append(f"{', '.join(self.size_vars)}{',' if len(self.size_vars) == 1 else ''} = sizes")
        cell, cta = n.local("cell"), n.local("row_tile" if dq else "key_tile")
        n_tiles = f"{self.blocks(along)} * {csub}" if csub != 1 else self.blocks(along)
        lines.append(f'{cell} = lax.axis_index("cell")')
        what_along = "rows" if dq else "keys"
        lines.append(f"{cta} = {cell} % ({n_tiles})  # the CTA's {TB * wgs} {what_along}")
        wg, tile_at = (n.local("wg"), n.local(f"{what_along}_at")) if ws else (None, cta)
        if ws:
            lines.append(f"# The warpgroup: 0 and 1 consumers ({TB} {what_along} each), {wgs} the producer (TMA copies only)")
            lines.append(f'{wg} = lax.axis_index("wg")')
            lines.append(f"{tile_at} = {cta} * {wgs} + {wg}  # a consumer's {what_along}, in tiles of {TB}")

        def mine(ref: str) -> str:
            """A consumer's part of a shared-memory allocation (each consumer has its own)."""
            return f"{ref}.at[{wg}]" if ws else ref
        self.lv = {i: n.local(i) for i in p.lead}
        stride = n_tiles
        for d in reversed(range(len(p.lead))):
            i = p.lead[d]
            lines.append(f"{self.lv[i]} = {cell} // ({stride})" + (f" % {self.size_of(i)}" if d else ""))
            stride = f"{stride} * {self.size_of(i)}"
        slot, count = n.local("slot"), n.local("count")
        group, gstride = "", ""
        for i in reversed(p.class_axes[:-2]):
            term = self.lv[i] + (f" * {gstride}" if gstride else "")
            group = term if not group else f"{term} + {group}"
            gstride = self.size_of(i) if not gstride else f"{gstride} * {self.size_of(i)}"
        block = f"{cta} // {csub}" if csub != 1 else cta
        what = "row block's" if dq else "key block's (the transposed tables)"
        lines.append(f"{slot} = " + (f"({group}) * {self.blocks(along)} + {block}" if group else block) + f"  # the {what} entry in the tables")
        lines.append(f"{count} = {tables[2]}[{slot}]" + (f" * {ssub}" if ssub != 1 else "")
                     + f"  # pipeline steps: {ssub} per non-empty {'key' if dq else 'row'} block")
        n_other = self.blocks(other)
        firsts = self.origin_lines(n, origins, lines)

        scalars = {}
        for a in bk.arrays:
            if a.layout == "scalar":
                var = n.local(f"{a.name}_value")
                lines.append(f"{var} = {refs[a.key]}[{', '.join(self.b_lead(a, s.index) for s in a.read.subs)}]")
                scalars[read_key(a.read)] = var

        def at(a: BArray) -> str:
            parts = []
            for i in self.b_dims(a):
                parts.append(self.b_lead(a, i) if i in p.lead else f"pl.ds({tile_at} * {TB}, {TB})" if i == along else f"pl.ds(0, {self.tile[i]})")
            return ", ".join(parts)

        def tile_shape(a: BArray) -> list[str]:
            return ([str(wgs)] if ws else []) + [str(TB if i in (p.query, p.key) else self.tile[i]) for i in self.b_dims(a) if i not in p.lead]

        scoped_arrays = [a for a in bk.arrays if a.scoped and a.layout != "scalar"]
        pipe = [a for a in bk.arrays if not a.scoped]
        scratch = {}
        scoped = [f"{smems[a.key]}=plgpu.SMEM({py_tuple(tile_shape(a))}, {a.dtype})" for a in scoped_arrays]
        q_dtype, k_dtype = k.operand(p.q.operand).dtype.jnp, k.operand(p.k.operand).dtype.jnp
        products = [c for c in p.consumers if c.kind == "softmax_product"]
        probs_dtypes = list(dict.fromkeys(k.operand(c.value.operand).dtype.jnp for c in products))
        square = f"({wgs}, {TB}, {TB})" if ws else f"({TB}, {TB})"
        scratch["ds"] = n.local("ds_smem")
        scoped.append(f"{scratch['ds']}=plgpu.SMEM({square}, {k_dtype if dq else q_dtype})")
        if not dq:
            for d in probs_dtypes:
                scratch[d] = n.local("probs_smem")
                scoped.append(f"{scratch[d]}=plgpu.SMEM({square}, {d})")
        # Warp-specialized, each gradient's epilogue tile is in the walk's scope (a consumer
        # cannot allocate alone): a copied-once array's (read for the last time) or its own.
        through = dict(bk.through)
        out_tiles = {}
        for name, over, dtype in bk.outs if ws else ():
            if through[name] is not None:
                out_tiles[name] = smems[through[name]]
            else:
                out_tiles[name] = n.local(f"{_out_stem(name)}_smem")
                scoped.append(f"{out_tiles[name]}=plgpu.SMEM(({wgs}, {TB}, {self.tile[over[1]]}), {dtype})")
        barrier = n.local("barrier")
        arrivals = len(scoped_arrays)
        scoped.append(f"{barrier}=plgpu.Barrier(" + ", ".join(([f"num_arrivals={arrivals}"] if arrivals > 1 else [])
                                                                + ([f"num_barriers={wgs}"] if ws else [])) + ")")
        scope_names = [s.split("=")[0] for s in scoped]
        copies_in = [f"plgpu.copy_gmem_to_smem({refs[a.key]}.at[{at(a)}], {mine(smems[a.key])}, {mine(barrier)})" for a in scoped_arrays]
        copies_in.append(f"plgpu.barrier_wait({mine(barrier)})")
        body = [] if ws else copies_in
        vec = {}  # a per-row or per-key vector copied once: its value (warp-specialized: read from the consumer's tile)
        for a in scoped_arrays:
            if a.layout in ("rows", "cols"):
                if ws:
                    vec[a.key] = f"{mine(smems[a.key])}[...]"
                    continue
                var = n.local(f"{a.name}_{'rows' if a.layout == 'rows' else 'keys'}")
                body.append(f"{var} = {smems[a.key]}[...]")
                vec[a.key] = var
        blk, stile, t = n.local("row_block" if not dq else "key_block"), n.local("step_tile"), n.local("t")
        body += ["", f"def {blk}({t}):", f"    # The {'key' if dq else 'row'} block of step {t} (the non-empty ones, in order)",
                 f"    return {tables[0]}[{slot} * {n_other} + {t}" + (f" // {ssub}]" if ssub != 1 else "]"),
                 "", f"def {stile}({t}):", f"    # The {TB} {'keys' if dq else 'rows'} step {t} reads",
                 f"    return {blk}({t}) * {ssub} + {t} % {ssub}" if ssub != 1 else f"    return {blk}({t})"]
        maps = []
        for a in pipe:
            fn = n.local(f"_{a.name}_tile")
            coords = [self.b_lead(a, i) if i in p.lead else f"{stile}({t})" if i == other else cta if i == along else "0" for i in self.b_dims(a)]
            body += ["", f"def {fn}({t}):", f"    return ({', '.join(coords)},)"]
            block_shape = py_tuple("None" if i in p.lead else str(TB * wgs if i == along else TB if i == other else self.tile[i])
                                   for i in self.b_dims(a))
            maps.append(f"plgpu.BlockSpec({block_shape}, {fn})")

        # ------------------------------------------------------------ the step
        sn = n.scope()
        idx, carry = sn.local("idx"), sn.local("carry")
        shape = f"({TB}, {TB})"
        row_vec = f"({TB},)"
        qpos, kpos = sn.local(f"{p.query}_pos"), sn.local(f"{p.key}_pos")
        # Scores are rows x keys in dq, keys x rows in dk/dv: an index's axis in the tile.
        qaxis, kaxis = (0, 1) if dq else (1, 0)
        qstart = f"{tile_at} * {TB}" if dq else f"{stile}({t}) * {TB}"
        kstart = f"{stile}({t}) * {TB}" if dq else f"{tile_at} * {TB}"
        pos_lines = [f"{qpos} = lax.broadcasted_iota(jnp.int32, {shape}, {qaxis}) + jnp.full({shape}, {qstart}, jnp.int32)",
                     f"{kpos} = lax.broadcasted_iota(jnp.int32, {shape}, {kaxis}) + jnp.full({shape}, {kstart}, jnp.int32)"]
        gpos = self.global_positions(sn, firsts, {p.query: qpos, p.key: kpos}, shape, pos_lines)
        by_read = {read_key(a.read): a for a in bk.arrays if a.source == "read" and a.key != "k_t" and a.key != "q_t"}

        def vector(a: BArray) -> str:
            """A per-row or per-key vector broadcast over the tile."""
            axis = qaxis if a.layout == "rows" else kaxis
            value = vec[a.key] if a.scoped else f"{smems[a.key]}[...]"
            return f"lax.broadcast_in_dim({value}, {shape}, [{axis}])"

        def read(r) -> str:
            a = by_read[read_key(r)]
            if a.layout == "tile" and ws and along in a.dims:
                # The pipeline's tile spans the CTA's rows (keys): this consumer's part.
                assert a.dims[0] == along and not a.scoped, a
                return f"{smems[a.key]}.at[pl.ds({wg} * {TB}, {TB})][...]"
            if a.layout == "tile":
                return f"{mine(smems[a.key]) if a.scoped else smems[a.key]}[...]"
            if a.layout in ("rows", "cols"):
                return vector(a)
            return f"jnp.full({shape}, {scalars[read_key(a.read)]}, {a.dtype})"

        def tile_of(a: BArray) -> str:
            return mine(smems[a.key]) if a.scoped else smems[a.key]

        def mma_a(a: BArray, m_: str, k_: str) -> str:
            """WGMMA's A (m, k) from an array's shared-memory tile."""
            return tile_of(a) if a.dims == (m_, k_) else f"{tile_of(a)}.T"

        def mma_b(a: BArray, k_: str, n_: str) -> str:
            """WGMMA's B (k, n) from an array's shared-memory tile (K-major: (n, k) read transposed)."""
            return tile_of(a) if a.dims == (k_, n_) else f"{tile_of(a)}.T"

        def product(a_expr: str, b_expr: str, cols: int, name: str) -> tuple[list[str], str]:
            fn, ref = sn.local(f"_{name}"), sn.local("acc_ref")
            return ["", f"def {fn}({ref}):", f"    plgpu.wgmma({ref}, {a_expr}, {b_expr})", f"    return {ref}[...]", ""], \
                f"pl.run_scoped({fn}, plgpu.ACC(({TB}, {cols}), {F32}))"

        accs = [sn.local(f"{_out_stem(name)}_acc") for name, _, _ in bk.outs]
        step = [f"{', '.join(accs)}{',' if len(accs) == 1 else ''} = {carry}", f"({t},) = {idx}"]
        kind = None
        if p.conditions or any(self.ragged(i) for i in (p.query, p.key)):
            kind = sn.local("kind")
            step.append(f"{kind} = {tables[1]}[{slot} * {n_other} + {blk}({t})]")
        qa, ka = bk.array("q"), bk.array("k")
        raw = sn.local("raw") if self.has_chain() else sn.local("s")
        lines_s, call = product(mma_a(qa, p.query, p.summed), mma_b(ka, p.summed, p.key), TB, "score") if dq else \
            product(mma_a(ka, p.key, p.summed), mma_b(qa, p.summed, p.query), TB, "score")
        step += lines_s + [f"{raw} = {call}" + (f" * {p.scale!r}" if p.scale is not None else "")]
        uses_pos = any(t_.op == "index" and t_.name in (p.query, p.key) for _, term in p.chain for t_ in term.walk())
        if uses_pos:
            step += pos_lines
        terms = ScoreTerms(gpos, self.lv, lambda v: f"jnp.full({shape}, {v}, jnp.int32)", read, F32, self.m.conv.size_var, {p.score: raw})
        pt = p.points[0]
        if self.has_chain():
            chain, arg = sn.local("_chain"), sn.local(p.score)
            terms.values = {p.score: arg}  # inside the chain's function, its argument
            step += ["", f"def {chain}({arg}):", "    # The elementwise steps after the product: their derivative is jax.vjp's."]
            step += terms.chain(p.chain, sn.local, "    ")
            step += [f"    return {terms.point(pt)}", ""]
            s, pull = sn.local("s"), sn.local("pull")
            step.append(f"{s}, {pull} = jax.vjp({chain}, {raw})")
        else:
            s = raw
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
                     f"{s} = lax.cond({kind} == _PARTIAL, {masked}, lambda {x}: {x}, {s})"]

        def row_stat(key: str) -> str:
            if dq:
                return f"lax.broadcast_in_dim({vec[key]}, {shape}, [0])"
            return f"lax.broadcast_in_dim({smems[key]}[...], {shape}, [1])"

        lse, probs, dprobs, ds = (sn.local(x) for x in ("lse", "probs", "dprobs", "ds"))
        lse_value = vec["lse"] if dq else f"{smems['lse']}[...]"
        step += [f"{lse} = jnp.where({lse_value} == jnp.full({row_vec}, -jnp.inf, {F32}), jnp.full({row_vec}, 0.0, {F32}), {lse_value})"
                 "  # a row with nothing present",
                 f"{probs} = jnp.exp({s} - lax.broadcast_in_dim({lse}, {shape}, [{qaxis}]))  # absent elements: exp(-inf) = 0"]
        if not dq:  # p^T stored at once (for dv), as each values' dtype
            for vd in dict.fromkeys(k.operand(c.value.operand).dtype.jnp for c in products):
                step.append(f"{mine(scratch[vd])}[...] = {probs}.astype({vd})")
        terms = []
        for c in products:
            da, va = bk.array(f"do:{c.output}"), bk.array(f"v:{c.value.operand}")
            e = self.e_of(c)
            if dq:  # dp = dO . V^T: rows x keys
                extra, call = product(mma_a(da, p.query, e), mma_b(va, e, p.key), TB, f"d{c.output}_product")
            else:  # dp^T = V . dO^T: keys x rows
                extra, call = product(mma_a(va, p.key, e), mma_b(da, e, p.query), TB, f"d{c.output}_product")
            step += extra
            terms.append(call + (f" * {c.scale!r}" if c.scale is not None else ""))
        delta = row_stat("delta")
        if terms:
            step.append(f"{dprobs} = " + " + ".join(terms))
            if not dq and len(probs_dtypes) == 1 and probs_dtypes[0] != F32:
                # Warp-specialized dk/dv: p read back from its 16-bit tile (ds goes to WGMMA as
                # 16 bits too), so the f32 p is not live beside dk, dv and the dO.V^T product.
                weight = sn.local("p")
                step.append(f"{weight} = {mine(scratch[probs_dtypes[0]])}[...].astype({F32})  # p as dv's WGMMA reads it")
            else:
                weight = probs
            if conds and not self.has_chain():
                # An absent element's weight is 0, but a NaN or Inf of its value (in dO . V^T) must
                # not reach ds there (0 x NaN): selected, not multiplied (a weight rounded to 0
                # passes no gradient either). With a chain, ds is selected after its derivative.
                step.append(f"{ds} = jnp.where({weight} == jnp.full({shape}, 0.0, {F32}), jnp.full({shape}, 0.0, {F32}), "
                            f"{weight} * ({dprobs} - {delta}))")
            else:
                step.append(f"{ds} = {weight} * ({dprobs} - {delta})")
        else:
            step.append(f"{ds} = -{probs} * {delta}")
        for c in p.consumers:
            if c.kind == "sum":
                step.append(f"{ds} = {ds} + jnp.where({s} == jnp.full({shape}, -jnp.inf, {F32}), jnp.full({shape}, 0.0, {F32}), "
                            f"{row_stat(f'dsum:{c.output}')})  # a sum's cotangent, where present")
        if self.has_chain():
            step.append(f"({ds},) = {pull}({ds})")
            step.append(f"{ds} = jnp.where({s} == jnp.full({shape}, -jnp.inf, {F32}), jnp.full({shape}, 0.0, {F32}), {ds})  # absent: no gradient")
        new = {}
        out_acc = dict(zip([name for name, _, _ in bk.outs], accs))
        if dq:
            kt = self.b_array(bk, "k_t", "k")
            step += [f"{mine(scratch['ds'])}[...] = {ds}.astype({k_dtype})", "plgpu.commit_smem()  # ds, as WGMMA's A"]
            new["dq"] = sn.local("dq_new")
            step.append(f"{new['dq']} = _mma_add({out_acc['dq']}, {mine(scratch['ds'])}, {mma_b(kt, p.key, p.summed)}, compiled)  # dq += ds . K")
        else:
            # ds^T to shared memory before the products: then only the accumulators are live
            # while they run (at d = e = 128 the carried dk and dv take 128 registers a thread).
            step += [f"{mine(scratch['ds'])}[...] = {ds}.astype({q_dtype})", "plgpu.commit_smem()  # p^T and ds^T, as WGMMA's A"]
            for value in dict.fromkeys(c.value.operand for c in products):
                vd = k.operand(value).dtype.jnp
                var = out_acc[f"dv:{value}"]
                for c in products:  # every product of these values adds p^T . dO
                    if c.value.operand != value:
                        continue
                    db = self.b_array(bk, f"do_t:{c.output}", f"do:{c.output}")
                    mb = mma_b(db, p.query, self.e_of(c))
                    new_var = sn.local(f"dv_{value}_new")
                    if c.scale is None:
                        step.append(f"{new_var} = _mma_add({var}, {mine(scratch[vd])}, {mb}, compiled)  # dv += p^T . dO")
                    else:  # the product's scale: on a fresh accumulator
                        extra, call = product(mine(scratch[vd]), mb, self.tile[self.e_of(c)], f"dv_{c.output}_product")
                        step += extra + [f"{new_var} = {var} + {call} * {c.scale!r}"]
                    var = new_var
                new[f"dv:{value}"] = var
            qt = self.b_array(bk, "q_t", "q")
            new["dk"] = sn.local("dk_new")
            step.append(f"{new['dk']} = _mma_add({out_acc['dk']}, {mine(scratch['ds'])}, {mma_b(qt, p.query, p.summed)}, compiled)  # dk += ds^T . Q")
        step.append(f"return {', '.join(new[name] for name, _, _ in bk.outs)}{',' if len(bk.outs) == 1 else ''}")
        step_fn = n.local("_row_step" if not dq else "_key_step")
        body += ["", f"def {step_fn}({', '.join([idx] + [smems[a.key] for a in pipe] + [carry])}):"] + ["    " + line for line in step]
        init = [f"jnp.zeros(({TB}, {self.tile[over[1]]}), {F32})" for _, over, _ in bk.outs]
        walk = n.local("_over_keys" if dq else "_over_rows")
        results = [n.local(_out_stem(name)) for name, _, _ in bk.outs]
        scale_lines = []
        if p.scale is not None:
            score_outs = {"dq"} if dq else {"dk"}
            for (name, _, _), var in zip(bk.outs, results):
                if name in score_outs:
                    scale_lines.append(f"{var} = {var} * {p.scale!r}  # the score's scale, once per tile")

        def dst(name: str, over) -> str:
            parts = [self.lv[i] for i in p.lead] + [f"pl.ds({tile_at} * {TB}, {TB})", f"pl.ds(0, {self.tile[over[1]]})"]
            return f"{out_refs[name]}.at[{', '.join(parts)}]"

        if ws:
            # A consumer: its tiles copied once, the walk (the pipeline's steps), its gradients
            # through its epilogue tiles.
            cn = n.scope()
            consumer, over = n.local("_consumer"), cn.local("over")
            cons = copies_in + [f"{', '.join(results)}{',' if len(results) == 1 else ''} = {over}(({', '.join(init)}{',' if len(init) == 1 else ''}))"]
            cons += scale_lines
            cons += [f"{mine(out_tiles[name])}[...] = {var}.astype({dtype})" for (name, _, dtype), var in zip(bk.outs, results)]
            cons.append("plgpu.commit_smem()")
            cons += [f"plgpu.copy_smem_to_gmem({mine(out_tiles[name])}, {dst(name, o)})" for name, o, _ in bk.outs]
            cons.append("plgpu.wait_smem_to_gmem(0, wait_read_only=True)")
            body += ["", f"def {consumer}({over}):",
                     f"    # A consumer warpgroup's {TB} {what_along}: its tiles, the walk (`{over}` runs the pipeline's steps), its gradients."]
            body += ["    " + line for line in cons]
            body += ["", "plgpu.emit_pipeline_warp_specialized(", f"    {step_fn},", f"    grid=({count},),",
                     "    in_specs=[" + ", ".join(maps) + "],", f"    max_concurrent_steps={STAGES},",
                     f"    memory_registers={MEMORY_REGISTERS},  # the producer's; the consumers take the rest (setmaxnreg)",
                     '    wg_axis="wg",', f"    num_compute_wgs={wgs},", f"    compute_context={consumer},",
                     f")({', '.join(refs[a.key] for a in pipe)})"]
            lines += ["", f"@functools.partial(pl.run_scoped, {', '.join(scoped)}, collective_axes=\"wg\")", f"def {walk}({', '.join(scope_names)}):"]
            lines += ["    " + line for line in body]
            self.b_tiles[bk.which] = n_tiles
            return params, lines
        body += ["", "return plgpu.emit_pipeline(", f"    {step_fn},", f"    grid=({count},),", "    in_specs=[" + ", ".join(maps) + "],",
                 f"    max_concurrent_steps={STAGES},", f"    init_carry=({', '.join(init)}{',' if len(init) == 1 else ''}),",
                 f")({', '.join(refs[a.key] for a in pipe)})"]
        lines += ["", f"@functools.partial(pl.run_scoped, {', '.join(scoped)})", f"def {walk}({', '.join(scope_names)}):"]
        lines += ["    " + line for line in body]
        lines += ["", f"{', '.join(results)}{',' if len(results) == 1 else ''} = {walk}"]
        lines += scale_lines
        # The epilogue: each gradient's tile through shared memory.
        store = n.local("_store")
        out_scoped, copies = [], []
        for (name, over, dtype), var in zip(bk.outs, results):
            sm = n.local(f"{_out_stem(name)}_smem")
            out_scoped.append(f"{sm}=plgpu.SMEM(({TB}, {self.tile[over[1]]}), {dtype})")
            copies.append((sm, f"{var}.astype({dtype})", dst(name, over)))
        lines += ["", f"@functools.partial(pl.run_scoped, {', '.join(out_scoped)})", f"def {store}({', '.join(c[0] for c in copies)}):"]
        lines += [f"    {sm}[...] = {value}" for sm, value, _ in copies]
        lines.append("    plgpu.commit_smem()")
        lines += [f"    plgpu.copy_smem_to_gmem({sm}, {dst_})" for sm, _, dst_ in copies]
        lines.append("    plgpu.wait_smem_to_gmem(0, wait_read_only=True)")
        self.b_tiles[bk.which] = n_tiles
        return params, lines
