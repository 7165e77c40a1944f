"""The paged walk on Mosaic GPU (Hopper): decoding over a paged key/value cache (language v2,
sections 2-3; the backend-neutral plan is `schedule/paged.py`).

`lower.py` applies the GPU's rules (the row walk's: `gpu/attention/lower.py`) and sizes the
shared memory, `emit.py` writes the module (the kernel; the classification per page, the
table checks and `reference` are the TPU paged module's), `describe.py` its plan.
"""

from .emit import emit_gpu_paged
from .lower import GpuPagedModule, lower_gpu_paged

__all__ = ["GpuPagedModule", "emit_gpu_paged", "lower_gpu_paged"]
