"""Source files, spans and diagnostics: how every spec problem is reported.

A diagnostic prints as ``FILE:LINE:COL: error: MESSAGE`` followed by the source
line and a caret under the offending token, the way compilers do.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, order=True)
class Span:
    """A region of a source file; lines and columns count from 1, end is exclusive."""

    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.line}:{self.col}"


@dataclass(frozen=True)
class SourceFile:
    """A spec's text and the name it is reported under (the path as given)."""

    name: str
    text: str

    def __post_init__(self):
        text = self.text.removeprefix("\ufeff")  # a UTF-8 byte-order mark, as some editors write
        # Windows (\r\n) and classic Mac (\r) line endings are newlines: the parser, the
        # diagnostics' line numbers and the header's digest all see \n (so a checkout that
        # converts line endings still matches its generated modules).
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        if text != self.text:
            object.__setattr__(self, "text", text)

    @classmethod
    def read(cls, path: str | Path) -> "SourceFile":
        """Read a spec file; a file that cannot be read or decoded is a SpecError."""
        name = str(path)
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            reason = exc.strerror or exc.__class__.__name__
            raise SpecError([Diagnostic(None, f"cannot read file: {reason}")], None, name) from None
        data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")  # so that errors below count lines as the parser does
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
            span = Span(line, col, line, col + 1)
            source = cls(name, data.decode("utf-8", errors="replace"))
            raise SpecError(
                [Diagnostic(span, f"file is not UTF-8 text (invalid byte 0x{data[exc.start]:02x})")],
                source,
            ) from None
        if "\x00" in text:
            offset = text.index("\x00")
            line = text.count("\n", 0, offset) + 1
            col = offset - (text.rfind("\n", 0, offset) + 1) + 1
            raise SpecError(
                [Diagnostic(Span(line, col, line, col + 1), "file is not text (it contains a NUL byte)")],
                cls(name, text.replace("\x00", " ")),
            )
        return cls(name, text)

    # Computed once per file (not per kernel or diagnostic): a spec may hold thousands of kernels.
    @functools.cached_property
    def digest(self) -> str:
        """The first 16 hex digits of the SHA-256 of the text (newlines as \n), for generated headers."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()[:16]

    @functools.cached_property
    def lines(self) -> tuple[str, ...]:
        # Only \n ends a line, as for the parser (str.splitlines would also split at \f, which is blank).
        return tuple(self.text.removesuffix("\n").split("\n")) if self.text else ()

    def line(self, number: int) -> str:
        return self.lines[number - 1] if 0 < number <= len(self.lines) else ""


@dataclass(frozen=True)
class Diagnostic:
    span: Span | None
    message: str
    notes: tuple[str, ...] = field(default=())

    def render(self, source: SourceFile | None, name: str | None = None) -> str:
        where = source.name if source is not None else (name or "<input>")
        if self.span is None or source is None:
            head = f"{where}: error: {self.message}"
            return "\n".join([head, *(f"  note: {n}" for n in self.notes)])
        head = f"{where}:{self.span.line}:{self.span.col}: error: {self.message}"
        raw = source.line(self.span.line)
        # Tabs would shift the caret: expand them in both the line and the caret offset.
        prefix = raw[: self.span.col - 1].expandtabs(4)
        text = raw.expandtabs(4)
        width = 1
        if self.span.end_line == self.span.line:
            width = max(1, len(raw[self.span.col - 1 : self.span.end_col - 1].expandtabs(4)))
        caret = " " * len(prefix) + "^" + "~" * (width - 1)
        lines = [head, f"    {text}", f"    {caret}"]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


class SpecError(Exception):
    """One or more diagnostics about a spec. str() gives the rendered report."""

    def __init__(self, diagnostics: list[Diagnostic], source: SourceFile | None, name: str | None = None):
        self.diagnostics = list(diagnostics)
        self.source = source
        self.name = name
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(d.render(self.source, self.name) for d in self.diagnostics)
