"""The chip table's memory figures, checked against libtpu: a copy kernel whose double-buffered
blocks just fit compiles, one just over does not."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from aot import compile_for
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sparsegen.tpu.targets import TARGETS

MiB = 1 << 20


def copy_kernel(rows: int, limit: int | None):
    """Four buffers (in and out, double-buffered) of rows x 1024 f32 = rows * 16 KiB."""

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def fn(x):
        spec = pl.BlockSpec((rows, 1024), lambda i: (i, 0))
        params = pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=limit)
        return pl.pallas_call(kernel, grid=(2,), in_specs=[spec], out_specs=spec, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), compiler_params=params)(x)

    return fn, [np.broadcast_to(np.float32(0), (2 * rows, 1024))]  # shape and dtype only: no memory


def fits(fn, args, target, space: str) -> bool:
    """Whether it compiles; a failure must be for lack of `space` (vmem or smem), nothing else."""
    try:
        compile_for(fn, args, TARGETS[target].topology)
        return True
    except Exception as exc:
        assert space in str(exc).lower(), str(exc)[:300]
        return False


def compiles(target, footprint: int, limit: int | None) -> bool:
    fn, args = copy_kernel(footprint // (4 * 4096) // 8 * 8, limit)
    return fits(fn, args, target, "vmem")


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_vmem_capacity_and_default_scoped_limit(target):
    chip = TARGETS[target]
    assert compiles(target, chip.vmem_bytes - 2 * MiB, chip.vmem_bytes)
    assert not compiles(target, chip.vmem_bytes + 2 * MiB, 256 * MiB)
    assert compiles(target, chip.scoped_vmem_bytes - 2 * MiB, None)
    assert not compiles(target, chip.scoped_vmem_bytes + 4 * MiB, None)


def smem_compiles(target, entries: int) -> bool:
    def kernel(s_ref, x_ref, o_ref):
        o_ref[...] = x_ref[...] + s_ref[pl.program_id(0)]

    def fn(s, x):
        spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(8,),
            in_specs=[pl.BlockSpec((8, 128), lambda i, s: (s[i] % 8, 0))], out_specs=pl.BlockSpec((8, 128), lambda i, s: (i, 0)),
        )  # fmt: skip
        return pl.pallas_call(kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(s, x)

    return fits(fn, [np.broadcast_to(np.int32(0), (entries,)), np.zeros((64, 128), np.int32)], target, "smem")


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_smem_budget(target):
    budget = TARGETS[target].smem_bytes // 4
    assert smem_compiles(target, budget)
    assert not smem_compiles(target, (1 << 20) // 4)
