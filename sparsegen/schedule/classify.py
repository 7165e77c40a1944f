"""Block classification, backend-neutral: a condition over a walk's class axes as host code
(numpy at trace time, jax.numpy for traced operands) computing, per block, whether it is
empty, partial or full. The row walk (attention) and the condition walk (a product's
terms) both classify with it; the kernel-side evaluation of a condition is the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Kernel, Read, Term
from ..expr import render
from ..pytext import live_lines
from ..terms import as_read

# Block kinds (the same numbering in every walk's tables).
EMPTY, PARTIAL, FULL = 0, 1, 2

# ------------------------------------------------------------- classification
# A condition is classified per block as two truth arrays over the class axes: `can`
# (some element may be present) and `must` (every element is). Integer terms become
# ranges [lo, hi] over a block; a comparison of two terms is one of their difference, an
# affine form over independent atoms (index values; other terms are atoms with their own
# ranges), so a single comparison is exact; an `and` of comparisons of the same affine form
# is intersected first (a window: i >= j and i - j < 1024), so it is exact too.


@dataclass(frozen=True)
class Conditions:
    """What the classifier reads of a plan: the points' conditions and the class axes (a
    row plan is one; an einsum's condition over its whole index space is another)."""

    points: tuple  # each with a `.condition` (None: every element present)
    class_axes: tuple[str, ...]
    kernel: Kernel  # whose operands the conditions read


