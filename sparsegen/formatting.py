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
- most lines of a long spec's module are one-line assignments (an elementwise chain is one
  per local, in the kernel, its backward and `reference`). A run of consecutive such lines
  that black leaves alone is taken out of its chunk and stands as one assignment while
  black formats the rest (the skeleton): black lays out statements one by one, and the
  blank lines around an assignment do not depend on its text. Whether black leaves a line
  alone is decided once per shape of the line (names and numbers as same-width
  placeholders), and the skeleton is the same for every length of chain and every
  constant in it, so formatting is linear in the module's size and cached across kernels.

What black returns is also kept on disk (`_DiskCache`: the user's cache folder, or
`SPARSEGEN_CACHE_DIR`), for whole modules and for chunks, keyed by black's version, this
file's digest and the text: a rebuild, `sparsegen check`, or a variant that differs in tile
sizes only formats from the cache, in another process too. Values are written whole
(a rename), so a reader never sees half a file.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import keyword
import os
import re
import tempfile
import tokenize
from pathlib import Path

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
        source = _swap(source, name, stand_in)
    text = _format_whole(source)
    for name, stand_in in stand_ins:
        text = _swap(text, stand_in, name)
    return text


_WORD_CHAR = re.compile(r"\w")


def _swap(text: str, old: str, new: str) -> str:
    """`old` replaced by `new` as a word, or as the start of one the module derives from it
    (`NAME_on_mesh`); no stand-in occurs in the source, so each is put back exactly where it
    was put. (The word start is checked by hand: a leading `\\b` makes the regex slow.)"""
    found = re.compile(rf"{re.escape(old)}(?=\b|_)")
    return found.sub(lambda m: m.group() if m.start() and _WORD_CHAR.match(text, m.start() - 1) else new, text)


class _DiskCache:
    """Text kept in files named by a digest of (kind, black's version, this file, key)."""

    def __init__(self):
        self._folder: Path | None | bool = False  # False: not looked up yet; None: off

    def folder(self) -> Path | None:
        if self._folder is False:
            from .resources import cache_dir  # one place says where sparsegen caches

            salt = hashlib.sha256(black.__version__.encode() + Path(__file__).read_bytes()).hexdigest()[:16]
            folder = cache_dir() / f"format-{salt}"
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError:
                folder = None  # a read-only home: format without the cache
            self._folder = folder
        return self._folder

    def get(self, kind: str, key: str, make) -> str:
        folder = self.folder()
        if folder is None:
            return make()
        path = folder / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.py"
        try:
            return path.read_text(encoding="utf-8")
        except OSError:
            pass
        value = make()
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(value)
            os.replace(tmp, path)
        except OSError:
            pass  # a full disk: the value is right, only not kept
        return value


_DISK = _DiskCache()


@functools.lru_cache(maxsize=64)
def _format_whole(source: str) -> str:
    """A whole module (its names stood in for), cached in memory and on disk: kernels that
    differ in name only (a spec of many alike, variants revisited) and rebuilds are
    formatted once."""
    return _DISK.get("module", source, lambda: _format_module(source))


def _format_module(source: str) -> str:
    chunks = source.strip("\n").split("\n\n\n")
    head = _split_docstring(chunks[0])
    docstring = None
    if head is not None:
        # The header comments and module docstring are emitted black-clean (they vary with
        # every variant, so caching would not help); black keeps one blank line after them.
        docstring, chunks[0] = head
    parts = [_skeleton(chunk) for chunk in chunks]
    forms = [_placeholders(skeleton) for skeleton, _ in parts]
    features = set().union(*(_features(form) for form, _ in forms))
    features |= set().union(*(_features(shape) for _, runs in parts for run in runs for shape in run.shapes))
    if docstring is not None:
        features |= _features(docstring)
    # As black infers them for the whole module (an empty set, which no real code gives,
    # would let black infer them per chunk).
    versions = frozenset(v for v in black.TargetVersion if features <= VERSION_TO_FEATURES[v])
    body = "\n\n\n".join(
        _format_with_runs(chunk, skeleton, runs, form, numbers, versions).rstrip("\n")
        for chunk, (skeleton, runs), (form, numbers) in zip(chunks, parts, forms)
    )
    return (docstring + "\n\n" if docstring is not None else "") + body + "\n"


# ---------------------------------------------------------------- runs of plain lines

# A one-line assignment of names, numbers, operators and brackets (no strings, comments,
# colons or keyword arguments): the only lines taken out of a chunk.
_PLAIN = re.compile(r"^( *)([A-Za-z_]\w*) = ([\w .+\-*/%@&|~^()\[\],]+)$", re.M)
_WORD = re.compile(r"[A-Za-z_]\w*|\.?\d(?:[\w.]|(?<=[eE])[+-])*")
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e-?\d+)?")  # as black spells it (not `1.`, `.5`, `1E5`, `1e+5`)
_STAND_IN = "_sparsegen_run = None"  # what a run is while black formats its chunk


