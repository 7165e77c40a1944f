"""Fragments of Python source text that every emitter writes the same way."""

from __future__ import annotations

import re


def py_tuple(items) -> str:
    """A Python tuple literal from item texts (one item keeps its trailing comma: "(a,)")."""
    items = list(items)
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def parameters(params, used, keywords=(), collapse: bool = True) -> tuple[str, list[str]]:
    """A function's parameter list as hand-written Pallas spells it (megablox, Splash), and
    the parameters to `del` at its top. Pallas passes every grid coordinate and every
    scalar-prefetch table positionally: trailing ones the body does not read collapse into
    `*_` (with `collapse`; kernels keep theirs: callers count them), and an unread one
    before a read one is kept and `del`-ed. `keywords` (bound by functools.partial) follow
    as keyword-only parameters."""
    params = list(params)
    last = max((i for i, p in enumerate(params) if p in used), default=-1) if collapse else len(params) - 1
    kept = params[: last + 1]
    deleted = [p for p in kept if p not in used]
    rest = ["*_"] if len(kept) < len(params) else ["*"] if keywords else []
    return ", ".join(kept + rest + list(keywords)), deleted


def words(text: str) -> set[str]:
    """The identifiers a fragment of code text names (for code the planner writes as text,
    where no expression tree is kept)."""
    return set(re.findall(r"\b[A-Za-z_]\w*\b", text))


def needed(lets, *texts: str) -> list:
    """The `(name, value text)` lets that `texts` read, directly or through later lets'
    values, in order: the others would be assigned and never read."""
    want, out = set().union(*(words(t) for t in texts)), []
    for name, value in reversed(list(lets)):
        if name in want:
            out.append((name, value))
            want |= words(value)
    return out[::-1]


def live_lines(lines, *tail: str) -> list[str]:
    """`lines` (a function body's, one statement a line, nested blocks indented) less the
    unindented assignments `a = ...` or `a, b = ...` that nothing after them reads: later
    kept lines or `tail`."""
    want, out = set().union(*(words(t) for t in tail)), []
    for line in reversed(list(lines)):
        head, sep, value = line.partition(" = ")
        plain = sep and not line[:1].isspace() and all(t.strip().isidentifier() for t in head.split(","))
        targets = {t.strip() for t in head.split(",")} if plain else None
        if targets is not None and not targets & want:
            continue
        out.append(line)
        want |= words(value if targets is not None else line)
    return out[::-1]
