"""The row walk on the TPU: flash attention and its relatives (language v1, sections 3-5).

`lower.py` decides the arrays and layouts, `kernels.py` writes the kernels (forward,
stored outputs, dq, dk/dv), `reference.py` the jax.numpy reference, `emit.py` the module,
`describe.py` its plan in words.
"""

from .emit import AttentionEmitter, emit_attention
from .lower import AttentionModule, lower_attention

__all__ = ["AttentionEmitter", "AttentionModule", "emit_attention", "lower_attention"]
