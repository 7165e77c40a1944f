"""What every lowered module is, on every target and for every walk: the kernel, the
target's chip facts, the calling convention and the module's names, why no gradient can go
through it (if so), and the answers the driver, `verify` and `plan` ask of any module.

Each target's module classes (tpu/lower.py `TpuModule`, tpu/attention/lower.py
`AttentionModule`, tpu/paged/lower.py `PagedModule`, gpu/plan.py `GpuModule`,
gpu/attention/lower.py `GpuWalkModule` and its row and paged walks' modules) add their plan.
`refused` and `has_backward` are the einsum walks' (a backward module, lowered like any
kernel's); a walk that plans its own backward kernels says its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .autodiff import refusals
from .callconv import Convention
from .ir import Kernel
from .names import ModuleNames


@dataclass(frozen=True)
class LoweredModule:
    kernel: Kernel
    target: object  # the target's chip facts: tpu/targets.py `Target`, gpu/targets.py `GpuTarget`
    conv: Convention
    names: ModuleNames
    backward_error: str | None = field(default=None, kw_only=True)  # why `jax.grad` cannot go through the kernel at all

    @property
    def name(self) -> str:
        return self.kernel.name

    @property
    def has_backward(self) -> bool:
        """Are there backward passes (a float input with a derived gradient)?"""
        return self.backward_module is not None

    @property
    def refused(self) -> tuple:
        """The gradients not derived (autodiff.Refusal), each raised only where it is needed."""
        return refusals(self.kernel, self.backward, self.backward_error)