class _Run:
    def __init__(self, indent: str, lines: list[str], shapes: list[str]):
        self.indent, self.lines, self.shapes = indent, lines, shapes


def _shape(code: str) -> str | None:
    """The line with every name and number a same-width placeholder (black lays them out
    alike); None where a word is a keyword or a number black would respell (`1.`, `1E5`)."""
    out, last = [], 0
    for m in _WORD.finditer(code):
        word = m.group()
        if word[0].isdigit() or word[0] == ".":
            if not _NUMBER.fullmatch(word):
                return None
        elif keyword.iskeyword(word) or keyword.issoftkeyword(word):
            return None
        out += [code[last : m.start()], "Q" * len(word)]
        last = m.end()
    return "".join(out) + code[last:]


@functools.lru_cache(maxsize=4096)
def _left_alone(shape: str) -> bool:
    """Does black leave this one-line statement as it is?"""

    def check() -> str:
        try:
            return "1" if black.format_str(shape, mode=BLACK_MODE) == shape + "\n" else "0"
        except Exception:  # not a statement at all: black cannot parse it
            return "0"

    return _DISK.get("alone", shape, check) == "1"


@functools.lru_cache(maxsize=4096)
def _skeleton(chunk: str) -> tuple[str, tuple[_Run, ...]]:
    """The chunk with each run of plain lines black leaves alone replaced by one stand-in
    line, and the runs; the chunk itself and () where it has none."""
    if _STAND_IN in chunk or "= " not in chunk:
        return chunk, ()
    lines = chunk.split("\n")
    plain: dict[int, tuple[str, str]] = {}
    row, at = 0, 0
    for m in _PLAIN.finditer(chunk):
        row, at = row + chunk.count("\n", at, m.start()), m.start()
        indent, code = m.group(1), m.group()[len(m.group(1)) :]
        if len(m.group()) > black.DEFAULT_LINE_LENGTH:
            continue
        shape = _shape(code)
        if shape is not None and _left_alone(shape):
            plain[row] = (indent, shape)
    if not plain:
        return chunk, ()
    out: list[str] = []
    runs: list[_Run] = []
    n = 0
    while n < len(lines):
        if n not in plain:
            out.append(lines[n])
            n += 1
            continue
        indent = plain[n][0]
        run = _Run(indent, [], [])
        while n in plain and plain[n][0] == indent:
            run.lines.append(lines[n])
            run.shapes.append(plain[n][1])
            n += 1
        runs.append(run)
        out.append(indent + _STAND_IN)
    skeleton = "\n".join(out)
    if not _stand_ins_are_statements(skeleton, tuple(len(r.indent) for r in runs)):
        return chunk, ()  # a line inside a string or brackets: format the chunk whole
    return skeleton, tuple(runs)


@functools.lru_cache(maxsize=1024)
def _stand_ins_are_statements(skeleton: str, indents: tuple[int, ...]) -> bool:
    """Is every stand-in an assignment statement of its own in the skeleton (not text in a
    string, nor a keyword argument in brackets)? Then the lines it stands for are too."""
    try:
        tree = ast.parse(skeleton)
    except SyntaxError:
        return False
    found = [
        node.col_offset
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "_sparsegen_run"
    ]
    return sorted(found) == sorted(indents) and len(found) == len(indents)


def _format_with_runs(chunk: str, skeleton: str, runs: tuple[_Run, ...], form: str, numbers: tuple[str, ...], versions: frozenset) -> str:
    formatted = _format_chunk(skeleton, form, numbers, versions)
    if not runs:
        return formatted
    lines = formatted.split("\n")
    stand_ins = [n for n, line in enumerate(lines) if line.strip() == _STAND_IN]
    if len(stand_ins) != len(runs) or any(lines[n] != run.indent + _STAND_IN for n, run in zip(stand_ins, runs)):
        return _format_chunk(chunk, *_placeholders(chunk), versions)
    for n, run in reversed(list(zip(stand_ins, runs))):
        lines[n : n + 1] = run.lines
    return "\n".join(lines)


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

    def parse() -> str:
        node = black.lib2to3_parse(code.lstrip())
        return "\n".join(sorted(f.name for f in black.get_features_used(node, future_imports=black.get_future_imports(node))))

    return frozenset(black.Feature[name] for name in _DISK.get("features", code, parse).split("\n") if name)


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
    key = ",".join(sorted(v.name for v in versions)) + "\n" + chunk
    return _DISK.get("chunk", key, lambda: black.format_str(chunk, mode=black.Mode(target_versions=set(versions))))
