"""The wrapper of a generated module, the same for every target: argument checks (`_prepare`),
`reference` in plain jax.numpy, the docstring's calling convention, the custom_vjp glue
(`Glue`), and the rendering of the skeleton every module's template extends
(`templates/module.py.j2`).

Only validated identifiers and numbers from the spec reach the output: names come from
the IR or the module's name tables, the spec is re-printed from the IR.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from .callconv import Convention
from .dtypes import after_sum_dtype
from .expr import render
from .ir import Einsum, Kernel
from .mesh import MeshPlan, mesh_plan
from .pytext import py_tuple
from .templating import environment, with_helpers


def spec_text(kernel: Kernel, name: str | None = None, tiles: dict[str, int] | None = None) -> str:
    """A kernel's spec, re-printed from the IR (identifiers and numbers only), optionally
    renamed and retiled (how `variants` derives its specs)."""
    k = kernel
    tiles = {i.name: i.tile for i in k.indices} | (tiles or {})
    lines = [f"kernel {name or k.name} {{"]
    for op in k.operands:
        lines.append(f"    {'in ' if op.direction == 'in' else 'out'} {op.decl}")
    for st in k.statements:
        lines.append(f"    {st.text}")
    lines.append("    tile " + ", ".join(f"{i.name} = {tiles[i.name]}" for i in k.indices))
    lines.append(f"    accumulate {k.accumulate.name}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def host(e) -> str:
    return render(e, "host")


def _condition_only(k: Kernel) -> list:
    """The operands that conditions read and nothing else does (no factor, value or table)."""
    conds, others = set(), set()
    for st in k.statements:
        cond = getattr(st, "condition", None)
        in_cond = cond.reads if cond is not None else ()
        conds |= {r.operand for r in in_cond}
        reads = [*st.reads, *(r for r in (getattr(st, x, None) for x in ("arg", "scores", "value")) if hasattr(r, "subs"))]
        for r in reads:
            if r not in in_cond:
                others.add(r.operand)
            others |= {sub.table.operand for sub in r.subs if sub.table is not None}
            others |= {sub.offset.operand for sub in r.subs if sub.offset is not None}
    return [op for op in k.operands if op.name in conds - others and op.direction == "in"]


class Wrapper:
    def __init__(self, kernel: Kernel, conv: Convention, spans=(), size_table: str = "size", names=None):
        self.k = kernel
        self.conv = conv
        self.spans = spans  # (operand, dim, tile): tiles that must span a symbolic dimension
        self.size = size_table
        self.names = names  # the module's names: `reference`'s locals avoid them

    # ---------------------------------------------------------------- _prepare
    def prepare_lines(self, smem_checks: list[str]) -> list[str]:
        k, conv, size = self.k, self.conv, self.size
        lines = []
        keywords = ", ".join(f'"{s.symbol}": {s.internal}' for s in conv.sizes)
        fixed = ", ".join(f'"{s.symbol}": {s.literal}' for s in conv.sizes if s.literal is not None)
        if conv.sizes:
            lines.append(f"{size} = _sizes({{{keywords}}}, {{{fixed}}})")
        nb: dict[str, str] = {}
        for p in conv.params:
            op = k.operand(p.operand)
            name = p.internal
            if p.kind in ("dense", "mask"):
                # An `index` operand takes any integer dtype, as a table or offsets do.
                dtype = "None" if op.dtype.kind == "index" else "jnp.bool_" if op.dtype.kind == "bool" else op.dtype.jnp
                lines.append(f'{name} = _as_array("{p.public}", {name}, {op.rank}, {dtype})')
                if op.dtype.kind == "bool":
                    # A bool array (0 or 1 by construction) reaches the kernels as int8.
                    lines.append(f"{name} = {name}.astype({op.dtype.jnp})")
                for d, dim in enumerate(op.dims):
                    what = f"{p.public} dim {d}"
                    if dim.symbol is not None:
                        lines.append(f'_bind({size}, "{dim.symbol}", {name}.shape[{d}], "{what}")')
                    else:
                        lines.append(f'_check_dim({name}.shape[{d}], {dim.literal}, "{what}")')
            elif p.kind == "blocks":
                read = self.read_of(op.name)
                tiles = tuple(k.index(i).tile for i in read.indices)
                kept = [t for t in tiles if t != 1]
                if len(kept) == len(tiles):
                    lines.append(f'{name} = _as_array("{p.public}", {name}, {op.rank + 1}, {op.dtype.jnp})')
                else:
                    # Tile-1 dimensions are dropped from the stored blocks; given kept, they are squeezed.
                    lines.append(f'{name} = _as_blocks("{p.public}", {name}, {py_tuple(map(str, tiles))}, {op.dtype.jnp})')
                indices = [i for i, t in zip(read.indices, tiles) if t != 1]
                for d, (idx, tile) in enumerate(zip(indices, kept)):
                    lines.append(f'_check_dim({name}.shape[{d + 1}], {tile}, "{p.public} dim {d + 1} (the tile of {idx})")')
                nb[op.name] = f"{name}.shape[0]"
            elif p.kind in ("coords", "out_coords"):
                lines.append(f'{name} = _as_array("{p.public}", {name}, 1, None)')
                if op.name not in nb:
                    nb[op.name] = f"{name}.shape[0]"
                else:
                    first = next(q for q in conv.params if q.operand == p.operand and q.kind in ("blocks", "out_coords"))
                    lines.append(f'_check_dim({name}.shape[0], {nb[op.name]}, "{p.public} length (one per block of {first.public})")')
            elif p.kind == "table":
                lines.append(f'{name} = _as_array("{p.public}", {name}, {op.rank}, None)')
                for d, dim in enumerate(op.dims):
                    what = f"{p.public} dim {d}"
                    if dim.symbol is not None:
                        lines.append(f'_bind({size}, "{dim.symbol}", {name}.shape[{d}], "{what}")')
                    else:
                        lines.append(f'_check_dim({name}.shape[{d}], {dim.literal}, "{what}")')
            elif p.kind == "index":
                length = op.dims[0].literal
                lines.append(f'{name} = _as_array("{p.public}", {name}, 1, None)')
                lines.append(f'_check_dim({name}.shape[0], {length}, "{p.public} length")')
        # A u32 operand only conditions read is compared as int32, saturated (`_int32`): the
        # kernel, the classification and `reference` read the same values.
        for op in _condition_only(k):
            if op.dtype.kind == "uint" and op.dtype.bits == 32:
                name = conv.param(op.name).internal
                lines.append(f"{name} = _int32({name})")
        for rel in k.relations:
            big = k.index(rel.index).size
            small = rel.dim
            lines.append(f'_relate({size}, {_sym(big)}, {_sym(small)}, {rel.divisor}, "{rel.what}, read as {rel.index} // {rel.divisor}")')
        for s in conv.sizes:
            if s.keyword_only:
                lines.append(f'_need({size}, "{s.symbol}", "{s.carriers}")')
        if conv.sizes:
            targets = ", ".join(s.internal for s in conv.sizes)
            values = ", ".join(f'{size}["{s.symbol}"][0]' for s in conv.sizes)
            lines.append(f"{targets} = {values}")
        # A tile that breaks the layout rule on a symbolic dimension must span it.
        for operand, d, tile in self.spans:
            dim = k.operand(operand).dims[d]
            if dim.symbol is not None:
                lines.append(f'_check_span({conv.size_var(dim.symbol)}, {tile}, "{operand} dim {d} ({dim.symbol})")')
        # A condition's read at an index plus an integer (`lo[g + 1]`) lies inside its dimension.
        shifted = set()
        for st in k.statements:
            for r in (getattr(st, "condition", None).reads if getattr(st, "condition", None) is not None else ()):
                for d, sub in enumerate(r.subs):
                    dim = k.operand(r.operand).dims[d]
                    if sub.shift and (r.operand, d, sub.index, sub.shift) not in shifted:
                        shifted.add((r.operand, d, sub.index, sub.shift))
                        last = host(conv.size(k.index(sub.index).size) + sub.shift)
                        lines.append(f"if {last} > {host(conv.size(dim))}:")
                        lines.append(f'    _fail(f"{r.operand} dim {d} has {{{host(conv.size(dim))}}} entries, but {r.text} reads entry {{{last} - 1}}")')
        # Dimensions read at an offset are addressed in whole blocks.
        checked = set()
        for use in conv.offset_uses:
            dim = k.operand(use.operand).dims[use.dim]
            if dim.literal is None and (dim.symbol, use.tile) not in checked:
                checked.add((dim.symbol, use.tile))
                lines.append(f'_check_multiple({conv.size_var(dim.symbol)}, {use.tile}, "{use.what}, read in blocks at an offset")')
        for p in conv.params:
            if p.kind in ("coords", "out_coords"):
                op = k.operand(p.operand)
                idx = self.read_of(op.name).indices[p.dim]
                limit = host(conv.size(op.dims[p.dim]).cdiv(k.index(idx).tile))
                lines.append(f'{p.internal} = _check_coords("{p.public}", {p.internal}, {limit}, "{op.name} dim {p.dim}")')
        for operand, var in conv.pads:
            coords = [p for p in conv.params if p.operand == operand and p.kind in ("coords", "out_coords")]
            quoted = py_tuple(f'"{p.public}"' for p in coords)
            lines.append(f"{var} = _check_padding({quoted}, {py_tuple(p.internal for p in coords)})")
        if conv.offset_uses:
            by_param: dict[str, list] = {}
            for use in conv.offset_uses:
                by_param.setdefault(use.param, []).append(use)
            parts = []
            for param, uses in by_param.items():
                public = next(p.public for p in conv.params if p.internal == param)
                spec = ", ".join(f'({u.position}, {u.tile}, {host(u.max_start)}, "{u.what}")' for u in uses)
                parts.append(f'*_check_offsets("{public}", {param}, ({spec},))')
            lines.append(f"{conv.offsets} = jnp.stack([{', '.join(parts)}])")
        lines += smem_checks
        sizes = py_tuple(s.internal for s in conv.sizes)
        lines.append(f"return {', '.join(list(conv.impl_args) + [sizes])}")
        return lines

    def whole_checks(self, reads, inner, tile: dict[str, int]) -> list[str]:
        """`_prepare`'s checks that a dimension one block spans whole (a row walk's summed
        index, a value's free index: `inner`) is its tile, for each symbolic dimension of
        `reads` indexed by one; a literal one is checked when the spec is built."""
        checks = []
        for r in reads:
            op = self.k.operand(r.operand)
            for d, s in enumerate(r.subs):
                dim = op.dims[d]
                if s.index in inner and dim.symbol is not None:
                    line = f'_check_whole({self.conv.size_var(dim.symbol)}, {tile[s.index]}, "{op.name} dim {d} ({dim.symbol})")'
                    if line not in checks:
                        checks.append(line)
        return checks

    def read_of(self, operand: str):
        return next(r for st in self.k.statements for r in (st.target, *st.reads) if r.operand == operand)

    # --------------------------------------------------------------- reference
    def reference_lines(self, outputs: dict[str, str]) -> list[str]:
        """Each statement in plain jax.numpy, over dense views of its operands."""
        k, conv = self.k, self.conv
        acc = k.accumulate
        lines = []
        values: dict[str, str] = {}
        self.scope = self.names.scope() if self.names is not None else None
        for st in k.statements:
            out = k.operand(st.target.operand)
            var = outputs[out.name]
            precision = ", precision=lax.Precision.HIGHEST" if acc.is_float else ""
            letters = {i: "abcdefghijklmnopqrstuvwxyz"[n] for n, i in enumerate(st.indices)}
            sparse = next((n for n, r in enumerate(st.factors) if k.operand(r.operand).direction == "in"
                           and k.operand(r.operand).sparsity in ("coo", "mask")), None)
            by_blocks = sparse is not None and (k.operand(st.factors[sparse].operand).sparsity == "coo"
                                                or set(st.factors[sparse].indices) & set(st.summed))
            if by_blocks:
                # Skipping is by block: a block the sparse operand leaves out is never
                # multiplied (a NaN it would meet stays out), as in the kernel.
                lines += self.block_products(st, sparse, var, letters, outputs, precision)
            else:
                # Every factor in the accumulate dtype: exact for narrower data, and one dtype
                # for XLA's dot (its CPU backend lacks some mixed-dtype forms).
                after, wide = self.after_sum(st)
                views = [_widen(self.view(st, n, lines, outputs), k.operand(r.operand).dtype, wide if n in after else acc)
                         for n, r in enumerate(st.factors)]
                specs = ["".join(letters[i] for i in f.indices) for f in st.factors]
                if after and st.condition is None:
                    # An integer sum, then the float factors after it (language v3, section 1):
                    # the sum exact in the accumulator, converted once, then scaled.
                    inner = [n for n in range(len(st.factors)) if n not in after]
                    held = [i for i in st.out_indices if any(i in st.factors[n].indices for n in inner)]
                    total = self.local("total")
                    spec = ",".join(specs[n] for n in inner) + "->" + "".join(letters[i] for i in held)
                    lines.append(f'{total} = jnp.einsum("{spec}", {", ".join(views[n] for n in inner)}, preferred_element_type={acc.jnp})')
                    spec = ",".join(["".join(letters[i] for i in held)] + [specs[n] for n in after]) + "->" + "".join(letters[i] for i in st.out_indices)
                    lines.append(f'{var} = jnp.einsum("{spec}", {_widen(total, acc, wide)}, {", ".join(views[n] for n in after)}, '
                                 f"preferred_element_type={wide.jnp}, precision=lax.Precision.HIGHEST)")
                elif st.condition is not None:
                    lines += self.conditioned(st, var, views, specs, letters, precision)
                else:
                    spec = ",".join(specs) + "->" + "".join(letters[i] for i in st.out_indices)
                    lines.append(f'{var} = jnp.einsum("{spec}", {", ".join(views)}, preferred_element_type={acc.jnp}{precision})')
                if sparse is not None:
                    # A mask applied after the sum: its all-zero blocks are skipped, so what
                    # the sum gives there (NaN too) is not multiplied: zeros.
                    read = st.factors[sparse]
                    mask = self.view(st, sparse, lines, outputs)
                    tiles = py_tuple(str(k.index(i).tile) for i in read.indices)
                    src = "".join(letters[i] for i in read.indices)
                    dst = "".join(letters[i] for i in st.out_indices)
                    present = f"_present({mask} != 0, {tiles})"
                    if src != dst:
                        present = f'_expand({present}, "{src}", "{dst}")'
                    lines.append(f"{var} = jnp.where({present}, {var}, 0)")
            if st.scale is not None:
                lines.append(f"{var} = {var} * {_number(st.scale)}")
            if any(s.offset for s in st.target.subs):
                # Offsets on the left: the statement writes its window; the rest is zeros.
                starts = []
                for d, s in enumerate(st.target.subs):
                    if s.offset is None:
                        starts.append("0")
                    else:
                        slot = conv.offset_slot(out.name, out.name, d)
                        starts.append(f"{conv.offsets}[{slot}] * {k.index(s.index).tile}")
                shape = py_tuple(host(conv.size(d)) for d in out.dims)
                lines.append(f"{var} = lax.dynamic_update_slice(jnp.zeros({shape}, {acc.jnp}), {var}, {py_tuple(starts)})")
            if out.sparsity == "coo":
                # Gathered before the cast, so repeated blocks' gradients add up in f32.
                tiles = py_tuple(str(k.index(i).tile) for i in st.out_indices)
                coords = py_tuple(p.internal for p in conv.params if p.operand == out.name and p.kind == "out_coords")
                lines.append(f"{var} = _gather_blocks({var}, {coords}, {conv.pad(out.name)}, {tiles})")
            lines.append(f"{var} = {var}.astype({out.dtype.jnp})")
            values[out.name] = var
        result = [values[o.name] for o in k.outputs]
        lines.append(f"return {result[0]}" if len(result) == 1 else f"return {', '.join(result)}")
        return lines

    def after_sum(self, st: Einsum) -> tuple[tuple[int, ...], object]:
        """The positions of the factors after `st`'s sum (its end groups) and the dtype they
        meet the sum in, where that is not the accumulator's (`after_sum_dtype`: an integer sum
        meeting a float scale); no positions otherwise: every factor then joins one einsum."""
        acc = self.k.accumulate
        ends = tuple(m for g in st.end_groups for m in g.members) if st.summed else ()
        wide = after_sum_dtype(acc, tuple(self.k.operand(st.factors[m].operand).dtype for m in ends))
        return (ends, wide) if wide != acc else ((), acc)

    def local(self, preferred: str) -> str:
        return self.scope.local(preferred) if self.scope is not None else preferred

    def conditioned(self, st: Einsum, var: str, views: list[str], specs: list[str], letters: dict, precision: str) -> list[str]:
        """A statement with a condition on its terms: an absent term adds nothing, whatever
        any of its factors holds (language v3, section 0), selected out where the kernel
        selects it (`schedule.condition.selection`, so the two agree, NaN for NaN): the value
        written for a condition on the output's indices; the product kept along the summed
        indices the condition uses, selected, then summed; or one group of the sum that
        holds the indices it spans, with `_present_value` for the other."""
        from .schedule.condition import condition_indices, selection
        from .terms import as_read, render_term

        k, conv, acc = self.k, self.conv, self.k.accumulate
        used = condition_indices(st.condition)
        rule = selection(st, {i: k.index(i).tile for i in st.indices}, used)
        src = "".join(letters[i] for i in used)
        out = "".join(letters[i] for i in st.out_indices)
        pref = f"preferred_element_type={acc.jnp}{precision}"

        def leaf(t) -> str:
            if t.op == "size":
                return conv.size_var(t.name)
            if t.op == "index":
                shape = py_tuple("-1" if i == t.name else "1" for i in used)
                return f"jnp.arange({host(conv.size(k.index(t.name).size))}).reshape({shape})"
            value = conv.param(t.read.operand).internal
            dims = [host(conv.size(d)) for d in k.operand(t.read.operand).dims]
            value = as_read(value, t.read, dims, [host(conv.size(k.index(i).size)) for i in t.read.indices])
            here = "".join(letters[i] for i in t.read.indices)
            value = f'_expand({value}, "{here}", "{src}")' if here != src else value
            return f"({value} != 0)" if t.op == "truth" else value

        def along(value: str, have: str, dst: str) -> str:
            return f'_expand({value}, "{have}", "{dst}")' if have != dst else value

        present = self.local("present")
        lines = [f"{present} = {render_term(st.condition, leaf)}"]
        if rule.target == "flush":
            # Every term of an output element is present or none is: the sum, then selected.
            lines.append(f'{var} = jnp.einsum("{",".join(specs)}->{out}", {", ".join(views)}, {pref})')
            lines.append(f"{var} = jnp.where({along(present, src, out)}, {var}, 0)")
            return lines
        members = [n for g in st.summed_groups for n in g.members]
        if rule.target == "product":
            # Kept along the summed indices the condition uses: each element of the product
            # is then all present or all absent; selected, then summed.
            inner = out + "".join(letters[i] for i in used if i in st.summed)
            lines.append(f'{var} = jnp.einsum("{",".join(specs[n] for n in members)}->{inner}", {", ".join(views[n] for n in members)}, {pref})')
            lines.append(f"{var} = jnp.where({along(present, src, inner)}, {var}, 0)")
            if inner != out:
                lines.append(f"{var} = {var}.sum(axis={py_tuple(str(d) for d in range(len(out), len(inner)))})")
        else:
            # The group chosen has its absent terms selected out (extended along the
            # condition's other indices); the other is met by `_present_value`.
            values, gspecs, keeps = [], [], {}
            for g, grp in enumerate(st.summed_groups):
                spec = specs[grp.main]
                if grp.extras:
                    value = f'jnp.einsum("{",".join(specs[n] for n in grp.members)}->{spec}", {", ".join(views[n] for n in grp.members)}, {pref})'
                else:
                    value = views[grp.main]
                if g == rule.group:
                    dst = spec + "".join(c for c in src if c not in spec)
                    keeps[g] = along(present, src, dst)
                    value = f"jnp.where({keeps[g]}, {along(value, spec, dst)}, 0)"
                    spec = dst
                name = self.local(f"{var}_{g}")
                lines.append(f"{name} = {value}")
                values.append(name)
                gspecs.append(spec)
            contract = ",".join(gspecs) + "->" + out
            lines.append(f'{var} = jnp.einsum("{contract}", {", ".join(values)}, {pref})')
            if rule.exposed is not None and acc.is_float:
                # Where the other group holds a NaN or Inf, the sum over the present terms alone.
                chosen, exposed = rule.group, rule.exposed
                a, b = self.local("a"), self.local("b")
                params = {chosen: a, exposed: b}
                dot = f'jnp.einsum("{contract}", {", ".join(params[g] for g in range(len(values)))}, {pref})'
                alone = f"_present_dot(lambda {a}, {b}: {dot}, {values[chosen]}, {values[chosen]}, {keeps[chosen]}, {values[exposed]})"
                lines.append(f"{var} = _present_value({var}, {var}, lambda: {alone})")
        ends = [g.main for g in st.end_groups]
        if ends:
            # Factors with no summed index multiply the sum (as in the kernel, at the flush).
            lines.append(f'{var} = jnp.einsum("{",".join([out] + [specs[n] for n in ends])}->{out}", {var}, {", ".join(views[n] for n in ends)}, {pref})')
        return lines

    def block_products(self, st: Einsum, sparse: int, var: str, letters, outputs, precision) -> list[str]:
        """The statement as a sum of per-block products over the sparse operand's blocks (a
        coo input's stored blocks; a mask's blocks that are not all zero)."""
        k, conv, acc = self.k, self.conv, self.k.accumulate
        lines: list[str] = []
        read = st.factors[sparse]
        op = k.operand(read.operand)
        idx = read.indices
        tiles = {i: k.index(i).tile for i in idx}
        tile_text = py_tuple(str(tiles[i]) for i in idx)
        shape = py_tuple(host(conv.size(d)) for d in op.dims)
        blocks, coords = self.local(f"{op.name}_at"), self.local(f"{op.name}_coords")
        if op.sparsity == "coo":
            param, pad = conv.param(op.name, "blocks").internal, conv.pad(op.name)
            lines.append(f"{coords} = {py_tuple(p.internal for p in conv.params if p.operand == op.name and p.kind == 'coords')}")
            # What lies past the array's end in a partial last block is absent.
            full = ", ".join(str(tiles[i]) for i in idx)
            lines.append(f"{blocks} = _cut_blocks({param}.reshape(({param}.shape[0], {full})).astype({acc.jnp}), {coords}, {tile_text}, {shape})")
        else:
            pad = self.local(f"{op.name}_skip")
            mask = _widen(self.view(st, sparse, lines, outputs), op.dtype, acc)
            lines.append(f"{blocks}, {coords} = _blocks_of({mask}, {tile_text})")
            lines.append(f"{pad} = ~jnp.any({blocks} != 0, axis={py_tuple(str(d + 1) for d in range(len(idx)))})")
        # Block-local indices are upper case; the block number is a letter no index uses.
        local = {i: letters[i].upper() for i in idx}
        block = next(c for c in "ZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in local.values())

        def name_of(i):
            return local[i] if i in local else letters[i]

        operands, specs = [blocks], [block + "".join(local[i] for i in idx)]
        for n, r in enumerate(st.factors):
            if n == sparse:
                continue
            view = _widen(self.view(st, n, lines, outputs), k.operand(r.operand).dtype, acc)
            axes = [d for d, i in enumerate(r.indices) if i in local]
            if axes:
                picked = py_tuple(f"{coords}[{idx.index(r.indices[d])}]" for d in axes)
                view = f"_at_blocks({view}, {py_tuple(map(str, axes))}, {picked}, {py_tuple(str(tiles[r.indices[d]]) for d in axes)})"
            operands.append(view)
            specs.append((block if axes else "") + "".join(name_of(i) for i in r.indices))
        parts = self.local(f"{var}_parts")
        spec = ",".join(specs) + "->" + block + "".join(name_of(i) for i in st.out_indices)
        lines.append(f'{parts} = jnp.einsum("{spec}", {", ".join(operands)}, preferred_element_type={acc.jnp}{precision})')
        axes = [d for d, i in enumerate(st.out_indices) if i in local]
        out_shape = py_tuple(host(conv.size(k.index(i).size)) for i in st.out_indices)
        picked = py_tuple(f"{coords}[{idx.index(st.out_indices[d])}]" for d in axes)
        out_tiles = py_tuple(str(tiles[st.out_indices[d]]) for d in axes)
        lines.append(f"{var} = _add_blocks({parts}, {py_tuple(map(str, axes))}, {picked}, {pad}, {out_shape}, {out_tiles})")
        return lines

    def view(self, st: Einsum, n: int, lines: list[str], outputs: dict[str, str]) -> str:
        """A factor as a dense array over its indices' full ranges."""
        k, conv = self.k, self.conv
        read = st.factors[n]
        op = k.operand(read.operand)
        if op.direction == "out":
            return outputs[op.name]
        param = conv.param(op.name, "blocks" if op.sparsity == "coo" else None).internal
        if op.sparsity == "coo":
            coords = py_tuple(p.internal for p in conv.params if p.operand == op.name and p.kind == "coords")
            shape = py_tuple(host(conv.size(d)) for d in op.dims)
            tiles = py_tuple(str(k.index(i).tile) for i in read.indices)
            name = f"{param}_dense"
            lines.append(f"{name} = _densify({param}, {coords}, {conv.pad(op.name)}, {shape}, {tiles}, {k.accumulate.jnp})")
            return name
        value = param
        if any(s.offset for s in read.subs):
            starts, sizes = [], []
            for d, s in enumerate(read.subs):
                if s.offset is None:
                    starts.append("0")
                    sizes.append(host(conv.size(op.dims[d])))
                else:
                    slot = conv.offset_slot(st.target.operand, op.name, d)
                    starts.append(f"{conv.offsets}[{slot}] * {k.index(s.index).tile}")
                    sizes.append(host(conv.size(k.index(s.index).size)))
            value = f"lax.dynamic_slice({value}, {py_tuple(starts)}, {py_tuple(sizes)})"
        for d, s in enumerate(read.subs):
            if s.divisor != 1:
                # h // n: each element serves n consecutive values of h.
                value = f"jnp.repeat({value}, {s.divisor}, axis={d})"
        return value

    # --------------------------------------------------------------- docstring
    def signature(self) -> tuple[str, str]:
        """Parameter lists of the kernel function and of `reference`."""
        public = [p.public for p in self.conv.params]
        keywords = [f"{s.symbol}=None" for s in self.conv.sizes]
        kernel = ", ".join(public + ["*"] + keywords + ["interpret=False"])
        reference = ", ".join(public + (["*"] + keywords if keywords else []))
        return kernel, reference

    def returns(self) -> str:
        k = self.k
        parts = []
        for out in k.outputs:
            if out.sparsity == "coo":
                tiles = ", ".join(str(k.index(i).tile) for i in self.read_of(out.name).indices if k.index(i).tile != 1)
                parts.append(f"{out.name}: {out.dtype.name}[nb, {tiles}], one block per requested coordinate, in the order given")
            else:
                parts.append(f"{out.name}: {out.dtype.name}[{', '.join(d.text for d in out.dims)}]")
        return parts[0] if len(parts) == 1 else "a tuple (" + "; ".join(parts) + ")"

    def docstrings(self, what: str, extra_args: list[str], errors: str, plan: list[str], target: str,
                   signature: str | None = None) -> tuple[str, str]:
        """The generated module's docstring and its kernel function's, the same for every target:
        `what` the kernel ("a Pallas TPU kernel"), `extra_args` the target's argument lines after
        the inputs' (interpret, ...), `errors` what bad arguments raise, `plan` the target's plan
        lines, `signature` the call's parameters (default: `signature()`'s)."""
        k = self.k
        returns = self.returns()
        args = self.argument_lines() + extra_args
        spec = "\n".join("    " + line for line in spec_text(k).splitlines())
        plan_lines = "\n".join("    " + line for line in plan)
        doc = (
            f"{k.name}: {what} generated by sparsegen.\n\n"
            f"Spec:\n\n{spec}\n\n"
            f"Call:\n\n    {k.name}({self.signature()[0] if signature is None else signature})\n\n"
            "Arguments:\n\n" + "\n".join(args) + "\n\n"
            f"Returns:\n\n    {returns}\n\n"
            f"{errors}\n\n"
            f"Plan (target {target}):\n\n{plan_lines}\n"
        )
        call_doc = f"Run the kernel: {returns}.\n\n    Arguments are the inputs in declaration order (see the module docstring).\n    "
        return doc, call_doc

    def argument_lines(self) -> list[str]:
        args = []
        for p in self.conv.params:
            shape = f"{p.dtype}[{', '.join(p.shape)}]"
            args.append(f"    {p.public}: {shape}" + (f"  {p.about}" if p.about else ""))
        for s in self.conv.sizes:
            if s.literal is not None:
                args.append(f"    {s.symbol}: int, keyword, optional  (fixed to {s.literal} by the spec)")
            elif s.keyword_only:
                args.append(f"    {s.symbol}: int, keyword, required  (carried only by {s.carriers})")
            else:
                args.append(f"    {s.symbol}: int, keyword, optional  (taken from the arguments; must agree if given)")
        return args

    # ------------------------------------------------------------------ module
    def module(self, template: str, source_name: str, target: str, doc: str, call_doc: str, glue: "Glue",
               prepare_lines: list[str], reference_lines: list[str], keywords: tuple[str, ...] = (),
               mesh: MeshPlan | None = None, **context) -> str:
        """The module's text (before black): `template`, which extends `templates/module.py.j2`,
        rendered with the skeleton's context (header, `_prepare`, `_reference`, the public
        functions, `sharded`, `glue`) and the target's own `context`; the helpers it calls in
        place. `keywords`: the kernel function's keywords besides the sizes and `interpret`
        (`max_steps`), which `sharded` passes on."""
        k, conv = self.k, self.conv
        size_vars = [s.internal for s in conv.sizes]
        kernel_signature, reference_signature = self.signature()
        on_mesh = self.mesh_context(kernel_signature, keywords, mesh)
        main = environment().get_template(template).render(
            k=k,
            source=source_name.encode("unicode_escape").decode("ascii"),
            digest=k.digest,
            target=target,
            doc=doc,
            call_doc=call_doc,
            helpers="{helpers}",
            public_params=[p.internal for p in conv.params] + size_vars,
            public_args=[p.public for p in conv.params] + [s.symbol for s in conv.sizes],
            prepare_lines=prepare_lines,
            impl_args=list(conv.impl_args),
            size_vars=size_vars,
            reference_lines=reference_lines,
            kernel_signature=kernel_signature,
            reference_signature=reference_signature,
            glue=glue,
            on_mesh=on_mesh,
            **context,
        )
        return with_helpers(main)

    # ------------------------------------------------------------------ sharded
    def mesh_context(self, kernel_signature: str, keywords: tuple[str, ...], plan: MeshPlan | None = None) -> dict:
        """What `templates/module.py.j2` writes `sharded` and its tables from: the plan of
        `sparsegen/mesh.py` (`plan`: the emitter's, where it asked for a ring), as Python literals."""
        k, conv = self.k, self.conv
        plan = plan or mesh_plan(k, conv, self.spans)
        rules = []
        for r in plan.rules:
            value = f'("{r.how}", {py_tuple(f"{chr(34)}{s}{chr(34)}" for s in r.sizes)})' if r.how else f"(None, {r.why!r})"
            rules.append(f'"{r.index}": {value}')

        def dims(table):
            return py_tuple(py_tuple("None" if i is None else f'"{i}"' for i in row) for row in table)

        signature = kernel_signature
        if keywords:
            signature = signature.replace("interpret=False", ", ".join(f"{w}=None" for w in keywords) + ", interpret=False")
        return {
            "rules": "{" + ", ".join(rules) + "}",
            "args": dims(plan.args),
            "outputs": dims(plan.outputs),
            "sums": dims(plan.sums),
            "sizes": py_tuple(f'"{s.symbol}"' for s in conv.sizes),
            "shifts": py_tuple(f'({n}, "{i}")' for n, i in plan.shifts),
            "signature": signature,
            "positional": [p.public for p in conv.params],
            "keywords": list(keywords),
            "doc": self.mesh_doc(plan),
            "ring": plan.ring,
            # Per coo input a split may deal by its coordinates: (blocks, coordinates, the
            # index of each dimension, its tile), positions among the positional arguments.
            "coo": py_tuple(f"({c.blocks}, {py_tuple(str(n) for n in c.coords)}, "
                            f"{py_tuple('None' if i is None else chr(34) + i + chr(34) for i in c.indices)}, "
                            f"{py_tuple(str(t) for t in c.tiles)})" for c in plan.coo) if plan.coo else "",
        }

    def mesh_doc(self, plan: MeshPlan) -> str:
        """`sharded`'s docstring: the call, then what each index does."""
        k = self.k
        split = [r.index for r in plan.rules if r.how]
        example = ", ".join(f'{i}="{axis}"' for i, axis in zip(split, ("data", "model"))) or 'INDEX="AXIS"'
        lines = [
            f"`{k.name}` on a device mesh, under jax.shard_map.",
            "",
            "Returns a function with the kernel's arguments and results; each index given as an",
            "axis of `mesh` is split over it:",
            "",
            f"    {k.name}_on_mesh = sharded(mesh, {example})",
            "",
            "Arrays may arrive sharded or not (each is laid out as the mapping says); gradients",
            "flow through it as through the kernel. A split index's size must be divisible by its",
            "mesh axis's size. Per index of the spec:",
            "",
        ]
        for r in plan.rules:
            text = {"ring": r.why,
                    "split": "split: each device runs the kernel on its slice, with no communication",
                    "sum": "split: each device sums its slice, and the partial results are added across the axis (psum)"
                    }.get(r.how, f"cannot be split: {r.why}")
            if r.how and r.coo:
                text += (f"; the stored blocks of {' and '.join(r.coo)} go to the device whose slice holds their "
                         "coordinate along it (made local), each device's padded to one bucket")
            if r.how and r.shifted:
                text += (f"; {' and '.join(r.shifted)}, compared with its position, {'is' if len(r.shifted) == 1 else 'are'} "
                         "given to each device less its slice's start, so positions stay global")
            lines += textwrap.wrap(f"{r.index}: {text}", 84, initial_indent="    ", subsequent_indent="        ",
                                   break_long_words=False, break_on_hyphens=False)
        lines += ["", "Mapping an index the spec lacks, to an axis the mesh lacks, or two indices to one", "axis, raises a ValueError."]
        return "\n".join(("    " + line) if line and n else line for n, line in enumerate(lines)) + "\n    "



