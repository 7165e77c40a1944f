"""The GPU backend: Mosaic GPU kernels for Hopper (H100, H200) from the same specs."""

from .lower import lower_gpu
from .plan import GpuError, GpuModule
from .targets import GPU_TARGETS

__all__ = ["GPU_TARGETS", "GpuError", "GpuModule", "lower_gpu"]
