"""A small expression language for index maps and kernel conditions.

The planner builds these trees; the emitter renders them as Python for Pallas
(integer division as `lax.div`, which lowers for TPU without needing the chip's
identity, unlike `//` on signed values) and `plan` renders them for people. Host array
code over `xp` (numpy at trace time, jax.numpy for traced operands: the block
classification) is rendered from the same trees in the "xp" style.
"""

from __future__ import annotations

from dataclasses import dataclass


class Expr:
    def __post_init__(self):
        # Allow plain ints wherever an expression is expected.
        for field in ("index", "a", "b", "cond"):
            if hasattr(self, field) and not isinstance(getattr(self, field), Expr):
                object.__setattr__(self, field, lift(getattr(self, field)))

    def __add__(self, other):
        return _bin("+", self, lift(other))

    def __sub__(self, other):
        return _bin("-", self, lift(other))

    def __mul__(self, other):
        return _bin("*", self, lift(other))

    def __and__(self, other):
        return _bin("&", self, lift(other))

    def __or__(self, other):
        return _bin("|", self, lift(other))

    def eq(self, other):
        return _bin("==", self, lift(other))

    def ne(self, other):
        return _bin("!=", self, lift(other))

    def lt(self, other):
        return _bin("<", self, lift(other))

    def gt(self, other):
        return _bin(">", self, lift(other))

    def div(self, other):
        return _bin("//", self, lift(other))

    def rem(self, other):
        return _bin("%", self, lift(other))

    def cdiv(self, other):
        """Ceiling division: the number of blocks of `other` that cover `self`."""
        return _bin("cdiv", self, lift(other))

    def le(self, other):
        return _bin("<=", self, lift(other))

    def ge(self, other):
        return _bin(">=", self, lift(other))


@dataclass(frozen=True, eq=False)
class Var(Expr):
    name: str


@dataclass(frozen=True, eq=False)
class Const(Expr):
    value: int


@dataclass(frozen=True, eq=False)
class Load(Expr):
    """An element of a scalar-prefetch array (SMEM)."""

    array: str
    index: Expr


@dataclass(frozen=True, eq=False)
class Bin(Expr):
    op: str
    a: Expr
    b: Expr


@dataclass(frozen=True, eq=False)
class Where(Expr):
    cond: Expr
    a: Expr
    b: Expr


@dataclass(frozen=True, eq=False)
class Call(Expr):
    """A call of a Pallas primitive, e.g. pl.program_id(0)."""

    fn: str
    args: tuple[Expr, ...]


@dataclass(frozen=True, eq=False)
class Not(Expr):
    """Elementwise logical not of a truth array (`~a`)."""

    a: Expr


@dataclass(frozen=True, eq=False)
class Neg(Expr):
    a: Expr


@dataclass(frozen=True, eq=False)
class Lit(Expr):
    """An atom of host code written as it is: a string literal, `True`, an operand's slice."""

    text: str


@dataclass(frozen=True, eq=False)
class Tup(Expr):
    items: tuple[Expr, ...]


@dataclass(frozen=True, eq=False)
class Max(Expr):
    a: Expr
    b: Expr


@dataclass(frozen=True, eq=False)
class Min(Expr):
    a: Expr
    b: Expr


def clip(e: Expr, low, high) -> Expr:
    return Max(Min(e, lift(high)), lift(low))


def lift(value) -> Expr:
    return value if isinstance(value, Expr) else Const(int(value))


_FOLD = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "//": lambda a, b: a // b,
    "%": lambda a, b: a % b,
    "cdiv": lambda a, b: -(-a // b),
}


def _bin(op: str, a: Expr, b: Expr) -> Expr:
    """Build a binary node, folding constants and identities so generated code stays plain."""
    if isinstance(a, Const) and isinstance(b, Const) and op in _FOLD:
        return Const(_FOLD[op](a.value, b.value))
    if isinstance(b, Const):
        if (op in ("+", "-") and b.value == 0) or (op in ("*", "//", "cdiv") and b.value == 1):
            return a
        if op == "%" and b.value == 1:
            return Const(0)
    if isinstance(a, Const):
        if op == "+" and a.value == 0:
            return b
        if op == "*" and a.value == 1:
            return b
    return Bin(op, a, b)


def flat(coords: list[Expr], extents: list[Expr]) -> Expr:
    """Row-major flat position of `coords` in a grid of `extents`."""
    out = coords[0]
    for c, n in zip(coords[1:], extents[1:]):
        out = out * n + c
    return out


# Python's precedence: comparisons bind loosest (and chain), then | and &.
_PREC = {"==": 1, "!=": 1, "<": 1, ">": 1, "<=": 1, ">=": 1, "|": 2, "&": 3, "+": 4, "-": 4, "*": 5, "//": 5, "%": 5}


_UNARY = 6  # -a, ~a: tighter than * and //, looser than an atom