@dataclass
class Glue:
    """The custom_vjp glue of a module, as `templates/module.py.j2` writes it for every kernel
    family: `_run` (`_impl` with its static arguments not differentiated), `_run_forward`
    (the residuals), `_run_backward` (which gradients are wanted, the cotangents, `_backward`'s
    call, a gradient per argument) and the `_PARTIALS`/`_REFUSED` tables."""

    args: list[str]  # `_impl`'s array arguments
    statics: list[str]  # its static arguments: the custom_vjp's nondiff ones, after `args`
    tables: str  # `_PARTIALS` and `_REFUSED`
    n_outputs: int
    cotangents: list[str]  # `_run_backward`'s names for the cotangents, one per output
    residuals_about: list[str]  # `_run_forward`'s comment
    residuals: list[str] = field(default_factory=list)  # what `_run_forward` keeps (with `perturbed`); default: `args`
    derived: bool = False  # a backward is derived (else `_run_backward` raises where a gradient is needed)
    bargs: list[str] = field(default_factory=list)  # `_backward`'s array arguments
    partials: list[str] = field(default_factory=list)  # its results
    returns: list[str] = field(default_factory=list)  # `_run_backward`'s result per argument
    prelude: list[str] = field(default_factory=list)  # `_run_backward`'s lines before `_backward` (sizes unpacked)
    wanted: bool = True  # `_backward` takes which gradients are wanted, and skips the others
    kept: list[str] = field(default_factory=list)  # `_impl`'s results, where it returns more than the outputs
    declared: list[str] = field(default_factory=list)  # the outputs among `kept`
    zeros: bool = False  # the backward reads every cotangent: symbolic zeros made zeros
    # Keywords `_backward` and `_run_backward` pass on (a row kernel's `origin=`, the
    # arrays' first positions, and `keys=`, key-side arrays of arguments read along both)
    keywords: tuple[str, ...] = ()
    # `_run`'s keyword to `_impl` where a call not differentiated returns the declared outputs
    # alone (a row kernel's `residuals=False`: no logsumexp kept for the gradients)
    primal: str = ""

    def __post_init__(self):
        self.residuals = self.residuals or list(self.args)

    @property
    def nothing(self) -> str:
        """`_run_backward`'s result where no gradient is wanted."""
        return py_tuple(["None"] * len(self.args))

    @property
    def nondiff(self) -> str:
        return py_tuple(str(len(self.args) + n) for n in range(len(self.statics)))

    @property
    def backward_statics(self) -> list[str]:
        return self.statics + (["wanted"] if self.wanted else [])


