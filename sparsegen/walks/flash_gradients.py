"""Which gradients the flash backward of a row or paged walk derives and which it refuses, the
same on every target (TPU: `tpu/attention/lower.py`; GPU: `gpu/attention/backward.py`)."""

from __future__ import annotations

from ..autodiff import Refusal
from ..ir import Kernel
from ..schedule.attention import RowPlan

_NOT_DERIVED = {"max": "a max reduction", "softmax_out": "a stored softmax", "scores_out": "a stored score"}


def gradient_refusals(kernel: Kernel, p: RowPlan) -> tuple:
    """The gradients the flash-attention backward does not derive: through a max reduction
    or a stored output, for every float operand the score reads (the others' gradients, and
    every gradient through the other outputs, are derived)."""
    reads = p.score_operands()
    operands = [op for op in kernel.operands if op.name in reads and op.dtype.is_float]
    return tuple(Refusal(op.name, c.output, f"the gradient of '{op.name}' through '{c.output}' ({_NOT_DERIVED[c.kind]}) is not derived yet")
                 for c in p.consumers if c.kind in _NOT_DERIVED for op in operands)


def derived_outputs(p: RowPlan) -> list[str]:
    """The outputs the backward carries gradients through (in the plan's order)."""
    return [c.output for c in p.consumers if c.kind not in _NOT_DERIVED]
