"""Syntax: the lark grammar, parsed into a typed AST whose nodes carry source spans.

Nothing here judges meaning (unknown dtypes, unbound indices...): that is the
checker's job. A parse error becomes a Diagnostic at the offending token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import lark
from lark import Lark, Token, Tree

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
    index: Name
    offset: Offset | None
    span: Span


@dataclass(frozen=True)
class Access:
    operand: Name
    subscripts: tuple[Subscript, ...]
    span: Span


@dataclass(frozen=True)
class Statement:
    target: Access
    factors: tuple[Access, ...]
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
    text: str  # the kernel's source text, for generated docstrings


@dataclass(frozen=True)
class Spec:
    source: SourceFile
    kernels: tuple[Kernel, ...]


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


class _Builder:
    def __init__(self, source: SourceFile):
        self.source = source

    def spec(self, tree: Tree) -> Spec:
        return Spec(self.source, tuple(self.kernel(k) for k in tree.children))

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
        span = _span(tree)
        lines = self.source.text.splitlines()[span.line - 1 : span.end_line]
        return Kernel(
            _name(name),
            tuple(operands),
            tuple(statements),
            tuple(tile_lines),
            tuple(accumulates),
            span,
            "\n".join(lines),
        )

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
        target, *factors = (self.access(a) for a in tree.children)
        return Statement(target, tuple(factors), _span(tree))

    def access(self, tree: Tree) -> Access:
        name, *subs = tree.children
        return Access(_name(name), tuple(self.subscript(s) for s in subs), _span(tree))

    def subscript(self, tree: Tree) -> Subscript:
        if tree.data == "plain":
            (tok,) = tree.children
            return Subscript(_name(tok), None, _span(tree))
        if tree.data == "offset_first":
            off, tok = tree.children
        else:
            tok, off = tree.children
        op, pos = off.children
        offset = Offset(_name(op), int(pos), _span(pos), _span(off))
        return Subscript(_name(tok), offset, _span(tree))

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
    "KERNEL": "'kernel'",
    "DIRECTION": "'in' or 'out'",
    "TILE": "'tile'",
    "ACCUMULATE": "'accumulate'",
    "_NL": "a line break",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "LSQB": "'['",
    "RSQB": "']'",
    "COMMA": "','",
    "COLON": "':'",
    "EQUAL": "'='",
    "STAR": "'*'",
    "PLUS": "'+'",
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
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _syntax_error(source: SourceFile, exc: lark.exceptions.LarkError) -> Diagnostic:
    if isinstance(exc, lark.exceptions.UnexpectedToken):
        tok = exc.token
        if tok.type == "$END":
            lines = source.text.splitlines() or [""]
            line = len(lines)
            col = len(lines[-1]) + 1
            return Diagnostic(Span(line, col, line, col + 1), f"unexpected end of file: expected {_expected(exc.expected)}")
        span = Span(tok.line, tok.column, tok.end_line or tok.line, tok.end_column or tok.column + 1)
        if tok.type == "_NL":
            # The newline token starts at the end of the line where something is missing.
            span = Span(tok.line, tok.column, tok.line, tok.column + 1)
        return Diagnostic(span, f"expected {_expected(exc.expected)}, found {_describe_token(tok)}")
    if isinstance(exc, lark.exceptions.UnexpectedCharacters):
        char = source.line(exc.line)[exc.column - 1 : exc.column] or "?"
        span = Span(exc.line, exc.column, exc.line, exc.column + 1)
        allowed = getattr(exc, "allowed", None) or ()
        hint = f": expected {_expected(allowed)}" if allowed else ""
        return Diagnostic(span, f"unexpected character '{char}'{hint}")
    if isinstance(exc, lark.exceptions.UnexpectedEOF):
        lines = source.text.splitlines() or [""]
        line, col = len(lines), len(lines[-1]) + 1
        return Diagnostic(Span(line, col, line, col + 1), f"unexpected end of file: expected {_expected(exc.expected)}")
    return Diagnostic(None, f"cannot parse: {exc}")


def parse(source: SourceFile) -> Spec:
    """Parse a spec; raise SpecError with one diagnostic on a syntax error."""
    try:
        tree = _parser().parse(source.text)
    except lark.exceptions.LarkError as exc:
        raise SpecError([_syntax_error(source, exc)], source) from None
    return _Builder(source).spec(tree)
