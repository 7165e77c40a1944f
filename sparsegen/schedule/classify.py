"""Block classification, backend-neutral: a condition over a walk's class axes as an
expression tree (`Classification`, over `expr` nodes) computing, per block, whether it is
empty, partial or full; rendered as host array code over `xp` (numpy at trace time,
jax.numpy for traced operands), the same for every target. The row walk (attention) and
the condition walk (a product's terms) both classify with it; the kernel-side evaluation
of a condition is the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..expr import Call, Const, Expr, Lit, Min, Neg, Not, Tup, Var, Where, lift, render
from ..ir import Kernel, Read, Term
from ..pytext import live_lines
from ..terms import as_read

# Block kinds (the same numbering in every walk's tables).
EMPTY, PARTIAL, FULL = 0, 1, 2

# ------------------------------------------------------------- classification
# A condition is classified per block as two truth arrays over the class axes: `can`
# (some element may be present) and `must` (every element is). Integer terms become
# ranges over a block (`Span`); a comparison of two terms is one of their difference, an
# affine form over independent atoms (index values; other terms are atoms with their own
# ranges), so a single comparison is exact; comparisons of one form of positions are
# intersected first (a window: i >= j and i - j < 1024; offsets: lo[g] <= m < lo[g + 1]),
# so an `and` of them is exact too. Operand values are compared with positions, never
# added to them (`_le`): ids padded with INT32_MIN, or u32 ids saturated, cannot wrap.
# Ids compared with an index walked one value at a time (`gid[m] == g`) are counted per
# (block, value) (`presence`): exact for ids in any order.


@dataclass(frozen=True)
class Conditions:
    """What the classifier reads of a plan: the points' conditions and the class axes (a
    row plan is one; an einsum's condition over its whole index space is another)."""

    points: tuple  # each with a `.condition` (None: every element present)
    class_axes: tuple[str, ...]
    kernel: Kernel  # whose operands the conditions read


TRUE, FALSE = Lit("True"), Lit("False")
XP = Var("xp")


@dataclass(frozen=True)
class Classification:
    """A condition's block kinds as trees: `lets` (names bound in order: block ranges,
    per-block statistics of operands), then `can` (some element may be present) and `must`
    (every element is), broadcast to `shape` (blocks per class axis)."""

    lets: tuple[tuple[tuple[str, ...], Expr], ...]
    can: Expr
    must: Expr
    shape: Expr
    parts: tuple[Expr, ...] = ()  # a split condition's parts' `must` (see `lines`)

    def lines(self) -> list[str]:
        """The classification as host code over `xp`, ending in `return kinds`; the lets
        nothing reads are dropped. With `parts`, the function takes `split`: when true, a
        partial block where one part alone may fail (the others hold over the whole block)
        has kind PARTIAL + 2 * (the part + 1), odd as PARTIAL is."""
        tail = [
            f"can = xp.broadcast_to({render(self.can, 'xp')}, {render(self.shape, 'xp')})",
            f"must = xp.broadcast_to({render(self.must, 'xp')}, {render(self.shape, 'xp')})",
        ]
        if self.parts:
            shape = render(self.shape, "xp")
            fails = ", ".join(f"xp.broadcast_to({render(negation(m), 'xp')}, {shape})" for m in self.parts)
            tail += [
                f"kinds = xp.where(can, xp.where(must, {FULL}, {PARTIAL}), {EMPTY}).astype(xp.int32)",
                "if not split:",
                "    return kinds",
                "# Where one part of the condition alone may fail, the step evaluates only that part.",
                f"fails = xp.stack(({fails},))",
                f"alone = (kinds == {PARTIAL}) & (fails.sum(axis=0) == 1)",
                f"return xp.where(alone, {PARTIAL} + 2 * (xp.argmax(fails, axis=0) + 1), kinds).astype(xp.int32)",
            ]
        else:
            tail.append(f"return xp.where(can, xp.where(must, {FULL}, {PARTIAL}), {EMPTY}).astype(xp.int32)")
        lets = [f"{', '.join(names)} = {render(value, 'xp')}" for names, value in self.lets]
        return live_lines(lets, *tail) + tail


