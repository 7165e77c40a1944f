"""Checked `ir.Term`s as jax.numpy code: the one renderer of the language's elementwise
expressions and conditions, for host code (`reference`, classification helpers) and for
kernels of every target alike; `leaf` says how a target reads indices, sizes and operands.
"""

from __future__ import annotations

from .flow import FUNCTIONS
from .ir import Read, Term

_FUNCTIONS = {f: f"jnp.{f}" for f in FUNCTIONS}  # every function of the language is jax.numpy's

# Python's precedence of what render_term writes (an atom binds tightest).
_ATOM, _UNARY, _MUL, _ADD, _AND, _OR, _CMP = 7, 6, 5, 4, 3, 2, 1
_RENDERED = {"+": ("+", _ADD), "-": ("-", _ADD), "*": ("*", _MUL), "/": ("/", _MUL), "and": ("&", _AND), "or": ("|", _OR)}


def render_term(t: Term, leaf) -> str:
    """A checked term as jax.numpy code; `leaf` renders indices, sizes and reads (as atoms).

    Brackets only where Python's precedence needs them, so the code keeps the term's exact
    tree (`a + b + c` is `(a + b) + c`; `a - (b - c)` keeps its brackets) and nests no
    deeper than the spec (whose depth the parser bounds)."""
    return _render_term(t, leaf)[0]


def _render_term(t: Term, leaf) -> tuple[str, int]:
    if t.op == "num":
        text = repr(t.value)
        return text, (_UNARY if text.startswith("-") else _ATOM)
    if t.op in ("index", "size", "read", "local", "truth"):
        return leaf(t), _ATOM
    args = [_render_term(x, leaf) for x in t.args]

    def wrap(arg: tuple[str, int], at_least: int) -> str:
        return arg[0] if arg[1] >= at_least else f"({arg[0]})"

    if t.op in ("+", "-", "*", "/"):
        op, prec = _RENDERED[t.op]
        return f"{wrap(args[0], prec)} {op} {wrap(args[1], prec + 1)}", prec
    if t.op in ("and", "or"):
        op, prec = _RENDERED[t.op]
        return f" {op} ".join(wrap(a, prec + 1) for a in args), prec
    if t.op == "neg":
        return f"-{wrap(args[0], _UNARY)}", _UNARY
    if t.op == "not":
        # Not `~`: over sizes only a truth value is a Python bool, and ~True is -2 (truthy).
        return f"jnp.logical_not({args[0][0]})", _ATOM
    if t.op == "cmp":
        # A chain compares neighbours (`a < b <= c`); `&` binds tighter than a comparison.
        pairs = [f"{wrap(args[n], _OR)} {op} {wrap(args[n + 1], _OR)}" for n, op in enumerate(t.ops)]
        return (pairs[0], _CMP) if len(pairs) == 1 else (" & ".join(f"({x})" for x in pairs), _AND)
    if t.op == "//":
        return f"_floordiv({args[0][0]}, {args[1][0]})", _ATOM
    if t.op == "%":
        return f"_mod({args[0][0]}, {args[1][0]})", _ATOM
    return f"{_FUNCTIONS[t.op]}({', '.join(a[0] for a in args)})", _ATOM


def as_read(array: str, read: Read, dims: list[str], sizes: list[str]) -> str:
    """`array` (host code) as `read` sees it: along a dimension read at a shift (`lo[g + 1]`)
    or with a size of its own (`lo[g]` of an `lo: i32[E1]`), the slice its index ranges over.
    `dims`: the array's dimension sizes, `sizes`: the read's indices' sizes (host text)."""
    cut = [bool(sub.shift) or dims[d] != sizes[d] for d, sub in enumerate(read.subs)]
    if not any(cut):
        return array
    parts = [(f"{sub.shift}:{sub.shift} + {sizes[d]}" if sub.shift else f":{sizes[d]}") if c else ":"
             for d, (sub, c) in enumerate(zip(read.subs, cut))]
    return f"{array}[{', '.join(parts)}]"


class ScoreTerms:
    """The leaves of a row walk's elementwise chain and condition inside a kernel, one rule
    on every target (the TPU's row and paged walks, the GPU's row walk, its backward and
    its paged walk) and in `reference`: what differs is how a target reads a position and
    a scalar, and its operands.

    An index is its positions where the walk lays them out (`positions`: a block, tile or
    vector of int32), else a lead index's scalar (`lead`) as `scalar` makes it a term's
    operand (the TPU broadcasts a scalar itself; Mosaic GPU takes a tile of it); a size is
    its static; a local the variable it was rendered into (`values`); a read its value
    (`read`, per target), a truth value `!= 0`. In the chain (a float context) integers
    are cast to `floats` (a size: `float(...)`); a condition compares them as they are."""

    def __init__(self, positions: dict[str, str], lead: dict[str, str], scalar, read, floats: str, size_var,
                 values: dict[str, str] | None = None):
        self.positions, self.lead, self.scalar, self.read = positions, lead, scalar, read
        self.floats, self.size_var = floats, size_var
        self.values = {} if values is None else values

    def leaf(self, t: Term, float_ctx: bool) -> str:
        if t.op == "index":
            v = self.positions[t.name] if t.name in self.positions else self.scalar(self.lead[t.name])
        elif t.op == "size":
            v = self.size_var(t.name)
            return f"float({v})" if float_ctx else v
        elif t.op == "local":
            return self.values[t.read.operand]
        else:
            v = self.read(t.read)
            if t.op == "truth":
                return f"({v} != 0)"
        return f"{v}.astype({self.floats})" if float_ctx else v

    def value(self, t: Term) -> str:
        """A term of the chain (floats)."""
        return render_term(t, lambda x: self.leaf(x, True))

    def test(self, t: Term) -> str:
        """A condition."""
        return render_term(t, lambda x: self.leaf(x, False))

    def chain(self, chain, local, indent: str = "") -> list[str]:
        """The chain's steps (`(name, term)` in order), each into its variable (`local(name)`),
        which later terms (and `point`) read."""
        lines = []
        for name, term in chain:
            var = local(name)
            lines.append(f"{indent}{var} = {self.value(term)}")
            self.values[name] = var
        return lines

    def point(self, pt) -> str:
        """The scores a reduction reads: the chain's local, or an operand read directly."""
        return self.values[pt.local] if pt.local is not None else self.leaf(Term("read", read=pt.read), True)
