"""Reverse-mode differentiation of the IR (language v1, section 6).

The gradient of an einsum is an einsum over the same sparsity: for `o[O] = c * f1 * ... * fn`
and a float factor `fj`, `dfj[Ij] = c * g[O] * (every other factor)`, summed over the
indices `fj` lacks, where `g` is the cotangent of `o`. The backward statements form a
kernel of their own (forward inputs and cotangents in, partial gradients out) that the
same pipeline schedules, lowers, checks and emits:

- a `coo` input's gradient is a `coo` output on its own stored blocks, in the same order
  (padding entries get zeros, a repeated block the full gradient of its position);
- a `coo` output's cotangent is a `coo` input on that output's topology;
- offsets on the right become offsets on the left, and back;
- a `mask` factor multiplies the cotangent and gets no gradient; where a backward
  statement walks a coo operand, the mask is read as a dense factor (the walk skips by
  the stored blocks);
- `index`, `mask` and integer inputs get no gradient.

An input read by several statements gets the sum of its partial gradients (added by the
wrapper). What cannot be derived yet comes back as a refusal per (input, output): the
module raises it only where that gradient is needed (the input differentiated and the
output's cotangent not a symbolic zero), so one underivable gradient blocks no other.
"""

from __future__ import annotations

from dataclasses import dataclass

from .callconv import Convention, OffsetUse, Param
from .ir import Einsum, Kernel, Operand, Read, group_factors, summed_indices
from .names import ModuleNames, NameTable


@dataclass(frozen=True)
class Partial:
    operand: str  # the forward input this is (a part of) the gradient of
    output: str  # the backward kernel's output that holds it
    through: str = ""  # the forward output whose cotangent it reads


@dataclass(frozen=True)
class Refusal:
    """A gradient that is not derived: that of `operand` through `output` (None: through
    every output). Raised only where needed: `operand` differentiated and the cotangent of
    `output` (of any output, for None) not a symbolic zero."""

    operand: str
    output: str | None
    reason: str

    @property
    def message(self) -> str:
        """The NotImplementedError's text: why, and how to differentiate the rest."""
        through = f"the cotangent of '{self.output}'" if self.output else "a cotangent"
        return (f"{self.reason}; asked for because '{self.operand}' is differentiated and {through} is not zero "
                f"(stop the gradient of '{self.operand}'" + (f" or leave '{self.output}' out of the loss" if self.output else "")
                + " to differentiate the rest)")


@dataclass(frozen=True)
class Backward:
    kernel: Kernel | None  # forward inputs and cotangents in, partial gradients out
    conv: Convention | None
    cotangents: tuple[tuple[str, str], ...]  # (forward output, its cotangent's array in the wrapper)
    partials: tuple[Partial, ...]
    error: str | None = None  # why no gradient of this kernel can be derived
    prelude: tuple[tuple[str, tuple], ...] = ()  # (array, (coo operand, shape, tiles)): coo inputs densified first
    refused: tuple[Refusal, ...] = ()  # the gradients not derived (the others are)

    @property
    def differentiable(self) -> bool:
        return self.error is None


def has_gradient(op: Operand) -> bool:
    """Float data inputs get gradients; `index`, `mask` and integer inputs never do."""
    return op.direction == "in" and op.sparsity not in ("mask", "index") and op.dtype.is_float


def refusals(kernel: Kernel, backward: Backward | None, error: str | None) -> tuple[Refusal, ...]:
    """Every gradient of a kernel that is not derived: the backward's own refusals, and where
    the backward is not available (`error`), those it derived too (every float input's,
    through any output, where none was derived)."""
    own = backward.refused if backward is not None else ()
    if not error:
        return own
    if backward is not None and backward.partials:
        # The backward was derived but cannot run: each of its gradients is refused.
        whole = dict.fromkeys((p.operand, p.through) for p in backward.partials)
        return own + tuple(Refusal(operand, output, error) for operand, output in whole)
    return tuple(Refusal(op.name, None, error) for op in kernel.operands if has_gradient(op))


def gradient_lines(kernel: Kernel, partials, refused) -> list[str]:
    """`plan`'s account of the gradients, per float input: through which outputs each is
    derived, and which are not (raised only where needed)."""
    lines = ["gradients (jax.grad), per float input:"]
    for op in kernel.operands:
        if not has_gradient(op):
            continue
        done = list(dict.fromkeys(p.through for p in partials if p.operand == op.name))
        parts = [f"through {', '.join(done)}"] if done else []
        for r in refused:
            if r.operand == op.name:
                parts.append(f"not derived through {r.output or 'any output'}: {r.reason} (raised only where needed: "
                             f"{op.name} differentiated and {'the cotangent of ' + r.output if r.output else 'a cotangent'} not zero)")
        lines.append(f"  {op.name}: " + ("; ".join(parts) if parts else "no gradient (it reaches no output)"))
    if len(lines) == 1:
        lines.append("  none: no float input, so nothing to differentiate")
    return lines


