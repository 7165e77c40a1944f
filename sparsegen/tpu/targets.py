"""TPU generations sparsegen targets, with the numbers its checks and estimates use.

Memory figures were measured by compiling kernels ahead of time through libtpu for
each topology (tests/test_targets.py keeps them honest):
- VMEM capacity: the largest footprint that compiles with `vmem_limit_bytes` raised
  (v5e 128 MiB, v6e 128 MiB less 64 KiB, v5p 64 MiB less 64 KiB, v4 16 MiB).
- Default scoped VMEM limit: what compiles without `vmem_limit_bytes`
  (16 MiB on v4, v5e and v5p; 32 MiB on v6e).
- SMEM: 1 MiB on every generation, of which the compiler keeps 1.7-3.1 KiB; the budget
  leaves 8 KiB aside.

Peak throughput and HBM bandwidth are the public per-chip figures from Google Cloud's
TPU documentation (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..targets import chips_for

KiB = 1 << 10
MiB = 1 << 20


@dataclass(frozen=True)
class Target:
    name: str
    topology: str  # for jax.experimental.topologies.get_topology_desc
    vmem_bytes: int  # usable VMEM per TensorCore
    scoped_vmem_bytes: int  # the compiler's default scoped VMEM limit
    smem_bytes: int  # usable SMEM (scalar prefetch arrays live here)
    int8_matmul: bool
    cores: int  # TensorCores per chip that share a grid's parallel axes (megacore)
    bf16_flops: float  # peak dense bf16 FLOP/s
    int8_ops: float  # peak int8 OP/s (0 where the MXU has no int8 mode)
    hbm_bytes_per_s: float
    # Copies (output-block sized, accumulate dtype) Mosaic keeps for a block of three or more
    # dimensions brought into the output's order. Measured: 64-80 MiB for 128^3 f32 blocks
    # on v5e (three); v4 relayouts through many more (29 MiB for a (128, 16, 128) f32 x bf16
    # product transposed (c, b, a) -> (a, b, c), where v5e needs 12.5; 18.2 MiB for one
    # (128, 8, 128) f32 block so transposed).
    transpose_copies: int = 3


TARGETS: dict[str, Target] = chips_for(
    "tpu",
    (
        Target("v4", "v4:2x2x1", 16 * MiB, 16 * MiB, MiB - 8 * KiB, False, 2, 275e12, 0.0, 1200e9, transpose_copies=32),
        Target("v5e", "v5e:2x2", 128 * MiB, 16 * MiB, MiB - 8 * KiB, True, 1, 197e12, 394e12, 819e9),
        Target("v5p", "v5p:2x2x1", 64 * MiB - 64 * KiB, 16 * MiB, MiB - 8 * KiB, True, 2, 459e12, 918e12, 2765e9),
        Target("v6e", "v6e:2x2", 128 * MiB - 64 * KiB, 32 * MiB, MiB - 8 * KiB, True, 1, 918e12, 1836e12, 1640e9),
    ),
)


def format_bytes(n: int) -> str:
    """Bytes in the unit a kernel author reads fastest (exact where it is whole)."""
    for unit, size in (("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"