def _render(e: Expr, style: str) -> tuple[str, int]:
    """Render with minimal parentheses; returns (text, precedence)."""
    if isinstance(e, Var):
        return e.name, 9
    if isinstance(e, Const):
        return str(e.value), (9 if e.value >= 0 else _UNARY)
    if isinstance(e, Lit):
        return e.text, 9
    if isinstance(e, Tup):
        items = [render(x, style) for x in e.items]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")", 9
    if isinstance(e, Not) and style == "xp":
        # Not `~`: a truth value over sizes only is a Python bool, and ~True is -2 (truthy).
        return f"xp.logical_not({render(e.a, style)})", 9
    if isinstance(e, (Not, Neg)):
        a, pa = _render(e.a, style)
        return ("~" if isinstance(e, Not) else "-") + (a if pa >= _UNARY else f"({a})"), _UNARY
    if isinstance(e, Load):
        return f"{e.array}[{render(e.index, style)}]", 9
    if isinstance(e, Call):
        fn = e.fn if style != "text" else e.fn.split(".")[-1]
        return f"{fn}({', '.join(render(a, style) for a in e.args)})", 9
    if isinstance(e, (Max, Min)):
        word = "max" if isinstance(e, Max) else "min"
        fn = f"jnp.{word}imum" if style == "py" else f"xp.{word}imum" if style == "xp" else word
        return f"{fn}({render(e.a, style)}, {render(e.b, style)})", 9
    if isinstance(e, Where):
        if style != "text":
            return f"{'xp' if style == 'xp' else 'jnp'}.where({render(e.cond, style)}, {render(e.a, style)}, {render(e.b, style)})", 9
        return f"({render(e.a, style)} if {render(e.cond, style)} else {render(e.b, style)})", 9
    if isinstance(e, Bin):
        if e.op == "cdiv":
            if style == "text":
                return f"ceil({render(e.a, style)} / {render(e.b, style)})", 9
            if style == "xp":
                a, pa = _render(e.a, style)
                b, pb = _render(e.b, style)
                return f"-(-{a if pa >= _UNARY else f'({a})'} // {b if pb > 5 else f'({b})'})", _UNARY
            return f"pl.cdiv({render(e.a, style)}, {render(e.b, style)})", 9
        if style == "py" and e.op in ("//", "%"):  # device code
            fn = "lax.div" if e.op == "//" else "lax.rem"
            return f"{fn}({render(e.a, style)}, {render(e.b, style)})", 9
        prec = _PREC[e.op]
        a, pa = _render(e.a, style)
        b, pb = _render(e.b, style)
        if pa < prec or (pa == prec and prec == 1):  # a == b == c would chain
            a = f"({a})"
        # Left-associative: the right side needs parentheses at equal precedence
        # unless the operator is associative.
        same = isinstance(e.b, Bin) and e.b.op == e.op
        if pb < prec or (pb == prec and not (same and e.op in ("+", "*", "&", "|"))):
            b = f"({b})"
        return f"{a} {e.op} {b}", prec
    raise TypeError(e)


def render(e: Expr, style: str = "py") -> str:
    """`style` is "py" (Pallas device code), "host" (plain Python), "xp" (host array code
    over `xp`, numpy or jax.numpy) or "text" (for people)."""
    return _render(e, style)[0]


def substitute(e: Expr, values: dict[str, Expr], arrays: dict[str, str] | None = None) -> Expr:
    """`e` with the variables in `values` replaced (folding constants again), and the arrays
    it loads from renamed by `arrays`."""

    def sub(x: Expr) -> Expr:
        return substitute(x, values, arrays)

    if isinstance(e, Var):
        return values.get(e.name, e)
    if isinstance(e, (Const, Lit)):
        return e
    if isinstance(e, Bin):
        return _bin(e.op, sub(e.a), sub(e.b))
    if isinstance(e, (Max, Min)):
        return type(e)(sub(e.a), sub(e.b))
    if isinstance(e, Load):
        return Load((arrays or {}).get(e.array, e.array), sub(e.index))
    if isinstance(e, Where):
        return Where(sub(e.cond), sub(e.a), sub(e.b))
    if isinstance(e, Call):
        return Call(e.fn, tuple(sub(a) for a in e.args))
    if isinstance(e, (Not, Neg)):
        return type(e)(sub(e.a))
    if isinstance(e, Tup):
        return Tup(tuple(sub(x) for x in e.items))
    raise TypeError(e)


def names(e: Expr) -> set[str]:
    """Variables and arrays an expression reads."""
    if isinstance(e, Var):
        return {e.name}
    if isinstance(e, (Const, Lit)):
        return set()
    if isinstance(e, (Not, Neg)):
        return names(e.a)
    if isinstance(e, Tup):
        return set().union(*(names(x) for x in e.items))
    if isinstance(e, Load):
        return {e.array} | names(e.index)
    if isinstance(e, Call):
        return set().union(*(names(a) for a in e.args))
    if isinstance(e, (Bin, Max, Min)):
        return names(e.a) | names(e.b)
    if isinstance(e, Where):
        return names(e.cond) | names(e.a) | names(e.b)
    raise TypeError(e)


def evaluate(e: Expr, env: dict[str, int | None]) -> int | None:
    """An integer expression over sizes (None where a name is unknown)."""
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Var):
        return env.get(e.name)
    if isinstance(e, (Bin, Max, Min)):
        a, b = evaluate(e.a, env), evaluate(e.b, env)
        if a is None or b is None:
            return None
        if isinstance(e, Max):
            return max(a, b)
        if isinstance(e, Min):
            return min(a, b)
        if e.op in ("//", "%", "cdiv") and not b:
            return None
        return _FOLD[e.op](a, b) if e.op in _FOLD else None
    return None
