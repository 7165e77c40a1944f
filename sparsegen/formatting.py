"""black, made fast enough to generate a hundred variants in seconds.

Generated modules are black-formatted, and black costs about a third of a second per
module. Two observations make it cheap, with output byte-identical to formatting the
whole module (tests/test_formatting.py checks that on every example and many variants):

- black formats top-level statements independently; the emitter separates them by two
  blank lines, which is also what black puts between them. So a module is formatted chunk
  by chunk, and the chunks every module shares (helpers) are formatted once.
- variants differ mostly in integer literals (tile sizes) and their names. A chunk is formatted with each
  integer replaced by a same-width placeholder name, which black lays out exactly as it
  would the number; the numbers are put back afterwards. The layout is cached by the
  placeholder form, so a chunk is formatted once per shape of its numbers.
"""

from __future__ import annotations

import functools
import io
import re
import tokenize

import black

BLACK_MODE = black.Mode(line_length=100, target_versions={black.TargetVersion.PY312})
_PLACEHOLDER = re.compile(r"^Q+$")


def format_module(source: str, names: tuple[str, ...] = ()) -> str:
    """black.format_str(source), computed chunk by chunk with caching.

    `names` (the kernel's name) vary between variants but never change black's layout:
    they are swapped for same-length stand-ins while formatting, so chunks that mention
    them are cached too.
    """
    stand_ins = [(name, "Z" * len(name)) for name in names if name and "Z" * len(name) not in source]
    for name, stand_in in stand_ins:
        source = re.sub(rf"\b{re.escape(name)}\b", stand_in, source)
    text = _format_module(source)
    for name, stand_in in stand_ins:
        text = re.sub(rf"\b{stand_in}\b", name, text)
    return text


def _format_module(source: str) -> str:
    chunks = source.strip("\n").split("\n\n\n")
    head = _split_docstring(chunks[0])
    if head is not None:
        # The header comments and module docstring are emitted black-clean (they vary with
        # every variant, so caching would not help); black keeps one blank line after them.
        docstring, rest = head
        chunks[0] = rest
        return docstring + "\n\n" + "\n\n\n".join(_format_chunk(c).rstrip("\n") for c in chunks) + "\n"
    return "\n\n\n".join(_format_chunk(chunk).rstrip("\n") for chunk in chunks) + "\n"


def _split_docstring(chunk: str) -> tuple[str, str] | None:
    """(comments and module docstring, the rest) of a module's first chunk, if it starts so."""
    lines = chunk.split("\n")
    n = 0
    while n < len(lines) and lines[n].startswith("#"):
        n += 1
    if n >= len(lines) or not lines[n].startswith('"""'):
        return None
    end = chunk.find('"""', len("\n".join(lines[:n])) + 4)
    if end < 0:
        return None
    close = chunk.find("\n", end)
    if close < 0 or not chunk[close:].startswith("\n\n"):
        return None
    return chunk[:close], chunk[close:].lstrip("\n")


@functools.lru_cache(maxsize=4096)
def _format_chunk(chunk: str) -> str:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(chunk).readline))
    except (tokenize.TokenError, SyntaxError):
        return _black(chunk)
    if any(t.type == tokenize.NAME and _PLACEHOLDER.match(t.string) for t in tokens):
        return _black(chunk)  # the chunk uses placeholder-like names itself
    numbers = [t for t in tokens if t.type == tokenize.NUMBER and t.string.isdigit()]
    if not numbers:
        return _black(chunk)
    lines = chunk.split("\n")
    for t in reversed(numbers):  # same width: columns of the other tokens do not move
        row, col = t.start
        lines[row - 1] = lines[row - 1][:col] + "Q" * len(t.string) + lines[row - 1][col + len(t.string) :]
    laid_out = _black("\n".join(lines)).split("\n")
    values = iter(t.string for t in numbers)
    placed = [t for t in tokenize.generate_tokens(io.StringIO("\n".join(laid_out)).readline) if t.type == tokenize.NAME and _PLACEHOLDER.match(t.string)]
    if len(placed) != len(numbers):
        return _black(chunk)
    for t in placed:
        row, col = t.start
        value = next(values)
        laid_out[row - 1] = laid_out[row - 1][:col] + value + laid_out[row - 1][col + len(value) :]
    return "\n".join(laid_out)


@functools.lru_cache(maxsize=4096)
def _black(chunk: str) -> str:
    return black.format_str(chunk, mode=BLACK_MODE)
