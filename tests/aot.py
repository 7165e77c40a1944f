"""Ahead-of-time compilation through libtpu for a TPU topology, with no TPU present."""

from __future__ import annotations

import functools
import os

import jax
import numpy as np

SWEEP = os.environ.get("SPARSEGEN_SWEEP") == "1"


def across_targets(names, targets):
    """(name, target) pairs for an ahead-of-time compile test of examples: every pair under
    SPARSEGEN_SWEEP=1; by default each name on one target, the targets in turn (each still
    gets some). tests/test_verify.py compiles every example, forward and backward, in `make
    test`, one example of each walk for every target; a compile takes seconds, so the other
    tests need not repeat it."""
    names, targets = list(names), list(targets)
    if SWEEP:
        return [(n, t) for n in names for t in targets]
    return [(n, targets[i % len(targets)]) for i, n in enumerate(names)]


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


def lower_for(fn, args, topology: str = "v5e:2x2"):
    """Lower `fn(*args)` for the topology's first device (no compile); returns the lowered object."""
    from jax.sharding import SingleDeviceSharding

    device = topology_device(topology)
    sharding = SingleDeviceSharding(device)
    structs = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=sharding) for a in args]
    with jax.default_device(device):
        return jax.jit(fn).trace(*structs).lower()


def mosaic_matmuls(lowered) -> list[tuple[str, str, str, str | None]]:
    """Every matmul of the Mosaic kernels in a lowered computation: (kernel, lhs type, rhs
    type, contract precision or None). The kernels travel as serialized MLIR in each
    tpu_custom_call's backend_config; parsed back with unregistered dialects allowed."""
    import base64
    import json
    import re

    from jax._src.lib.mlir import ir

    out = []
    text = lowered.as_text()
    for config, name in re.findall(r'backend_config = "((?:[^"\\]|\\.)*)", kernel_name = "(\w+)"', text):
        config = re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), config)
        body = base64.b64decode(json.loads(config)["custom_call_config"]["body"])
        context = ir.Context()
        context.allow_unregistered_dialects = True
        with context:
            asm = ir.Module.parse(body).operation.get_asm(print_generic_op_form=True)
        for line in asm.splitlines():
            if ".tpu.matmul\"" not in line:
                continue
            types = re.search(r":\s*\((vector<[^>]*>), (vector<[^>]*>), ", line)
            precision = re.search(r"precision = #tpu\.contract_precision<(\w+)>", line)
            out.append((name, types.group(1), types.group(2), precision.group(1) if precision else None))
    return out
