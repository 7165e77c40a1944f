"""Fragments of Python source text that every emitter writes the same way."""

from __future__ import annotations


def py_tuple(items) -> str:
    """A Python tuple literal from item texts (one item keeps its trailing comma: "(a,)")."""
    items = list(items)
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
