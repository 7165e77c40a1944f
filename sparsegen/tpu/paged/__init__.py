"""The paged walk on the TPU (language v2, sections 2-3): decoding over a paged key/value
cache. `lower.py` decides the arrays and buffers, `emit.py` writes the module,
`describe.py` its plan in words."""

from .emit import PagedEmitter, emit_paged
from .lower import PagedModule, lower_paged

__all__ = ["PagedEmitter", "PagedModule", "emit_paged", "lower_paged"]
