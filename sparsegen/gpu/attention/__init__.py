"""The row walk on Mosaic GPU (Hopper): attention-like kernels (language v1, sections 3-5).

`lower.py` decides the arrays, tiles and shared memory (and applies the GPU's rules),
`emit.py` writes the module (the kernel, the tables, `reference`), `describe.py` its plan.
"""

from .emit import emit_gpu_attention
from .lower import GpuAttentionModule, lower_gpu_attention

__all__ = ["GpuAttentionModule", "emit_gpu_attention", "lower_gpu_attention"]
