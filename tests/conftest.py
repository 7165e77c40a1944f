"""Shared fixtures: build kernels from spec text, run them in the three no-TPU modes."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from sparsegen.jaxenv import interpreter_threads, quiet_libtpu, unoptimised_cpu_compiles  # noqa: E402

from crash_rerun import pytest_handlecrashitem, pytest_report_teststatus, pytest_terminal_summary  # noqa: E402,F401

quiet_libtpu()  # also lets test workers share libtpu for ahead-of-time compiles
interpreter_threads()  # a thread per warpgroup in the Mosaic GPU interpreter, on few cores too
# The interpreted kernels' compiles, about 20% less CPU (tests/test_kernels.py: 40 -> 32
# CPU-seconds, tests/test_attention.py: 159 -> 127); AOT compiles through libtpu unchanged.
unoptimised_cpu_compiles()


ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
GENERATED = ROOT / "generated"
BUILD_CACHE = ROOT / ".pytest_cache" / "sparsegen-modules"

from sparsegen.compiler import compile_source  # noqa: E402
from sparsegen.source import SourceFile  # noqa: E402


def spec_text(name: str) -> str:
    return (SPECS / f"{name}.spk").read_text()


def with_tiles(text: str, **tiles: int) -> str:
    """The spec with its tile line replaced."""
    line = "tile " + ", ".join(f"{k} = {v}" for k, v in tiles.items())
    return re.sub(r"^(\s*)tile .*$", lambda m: m.group(1) + line, text, count=1, flags=re.M)


_modules: dict[str, tuple] = {}


def build(text: str, target: str = "v5e", formatted: bool = False):
    """Compile spec text with one kernel; return (checked kernel, imported module).
    A TPU module as the templates write it, before black, unless `formatted` (a test that
    reads the module's text, or that black takes it): the same code (tests/test_formatting.py
    proves black's output is, docstrings aside, the same syntax tree, on every example), and
    black takes most of a build (0.3-3 CPU-seconds a module). GPU modules are always formatted."""
    formatted = formatted or target.startswith("h")
    key = hashlib.sha256(f"{target}\n{formatted}\n{text}".encode()).hexdigest()[:20]
    if key in _modules:
        return _modules[key]
    if formatted:
        (module,) = compile_source(SourceFile("test.spk", text), target)
        name, code, plan = module.kernel, module.code, module.plan
    else:
        from sparsegen.compiler import lower_source
        from sparsegen.backends import emit_module as emit

        (plan,) = lower_source(SourceFile("test.spk", text), target)
        name, code = plan.name, emit(plan, "test.spk", formatted=False)
    BUILD_CACHE.mkdir(parents=True, exist_ok=True)
    path = BUILD_CACHE / f"{name}_{key}.py"
    # Both test workers may build the same module: write whole files only.
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(code)
    os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(f"sparsegen_test_{name}_{key}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    _modules[key] = (plan.kernel, mod)
    return _modules[key]


def assert_matches(kernel, out, ref, env=None):
    """Every output of a kernel against a reference, within the tolerance its dtypes and sums allow."""
    from sparsegen.testing import tolerance

    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    assert len(outs) == len(refs) == len(kernel.outputs)
    for op, o, r in zip(kernel.outputs, outs, refs):
        o = np.asarray(o).astype(np.float64)
        r = np.asarray(r).astype(np.float64)
        assert o.shape == r.shape, (op.name, o.shape, r.shape)
        assert not np.isnan(o).any(), f"NaN in {op.name}: a block was left unwritten, or garbage reached it"
        rtol, atol = tolerance(kernel, op.name, env)
        # Absolute error is measured against the typical size of the result (its RMS), at
        # least that of one term (the data are of order 1): cancellation can make a sum tiny.
        scale = max(1.0, float(np.sqrt(np.mean(r**2)))) if r.size else 1.0
        np.testing.assert_allclose(o, r, rtol=rtol, atol=atol * scale, err_msg=f"output {op.name}")


SWEEP = os.environ.get("SPARSEGEN_SWEEP") == "1"


def in_both_modes(cases, simulated, names: str | None = None, interpreted=None, *, alone: bool = False):
    """Parameters for a test taking `interpret` beside its own: every case in the CPU
    interpreter, and in the simulator the representative ones (`simulated`: a list of cases,
    or a predicate on a case), every case under SPARSEGEN_SWEEP=1. The simulator traces and
    runs each kernel op by op (seconds to minutes a case), and what it adds to the CPU
    interpreter (NaN-filled memory, revisit and bounds checks) depends on a walk's kind, not
    on which example of that kind runs it. `interpreted` (a predicate on a case), where
    given, leaves the other cases out of the CPU interpreter but under SPARSEGEN_SWEEP=1 (a
    case another one covers there: "random" blocks where "padded" draws them and padding
    entries too). `alone`: the simulated cases run in the simulator alone, the others in the
    CPU interpreter (every case in both under SPARSEGEN_SWEEP=1): the simulator makes the
    interpreter's call, with NaN-filled memory and revisit and bounds checks besides. Use as
    `@pytest.mark.parametrize(*in_both_modes(CASES, [...], "name"), indirect=["interpret"])`;
    a case that is a tuple fills several names ("name,pattern")."""
    keep = simulated if callable(simulated) else (lambda case, chosen=list(simulated): case in chosen)
    interpret = interpreted or ((lambda case: not keep(case)) if alone else (lambda case: True))
    params, ids = [], []
    for mode in ("cpu", "sim"):
        for case in cases:
            if SWEEP or (interpret(case) if mode == "cpu" else keep(case)):
                values = case if isinstance(case, tuple) else (case,)
                params.append((*values, mode))
                ids.append("-".join([mode, *map(str, values)]))
    names = names or "case"
    return f"{names},interpret", [pytest.param(*p, id=i) for p, i in zip(params, ids)]


# For a test whose point does not depend on the mode (names, symbolic zeros, which gradient
# is asked for): the CPU interpreter, and the simulator too under SPARSEGEN_SWEEP=1.
cpu_unless_sweep = pytest.mark.parametrize("interpret", ["cpu", "sim"] if SWEEP else ["cpu"], indirect=True)

# For a test the simulator checks more of than the CPU interpreter (a traced walk's revisits,
# memory no step writes), where other tests run the same walk in the CPU interpreter: the
# simulator, and the CPU interpreter too under SPARSEGEN_SWEEP=1.
sim_unless_sweep = pytest.mark.parametrize("interpret", ["cpu", "sim"] if SWEEP else ["sim"], indirect=True)


# For a test whose checks differ between the modes (a step only one of them takes): both.
both_modes = pytest.mark.parametrize("interpret", ["cpu", "sim"], indirect=True)


@pytest.fixture(params=["cpu", "sim"] if SWEEP else ["sim"])
def interpret(request):
    """The TPU simulator (NaN-filled memory, revisit and bounds checks), and the CPU
    interpreter too under SPARSEGEN_SWEEP=1: for a test taking `interpret` unparametrized, the
    simulator makes the interpreter's call and checks more (the generated wrappers pass
    `interpret` through to pallas_call), so by default the CPU interpreter's twin adds only
    time; every test file runs kernels in the CPU interpreter elsewhere (interpret=True, and
    in_both_modes' and cpu_unless_sweep's cases). Parametrize `interpret` (indirect) for
    other modes: in_both_modes, cpu_unless_sweep, sim_unless_sweep, both_modes."""
    import jax
    from jax.experimental.pallas import tpu as pltpu

    if request.param == "cpu":
        yield True
    else:
        yield pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
        jax.effects_barrier()  # a kernel whose result nobody awaited (a forward under grad) may still run
        pltpu.reset_tpu_interpret_mode_state()


# Modules whose tests wait on one long piece of work (a mesh runner process, the MoE
# example's training, the cycle estimates' helper process, run_examples.py, test_gpu.py's
# every-example ptxas compile: 25 to 100 CPU-seconds each, none divisible) run first, each
# module's tests together and in their order: `--dist worksteal` hands each worker half the
# suite in this order and rebalances by taking tests from the end of the other's queue, so
# what is left at the end is short tests, not a long one holding one worker while the
# other idles.
LONG_FIRST = ["test_sharded.py", "test_sharded_gpu.py", "test_cycles.py", "test_moe_example.py",
              "test_sharded_sweep.py", "test_gpu.py", "test_run_examples.py", "test_sharded_typed.py"]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: n for n, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module's tests keep their order
