"""NVIDIA GPUs sparsegen targets (Hopper, Mosaic GPU), with the numbers its rules and estimates use.

Shared memory: the opt-in maximum per block, 227 KiB (232448 bytes) on sm_90, which is also
Mosaic GPU's own limit (`max_smem_bytes`). Peak dense bf16 throughput and HBM bandwidth are
NVIDIA's published SXM figures (H100: 989 TFLOP/s, 3.35 TB/s; H200: 989 TFLOP/s, 4.8 TB/s).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..targets import chips_for


@dataclass(frozen=True)
class GpuTarget:
    name: str
    device_kind: str  # jax's device_kind, for the abstract device that lowering runs under
    smem_bytes: int  # shared memory one CTA may use
    sms: int
    bf16_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: int


GPU_TARGETS: dict[str, GpuTarget] = chips_for(
    "gpu",
    (
        GpuTarget("h100", "NVIDIA H100 80GB HBM3", 232448, 132, 989e12, 3.35e12, 80 << 30),
        GpuTarget("h200", "NVIDIA H200", 232448, 132, 989e12, 4.8e12, 141 << 30),
    ),
)


def target_config(t: GpuTarget) -> str:
    """The GpuTargetConfigProto (text) of a compile-only device for XLA:GPU (stage 3 of
    `verify`): sm_90, NVIDIA's published figures for the chip."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {t.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(t.hbm_bytes_per_s)}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {t.hbm_bytes}
  shared_memory_per_block_optin: {t.smem_bytes}
  cuda_compute_capability {{
    major: 9
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
device_description_str: "{t.device_kind}"
"""
