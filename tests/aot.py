"""Ahead-of-time compilation through libtpu for a TPU topology, with no TPU present."""

from __future__ import annotations

import functools

import jax
import numpy as np


@functools.cache
def topology_device(topology: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology, "tpu").devices[0]


def compile_for(fn, args, topology: str = "v5e:2x2"):
    """Lower and compile `fn(*args)` for the topology's first device; returns the compiled object."""
    from jax.sharding import SingleDeviceSharding

    device = topology_device(topology)
    sharding = SingleDeviceSharding(device)
    structs = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=sharding) for a in args]
    # Some Mosaic lowerings ask which TPU they target: the default device tells them.
    with jax.default_device(device):
        return jax.jit(fn).trace(*structs).lower().compile()


def tpu_present() -> bool:
    try:
        return any(d.platform == "tpu" for d in jax.devices())
    except RuntimeError:
        return False
