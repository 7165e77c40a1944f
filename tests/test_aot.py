"""Every generated kernel compiles ahead of time for TPU v5e through libtpu, without a TPU;
on a machine with a TPU the same kernels also run compiled."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
from aot import compile_for, tpu_present
from conftest import GENERATED, SPECS, assert_matches

from sparsegen.compiler import load
from sparsegen.testing import example_args

# Realistic shapes at each spec's own tiles.
SIZES = {
    "dsd_matmul": dict(M=4096, K=4096, N=4096),
    "dds_matmul": dict(M=4096, K=4096, N=4096),
    "masked_matmul": dict(M=4096, K=4096, N=4096),
    "sdd_matmul": dict(M=2048, K=2048, N=2048),
    "block_slice": {},
}


def generated(name):
    spec = importlib.util.spec_from_file_location(f"generated_{name}", GENERATED / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    (kernel,) = load(SPECS / f"{name}.spk")[1]
    return kernel, mod


@pytest.mark.parametrize("name", sorted(SIZES))
@pytest.mark.parametrize("topology", ["v5e:2x2"])
def test_generated_kernel_compiles_for_tpu(name, topology):
    kernel, mod = generated(name)
    args, keywords = example_args(kernel, SIZES[name], "random", np.random.default_rng(0))
    fn = getattr(mod, name)
    compiled = compile_for(lambda *a: fn(*a, **keywords), args, topology)
    assert "tpu_custom_call" in compiled.as_text()  # the Pallas kernel went through Mosaic


@pytest.mark.tpu
@pytest.mark.skipif(not tpu_present(), reason="needs a TPU: no TPU device on this machine")
@pytest.mark.parametrize("name", sorted(SIZES))
def test_generated_kernel_runs_compiled_on_tpu(name):
    kernel, mod = generated(name)
    sizes = {k: min(v, 1024) for k, v in SIZES[name].items()}
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(1))
    out = getattr(mod, name)(*args, **keywords, interpret=False)
    assert_matches(kernel, out, mod.reference(*args, **keywords))


@pytest.mark.parametrize("which", ["NASTY", "NASTY_MASK", "TRANSPOSED", "XMASK", "MASKED_SDD", "XMASK_SDD"])
def test_other_shapes_of_kernel_compile_for_tpu(which):
    """f32 matmuls at full precision, transposed reads, 1-D masks, masks on a summed factor."""
    import hygiene_specs
    from conftest import build

    kernel, mod = build(getattr(hygiene_specs, which))
    symbols = {s: 1024 for s, lit in kernel.symbols if lit is None}
    args, keywords = example_args(kernel, symbols, "random", np.random.default_rng(0))
    fn = getattr(mod, kernel.name)
    assert "tpu_custom_call" in compile_for(lambda *a: fn(*a, **keywords), args).as_text()