@dataclass(frozen=True)
class Extent:
    """One end (the least or greatest value per block) of an integer term: `bounded` (over
    positions, sizes and literals: int32 without overflow, as the kernels' own index
    arithmetic) plus the sum of coefficient times operand value (`ops`: any int32)."""

    bounded: Expr
    ops: tuple[tuple[int, Expr], ...] = ()


@dataclass(frozen=True)
class Span:
    """An integer term's range per block: its bounded part's least and greatest value, and
    per operand value in it, its coefficient and least and greatest value. The two parts
    are kept apart: ids padded with INT32_MIN added to a position would wrap."""

    lo: Expr
    hi: Expr
    ops: tuple[tuple[int, Expr, Expr], ...] = ()

    def least(self) -> Extent:
        return Extent(self.lo, tuple((c, lo if c > 0 else hi) for c, lo, hi in self.ops))

    def greatest(self) -> Extent:
        return Extent(self.hi, tuple((c, hi if c > 0 else lo) for c, lo, hi in self.ops))

    def shifted(self, v: int) -> "Span":
        return Span(self.lo + v, self.hi + v, self.ops)


def all_of(parts: list[Expr]) -> Expr:
    """The truth arrays and-ed (literals folded: `~True` is -2 in Python, never written)."""
    if any(p is FALSE for p in parts):
        return FALSE
    parts = [p for p in parts if p is not TRUE]
    if not parts:
        return TRUE
    out = parts[0]
    for p in parts[1:]:
        out = out & p
    return out


def any_of(parts: list[Expr]) -> Expr:
    if any(p is TRUE for p in parts):
        return TRUE
    parts = [p for p in parts if p is not FALSE]
    if not parts:
        return FALSE
    out = parts[0]
    for p in parts[1:]:
        out = out | p
    return out


def negation(e: Expr) -> Expr:
    return FALSE if e is TRUE else TRUE if e is FALSE else Not(e)


def _extreme(fn: str, values: list[Expr]) -> Expr:
    return values[0] if len(values) == 1 else Call(fn, (XP, *values))


