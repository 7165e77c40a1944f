"""Every kernel the compiler emits now (not the checked-in generated/) compiles ahead of
time through libtpu for TPU v5e, v6e and v4, without a TPU; on a machine with a TPU the
same kernels also run compiled."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
from aot import SWEEP, across_targets, compile_for, tpu_present
from conftest import SPECS, assert_matches

from sparsegen.compiler import compile_file, load
from sparsegen.testing import example_args

TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v4": "v4:2x2x1"}
SPEC_FILES = sorted(SPECS.glob("*.spk"))
# Every kernel of every spec (a file may hold several: masked_backward.spk has two).
KERNELS = [(path.stem, k.name) for path in SPEC_FILES for k in load(path)[1]]

_fresh: dict[tuple[str, str], dict] = {}


def fresh_modules(spec: str, target: str, tmp_path_factory) -> dict:
    """kernel name -> (plan kernel, module) for a spec compiled now for a target, each module
    imported from its own file in a temporary folder."""
    key = (spec, target)
    if key not in _fresh:
        folder = tmp_path_factory.mktemp(f"aot_{spec}_{target}")
        modules = {}
        for module in compile_file(SPECS / f"{spec}.spk", target):
            path = folder / f"{module.kernel}.py"
            path.write_text(module.code)
            name = f"fresh_{target}_{module.kernel}"
            imp = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(imp)
            sys.modules[name] = mod
            imp.loader.exec_module(mod)
            modules[module.kernel] = (module.plan.kernel, mod)
        _fresh[key] = modules
    return _fresh[key]


def shapes(kernel, scale: int) -> dict[str, int]:
    """Each free size symbol: `scale` blocks of the largest tile along it."""
    tiles: dict[str, int] = {}
    for index in kernel.indices:
        if index.size.symbol is not None and index.size.literal is None:
            tiles[index.size.symbol] = max(tiles.get(index.size.symbol, 1), index.tile)
    out = {s: scale * t for s, t in tiles.items()}
    for rel in kernel.relations:  # `h // 8` with tile h = 1: H a multiple of 8
        big = kernel.index(rel.index).size.symbol
        if big in out:
            out[big] = -(-out[big] // rel.divisor) * rel.divisor
    return out


def test_every_spec_kernel_is_listed():
    assert (
        len(SPEC_FILES) >= 7
        and ("masked_backward", "masked_matmul_dx") in KERNELS
        and ("masked_backward", "masked_matmul_dy") in KERNELS
    )


# tests/test_verify.py compiles every example, forward and backward, emitted now as here
# (and compile_for, like verify, compiles for the arguments' shapes and dtypes only; a coo
# input, a mask and attention for each of v5e, v6e and v4). Here by default dsd_matmul on
# v5e (this path: compile_for of a module emitted into a temporary folder); one kernel of
# each kind, the targets in turn, repeated test_verify's compiles (about 30 CPU-seconds):
# every kernel on every target under SPARSEGEN_SWEEP=1.
FRESH = ([(s, n, t) for (s, n), t in across_targets(KERNELS, sorted(TOPOLOGIES))] if SWEEP
         else [("dsd_matmul", "dsd_matmul", "v5e")])


@pytest.mark.parametrize("spec,name,target", FRESH, ids=[f"{s}-{n}-{t}" for s, n, t in FRESH])
def test_fresh_kernel_compiles_for_tpu(spec, name, target, tmp_path_factory):
    kernel, mod = fresh_modules(spec, target, tmp_path_factory)[name]
    assert mod.__file__.startswith(str(tmp_path_factory.getbasetemp()))  # not generated/
    args, keywords = example_args(kernel, shapes(kernel, 4), "random", np.random.default_rng(0))
    fn = getattr(mod, name)
    compiled = compile_for(lambda *a: fn(*a, **keywords), args, TOPOLOGIES[target])
    assert "tpu_custom_call" in compiled.as_text()  # the Pallas kernel went through Mosaic


@pytest.mark.tpu
@pytest.mark.skipif(not tpu_present(), reason="needs a TPU: no TPU device on this machine")
@pytest.mark.parametrize("spec,name", KERNELS, ids=[f"{s}-{n}" for s, n in KERNELS])
def test_fresh_kernel_runs_compiled_on_tpu(spec, name, tmp_path_factory):
    kernel, mod = fresh_modules(spec, "v5e", tmp_path_factory)[name]
    args, keywords = example_args(kernel, shapes(kernel, 2), "random", np.random.default_rng(1))
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
