"""Compiling allocates millions of small acyclic objects (syntax trees, terms, lines of
code). Python's cyclic collector rescans every live one each time it runs, which made a long
spec's parse, check and build superlinear; reference counting alone frees them. The stages
that allocate run with the collector paused (cycles wait until it resumes)."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def no_cycle_collection():
    """Pause the cyclic collector (a context manager, or a decorator); nests."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
