"""The TPU simulator's race detector over one kernel per walk: no race is reported.

The simulator runs with two cores per device (a megacore: v4, v5p), so the grid's
'parallel' axes are split between cores in a random order; an axis wrongly marked
parallel (two cores writing one output block, or accumulating into it) is a race. A
positive control shows the detector is live: the same kernel with its reduction axis
marked parallel reports a race.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
from conftest import assert_matches, build
from jax.experimental.pallas import tpu as pltpu
from oracle import oracle

from sparsegen.testing import example_args

SPECS = {
    "dense": """
kernel race_dense {
    in  x: f32[M, K]
    in  y: f32[K, N]
    out o: f32[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}
""",
    "coo_input": """
kernel race_dsd {
    in  x: bf16[M, K] coo
    in  y: bf16[K, N]
    out o: bf16[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}
""",
    "mask": """
kernel race_masked {
    in  x: bf16[M, K]
    in  y: bf16[K, N]
    in  keep: i32[M, N] mask
    out o: f32[M, N]
    o[m, n] = keep[m, n] * x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}
""",
    "coo_output": """
kernel race_sdd {
    in  x: f32[M, K]
    in  y: f32[K, N]
    out o: f32[M, N] coo
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}
""",
    "coo_join": """
kernel race_join {
    in  x: f32[M, K] coo
    in  y: f32[K, N]
    out o: f32[M, N] coo
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}
""",
    # Offsets on the left side (literal sizes: symbolic ones fail, see test_window.py).
    "window": """
kernel race_window {
    in  x: f32[256, 384]
    in  y: f32[384, 256]
    in  at: index[2]
    out o: f32[512, 512]
    o[at[0] + m, at[1] + n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}
""",
}
SIZES = dict(M=256, K=384, N=256)


def races():
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    return interpret_pallas_call.races


def run_detecting_races(kernel, fn, args, keywords):
    params = pltpu.InterpretParams(detect_races=True, on_race="warn", num_cores_or_threads=2, random_seed=7)
    try:
        out = fn(*args, **keywords, interpret=params)
        np.asarray(out)
        state = races()
        assert state is not None, "the simulator ran without its race detector"
        return out, state.races_found
    finally:
        pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.parametrize("walk", sorted(SPECS))
def test_no_race_in_any_walk(walk):
    kernel, mod = build(SPECS[walk])
    args, keywords = example_args(kernel, SIZES, "duplicates", np.random.default_rng(11))
    out, found = run_detecting_races(kernel, getattr(mod, kernel.name), args, keywords)
    assert not found, f"the race detector reported a race in the {walk} walk"
    assert_matches(kernel, out, oracle(kernel, args, keywords))


def test_the_race_detector_is_live(tmp_path):
    """Positive control: mark the summed axis of the dense kernel 'parallel' too. The cores
    split the grid's points in order, so with one output block and three steps of k the
    two cores both accumulate into and write back that block: a race is reported."""
    kernel, mod = build(SPECS["dense"], formatted=True)  # its text is edited below
    code = open(mod.__file__).read()
    honest = 'dimension_semantics=("parallel", "parallel", "arbitrary")'
    assert honest in code
    path = tmp_path / "race_dense_all_parallel.py"
    path.write_text(code.replace(honest, 'dimension_semantics=("parallel", "parallel", "parallel")'))
    spec = importlib.util.spec_from_file_location("race_dense_all_parallel", path)
    broken = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = broken
    spec.loader.exec_module(broken)
    args, keywords = example_args(kernel, dict(M=128, K=384, N=128), "random", np.random.default_rng(0))
    _, found = run_detecting_races(kernel, broken.race_dense, args, keywords)
    assert found
    # The honest kernel, on the same arguments, has none.
    _, found = run_detecting_races(kernel, mod.race_dense, args, keywords)
    assert not found