def einsum_glue(kernel: Kernel, conv: Convention, names, backward, refused, pass_outputs: dict[str, str],
                bargs=(), prelude=()) -> Glue:
    """The glue of an einsum module, on every target: the residuals are the inputs; one
    backward pass per partial gradient (`pass_outputs`, as `gradient_tables` takes them), run
    where wanted; `prelude`: `_run_backward`'s lines before them."""
    info = gradient_tables(kernel, conv, backward, refused, pass_outputs)
    cotangents = [a for _, a in backward.cotangents] if backward else [names.local(f"g_{o.name}") for o in kernel.outputs]
    return Glue(
        args=list(conv.impl_args),
        statics=["sizes", "interpret"],
        tables=info["tables"],
        n_outputs=info["n_outputs"],
        cotangents=cotangents,
        residuals_about=["The gradient of an einsum needs the inputs, never the outputs: they are the residuals,",
                         "with which of them are differentiated."],
        derived=bool(pass_outputs),
        bargs=list(bargs),
        partials=info["partials"],
        returns=info["returns"],
        prelude=list(prelude),
    )


def gradient_tables(kernel: Kernel, conv: Convention, backward, refused, pass_outputs: dict[str, str]) -> dict:
    """What `_run_backward` needs, the same for every target: per backward pass (in order,
    `pass_outputs`: its output operand -> its variable) the argument whose gradient it
    computes and the output whose cotangent it reads (`_PARTIALS`); the gradients not
    derived (`_REFUSED`: argument, output or None for any, message); and what each argument
    gets back: the sum of its computed partials, None for no gradient."""
    args = list(conv.impl_args)
    outputs = [o.name for o in kernel.outputs]

    def arg_of(operand: str) -> int:
        return args.index(next(p.internal for p in conv.params if p.operand == operand and p.kind in ("dense", "blocks")))

    partials = {part.output: part for part in backward.partials} if backward is not None else {}
    table, by_operand = [], {}
    for output, var in pass_outputs.items():
        part = partials[output]
        table.append(f"({arg_of(part.operand)}, {outputs.index(part.through)})")
        by_operand.setdefault(part.operand, []).append(var)
    returns = []
    for a in args:
        param = next((p for p in conv.params if p.internal == a), None)
        if param is not None and param.kind in ("dense", "blocks") and param.operand in by_operand:
            returns.append(f"_add({', '.join(by_operand[param.operand])})")
        else:
            returns.append("None")
    tables = vjp_tables(["# The backward's passes, in order: (the argument whose gradient each computes, the output",
                         "# whose cotangent it reads), by position."], table, refused, arg_of, outputs)
    return {"partials": list(pass_outputs.values()), "tables": tables, "returns": returns, "n_outputs": len(outputs)}


def vjp_tables(partials_comment: list[str], partials: list[str], refused, arg_of, outputs: list[str]) -> str:
    """The module-level tables `_gradients_wanted` reads, for every kernel family: `_PARTIALS`
    (the gradients the backward computes, as `(argument, output)` tuples) and `_REFUSED`
    (those not derived: argument, output or None for any, the message)."""
    rows = [f"({arg_of(r.operand)}, {outputs.index(r.output) if r.output else None}, {r.message!r})" for r in refused]
    return "\n".join([
        *partials_comment,
        f"_PARTIALS = {py_tuple(partials)}",
        "# The gradients not derived: (argument, output or None for any, why). Each is raised only",
        "# where needed: its argument differentiated and that cotangent not a symbolic zero.",
        f"_REFUSED = {py_tuple(rows)}",
    ])


def _widen(value: str, dtype, acc) -> str:
    return value if dtype == acc else f"{value}.astype({acc.jnp})"


def _sym(size) -> str:
    return f'"{size.symbol}"' if size.symbol is not None else str(size.literal)


def _number(value) -> str:
    return repr(value)
