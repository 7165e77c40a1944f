"""The kernel body in Pallas TPU code: reading blocks, the sum, the phases.

Values carry the indices of their axes, so aligning a factor to another (a transpose, a
broadcast) is decided here from the schedule's index lists. The common matrix products
read like the tutorial (`jnp.dot`, `lax.dot_general` for transposed operands); anything
else is a `jnp.einsum` over the block's indices.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import DTYPES, DType, after_sum_dtype, matrix_dtype
from ..expr import Var, render
from ..pytext import py_tuple as _tuple
from ..schedule.core import Factor, Product, Tail
from .lower import Spec, TpuPass


@dataclass(frozen=True)
class Val:
    code: str
    axes: tuple[str, ...]
    dtype: DType
    simple: bool = True  # a ref read or a name: safe to use twice, no parentheses needed


def align(v: Val, target: tuple[str, ...]) -> str:
    """`v` with its axes in `target`'s order, unit axes where it lacks one (numpy broadcasting)."""
    if v.axes == target or not v.axes:
        return v.code
    present = [a for a in target if a in v.axes]
    perm = [v.axes.index(a) for a in present]
    code = v.code if v.simple else f"({v.code})"
    if perm != sorted(perm):
        code = f"{code}.T" if len(perm) == 2 else f"jnp.transpose({code}, {_tuple(map(str, perm))})"
    if len(present) < len(target):
        code = f"{code}[{', '.join(':' if a in v.axes else 'None' for a in target)}]"
    return code


def cast(code: str, frm: DType, to: DType) -> str:
    return code if frm == to else f"{code}.astype({to.jnp})"