class Classifier:
    """Host code (over `xp`: numpy at trace time, or jax.numpy for traced operands) that
    computes the block kinds of a row plan's condition (or any `Conditions`)."""

    def __init__(self, plan: Conditions, conv, local, tile_of, size_of):
        self.p = plan
        self.conv = conv
        self.local = local  # a fresh local name
        self.tile_of = tile_of
        self.size_of = size_of  # index -> host expression of its size
        self.lines: list[str] = []
        self.axes = plan.class_axes
        self.ranges: dict[str, tuple[str, str]] = {}
        self.read_ranges: dict[Read, tuple[str, str]] = {}

    def shape_for(self, indices) -> str:
        """A reshape target putting `indices` on their class axes (1 elsewhere)."""
        return "(" + ", ".join("-1" if a in indices else "1" for a in self.axes) + ("," if len(self.axes) == 1 else "") + ")"

    def index_range(self, i: str) -> tuple[str, str]:
        if i not in self.ranges:
            t = self.tile_of(i)
            blocks = self.local(f"{i}_block")
            lo, hi = self.local(f"{i}_lo"), self.local(f"{i}_hi")
            size = self.size_of(i)
            self.lines.append(f"{blocks} = xp.arange(-(-{size} // {t})).reshape({self.shape_for([i])})")
            self.lines.append(f"{lo} = {blocks} * {t}")
            self.lines.append(f"{hi} = xp.minimum({lo} + {t}, {size}) - 1")
            self.ranges[i] = (lo, hi)
        return self.ranges[i]

    def read_range(self, r: Read) -> tuple[str, str]:
        """Per block, the least and greatest value an integer operand holds there."""
        if r not in self.read_ranges:
            self.read_ranges[r] = self.block_pair(r, "_block_min_max", "{}", ("min", "max"))
        return self.read_ranges[r]

    def block_pair(self, r: Read, helper: str, of: str, what: tuple[str, str]) -> tuple[str, str]:
        """Two per-block statistics of an operand (`helper` over `of` its array, and its
        tiles), laid out over the class axes."""
        a, b = (self.local(f"{r.operand}_{w}") for w in what)
        param = self.conv.param(r.operand).internal
        dims = [render(self.conv.size(d), "host") for d in self.p.kernel.operand(r.operand).dims]
        param = as_read(param, r, dims, [self.size_of(i) for i in r.indices])
        tiles = "(" + ", ".join(str(self.tile_of(i)) for i in r.indices) + ",)"
        order = "".join(chr(97 + n) for n in range(len(r.indices)))
        dst = "".join(order[r.indices.index(x)] if x in r.indices else "z" for x in self.axes)
        self.lines.append(f"{a}, {b} = {helper}({of.format(param)}, {tiles})")
        self.lines.append(f'{a}, {b} = _expand({a}, "{order}", "{dst}"), _expand({b}, "{order}", "{dst}")')
        return a, b

    # Integer terms as ranges; None: unknown.
    def affine(self, t: Term) -> dict | None:
        """t as {atom: coefficient} with the constant under key 1; atoms are index names or
        Terms; None when t is not a sum of atoms times integer constants."""
        if t.op == "num":
            return {1: t.value}
        if t.op == "size":
            return {1: self.conv.size_var(t.name)}
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

    def atom_range(self, atom) -> tuple[str, str] | None:
        if isinstance(atom, str):
            return self.index_range(atom)
        t: Term = atom
        if t.op == "read":
            return self.read_range(t.read)
        if t.op in ("//", "%") and t.args[1].op == "num" and t.args[1].value > 0:
            inner = self.range(t.args[0])
            if inner is None:
                return None
            lo, hi = inner
            c = t.args[1].value
            if t.op == "//":
                return f"({lo}) // {c}", f"({hi}) // {c}"
            same = f"(({lo}) // {c} == ({hi}) // {c})"
            return f"xp.where({same}, ({lo}) % {c}, 0)", f"xp.where({same}, ({hi}) % {c}, {c - 1})"
        if t.op == "*":
            a, b = self.range(t.args[0]), self.range(t.args[1])
            if a is None or b is None:
                return None
            corners = [f"({x}) * ({y})" for x in a for y in b]
            return f"_min_of(xp, {', '.join(corners)})", f"_max_of(xp, {', '.join(corners)})"
        return None

    def range(self, t: Term) -> tuple[str, str] | None:
        form = self.affine(t)
        if form is None:
            return None
        return self.form_range(form)

    def form_range(self, form: dict) -> tuple[str, str] | None:
        const = form.get(1, 0)
        lo, hi = ([str(const)], [str(const)]) if const != 0 else ([], [])
        for atom, c in form.items():
            if atom == 1 or c == 0:
                continue
            r = self.atom_range(atom)
            if r is None or not isinstance(c, int):
                return None
            a, b = r if c > 0 else r[::-1]
            lo.append(_term(c, a))
            hi.append(_term(c, b))
        return _sum(lo), _sum(hi)

    # Truth values: (can, must) code.
    def truth(self, t: Term) -> tuple[str, str]:
        if t.op == "truth":
            return self.block_pair(t.read, "_block_any_all", "{} != 0", ("any", "all"))
        if t.op == "not":
            can, must = self.truth(t.args[0])
            return f"~({must})", f"~({can})"
        if t.op == "or":
            parts = [self.truth(a) for a in t.args]
            return " | ".join(f"({c})" for c, _ in parts), " | ".join(f"({m})" for _, m in parts)
        if t.op == "and":
            return self.conjunction(list(t.args))
        if t.op == "cmp":  # a chain a < b < c is split by conjunction
            return self.conjunction([t])
        raise AssertionError(t.op)

    def conjunction(self, terms: list[Term]) -> tuple[str, str]:
        """and: comparisons of one affine form intersect their bounds (exact); the rest and-ed."""
        flat: list[Term] = []
        for t in terms:
            if t.op == "and":
                flat += list(t.args)
            elif t.op == "cmp" and len(t.ops) > 1:
                flat += [Term("cmp", (t.args[n], t.args[n + 1]), ops=(op,)) for n, op in enumerate(t.ops)]
            else:
                flat.append(t)
        groups: dict[tuple, list[tuple[str, object]]] = {}
        rest: list[Term] = []
        for t in flat:
            bound = self.bound(t) if t.op == "cmp" else None
            if bound is None:
                rest.append(t)
                continue
            key, lo, hi = bound
            groups.setdefault(key, []).append((lo, hi))
        cans, musts = [], []
        for key, bounds in groups.items():
            form = dict(key)
            r = self.form_range(form)
            if r is None:
                cans.append("True")
                musts.append("False")
                continue
            lo, hi = (f"({x})" for x in r)
            los = [b for b, _ in bounds if b is not None]
            his = [b for _, b in bounds if b is not None]
            low = f"_max_of(xp, {', '.join(map(str, los))})" if len(los) > 1 else (str(los[0]) if los else None)
            high = f"_min_of(xp, {', '.join(map(str, his))})" if len(his) > 1 else (str(his[0]) if his else None)
            # Some value of the form in [low, high] lies in [lo, hi]; every value does.
            can = [f"({hi} >= {low})" if low else None, f"({lo} <= {high})" if high else None]
            must = [f"({lo} >= {low})" if low else None, f"({hi} <= {high})" if high else None]
            if low and high:
                can.append(f"({low} <= {high})")
            cans.append(" & ".join(c for c in can if c) or "True")
            musts.append(" & ".join(m for m in must if m) or "True")
        for t in rest:
            c, m = self.truth(t) if t.op != "cmp" else self.compare(t)
            cans.append(f"({c})")
            musts.append(f"({m})")
        return " & ".join(cans), " & ".join(musts)

    def bound(self, t: Term):
        """A comparison as `low <= form <= high` over an affine form without constant."""
        a, b = self.affine(t.args[0]), self.affine(t.args[1])
        if a is None or b is None:
            return None
        form = dict(a)
        for k, c in b.items():
            form[k] = _add(form.get(k, 0), _mul(-1, c))
        const = form.pop(1, 0)
        form = {k: c for k, c in form.items() if c != 0}
        if not form or not all(isinstance(c, int) for c in form.values()):
            return None
        key = tuple(sorted(form.items(), key=lambda kv: repr(kv[0])))
        neg = f"-({const})" if const != 0 else "0"
        op = t.ops[0]
        # form + const op 0
        if op == ">=":
            return key, neg, None
        if op == ">":
            return key, f"{neg} + 1", None
        if op == "<=":
            return key, None, neg
        if op == "<":
            return key, None, f"{neg} - 1"
        if op == "==":
            return key, neg, neg
        return None  # != is no interval

    def compare(self, t: Term) -> tuple[str, str]:
        r = self.range(Term("-", (t.args[0], t.args[1])))
        if r is None:
            return "True", "False"
        lo, hi = (f"({x})" for x in r)
        op = t.ops[0]
        return {
            ">=": (f"{hi} >= 0", f"{lo} >= 0"),
            ">": (f"{hi} > 0", f"{lo} > 0"),
            "<=": (f"{lo} <= 0", f"{hi} <= 0"),
            "<": (f"{lo} < 0", f"{hi} < 0"),
            "==": (f"({lo} <= 0) & ({hi} >= 0)", f"({lo} == 0) & ({hi} == 0)"),
            "!=": (f"~(({lo} == 0) & ({hi} == 0))", f"({lo} > 0) | ({hi} < 0)"),
        }[op]

    def kinds(self, ragged: list[str]) -> list[str]:
        """Lines computing `kinds` (EMPTY/PARTIAL/FULL per block over the class axes)."""
        for i in self.axes:
            self.index_range(i)
        # A block is visited if some point may have an element present there, and full
        # (no condition evaluated) only if every point has all of them.
        parts = [self.truth(pt.condition) if pt.condition is not None else ("True", "True") for pt in self.p.points]
        if len(parts) == 1:
            can, must = parts[0]
        else:
            can = "True" if ("True", "True") in parts else " | ".join(f"({c})" for c, _ in parts)
            must = " & ".join(f"({m})" for _, m in parts if m != "True") or "True"
        shape = "(" + ", ".join(f"{self.ranges[a][0]}.size" for a in self.axes) + ",)"
        tails = [f"({self.ranges[i][0]} + {self.tile_of(i)} > {self.size_of(i)})" for i in ragged]
        if tails:
            must = f"({must}) & ~({' | '.join(tails)})"
        tail = [
            f"can = xp.broadcast_to({can}, {shape})",
            f"must = xp.broadcast_to({must}, {shape})",
            f"return xp.where(can, xp.where(must, {FULL}, {PARTIAL}), {EMPTY}).astype(xp.int32)",
        ]
        # Ranges are written whole (lo and hi); the ends no comparison reads are dropped.
        return live_lines(self.lines, *tail) + tail


def _term(c: int, x: str) -> str:
    if c == 1:
        return x
    if c == -1:
        return f"-{x}" if x.isidentifier() else f"-({x})"
    return f"{c} * ({x})"


def _sum(parts: list[str]) -> str:
    if not parts:
        return "0"
    out = parts[0]
    for x in parts[1:]:
        out += f" - {x[1:]}" if x.startswith("-") else f" + {x}"
    return out


def _add(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    return f"({a}) + ({b})"


def _mul(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    return f"({a}) * ({b})"