class Classifier:
    """The block kinds of a row plan's condition (or any `Conditions`) as a `Classification`."""

    def __init__(self, plan: Conditions, conv, local, tile_of, size_of, origins=None, array_of=None):
        self.p = plan
        # index -> the global position of its first element (an Expr): a condition compares
        # positions, while a ragged tail is local to the arrays given (a shard on a mesh).
        self.origins = origins or {}
        self.array_of = array_of or (lambda r: None)  # a read's array where not its operand's (a key side given apart)
        self.conv = conv
        self.local = local  # a fresh local name
        self.tile_of = tile_of
        self.size_of = size_of  # index -> its size (an expr over the wrapper's size variables)
        self.lets: list[tuple[tuple[str, ...], Expr]] = []
        self.axes = plan.class_axes
        self.ranges: dict[str, tuple[Expr, Expr]] = {}
        self.read_ranges: dict[Read, tuple[Expr, Expr]] = {}
        self.stats: dict[tuple, tuple[str, str]] = {}  # (helper, array, tiles) -> its two results

    def let(self, name: str, value: Expr) -> Var:
        self.lets.append(((name,), value))
        return Var(name)

    def place(self, indices) -> Expr:
        """A reshape target putting `indices` on their class axes (1 elsewhere)."""
        return Tup(tuple(Const(-1) if a in indices else Const(1) for a in self.axes))

    def blocks(self, i: str) -> Expr:
        return self.size_of(i).cdiv(self.tile_of(i))

    def index_range(self, i: str) -> tuple[Expr, Expr]:
        """Per block along `i`, its first and last element."""
        if i not in self.ranges:
            t = self.tile_of(i)
            blocks = self.let(self.local(f"{i}_block"), Call("xp.reshape", (Call("xp.arange", (self.blocks(i),)), self.place([i]))))
            lo = self.let(self.local(f"{i}_lo"), blocks * t)
            hi = lo if t == 1 else self.let(self.local(f"{i}_hi"), Min(lo + t, self.size_of(i)) - 1)
            self.ranges[i] = (lo, hi)
        return self.ranges[i]

    def read_range(self, r: Read) -> tuple[Expr, Expr]:
        """Per block, the least and greatest value an integer operand holds there."""
        if r not in self.read_ranges:
            self.read_ranges[r] = self.block_pair(r, "_block_min_max", lambda x: x, ("min", "max"))
        return self.read_ranges[r]

    def block_pair(self, r: Read, helper: str, of, what: tuple[str, str]) -> tuple[Expr, Expr]:
        """Two per-block statistics of an operand (`helper` over `of` its array, and its
        tiles; computed once per operand), laid out over the class axes as `r` reads it."""
        keyed = self.array_of(r)
        param = keyed or self.conv.param(r.operand).internal
        dims = [render(self.conv.size(d), "host") for d in self.p.kernel.operand(r.operand).dims]
        param = Lit(as_read(param, r, dims, [render(self.size_of(i), "host") for i in r.indices]))
        tiles = Tup(tuple(Const(self.tile_of(i)) for i in r.indices))
        key = (helper, param.text, tuple(self.tile_of(i) for i in r.indices))
        if key not in self.stats:
            names = tuple(self.local(f"{keyed or r.operand}_{w}") for w in what)
            self.lets.append((names, Call(helper, (of(param), tiles))))
            self.stats[key] = names
        order = "".join(chr(97 + n) for n in range(len(r.indices)))
        dst = "".join(order[r.indices.index(x)] if x in r.indices else "z" for x in self.axes)
        if dst == order:
            return tuple(Var(x) for x in self.stats[key])
        return tuple(self.let(self.local(f"{x}_{''.join(r.indices)}"), Call("_expand", (Var(x), Lit(f'"{order}"'), Lit(f'"{dst}"'))))
                     for x in self.stats[key])

    # Integer terms as ranges; None: unknown.
    def affine(self, t: Term) -> dict | None:
        """t as {atom: coefficient} with the constant under key 1 (an int, or an expr over
        sizes); atoms are index names or Terms; None when t is not a sum of atoms times
        integer constants."""
        if t.op == "num":
            return {1: t.value}
        if t.op == "size":
            return {1: Var(self.conv.size_var(t.name))}
        if t.op == "index":
            return {t.name: 1}
        if t.op in ("+", "-"):
            a, b = self.affine(t.args[0]), self.affine(t.args[1])
            if a is None or b is None:
                return None
            sign = 1 if t.op == "+" else -1
            out = dict(a)
            for key, c in b.items():
                out[key] = _add(out.get(key, 0), _mul(sign, c))
            return out
        if t.op == "neg":
            a = self.affine(t.args[0])
            return None if a is None else {k: _mul(-1, c) for k, c in a.items()}
        if t.op == "*":
            a, b = self.affine(t.args[0]), self.affine(t.args[1])
            if a is None or b is None:
                return {t: 1}
            for x, y in ((a, b), (b, a)):
                if set(x) == {1} and isinstance(x[1], int):
                    return {k: _mul(x[1], c) for k, c in y.items()}
            return {t: 1}
        return {t: 1}  # // % reads: atoms with their own ranges

    def atom_range(self, atom) -> tuple[Expr, Expr, bool] | None:
        """An atom's least and greatest value per block, and whether they come from operand
        data (any int32: compared, never added to positions; see `_le`)."""
        if isinstance(atom, str):
            lo, hi = self.index_range(atom)
            origin = self.origins.get(atom)
            return (lo, hi, False) if origin is None else (lo + origin, hi + origin, False)
        t: Term = atom
        if t.op == "read":
            return (*self.read_range(t.read), True)
        if t.op in ("//", "%") and t.args[1].op == "num" and t.args[1].value > 0:
            inner = self.value_range(t.args[0])
            if inner is None:
                return None
            lo, hi, data = inner
            c = t.args[1].value
            if t.op == "//":
                return lo.div(c), hi.div(c), data
            same = lo.div(c).eq(hi.div(c))  # one period: the remainders keep their order
            return Where(same, lo.rem(c), 0), Where(same, hi.rem(c), c - 1), data
        if t.op == "*":
            a, b = self.span(t.args[0]), self.span(t.args[1])
            if a is None or b is None or a.ops or b.ops:
                return None  # a product of operand values may leave int32: unknown
            corners = [x * y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
            return _extreme("_min_of", corners), _extreme("_max_of", corners), False
        return None

    def value_range(self, t: Term) -> tuple[Expr, Expr, bool] | None:
        """A term's least and greatest value as two arrays: its bounded part alone, or one
        operand value plus it (added saturating: `_sat_add`); None for anything else."""
        s = self.span(t)
        if s is None:
            return None
        if not s.ops:
            return s.lo, s.hi, False
        if len(s.ops) != 1 or s.ops[0][0] != 1:
            return None
        _, lo, hi = s.ops[0]
        if isinstance(s.lo, Const) and s.lo.value == 0 and isinstance(s.hi, Const) and s.hi.value == 0:
            return lo, hi, True
        return Call("_sat_add", (lo, s.lo)), Call("_sat_add", (hi, s.hi)), True

    def span(self, t: Term) -> Span | None:
        form = self.affine(t)
        return None if form is None else self.form_span(form)

    def form_span(self, form: dict) -> Span | None:
        """An affine form's least and greatest value per block (`Span`)."""
        const = form.get(1, 0)
        lo, hi = ([(1, lift(const))], [(1, lift(const))]) if not (isinstance(const, int) and const == 0) else ([], [])
        ops = []
        for atom, c in form.items():
            if atom == 1 or (isinstance(c, int) and c == 0):
                continue
            r = self.atom_range(atom)
            if r is None or not isinstance(c, int):
                return None
            a, b, data = r
            if data:
                ops.append((c, a, b))
                continue
            a, b = (a, b) if c > 0 else (b, a)
            lo.append((c, a))
            hi.append((c, b))
        return Span(_sum(lo), _sum(hi), tuple(ops))

    # Truth values: (can, must) trees.
    def truth(self, t: Term) -> tuple[Expr, Expr]:
        if t.op == "truth":
            return self.block_pair(t.read, "_block_any_all", lambda x: x.ne(0), ("any", "all"))
        if t.op == "not":
            can, must = self.truth(t.args[0])
            return negation(must), negation(can)
        if t.op == "or":
            parts = [self.truth(a) for a in t.args]
            return any_of([c for c, _ in parts]), any_of([m for _, m in parts])
        if t.op == "and":
            return self.conjunction(list(t.args))
        if t.op == "cmp":  # a chain a < b < c is split by conjunction
            return self.conjunction([t])
        raise AssertionError(t.op)

    def conjunction(self, terms: list[Term]) -> tuple[Expr, Expr]:
        """and: comparisons of one affine form intersect their bounds (exact); the rest and-ed."""
        parts = self.conjunct_parts(conjuncts(Term("and", tuple(terms))))
        return all_of([c for _, c, _ in parts]), all_of([m for _, _, m in parts])

    def conjunct_parts(self, flat: list[Term]) -> list[tuple[tuple[int, ...], Expr, Expr]]:
        """An `and`'s conjuncts (`conjuncts`) as parts: ids compared with an index walked one
        value at a time (`presence`), the comparisons of one form of positions together (their
        bounds intersected: `lo[g] <= m < lo[g + 1]` is one part), each other term alone; per
        part, the conjuncts it holds (their places in `flat`), its `can` and its `must`."""
        groups: dict[tuple, list[tuple[int, Span | None, Span | None]]] = {}
        rest: list[tuple[int, Term]] = []
        found: list[tuple[tuple[int, ...], Expr, Expr]] = []
        for n, t in enumerate(flat):
            exact = self.presence(t) if t.op == "cmp" else None
            if exact is not None:
                found.append(((n,), *exact))
                continue
            bound = self.bound(t) if t.op == "cmp" else None
            if bound is None:
                rest.append((n, t))
                continue
            key, lo, hi = bound
            groups.setdefault(key, []).append((n, lo, hi))
        parts = []
        for key, bounds in groups.items():
            held = tuple(n for n, _, _ in bounds)
            p = self.form_span(dict(key))
            if p is None:
                parts.append((held, TRUE, FALSE))
                continue
            lows = _merged([b for _, b, _ in bounds if b is not None], "_max_of")
            highs = _merged([b for _, _, b in bounds if b is not None], "_min_of")
            # Some value of the form lies between every low and every high bound; every value does.
            can = [_le(low.least(), p.greatest(), TRUE) for low in lows] + [_le(p.least(), high.greatest(), TRUE) for high in highs]
            can += [_le(low.least(), high.greatest(), TRUE) for low in lows for high in highs]
            must = [_le(low.greatest(), p.least(), FALSE) for low in lows] + [_le(p.greatest(), high.least(), FALSE) for high in highs]
            parts.append((held, all_of(can), all_of(must)))
        for n, t in rest:
            c, m = self.truth(t) if t.op != "cmp" else self.compare(t)
            parts.append(((n,), c, m))
        return found + parts

    def presence(self, t: Term) -> tuple[Expr, Expr] | None:
        """`ids[i] == g (+ c)` with `g` walked one value at a time (a class axis of tile 1) and
        `i` another class axis: per (block of i, value of g), whether some id of the block is
        that value and whether every one is (`_group_presence`, a scatter: exact for ids in any
        order, where ranges count every value between a block's least and greatest id)."""
        if t.ops != ("==",):
            return None
        form = self.affine(Term("-", (t.args[0], t.args[1])))
        if form is None:
            return None
        shift = form.pop(1, 0)
        atoms = [(a, c) for a, c in form.items() if not (isinstance(c, int) and c == 0)]
        if not isinstance(shift, int) or abs(shift) >= 1 << 30 or len(atoms) != 2:
            return None
        (read, cr), (g, cg) = sorted(atoms, key=lambda ac: isinstance(ac[0], str))
        if not (isinstance(g, str) and isinstance(read, Term) and read.op == "read" and cr in (1, -1) and cg == -cr):
            return None
        r = read.read
        sub = r.subs[0] if len(r.subs) == 1 else None
        if (sub is None or not sub.lowered or sub.divisor != 1 or sub.offset is not None or g not in self.axes or self.tile_of(g) != 1
                or g in self.origins or r.indices[0] not in self.axes or r.indices[0] == g):
            return None
        # ids + shift * cr == g: the group of an id is the id plus `shift` (times the ids' sign, +1).
        i = r.indices[0]
        keyed = self.array_of(r)
        param = keyed or self.conv.param(r.operand).internal
        dims = [render(self.conv.size(d), "host") for d in self.p.kernel.operand(r.operand).dims]
        ids = Lit(as_read(param, r, dims, [render(self.size_of(i), "host")]))
        key = ("_group_presence", ids.text, self.tile_of(i), shift * cr)
        if key not in self.stats:
            names = tuple(self.local(f"{keyed or r.operand}_{w}") for w in ("present", "whole"))
            self.lets.append((names, Call("_group_presence", (ids, Const(self.tile_of(i)), self.size_of(g), Const(shift * cr)))))
            self.stats[key] = names
        dst = "".join("a" if x == i else "b" if x == g else "z" for x in self.axes)
        if dst == "ab":
            return tuple(Var(x) for x in self.stats[key])
        return tuple(self.let(self.local(f"{x}_{i}{g}"), Call("_expand", (Var(x), Lit('"ab"'), Lit(f'"{dst}"')))) for x in self.stats[key])

    def bound(self, t: Term):
        """A comparison as `low <= form <= high`: `form` over positions (indices and terms of
        them, its first coefficient positive: the key), `low` and `high` spans of the rest
        (operand values, sizes, literals), None where absent."""
        a, b = self.affine(t.args[0]), self.affine(t.args[1])
        if a is None or b is None:
            return None
        form = dict(a)
        for k, c in b.items():
            form[k] = _add(form.get(k, 0), _mul(-1, c))
        const = form.pop(1, 0)
        form = {k: c for k, c in form.items() if not (isinstance(c, int) and c == 0)}
        if not form or not all(isinstance(c, int) for c in form.values()):
            return None
        op = t.ops[0]
        if op == "!=":
            return None  # no interval
        data = {k: c for k, c in form.items() if not isinstance(k, str) and _reads_data(k)}
        key = sorted(((k, c) for k, c in form.items() if k not in data), key=lambda kv: repr(kv[0]))
        if key and key[0][1] < 0:  # `lo[g] <= m` and `m < lo[g + 1]` bound the same form, m
            key = [(k, -c) for k, c in key]
            data = {k: -c for k, c in data.items()}
            const = _mul(-1, const)
            op = {">=": "<=", ">": "<", "<=": ">=", "<": ">", "==": "=="}[op]
        # form + data + const op 0: form op -(data + const)
        rest = self.form_span({**{k: -c for k, c in data.items()}, 1: _mul(-1, const)})
        if rest is None:
            return None
        key = tuple(key)
        if op == ">=":
            return key, rest, None
        if op == ">":
            return key, rest.shifted(1), None
        if op == "<=":
            return key, None, rest
        if op == "<":
            return key, None, rest.shifted(-1)
        return key, rest, rest  # ==

    def compare(self, t: Term) -> tuple[Expr, Expr]:
        s = self.span(Term("-", (t.args[0], t.args[1])))
        if s is None:
            return TRUE, FALSE
        op = t.ops[0]
        if not s.ops and isinstance(s.lo, Const) and isinstance(s.hi, Const):  # no index in it: decided here
            lo = s.lo.value
            truth = {">=": lo >= 0, ">": lo > 0, "<=": lo <= 0, "<": lo < 0, "==": lo == 0, "!=": lo != 0}[op]
            return (TRUE, TRUE) if truth else (FALSE, FALSE)
        zero = Span(Const(0), Const(0), ())

        def ge(x: Extent, v: int, unknown: Expr) -> Expr:
            return _le(zero.shifted(v).least(), x, unknown)

        def le(x: Extent, v: int, unknown: Expr) -> Expr:
            return _le(x, zero.shifted(v).least(), unknown)

        lo, hi = s.least(), s.greatest()
        if op == "==":
            return all_of([le(lo, 0, TRUE), ge(hi, 0, TRUE)]), all_of([ge(lo, 0, FALSE), le(hi, 0, FALSE)])
        if op == "!=":
            return negation(all_of([ge(lo, 0, FALSE), le(hi, 0, FALSE)])), any_of([ge(lo, 1, FALSE), le(hi, -1, FALSE)])
        return {
            ">=": lambda: (ge(hi, 0, TRUE), ge(lo, 0, FALSE)),
            ">": lambda: (ge(hi, 1, TRUE), ge(lo, 1, FALSE)),
            "<=": lambda: (le(lo, 0, TRUE), le(hi, 0, FALSE)),
            "<": lambda: (le(lo, -1, TRUE), le(hi, -1, FALSE)),
        }[op]()

    def classification(self, ragged: list[str], split: bool = False) -> Classification:
        """The block kinds: EMPTY/PARTIAL/FULL per block over the class axes; `ragged`: the
        class axes whose last block may be partly past the end (never full). `split`: for a
        single condition, an `and` of parts (`conjunct_parts`), also which part alone may
        fail in a partial block (`Classification.parts`, `self.split`: per conjunct, its part)."""
        # A block is visited if some point may have an element present there, and full
        # (no condition evaluated) only if every point has all of them.
        conds = [pt.condition for pt in self.p.points if pt.condition is not None]
        self.split = None
        split_musts: tuple[Expr, ...] = ()
        if split and len(self.p.points) == 1 and len(conds) == 1 and len(conjuncts(conds[0])) > 1:
            flat = conjuncts(conds[0])
            got = self.conjunct_parts(flat)
            parts = [(all_of([c for _, c, _ in got]), all_of([m for _, _, m in got]))]
            if len(got) > 1:
                self.split = [next(g for g, (held, _, _) in enumerate(got) if n in held) for n in range(len(flat))]
                split_musts = tuple(m for _, _, m in got)
        else:
            parts = [self.truth(pt.condition) if pt.condition is not None else (TRUE, TRUE) for pt in self.p.points]
        can, must = any_of([c for c, _ in parts]), all_of([m for _, m in parts])
        tails = [(self.index_range(i)[0] + self.tile_of(i)).gt(self.size_of(i)) for i in ragged]
        if tails:
            must = all_of([must, negation(any_of(tails))])
        shape = Tup(tuple(self.blocks(a) for a in self.axes))
        return Classification(tuple(self.lets), can, must, shape, split_musts)

    def kinds(self, ragged: list[str], split: bool = False) -> list[str]:
        """Host lines computing the block kinds (`Classification.lines`)."""
        return self.classification(ragged, split).lines()


def conjuncts(t: Term) -> list[Term]:
    """The conjuncts of a condition (itself if not an `and`): an `and`'s terms, a chain
    `a < b < c` as its comparisons, one level deep (as the classifier intersects them)."""
    terms = list(t.args) if t.op == "and" else [t]
    flat: list[Term] = []
    for x in terms:
        if x.op == "and":
            flat += list(x.args)
        elif x.op == "cmp" and len(x.ops) > 1:
            flat += [Term("cmp", (x.args[n], x.args[n + 1]), ops=(op,)) for n, op in enumerate(x.ops)]
        else:
            flat.append(x)
    return flat


def _le(a: Extent, b: Extent, unknown: Expr) -> Expr:
    """a <= b per block, decided here when both are numbers. Operand values are compared
    with the positions' part, never added to it, so nothing overflows int32: one value
    (its coefficient divided into the other side), or two with coefficients of one added
    or subtracted saturating (`_sat_add`, `_sat_sub`: exact against a value inside int32);
    `unknown` for more."""
    terms = a.ops + tuple((-c, v) for c, v in b.ops)
    x, y = a.bounded, b.bounded
    if not terms:
        if isinstance(x, Const) and isinstance(y, Const):
            return TRUE if x.value <= y.value else FALSE
        return y.ge(x) if isinstance(x, Const) else x.le(y)
    if len(terms) == 1:
        ((c, v),) = terms
        if c > 0:  # c v <= y - x
            t = _diff(y, x)
            return v.le(t if c == 1 else t.div(c))
        # -c v >= x - y: v >= ceil((x - y) / -c)
        return v.ge(_diff(x, y) if c == -1 else _negate(_diff(y, x).div(-c)))
    if len(terms) == 2 and all(abs(c) == 1 for c, _ in terms):
        (c1, v1), (c2, v2) = terms
        if c1 == c2:
            total = Call("_sat_add", (v1, v2))
            return total.le(_diff(y, x)) if c1 > 0 else total.ge(_diff(x, y))
        plus, minus = (v1, v2) if c1 > 0 else (v2, v1)
        return Call("_sat_sub", (plus, minus)).le(_diff(y, x))
    return unknown


def _diff(a: Expr, b: Expr) -> Expr:
    """a - b, plainly written (`m_lo + 1`, `-x`)."""
    if isinstance(b, Const):
        return a - b.value if b.value >= 0 else a + (-b.value)
    if isinstance(a, Const) and a.value == 0:
        return Neg(b)
    return a - b


def _negate(e: Expr) -> Expr:
    return Const(-e.value) if isinstance(e, Const) else Neg(e)


def _reads_data(t: Term) -> bool:
    """Does an atom's value come from operand data (a read, or a term of one)?"""
    return any(x.op == "read" for x in t.walk())


def _merged(spans: list[Span], fn: str) -> list[Span]:
    """Bounds of one side: those without operand values merged into one (`_max_of` of the
    low ones, `_min_of` of the high ones; folded when numbers), the others kept apart."""
    plain = [s.lo for s in spans if not s.ops]
    kept = [s for s in spans if s.ops]
    if len(plain) > 1:
        if all(isinstance(v, Const) for v in plain):
            pick = max if fn == "_max_of" else min
            plain = [Const(pick(v.value for v in plain))]
        else:
            plain = [_extreme(fn, plain)]
    return [Span(v, v, ()) for v in plain] + kept


def _sum(terms: list[tuple[int, Expr]]) -> Expr:
    """sum of c * x (c an int): `a - 2 * b` rather than `a + -2 * b`."""
    if not terms:
        return Const(0)
    c, x = terms[0]
    out = x if c == 1 else Neg(x) if c == -1 else Const(c) * x
    for c, x in terms[1:]:
        if isinstance(x, Const) and x.value < 0:  # `N - 300` rather than `N + -300`
            c, x = -c, Const(-x.value)
        out = out + (x if c == 1 else Const(c) * x) if c > 0 else out - (x if c == -1 else Const(-c) * x)
    return out


def _add(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    if isinstance(b, int) and b < 0:
        return lift(a) - (-b)
    return lift(a) + lift(b)


def _mul(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    return lift(a) * lift(b)