class _Unsupported(Exception):
    pass


def derive(kernel: Kernel, conv: Convention, names: ModuleNames, densify: str | None = None) -> Backward:
    """The backward kernel of the gradients that can be derived, and a refusal for each that
    cannot. `densify`: where a target cannot densify a coo input for a gradient, why (that
    gradient is refused)."""
    try:
        return _Deriver(kernel, conv, names, densify).run()
    except _Unsupported as exc:
        return Backward(None, None, (), (), str(exc))


class _Deriver:
    def __init__(self, kernel: Kernel, conv: Convention, names: ModuleNames, densify: str | None = None):
        self.k = kernel
        self.no_densify = densify
        self.conv = conv
        self.names = names
        # Operand names of the backward kernel: the forward's, then new ones that avoid them.
        self.operand_names = NameTable({op.name for op in kernel.operands} | {i.name for i in kernel.indices})
        self.operands: dict[str, Operand] = {op.name: op for op in kernel.operands}
        self.params: list[Param] = list(conv.params)
        self.pads: list[tuple[str, str]] = list(conv.pads)
        self.uses: list[OffsetUse] = []
        self.dense_alias: dict[str, str] = {}
        self.prelude: list[tuple[str, tuple]] = []

    def run(self) -> Backward:
        k, conv = self.k, self.conv
        for st in k.statements:
            for r in st.factors:
                if k.operand(r.operand).direction == "out":
                    raise _Unsupported(f"gradients through chained statements (here '{st.target.operand}' reads '{r.operand}') are not supported yet")
        cotangents = {}
        args = list(conv.impl_args)
        for out in k.outputs:
            name = self.operand_names.take(f"g_{out.name}")
            array = self.names.local(f"g_{out.name}")
            cotangents[out.name] = (name, array)
            args.append(array)
            self.operands[name] = Operand(name, "in", out.dtype, out.dims, "coo" if out.sparsity == "coo" else "dense", out.span, out.dtype_span)
            if out.sparsity == "coo":
                self.params.append(Param(name, array, name, "blocks", None, (), out.dtype.name, f"the cotangent of {out.name}"))
                for p in conv.params:
                    if p.operand == out.name and p.kind == "out_coords":
                        self.params.append(Param(p.public, p.internal, name, "coords", p.dim, p.shape, p.dtype, p.about))
                self.pads.append((name, conv.pad(out.name)))
            else:
                self.params.append(Param(name, array, name, "dense", None, (), out.dtype.name, f"the cotangent of {out.name}"))
        statements, partials, refused = [], [], []
        for st in k.statements:
            gname = cotangents[st.target.operand][0]
            for n, f in enumerate(st.factors):
                op = k.operand(f.operand)
                if not has_gradient(op):
                    continue
                # A factor whose gradient cannot be derived is refused alone: the others are.
                saved, self.current = self.snapshot(), (op.name, st.target.operand)
                try:
                    if any(s.divisor != 1 for s in f.subs):
                        raise _Unsupported(f"the gradient of '{op.name}', read as {f.text}, is not supported yet (a divided subscript on the left)")
                    statements.append(self.statement(st, n, gname, partials))
                except _Unsupported as exc:
                    self.restore(saved)
                    refused.append(Refusal(op.name, st.target.operand, str(exc)))
        refused = tuple(refused)
        if not statements:
            return Backward(None, None, tuple((o, a) for o, (_, a) in cotangents.items()), (), None, refused=refused)
        operands = [op for op in self.operands.values()]
        bwd = Kernel(
            name=f"{k.name}_backward",
            source_name=k.source_name,
            digest=k.digest,
            operands=tuple(operands),
            indices=k.indices,
            statements=tuple(statements),
            accumulate=k.accumulate,
            name_span=k.name_span,
            tile_span=k.tile_span,
            symbols=k.symbols,
            relations=k.relations,
            accumulate_span=k.accumulate_span,
        )
        args += [var for var, _ in self.prelude]
        bconv = Convention(tuple(self.params), conv.sizes, tuple(self.pads), conv.offsets, tuple(self.uses), tuple(args))
        return Backward(bwd, bconv, tuple((o, a) for o, (_, a) in cotangents.items()), tuple(partials), prelude=tuple(self.prelude),
                        refused=refused)

    def snapshot(self) -> tuple:
        return (set(self.operand_names.used), dict(self.operands), list(self.params), list(self.pads), list(self.uses),
                dict(self.dense_alias), list(self.prelude))

    def restore(self, saved: tuple) -> None:
        used, self.operands, self.params, self.pads, self.uses, self.dense_alias, self.prelude = saved
        self.operand_names.used = used

    def statement(self, st: Einsum, n: int, gname: str, partials: list[Partial]) -> Einsum:
        k, conv = self.k, self.conv
        f = st.factors[n]
        op = k.operand(f.operand)
        dname = self.operand_names.take(f"d_{op.name}")
        self.operands[dname] = Operand(dname, "out", op.dtype, op.dims, "coo" if op.sparsity == "coo" else "dense", op.span, op.dtype_span)
        if op.sparsity == "coo":
            # The gradient lives on the input's own stored blocks: requested at its coordinates.
            for p in conv.params:
                if p.operand == op.name and p.kind == "coords":
                    self.params.append(Param(p.public, p.internal, dname, "out_coords", p.dim, p.shape, p.dtype, p.about))
            self.pads.append((dname, conv.pad(op.name)))
        target = Read(dname, f.subs, f.span)
        g = Read(gname, st.target.subs, st.target.span)
        others = [r for m, r in enumerate(st.factors) if m != n]
        sparse_in = [r for r in [g, *others] if self.operands[r.operand].sparsity == "coo"]
        if len(sparse_in) > 1:
            # The cotangent of a coo output meets a coo input (the gradient of a coo join's
            # dense factor): the cotangent drives the walk, the input is densified first.
            others = [self.densified(r) if self.operands[r.operand].sparsity == "coo" else r for r in others]
            sparse_in = [g]
        if sparse_in:
            # A coo operand drives the walk: a mask here is read as a dense factor.
            others = [self.dense(r) if self.operands[r.operand].sparsity == "mask" else r for r in others]
        factors = (g, *others)
        summed = summed_indices(target, factors)
        masks = {r.operand for r in factors if self.operands[r.operand].sparsity == "mask"}
        summed_groups, end_groups = group_factors(factors, set(summed), masks)
        if len(summed_groups) > 2:
            raise _Unsupported(f"the gradient of '{op.name}' through '{st.target.operand}' multiplies three groups of factors in one sum, "
                               "which needs a local tensor (not supported yet)")
        # A condition on the terms keeps them: the derived statement has the same terms.
        e = Einsum(target, factors, st.numbers, tuple(summed), summed_groups, end_groups, st.span, st.condition)
        # Offsets keep their slots: the backward reads the same offsets where the forward did.
        forward_name = {dname: op.name, gname: st.target.operand}
        for r in (target, *factors):
            base = forward_name.get(r.operand, self.dense_alias_of(r.operand))
            for d, s in enumerate(r.subs):
                if s.offset is None:
                    continue
                use = next(u for u in conv.offset_uses if (u.statement, u.operand, u.dim) == (st.target.operand, base, d))
                self.uses.append(OffsetUse(dname, r.operand, d, use.param, use.index_operand, use.position, use.tile, use.max_start, use.what, use.slot))
        partials.append(Partial(op.name, dname, st.target.operand))
        return e

    def dense(self, r: Read) -> Read:
        """A mask read as an ordinary dense factor (the same array)."""
        op = self.operands[r.operand]
        if op.name not in self.dense_alias:
            alias = self.operand_names.take(f"{op.name}_values")
            self.dense_alias[op.name] = alias
            self.operands[alias] = Operand(alias, "in", op.dtype, op.dims, "dense", op.span, op.dtype_span)
            p = self.conv.param(op.name)
            self.params.append(Param(p.public, p.internal, alias, "dense", None, p.shape, p.dtype, p.about))
        return Read(self.dense_alias[op.name], r.subs, r.span)

    def densified(self, r: Read) -> Read:
        """A coo input read as the dense array it stands for, built by the wrapper."""
        op = self.operands[r.operand]
        if self.no_densify:
            raise _Unsupported(f"the gradient of '{self.current[0]}' through '{self.current[1]}' reads the coo input '{op.name}' "
                               f"as a dense array, {self.no_densify}")
        if op.name not in self.dense_alias:
            alias = self.operand_names.take(f"{op.name}_dense")
            array = self.names.local(f"{op.name}_dense")
            self.dense_alias[op.name] = alias
            self.operands[alias] = Operand(alias, "in", op.dtype, op.dims, "dense", op.span, op.dtype_span)
            self.params.append(Param(alias, array, alias, "dense", None, (), op.dtype.name, f"{op.name} as a dense array"))
            tiles = tuple(self.k.index(i).tile for i in r.indices)
            self.prelude.append((array, (op.name, tiles)))
        return Read(self.dense_alias[op.name], r.subs, r.span)

    def dense_alias_of(self, name: str) -> str:
        return next((m for m, a in self.dense_alias.items() if a == name), name)