class BodyWriter:
    def __init__(self, kernel, tp: TpuPass):
        self.k = kernel
        self.tp = tp
        self.p = tp.p
        self.body = tp.p.body
        self.acc = tp.p.accumulate
        self.spec = {s.block.key: s for s in tp.specs}
        self.letters = {}
        for i in self.p.statement.indices:
            self.letters[i] = "abcdefghijklmnopqrstuvwxyz"[len(self.letters)]

    # ------------------------------------------------------------ values
    def read(self, f: Factor) -> Val:
        spec: Spec = self.spec[f.block]
        code = f"{spec.ref}[...]"
        shape = tuple(d.extent for d in spec.block.dims if d.live)
        if spec.view.ref_shape != shape:  # a view with unit dimensions (a scalar: shape ())
            if f.dtype.bits < 32 and tuple(spec.view.ref_shape[-2:]) != shape[-2:]:
                # Measured: Mosaic cannot move packed (16/8-bit) rows between sublanes; the
                # block is widened to 32 bits first.
                code = f"{code}.astype({self.acc.jnp}).reshape({_tuple(map(str, shape))})"
                return Val(code, f.live, self.acc, False)
            code = f"{code}.reshape({_tuple(map(str, shape))})"
            return Val(code, f.live, f.dtype, False)
        return Val(code, f.live, f.dtype)

    def product(self, q: Product, for_mxu: bool = False, dtype: DType | None = None) -> Val:
        """The factors of `q` multiplied, in the accumulator's dtype (or `dtype`: the flush's,
        `after_sum_dtype`); `for_mxu`: rounded back to the first factor's dtype, to feed the MXU
        a narrow operand (as a bf16 kernel would)."""
        acc = self.acc if dtype is None else dtype
        vals = [self.read(f) for f in q.factors]
        main = vals[0]
        if len(vals) == 1:
            return main
        # The product holds every factor's axes: the first factor's order, unless another
        # factor holds axes it lacks (then the widest factor's order, the rest appended).
        if not all(set(v.axes) <= set(main.axes) for v in vals[1:]):
            widest = max(vals, key=lambda v: len(v.axes))
            axes = list(widest.axes)
            for v in vals:
                axes += [a for a in v.axes if a not in axes]
            axes = tuple(axes)
        else:
            axes = main.axes
        parts = []
        for v in vals:
            if v.axes != axes and v.dtype != acc:
                # Widened before it is broadcast: Mosaic cannot broadcast packed (bf16) sublanes.
                v = Val(cast(v.code if v.simple else f"({v.code})", v.dtype, acc), v.axes, acc, False)
            code = align(v, axes)
            parts.append(cast(code if v.simple or code == v.code else f"({code})", v.dtype, acc))
        code = " * ".join(parts)
        fed, _ = q.fed  # the factor's dtype, or wider where the product could wrap in it
        if for_mxu and fed != acc:
            return Val(f"({code}).astype({fed.jnp})", axes, fed, False)
        return Val(code, axes, acc, False)

    def widened(self, v: Val, axes: tuple[str, ...], dtype: DType | None = None) -> str:
        """`v` laid out along `axes` (broadcast where it lacks one), in the accumulate dtype
        (or `dtype`)."""
        return cast(align(v, axes) if v.simple else f"({align(v, axes)})", v.dtype, self.acc if dtype is None else dtype)

    # ------------------------------------------------------------ the sum
    def contraction(self, vals: list[Val]) -> str:
        """The sum of one step, with the accumulator's axes (broadcast where the sum lacks one)."""
        acc = self.acc
        summed = set(self.body.summed_indices)
        have = {a for v in vals for a in v.axes if a not in summed}
        target = tuple(a for a in self.body.acc_live if a in have)
        value = self._contraction(vals, target)
        if target == self.body.acc_live:
            return value
        simple = not any(op in value.replace("[...]", "") for op in (" * ", " + "))  # else a product of parts
        return align(Val(value, target, acc, simple), self.body.acc_live)

    def _contraction(self, vals: list[Val], target: tuple[str, ...]) -> str:
        wide = matrix_dtype(tuple(v.dtype for v in vals), self.acc) if len(vals) == 2 else self.acc
        if wide.is_float and not self.acc.is_float:
            # An integer sum meeting a covered product formed wider (`Product.fed`): both sides
            # in that float dtype (exact for what they hold), the step's sum in f32, then added
            # to the integer accumulator.
            vals = [Val(cast(v.code if v.simple else f"({v.code})", v.dtype, wide), v.axes, wide, v.dtype == wide and v.simple)
                    for v in vals]
            return f"({self._contraction_in(vals, target, DTYPES['f32'])}).astype({self.acc.jnp})"
        return self._contraction_in(vals, target, self.acc)

    def _contraction_in(self, vals: list[Val], target: tuple[str, ...], acc: DType) -> str:
        summed = set(self.body.summed_indices)
        pref = f"preferred_element_type={acc.jnp}"
        if any(v.dtype.name == "f32" for v in vals):
            # The MXU rounds f32 operands to bf16 unless asked for full precision.
            pref += ", precision=lax.Precision.HIGHEST"
        if len(vals) == 1:
            (v,) = vals
            axes = [n for n, a in enumerate(v.axes) if a in summed]
            code = cast(v.code if v.simple else f"({v.code})", v.dtype, acc)
            if not axes:
                return align(Val(code, v.axes, acc, v.simple), target)
            rest = tuple(a for a in v.axes if a not in summed)
            total = f"jnp.sum({code}, axis={_tuple(map(str, axes)) if len(axes) > 1 else axes[0]})"
            return align(Val(total, rest, acc, True), target)
        a, b = vals
        for_sum = [i for i in (*a.axes, *b.axes) if i in summed and not (i in a.axes and i in b.axes)]
        if for_sum:
            # Indices only one factor holds are summed first, in the accumulate dtype (inside
            # jnp.einsum they would be summed in the factors' dtype).
            pre = []
            for v in (a, b):
                own = [n for n, i in enumerate(v.axes) if i in for_sum]
                if not own:
                    pre.append(v)
                    continue
                code = cast(v.code if v.simple else f"({v.code})", v.dtype, acc)
                code = f"jnp.sum({code}, axis={_tuple(map(str, own)) if len(own) > 1 else own[0]})"
                pre.append(Val(code, tuple(i for i in v.axes if i not in for_sum), acc, True))
            a, b = pre
        if a.dtype != b.dtype:
            a = Val(cast(a.code, a.dtype, acc), a.axes, acc, False)
            b = Val(cast(b.code, b.dtype, acc), b.axes, acc, False)
        shared = [i for i in a.axes if i in b.axes]
        contracted = [i for i in shared if i in summed]
        batch = [i for i in shared if i not in summed]
        alone = [i for i in (*a.axes, *b.axes) if i in summed and i not in shared]
        fa = [i for i in a.axes if i not in b.axes and i not in summed]
        fb = [i for i in b.axes if i not in a.axes and i not in summed]
        if not contracted:
            # Nothing to contract within the block (the summed indices have tiles of 1): an
            # elementwise product, after summing what only one factor holds.
            parts = []
            for v in (a, b):
                own = [n for n, i in enumerate(v.axes) if i in summed]
                code = cast(v.code if v.simple else f"({v.code})", v.dtype, acc)
                if own:
                    code = f"jnp.sum({code}, axis={_tuple(map(str, own)) if len(own) > 1 else own[0]})"
                rest = tuple(i for i in v.axes if i not in summed)
                parts.append(align(Val(code, rest, acc), target))
            return " * ".join(parts)
        if not target:
            # Everything summed: Mosaic's dot yields no scalar, so multiply and sum.
            lhs = cast(a.code if a.simple else f"({a.code})", a.dtype, acc)
            rhs = align(Val(cast(b.code if b.simple else f"({b.code})", b.dtype, acc), b.axes, acc), a.axes)
            return f"jnp.sum({lhs} * {rhs})"
        if len(a.axes) == 2 and len(b.axes) == 2 and len(contracted) == 1 and not batch and not alone:
            lhs, rhs = (a, b) if tuple(fa + fb) == target else (b, a) if tuple(fb + fa) == target else (None, None)
            if lhs is not None:
                (c,) = contracted
                dims = (lhs.axes.index(c), rhs.axes.index(c))
                lc = lhs.code if lhs.simple else f"({lhs.code})"
                rc = rhs.code if rhs.simple else f"({rhs.code})"
                if dims == (1, 0):
                    return f"jnp.dot({lhs.code}, {rhs.code}, {pref})"
                return f"lax.dot_general({lc}, {rc}, ((({dims[0]},), ({dims[1]},)), ((), ())), {pref})"
        spec = f"{self.sub(a.axes)},{self.sub(b.axes)}->{self.sub(target)}"
        return f'jnp.einsum("{spec}", {a.code}, {b.code}, {pref})'

    def sub(self, axes) -> str:
        return "".join(self.letters[i] for i in axes)

    # ------------------------------------------------------------ tails
    def tail_lines(self, name: str, v: Val, tails: tuple[Tail, ...]) -> list[str]:
        lines = []
        for t in tails:
            if t.index in v.axes:
                limit = render(Var(t.size) - t.coord * t.tile, "py")  # a tree: the coordinate may be a sum
                lines.append(f"{name} = _mask_tail({name}, {v.axes.index(t.index)}, {limit})")
        return lines

    def guarded(self, tails: tuple[Tail, ...], lines: list[str]) -> list[str]:
        """Tail masks run only where a size is ragged: decided at trace time (sizes are static)."""
        if not lines:
            return []
        sizes = list(dict.fromkeys(f"{t.size} % {t.tile}" for t in tails))
        cond = " or ".join(sizes)
        return [f"if {cond}:  # a partial last block: what lies past the end is absent", *("    " + line for line in lines)]

    # ------------------------------------------------------------ conditions
    def select_lines(self, name: str, v: Val) -> tuple[list[str], str]:
        """`name` (a value over v.axes) with the entries where the body's condition is false
        replaced by 0: positions from the step's block coordinates, integer operands from
        their blocks, an index walked one value at a time as a scalar. Also the name of the
        condition's value (broadcastable to v)."""
        from ..terms import render_term

        sel = self.body.select
        coords = dict(sel.coords)
        reads = dict(sel.reads)
        scalars = dict(sel.scalars)
        rank = len(v.axes)
        lines: list[str] = []
        pos: dict[str, str] = {}

        def leaf(t) -> str:
            if t.op == "size":
                return dict(sel.sizes)[t.name]
            if t.op == "index":
                i = t.name
                coord = render(coords[i], "py")
                tile = self.k.index(i).tile
                if tile == 1:
                    return coord if " " not in coord else f"({coord})"
                if i not in pos:
                    pos[i] = self.tp_local(f"{i}_pos")
                    shape = _tuple("1" if a != i else str(tile) for a in v.axes)
                    lines.append(f"{pos[i]} = {coord} * {tile} + lax.broadcasted_iota(jnp.int32, {shape}, {v.axes.index(i)})")
                return pos[i]
            if t.read in scalars:
                value = render(scalars[t.read], "py")
                return f"({value} != 0)" if t.op == "truth" else value
            spec = self.spec[reads[t.read]]
            layout = spec.block.layout
            ref = spec.ref
            value = f"{ref}[:, 0:1]" if layout == "rows" else f"{ref}[0:1, :]" if layout == "cols" else \
                f"{ref}[...]" if spec.view.ref_shape == tuple(d.extent for d in spec.block.dims if d.live) else f"{ref}[...].reshape(())"
            if layout != "natural" and rank > 2:
                value = f"{value}.reshape({_tuple(str(self.k.index(a).tile) if a in t.read.indices else '1' for a in v.axes)})"
            return f"({value} != 0)" if t.op == "truth" else value

        present = render_term(sel.condition, leaf)
        if present in self._present:  # the same condition selects another value: computed once
            keep = self._present[present]
        else:
            keep = self._present[present] = self.tp_local("present")
            lines.append(f"{keep} = {present}")
        if v.dtype.is_float and v.dtype.bits == 16:
            # Via f32 (exact): Mosaic selects a packed bf16 block as int16, which libtpu's
            # cycle profiler rejects as a matmul's left operand (attention's kernels do the same).
            lines.append(f"{name} = jnp.where({keep}, {name}.astype(jnp.float32), 0.0).astype({name}.dtype)")
        else:
            lines.append(f"{name} = jnp.where({keep}, {name}, jnp.zeros_like({name}))")
        return lines, keep

    def compute_lines(self, partial: bool = False, groups=None) -> tuple[list[str], str]:
        """Lines before the accumulation, and the accumulated value; `partial`: in a step
        where the body's condition holds for some terms only (its absent ones selected out);
        `groups`: the sum's groups in place of the body's (a mask left out where all ones)."""
        body = self.body
        groups = groups or body.summed or body.step
        # Only two groups that share a summed axis make a matrix product; elsewhere products
        # stay wide (the reference rounds nothing before the sum).
        vals = [self.product(q, for_mxu=body.matrix_product) for q in groups]
        tails = body.tails
        self._present = {}
        sel = body.select if partial else None
        selected = (sel.group,) if sel is not None and sel.target == "group" else ()
        needs_locals = any(t.index in v.axes for v in vals for t in tails) or bool(selected)
        exposed = sel is not None and sel.exposed is not None and vals[sel.exposed].dtype.is_float
        lines: list[str] = []
        keeps = {}
        if needs_locals:
            masked = []
            named = []
            for n, (q, v) in enumerate(zip(groups, vals)):
                name = self.tp_local(q.factors[0].operand)
                lines.append(f"{name} = {v.code}")
                named.append(Val(name, v.axes, v.dtype, True))
                masked += self.tail_lines(name, named[-1], tails)
                if n in selected:
                    # The condition's absent terms: selected out, so what they hold never counts.
                    more, keeps[n] = self.select_lines(name, named[-1])
                    lines += more
            lines += self.guarded(tails, masked)
            vals = named
        if body.summed:
            value = self.contraction(vals)
            if sel is not None and sel.target == "product":
                # Every term of an element of the step's product is present or none is: the
                # product is selected (each step with its own value of a summed scalar index).
                part = self.tp_local("part")
                lines.append(f"{part} = {value}")
                more, _ = self.select_lines(part, Val(part, body.acc_live, self.acc))
                lines += more
                value = part
            elif exposed:
                # Added by `_present_step` (no value for the caller to add).
                assert not body.step
                chosen = sel.group
                # The chosen group's values in f32, read again from its blocks where the step is
                # recomputed: widening the selected 16-bit block that feeds the matrix product,
                # Mosaic selects it packed (as int16), which libtpu's cycle profiler rejects on v5e.
                wide = self.product(groups[chosen])
                wide = cast(wide.code if wide.simple else f'({wide.code})', wide.dtype, self.acc)
                return lines + self.present_step(value, vals, chosen, sel.exposed, keeps[chosen], wide), ""
            if body.step:
                # Factors outside the sum read at this step (a coo operand's own block).
                scale = [self.product(q) for q in body.step]
                value = " * ".join([f"({value})", *(self.widened(v, body.acc_live) for v in scale)])
            return lines, value
        # No sum: an elementwise product, accumulated per step.
        parts = [self.widened(v, body.acc_live) for v in vals]
        return lines, " * ".join(parts)

    def present_step(self, value: str, vals: list[Val], chosen: int, exposed: int, keep: str, wide: str) -> list[str]:
        """Lines adding the step's product `value` to the accumulator where the absent terms
        are selected out of the group `chosen` alone: a NaN or Inf the group `exposed` holds
        meets them (0 * NaN). Checked on one slice of the product (at the first of `chosen`'s
        own indices); only where that is not finite is the step recomputed over the present
        terms (`_present_step`; `wide`: `chosen`'s values in f32, read there alone)."""
        part, write, arg = self.tp_local("part"), self.tp_local("write"), self.tp_local("value")
        mine = set(vals[chosen].axes) - set(vals[exposed].axes)
        # A non-finite entry of `exposed` reaches every value of `chosen`'s own indices (0 * NaN
        # and 0 * Inf are NaN): one of them suffices (the first: a block's row where it can be).
        first = next((a for a in self.body.acc_live if a in mine), None)
        probe = f"{part}[{', '.join('0:1' if a == first else ':' for a in self.body.acc_live)}]" if first else part
        a, b = self.tp_local("a"), self.tp_local("b")
        params = {chosen: a, exposed: b}
        dot = self.contraction([Val(params[n], v.axes, v.dtype, True) for n, v in enumerate(vals)])
        x, y = vals[chosen].code, vals[exposed].code
        return [f"{part} = {value}",
                "",
                f"def {write}({arg}):",
                f"    {self.tp.acc_ref}[...] += {arg}",
                "",
                f"_present_step({probe}, {write}, {part}, lambda: _present_dot(lambda {a}, {b}: {dot}, {x}, {wide}, {keep}, {y}))"]

    def tp_local(self, operand: str) -> str:
        name = operand if operand.isidentifier() else "v"
        used = {s.ref for s in self.tp.specs} | {self.tp.acc_ref} | {a.var for a in self.p.axes} | {t.var for t in self.p.tables}
        used |= {a.static for a in self.p.axes} | {n for n, _ in self.body.lets} | set(self.tp.sizes)
        used |= {"jnp", "lax", "pl", "pltpu", "np", "jax", "functools"}
        while name in used or name in self._locals:
            name += "_"
        self._locals.add(name)
        return name

    _locals: set = set()
    _present: dict = {}  # a condition's text -> its local, in the lines being written

    def flush_value(self, products: tuple[Product, ...] | None, select: bool = False) -> tuple[list[str], str]:
        """The value written to the output block at a flush (zeros for None); `select`: the
        body's condition selects absent elements out where the step is partial."""
        out = self.tp.out_spec
        ref = out.ref
        if products is None:
            return [], f"jnp.zeros_like({ref})"
        body = self.body
        parts = []
        # An integer sum meeting a float factor after it (a scale) is converted once, here.
        epi = after_sum_dtype(self.acc, tuple(f.dtype for q in products for f in q.factors)) if body.accumulator else self.acc
        if body.accumulator:
            parts.append(self.widened(Val(f"{self.tp.acc_ref}[...]", body.acc_live, self.acc), body.out_live, epi))
        for q in products:
            v = self.product(q, dtype=epi)
            parts.append(self.widened(v, body.out_live, epi))
        if not parts:  # every factor is all ones here (a full mask block)
            parts = [f"jnp.ones({_tuple(map(str, body.acc_shape))}, {self.acc.jnp})"]
        if self.p.scale is not None:
            parts.append(self.p.scale.text)
        value = " * ".join(parts)
        covered = set(body.out_live if body.accumulator else ())
        for q in products:
            covered |= q.indices
        if not covered >= set(body.out_live):
            # Factors that lack some of the output's indices: the block repeats along them.
            value = f"jnp.broadcast_to({value}, {_tuple(map(str, self.body.acc_shape))})"
        lines = []
        self._present = {}
        if select and body.select is not None and body.select.target == "flush":
            name = self.tp_local("value")
            lines.append(f"{name} = {value}")
            more, _ = self.select_lines(name, Val(name, body.out_live, epi))
            lines += more
            value = name
        if body.out_tails and any(t.index in body.out_live for t in body.out_tails):
            name = self.tp_local("value")
            lines.append(f"{name} = {value}")
            masked = self.tail_lines(name, Val(name, body.out_live, epi), body.out_tails)
            lines += self.guarded(body.out_tails, masked)
            value = name
        shape = tuple(d.extent for d in out.block.dims if d.live)
        cast_to = f"{ref}.dtype"
        if len(parts) > 1 and value != parts[0] and not lines:
            value = f"({value})"
        value = f"{value}.astype({cast_to})"
        if out.view.ref_shape != shape:
            value = f"{value}.reshape({ref}.shape)"
        return lines, value
