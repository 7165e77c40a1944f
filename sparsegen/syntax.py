"""Syntax: the lark grammar, parsed into a typed AST whose nodes carry source spans.

Nothing here judges meaning (unknown dtypes, unbound indices, which expressions a
statement may use...): that is the checker's job. A parse error becomes a Diagnostic
at the offending token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import lark
from lark import Lark, Token, Tree

from .allocation import no_cycle_collection
from .resources import read_resource
from .source import Diagnostic, SourceFile, Span, SpecError

# ---------------------------------------------------------------------------- AST


@dataclass(frozen=True)
class Name:
    text: str
    span: Span


@dataclass(frozen=True)
class Dim:
    """A declared dimension: an integer literal or a symbolic size."""

    value: int | str
    span: Span


@dataclass(frozen=True)
class Operand:
    direction: str  # "in" | "out"
    name: Name
    dtype: Name
    dims: tuple[Dim, ...]
    sparsity: Name | None
    span: Span


@dataclass(frozen=True)
class Offset:
    """A scalar read from an `index` operand: `start[0]`."""

    operand: Name
    position: int
    position_span: Span
    span: Span


@dataclass(frozen=True)
class Subscript:
    """One subscript. Language v1: `i`, `s[0] + i`, `h // 4`; v2: `g + 1` (conditions),
    `j // T` (a size divides), `j % T` / `j % 8`, a read through a table (`pages[b, j // T]`)
    and, inside a table only, an integer literal (`pages[b, 0]`).

    For a table read `index` is the table's name token and `table` the read; for a literal
    `index` is the literal's token: `indices` lists the indices a subscript uses.
    """

    index: Name
    offset: Offset | None
    divisor: int | None  # `h // 4`
    span: Span
    shift: int | None = None  # `g + 1`: a condition's read at an index plus an integer (language v2, section 1)
    divisor_size: Name | None = None  # `j // T`: a size symbol divides (language v2, section 2)
    modulus: int | Name | None = None  # `j % 8`, `j % T` (language v2, section 2)
    by_span: Span | None = None  # the divisor's or modulus's token
    table: "Access | None" = None  # `pages[b, j // T]` (language v2, section 2)
    literal: int | None = None  # `0` in `pages[b, 0]` (inside a table only)

    @property
    def indices(self) -> tuple[Name, ...]:
        """The index tokens this subscript uses (a table's, in order; none for a literal)."""
        if self.table is not None:
            return tuple(n for s in self.table.subscripts for n in s.indices)
        if self.literal is not None:
            return ()
        return (self.index,)

    @property
    def plain(self) -> bool:
        """An index alone, or offset, shifted or divided by an integer (the forms of v1)."""
        return self.table is None and self.literal is None and self.modulus is None and self.divisor_size is None

    @property
    def text(self) -> str:
        if self.table is not None:
            return f"{self.table.operand.text}[{', '.join(s.text for s in self.table.subscripts)}]"
        if self.literal is not None:
            return str(self.literal)
        if self.modulus is not None:
            return f"{self.index.text} % {self.modulus.text if isinstance(self.modulus, Name) else self.modulus}"
        if self.divisor_size is not None:
            return f"{self.index.text} // {self.divisor_size.text}"
        if self.divisor is not None:
            return f"{self.index.text} // {self.divisor}"
        if self.offset is not None:
            return f"{self.offset.operand.text}[{self.offset.position}] + {self.index.text}"
        if self.shift is not None:
            return f"{self.index.text} {'+' if self.shift > 0 else '-'} {abs(self.shift)}"
        return self.index.text


# Expressions. Every node has a span; the checker decides which ones a statement may use.


@dataclass(frozen=True)
class Access:
    """`x[i, j]`: a read of an operand or a local (or, on the left, the assigned tensor)."""

    operand: Name
    subscripts: tuple[Subscript, ...]
    span: Span


@dataclass(frozen=True)
class Number:
    text: str
    value: int | float
    span: Span


@dataclass(frozen=True)
class Value:
    """A bare name in an expression: an index's value or a size."""

    name: Name
    span: Span


@dataclass(frozen=True)
class Call:
    fn: Name
    args: tuple["Expr", ...]
    span: Span


@dataclass(frozen=True)
class Binary:
    op: str  # + - * / // %
    a: "Expr"
    b: "Expr"
    span: Span


@dataclass(frozen=True)
class Neg:
    a: "Expr"
    span: Span


@dataclass(frozen=True)
class Compare:
    """`a < b <= c`: a chain, as in Python."""

    first: "Expr"
    rest: tuple[tuple[str, "Expr"], ...]
    span: Span


@dataclass(frozen=True)
class Logic:
    op: str  # "and" | "or"
    values: tuple["Expr", ...]
    span: Span


@dataclass(frozen=True)
class Not:
    a: "Expr"
    span: Span


Expr = Access | Number | Value | Call | Binary | Neg | Compare | Logic | Not


@dataclass(frozen=True)
class Statement:
    target: Access
    value: Expr
    condition: Expr | None
    span: Span


@dataclass(frozen=True)
class Tile:
    index: Name
    size: int
    size_span: Span
    span: Span


@dataclass(frozen=True)
class TileLine:
    tiles: tuple[Tile, ...]
    span: Span


@dataclass(frozen=True)
class Accumulate:
    dtype: Name
    span: Span


@dataclass(frozen=True)
class Kernel:
    name: Name
    operands: tuple[Operand, ...]
    statements: tuple[Statement, ...]
    tile_lines: tuple[TileLine, ...]
    accumulates: tuple[Accumulate, ...]
    span: Span


@dataclass(frozen=True)
class Spec:
    source: SourceFile
    kernels: tuple[Kernel, ...]


def factors(e: Expr) -> list[Expr]:
    """The factors of a product `a * b * c` (a single expression is its own factor)."""
    if isinstance(e, Binary) and e.op == "*":
        return factors(e.a) + factors(e.b)
    return [e]


def literal(e: Expr) -> Number | None:
    """A numeric literal, a leading minus folded in (`-0.5`); None for anything else."""
    if isinstance(e, Number):
        return e
    if isinstance(e, Neg) and isinstance(e.a, Number):
        return Number(f"-{e.a.text}", -e.a.value, e.span)
    return None


def is_product(e: Expr) -> bool:
    """Is an expression a product of reads and numeric literals (the einsum form)?"""
    return all(isinstance(f, Access) or literal(f) is not None for f in factors(e))


# ------------------------------------------------------------------------- parser


@functools.cache
def _parser() -> Lark:
    return Lark(read_resource("grammars", "spk.lark"), parser="lalr", lexer="contextual", propagate_positions=True)


def _span(node: Tree | Token) -> Span:
    if isinstance(node, Token):
        return Span(node.line, node.column, node.end_line, node.end_column)
    m = node.meta
    return Span(m.line, m.column, m.end_line, m.end_column)


def _name(tok: Token) -> Name:
    return Name(str(tok), _span(tok))


_BINARY = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%"}
# How deep an expression may nest: every operator, comparison, `and`/`or`/`not` and function
# call is a level above its operands (a chain `a + b + c` a level per operator). Generated
# code nests at most one bracket per level, well inside what Python, black and the
# recursive passes of the compiler handle (Python refuses 200 nested brackets).
MAX_DEPTH = 100
_OPERATORS = frozenset(_BINARY) | {"neg", "not_", "and_", "or_", "compare", "call"}


def _too_deep(tree: Tree) -> list[Diagnostic]:
    """A diagnostic at the first operator of each statement's expressions that lies more than
    MAX_DEPTH levels deep, found without recursion (the tree may be thousands deep)."""
    found = []
    statements = (item for kernel in tree.children for item in kernel.children if isinstance(item, Tree) and item.data == "statement")
    for statement in statements:
        for top in statement.children[1:]:
            if not isinstance(top, Tree) or top.data in ("access",):
                continue
            stack = [(top, 1 if top.data in _OPERATORS else 0)]
            while stack:
                node, level = stack.pop()
                if level > MAX_DEPTH:
                    found.append(Diagnostic(_span(node), f"expression nested more than {MAX_DEPTH} levels deep (each operator and function call is a level; a chain `a + b + c` one per operator); split it into local tensors", ))
                    break
                for child in node.children:
                    if isinstance(child, Tree) and child.data in _OPERATORS:
                        stack.append((child, level + 1))
                    elif isinstance(child, Tree) and child.data != "access":
                        stack.append((child, level))
    return found


class _Builder:
    def __init__(self, source: SourceFile):
        self.source = source

    def spec(self, source: SourceFile, tree: Tree) -> Spec:
        return Spec(source, tuple(self.kernel(k) for k in tree.children))

    def kernel(self, tree: Tree) -> Kernel:
        _, name, *items = tree.children
        operands, statements, tile_lines, accumulates = [], [], [], []
        for item in items:
            kind = item.data
            if kind == "operand":
                operands.append(self.operand(item))
            elif kind == "statement":
                statements.append(self.statement(item))
            elif kind == "tiles":
                tile_lines.append(self.tiles(item))
            elif kind == "accumulate":
                accumulates.append(Accumulate(_name(item.children[1]), _span(item)))
        return Kernel(_name(name), tuple(operands), tuple(statements), tuple(tile_lines), tuple(accumulates), _span(tree))

    def operand(self, tree: Tree) -> Operand:
        direction, name, dtype, *rest = tree.children
        dims = [c for c in rest if isinstance(c, Tree)]
        sparsity = [c for c in rest if isinstance(c, Token)]
        return Operand(
            str(direction),
            _name(name),
            _name(dtype),
            tuple(self.dim(d) for d in dims),
            _name(sparsity[0]) if sparsity else None,
            _span(tree),
        )

    def dim(self, tree: Tree) -> Dim:
        (tok,) = tree.children
        value = int(tok) if tok.type == "INT" else str(tok)
        return Dim(value, _span(tok))

    def statement(self, tree: Tree) -> Statement:
        target, value, *rest = tree.children
        condition = self.expr(rest[1]) if rest else None
        return Statement(self.access(target), self.expr(value), condition, _span(tree))

    def access(self, tree: Tree) -> Access:
        name, *subs = tree.children
        return Access(_name(name), tuple(self.subscript(s) for s in subs), _span(tree))

    def subscript(self, tree: Tree) -> Subscript:
        if tree.data == "plain":
            (tok,) = tree.children
            return Subscript(_name(tok), None, None, _span(tree))
        if tree.data == "literal":
            (tok,) = tree.children
            return Subscript(_name(tok), None, None, _span(tree), literal=int(tok))
        if tree.data == "through":
            (table,) = tree.children
            name, *entries = table.children
            read = Access(_name(name), tuple(self.subscript(e) for e in entries), _span(table))
            return Subscript(_name(name), None, None, _span(tree), table=read)
        if tree.data in ("divided", "modulo"):
            tok, by = tree.children
            (amount,) = by.children
            value = -int(amount) if by.data == "negative" else (int(amount) if amount.type == "INT" else _name(amount))
            if tree.data == "modulo":
                return Subscript(_name(tok), None, None, _span(tree), modulus=value, by_span=_span(by))
            if isinstance(value, Name):
                return Subscript(_name(tok), None, None, _span(tree), divisor_size=value, by_span=_span(by))
            return Subscript(_name(tok), None, value, _span(tree), by_span=_span(by))
        if tree.data in ("shifted", "shifted_back"):
            tok, amount = tree.children
            return Subscript(_name(tok), None, None, _span(tree), int(amount) * (1 if tree.data == "shifted" else -1))
        if tree.data == "offset_first":
            off, tok = tree.children
        else:
            tok, off = tree.children
        op, *entries = off.children
        if len(entries) != 1 or entries[0].data != "literal":
            # `s[i] + j`: an offset is one literal entry of an index operand.
            bad = entries[0] if len(entries) == 1 else entries[1]
            raise SpecError([Diagnostic(_span(bad), f"an offset reads one entry of an index operand at a literal position (`{op}[0] + {tok}`); a read through a table is a whole subscript (`x[{op}[...]]`)")], self.source)
        (pos,) = entries[0].children
        offset = Offset(_name(op), int(pos), _span(pos), _span(off))
        return Subscript(_name(tok), offset, None, _span(tree))

    def expr(self, node: Tree | Token) -> Expr:
        span = _span(node)
        kind = node.data
        if kind == "access":
            return self.access(node)
        if kind == "number":
            (tok,) = node.children
            text = str(tok)
            return Number(text, int(text) if tok.type == "INT" else float(text), span)
        if kind == "value":
            (tok,) = node.children
            return Value(_name(tok), span)
        if kind == "call":
            fn, *args = node.children
            return Call(_name(fn), tuple(self.expr(a) for a in args), span)
        if kind in _BINARY:
            a, b = node.children
            return Binary(_BINARY[kind], self.expr(a), self.expr(b), span)
        if kind == "neg":
            return Neg(self.expr(node.children[0]), span)
        if kind == "not_":
            return Not(self.expr(node.children[1]), span)
        if kind in ("and_", "or_"):
            values = [c for c in node.children if not isinstance(c, Token)]
            return Logic(kind[:-1], tuple(self.expr(v) for v in values), span)
        if kind == "compare":
            first, *rest = node.children
            pairs = tuple((str(rest[i]), self.expr(rest[i + 1])) for i in range(0, len(rest), 2))
            return Compare(self.expr(first), pairs, span)
        raise AssertionError(f"unexpected expression node {kind}")

    def tiles(self, tree: Tree) -> TileLine:
        tiles = []
        for t in tree.children[1:]:
            name, size = t.children
            tiles.append(Tile(_name(name), int(size), _span(size), _span(t)))
        return TileLine(tuple(tiles), _span(tree))


# Human names for the grammar's terminals, for "expected ..." messages.
_TERMINALS = {
    "NAME": "a name",
    "INT": "an integer",
    "NUMBER": "a number",
    "KERNEL": "'kernel'",
    "DIRECTION": "'in' or 'out'",
    "TILE": "'tile'",
    "ACCUMULATE": "'accumulate'",
    "WHERE": "'where'",
    "AND": "'and'",
    "OR": "'or'",
    "NOT": "'not'",
    "COMPARE": "a comparison",
    "_NL": "a line break",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "LSQB": "'['",
    "RSQB": "']'",
    "LPAR": "'('",
    "RPAR": "')'",
    "COMMA": "','",
    "COLON": "':'",
    "EQUAL": "'='",
    "STAR": "'*'",
    "PLUS": "'+'",
    "MINUS": "'-'",
    "SLASH": "'/'",
    "PERCENT": "'%'",
    "__ANON_0": "'//'",
    "$END": "end of file",
}


def _describe_token(tok: Token) -> str:
    if tok.type == "$END":
        return "end of file"
    if tok.type == "_NL":
        return "end of line"
    return f"'{tok}'"


def _expected(names) -> str:
    words = sorted({_TERMINALS.get(n, n) for n in names})
    if not words:
        return "something else"
    if len(words) > 6:  # inside an expression almost anything may follow: say so briefly
        return "an operator or the end of the expression"
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _end_of(source: SourceFile) -> Span:
    lines = source.lines or ("",)
    line, col = len(lines), len(lines[-1]) + 1
    return Span(line, col, line, col + 1)


def _unexpected_character(char: str, hint: str) -> str:
    """The lexer's refusal of `char`. A character outside ASCII is named by its code point
    (an invisible one shows nothing else); a letter there was meant to start or continue
    a name, and a space-like one to separate tokens, so what the parser expected instead
    would mislead."""
    if char.isascii() and char.isprintable():
        return f"unexpected character '{char}'{hint}"
    import unicodedata

    code = " ".join(filter(None, (f"U+{ord(char):04X}", unicodedata.name(char, ""))))  # control characters have no name
    if char.isspace() or unicodedata.category(char) in ("Cf", "Cc", "Zs", "Zl", "Zp"):
        return f"unexpected invisible character {code}: only ASCII spaces, tabs and line breaks separate tokens"
    if ("_" + char).isidentifier():
        return (f"unexpected character '{char}' ({code}): names are ASCII identifiers (a letter or '_', then "
                "letters, digits or '_')")
    return f"unexpected character '{char}' ({code}){hint}"


def _syntax_error(source: SourceFile, exc: lark.exceptions.LarkError) -> Diagnostic:
    if isinstance(exc, lark.exceptions.UnexpectedToken):
        tok = exc.token
        if tok.type == "$END":
            return Diagnostic(_end_of(source), f"unexpected end of file: expected {_expected(exc.expected)}")
        span = Span(tok.line, tok.column, tok.end_line or tok.line, tok.end_column or tok.column + 1)
        if tok.type == "_NL":
            # The newline token starts at the end of the line where something is missing.
            span = Span(tok.line, tok.column, tok.line, tok.column + 1)
        if tok.type == "NAME" and str(tok) == "kernel" and "KERNEL" in exc.expected:
            # `kernel 9k {`: the keyword is one only before a name.
            return Diagnostic(span, "'kernel' must be followed by the kernel's name (a letter or '_', then letters, digits or '_')")
        return Diagnostic(span, f"expected {_expected(exc.expected)}, found {_describe_token(tok)}")
    if isinstance(exc, lark.exceptions.UnexpectedCharacters):
        char = source.line(exc.line)[exc.column - 1 : exc.column] or "?"
        span = Span(exc.line, exc.column, exc.line, exc.column + 1)
        allowed = getattr(exc, "allowed", None) or ()
        hint = f": expected {_expected(allowed)}" if allowed else ""
        return Diagnostic(span, _unexpected_character(char, hint))
    if isinstance(exc, lark.exceptions.UnexpectedEOF):
        return Diagnostic(_end_of(source), f"unexpected end of file: expected {_expected(exc.expected)}")
    return Diagnostic(None, f"cannot parse: {exc}")


@no_cycle_collection()
def parse(source: SourceFile) -> Spec:
    """Parse a spec; raise SpecError with one diagnostic on a syntax error."""
    try:
        tree = _parser().parse(source.text)
    except lark.exceptions.LarkError as exc:
        raise SpecError([_syntax_error(source, exc)], source) from None
    too_deep = _too_deep(tree)
    if too_deep:
        raise SpecError(too_deep, source)
    return _Builder(source).spec(source, tree)
