"""black, made fast enough to generate a hundred variants in seconds.

Generated modules are formatted as black does with its default configuration (line length
88, target versions inferred from the code), so a project that runs plain `black` leaves
them alone. black costs about a third of a second per module. Three observations make it
cheap, with output byte-identical to formatting the whole module (tests/test_formatting.py
checks that on every example and many variants):

- black formats top-level statements independently; the emitter separates them by two
  blank lines, which is also what black puts between them. So a module is formatted chunk
  by chunk, and the chunks every module shares (helpers) are formatted once.
- the one thing black decides for the whole module is the Python versions it targets,
  inferred from the features the code uses (they decide, e.g., whether a split call gets
  a trailing comma after `*args`). The features of each chunk are found once, and their
  union gives the versions black would infer; every chunk is formatted for those.
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
from black.mode import VERSION_TO_FEATURES  # black is pinned (pyproject.toml)

BLACK_MODE = black.Mode()  # black's defaults: what `black` checks with no configuration
_PLACEHOLDER = re.compile(r"^Q+$")


def format_module(source: str, names: tuple[str, ...] = ()) -> str:
    """black.format_str(source, mode=BLACK_MODE), computed chunk by chunk with caching.

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
    docstring = None
    if head is not None:
        # The header comments and module docstring are emitted black-clean (they vary with
        # every variant, so caching would not help); black keeps one blank line after them.
        docstring, chunks[0] = head
    forms = [_placeholders(chunk) for chunk in chunks]
    features = set().union(*(_features(form) for form, _ in forms))
    if docstring is not None:
        features |= _features(docstring)
    # As black infers them for the whole module (an empty set, which no real code gives,
    # would let black infer them per chunk).
    versions = frozenset(v for v in black.TargetVersion if features <= VERSION_TO_FEATURES[v])
    body = "\n\n\n".join(_format_chunk(chunk, form, numbers, versions).rstrip("\n") for chunk, (form, numbers) in zip(chunks, forms))
    return (docstring + "\n\n" if docstring is not None else "") + body + "\n"


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
def _placeholders(chunk: str) -> tuple[str, tuple[str, ...]]:
    """The chunk with each integer literal replaced by a same-width placeholder, and the
    integers in order; the chunk itself and () where that cannot be done safely."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(chunk).readline))
    except (tokenize.TokenError, SyntaxError):
        return chunk, ()
    if any(t.type == tokenize.NAME and _PLACEHOLDER.match(t.string) for t in tokens):
        return chunk, ()  # the chunk uses placeholder-like names itself
    numbers = [t for t in tokens if t.type == tokenize.NUMBER and t.string.isdigit()]
    lines = chunk.split("\n")
    for t in reversed(numbers):  # same width: columns of the other tokens do not move
        row, col = t.start
        lines[row - 1] = lines[row - 1][:col] + "Q" * len(t.string) + lines[row - 1][col + len(t.string) :]
    return "\n".join(lines), tuple(t.string for t in numbers)


@functools.lru_cache(maxsize=4096)
def _features(code: str) -> frozenset:
    """The Python features black's version inference sees in the code (digit-only integers,
    which the placeholders replace, add none)."""
    node = black.lib2to3_parse(code.lstrip())
    return frozenset(black.get_features_used(node, future_imports=black.get_future_imports(node)))


@functools.lru_cache(maxsize=4096)
def _format_chunk(chunk: str, form: str, numbers: tuple[str, ...], versions: frozenset) -> str:
    if not numbers:
        return _black(chunk, versions)
    laid_out = _black(form, versions).split("\n")
    placed = [t for t in tokenize.generate_tokens(io.StringIO("\n".join(laid_out)).readline) if t.type == tokenize.NAME and _PLACEHOLDER.match(t.string)]
    if len(placed) != len(numbers):
        return _black(chunk, versions)
    for t, value in zip(placed, numbers):
        row, col = t.start
        laid_out[row - 1] = laid_out[row - 1][:col] + value + laid_out[row - 1][col + len(value) :]
    return "\n".join(laid_out)


@functools.lru_cache(maxsize=4096)
def _black(chunk: str, versions: frozenset) -> str:
    return black.format_str(chunk, mode=black.Mode(target_versions=set(versions)))
