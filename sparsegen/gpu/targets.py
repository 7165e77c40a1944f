"""NVIDIA GPUs sparsegen targets (Hopper, Mosaic GPU), with the numbers its rules and estimates use.

Shared memory: the opt-in maximum per block, 227 KiB (232448 bytes) on sm_90, which is also
Mosaic GPU's own limit (`max_smem_bytes`). Peak dense bf16 throughput and HBM bandwidth are
NVIDIA's published SXM figures (H100: 989 TFLOP/s, 3.35 TB/s; H200: 989 TFLOP/s, 4.8 TB/s).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuTarget:
    name: str
    device_kind: str  # jax's device_kind, for the abstract device that lowering runs under
    smem_bytes: int  # shared memory one CTA may use
    sms: int
    bf16_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: int


GPU_TARGETS: dict[str, GpuTarget] = {
    t.name: t
    for t in (
        GpuTarget("h100", "NVIDIA H100 80GB HBM3", 232448, 132, 989e12, 3.35e12, 80 << 30),
        GpuTarget("h200", "NVIDIA H200", 232448, 132, 989e12, 4.8e12, 141 << 30),
    )
}


def is_gpu(target: str) -> bool:
    return target in GPU_TARGETS
