"""`sparsegen verify --cycles`: libtpu's static cycle estimate, parsed for a dense matmul, and
the table-driven regions weighted by a walk whose tables are known (dsd_matmul on tril).

The compiles run in a helper process with the profile flag; they are skipped only where this
libtpu writes no estimate (it lacks --xla_jf_dump_static_llo_profile_to).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import SPECS

from sparsegen.cli import main
from sparsegen.cycles import measure
from sparsegen.tpu import cycles

DENSE = """kernel mm {
    in  x: bf16[M, K]
    in  y: bf16[K, N]
    out o: bf16[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 256, n = 256, k = 256
    accumulate f32
}
"""


# Every estimate the tests below read, made in one helper process (`measure`: python,
# jax and libtpu start once, not once a test); the dense matmul at 512 tiles and the
# one-group grouped matmul are compared with each other.
JOBS = {
    "dense": {"spec": "mm.spk", "text": DENSE, "kernel": "mm", "target": "v5e", "shapes": {"M": 512, "K": 512, "N": 512},
              "pattern": "density=1"},
    "tril": {"spec": str(SPECS / "dsd_matmul.spk"), "kernel": "dsd_matmul", "target": "v5e",
             "shapes": {"M": 2048, "K": 2048, "N": 2048}, "pattern": "tril"},
    "dense512": {"spec": "mm.spk", "text": DENSE.replace("256", "512"), "kernel": "mm", "target": "v5e",
                 "shapes": {"M": 2048, "K": 2048, "N": 2048}, "pattern": "density=1"},
    "grouped": {"spec": str(SPECS / "grouped_matmul.spk"), "kernel": "grouped_matmul", "target": "v5e",
                "shapes": {"M": 2048, "K": 2048, "N": 2048, "E": 1}, "pattern": "density=1"},
    "dds": {"spec": str(SPECS / "dds_matmul.spk"), "kernel": "dds_matmul", "target": "v5e",
            "shapes": {"M": 1024, "K": 1024, "N": 1024}, "pattern": "density=0.25", "backward": True},
    "dsd": {"spec": str(SPECS / "dsd_matmul.spk"), "kernel": "dsd_matmul", "target": "v5e",
            "shapes": {"M": 1024, "K": 1024, "N": 1024}, "pattern": "density=0.25", "backward": True},
    "tril_cond": {"spec": str(SPECS / "tril_matmul.spk"), "kernel": "tril_matmul", "target": "v5e",
                  "shapes": {"M": 1024, "N": 512}, "pattern": "density=1"},
    "attention": {"spec": str(SPECS / "causal_attention.spk"), "kernel": "causal_attention", "target": "v5e",
                  "shapes": {"B": 1, "H": 1, "S": 1000, "D": 128}, "pattern": "tril", "backward": True},
}


@pytest.fixture(scope="module")
def estimates():
    try:
        found = measure([{"seed": 0, "backward": False, **job} for job in JOBS.values()])
    except cycles.NoProfile as exc:
        pytest.skip(f"this libtpu lacks {cycles.FLAG} (no static profile): {exc}")
    return dict(zip(JOBS, found))


def _found(estimates, name: str) -> cycles.KernelCycles:
    found = estimates[name]
    assert found.error is None, found.error
    return found


def test_dense_matmul_estimate_is_parsed(estimates):
    found = _found(estimates, "dense")
    (p,) = found.forward
    assert p.grid == (2, 2, 2) and p.steps == 8
    # No condition reads a table: the estimator's own figure stands, from one compile.
    assert p.walk is None and p.zero is None and p.cycles == p.raw
    assert all(r.count == r.estimator_count for r in p.regions)
    # 2 * 512^3 FLOPs at 131072 a cycle (four 128x128 MXUs): 2048 cycles at least.
    assert p.mxu_cycles == 2048
    assert p.computing_steps == 8
    assert 2048 < p.cycles < 20 * 2048
    assert found.to_json()["forward"]["mxu_ratio"] == round(p.cycles / 2048, 3)


def test_regions_are_weighted_by_the_real_tables(estimates):
    """dsd_matmul at 2048^3 with 512 tiles on tril: 10 stored blocks of 16, 4 column blocks.
    The walk has 4 x 10 steps (tril feeds every output block: no step writes zeros): 40
    multiply a stored block, 16 of them (a run's last) also flush their output block, 16
    start one. The estimator reads the tables as zeros (every step padding: none computing
    or flushing, the first of each column initialising)."""
    found = _found(estimates, "tril")
    (p,) = found.forward
    assert p.grid == (4, 10)
    counts = {r.name: (r.count, r.estimator_count) for r in p.regions}
    assert counts == {"_init": (16, 4), "_compute": (40, 0), "_flush": (16, 0)}
    assert p.computing_steps == 40
    assert p.mxu_cycles == 40 * 2 * 512**3 / 131072
    # The real walk computes 40 times and flushes 16 output blocks where the estimator saw
    # neither: walk - zero is at least most of 40 products.
    assert p.walk > p.zero + 40 * 2048 * 3 // 4
    assert p.cycles == p.walk + p.raw - p.zero
    assert p.mxu_cycles < p.cycles < p.raw + 2 * p.mxu_cycles


def test_a_full_walk_is_weighted_as_the_dense_product(estimates):
    """grouped_matmul with one group (every block full) takes the dense product's path: init at
    the first k, the product at every step, the flush at the last k. Its weighted estimate is
    near the dense kernel's at the same tiles and shape: 8% over it (the same kernel with its
    conditions rewritten so that the estimator's zero tables take this path says as much: the
    gid block and the table reads of each step, on a small grid). Before two fixes it was
    11.8x: the lookup's `// 31` and `% 31` (the profiler takes them as 0: every step ran step
    0's regions) and the traced grid extent (the estimator walked a grid of its own size)."""
    dense, grouped = _found(estimates, "dense512"), _found(estimates, "grouped")
    (d,), (g,) = dense.forward, grouped.forward
    assert d.steps == g.steps == 64
    assert {r.name: r.count for r in g.regions} == {"_init": 16, "_compute_partial": 0, "_compute_full": 64, "_flush": 16}
    assert g.walk is not None and 1 <= g.cycles / d.cycles < 1.15, (g.cycles, d.cycles, g.raw, g.walk, g.zero)


def test_lookup_reproduces_every_steps_bit():
    """The condition that replaces a table-driven one is the step's bit, for any bits and grid."""
    grid = (3, 5, 7)
    host = cycles._HostPl(grid)
    rng = np.random.default_rng(0)
    for bits in (rng.random(host.steps) < 0.5, np.zeros(host.steps, bool), np.ones(host.steps, bool)):
        got = cycles._lookup(bits, grid, host, _NumpyInt32())
        assert np.array_equal(np.broadcast_to(got, bits.shape), bits)


def test_lookup_reproduces_bits_past_32_words():
    host = cycles._HostPl((9, 130))  # 1170 steps: 37 words
    bits = np.random.default_rng(1).random(host.steps) < 0.3
    got = cycles._lookup(bits, host.grid, host, _NumpyInt32())
    assert np.array_equal(np.broadcast_to(got, bits.shape), bits)


def test_a_traced_grid_extent_is_compiled_as_its_number():
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu

    spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(2, jnp.asarray(3), 4))
    call = cycles.Call(None, {"grid_spec": spec}, (np.zeros(3, np.int32),))
    grid = cycles._static_grid(call).grid
    assert grid == (2, 3, 4) and all(type(g) is int for g in grid)


class _NumpyInt32:
    int32 = staticmethod(np.int64)
    where = staticmethod(np.where)


def test_conditions_are_evaluated_from_the_kernel_code():
    """region_conditions runs the kernel's own code on the tables, and on zeros."""

    def kernel(kinds, x_ref, o_ref):
        step = pl.program_id(1)

        @pl.when(kinds[step] == 1)
        def _compute():
            raise AssertionError("region bodies never run on the host")

        @pl.when(step == pl.num_programs(1) - 1)
        def _flush():
            raise AssertionError

    call = cycles.Call(kernel, {"grid_spec": _Spec((2, 3), 1)}, (np.array([1, 0, 1], np.int32), None, None))
    real = cycles.region_conditions(call)
    zero = cycles.region_conditions(call, zero=True)
    assert [n for n, _ in real] == ["_compute", "_flush"]
    assert real[0][1].tolist() == [True, False, True] * 2 and not zero[0][1].any()
    assert real[1][1].tolist() == zero[1][1].tolist() == [False, False, True] * 2


pl = None  # the kernel above looks `pl` up in this module's globals, as generated code does


class _Spec:
    def __init__(self, grid, tables):
        self.grid, self.num_scalar_prefetch = grid, tables


def test_verify_cycles_json(tmp_path, capsys):
    spec = tmp_path / "mm.spk"
    spec.write_text(DENSE)
    code = main(["verify", str(spec), "--quick", "--cycles", "--shape", "M=512,K=512,N=512", "--json"])
    out = capsys.readouterr()
    if "no static profile" in out.err or "no estimated_cycles" in out.err:
        pytest.skip(f"this libtpu lacks {cycles.FLAG}")
    assert code == 0, out.err
    (result,) = json.loads(out.out)["results"]
    forward = result["cycles"]["forward"]
    assert forward["mxu_min_cycles"] == 2048 and forward["estimated_cycles"] > 2048
    assert forward["passes"][0]["cycles_per_computing_step"] == round(forward["estimated_cycles"] / 8, 1)
    assert result["cycles"]["backward"]["passes"], "the backward passes are estimated too"


def test_pattern_needs_cycles(capsys):
    assert main(["verify", str(SPECS / "dsd_matmul.spk"), "--quick", "--pattern", "tril"]) == 2
    assert "--cycles" in capsys.readouterr().err


def test_cycles_is_refused_for_gpu_targets(capsys):
    assert main(["verify", str(SPECS / "dsd_matmul.spk"), "--target", "h200", "--cycles"]) == 2
    assert "for TPU targets only" in capsys.readouterr().err


def test_attention_backward_passes_are_estimated(estimates):
    """causal_attention's backward (dk, dv and dq in one fused walk over key blocks), its
    diagonal (partial) blocks walked: libtpu's profiler aborted on the dq and dk/dv passes
    ("Expected vector-bf16packed, got vector-int16" on a vmatmul) while a partial step zeroed
    a bf16 block that is a product's left operand with a bf16 select; the kernels now select
    such a block as f32 (sparsegen/tpu/attention/kernels.py: zero_outside). S = 1000, a ragged
    multiple of the 512 tile (at a multiple the kernel zeroes nothing: `may_pass_end`): two
    row blocks, one head, 3 steps."""
    found = _found(estimates, "attention")
    assert len(found.backward) == 1, found.backward
    for p in found.backward:
        assert p.cycles is not None, p.note
        counts = {r.name: r.count for r in p.regions}
        assert counts["_partial"] + counts["_full"] == 3 and counts["_partial"] >= 2, counts
        assert p.cycles > p.mxu_cycles > 0


def test_coo_walks_with_a_moving_output_are_estimated(estimates):
    """The coo-input walks whose output block moves along the steps (dds_matmul's forward and
    d_x, dsd_matmul's d_y): libtpu's static profiler aborted on them ("No DMA issue node found
    for sync flag") while an operand other than the stored blocks came first in the call; the
    walk now passes its stored blocks first (schedule/coo_input.py). Every pass has a figure."""
    for name, passes in (("dds", 3), ("dsd", 3)):
        found = _found(estimates, name)
        every = found.forward + found.backward
        assert len(every) == passes, every
        for p in every:
            assert p.cycles is not None and p.steps > 0, (name, p.kernel, p.note)
            assert p.cycles > p.mxu_cycles > 0, (name, p.kernel)


def test_the_non_finite_path_of_a_condition_is_not_walked(estimates):
    """tril_matmul (`k <= m`: y lacks m) at M = 1024, 512 tiles: two diagonal (partial) steps
    and one full. A partial step checks one row of its product and adds it (`_present_step`'s
    `_finite`); its `_nonfinite` region (7 more products, run only where y holds a NaN or
    Inf) is not walked or counted: the partial region's MXU work is its one product, and the
    estimate stays near the product's minimum (the estimator would count the region as run,
    and libtpu's v5e profiler aborted on it before it read x's values from its block again)."""
    found = _found(estimates, "tril_cond")
    (p,) = found.forward
    assert p.cycles is not None, p.note
    regions = {r.name: (r.count, r.flops) for r in p.regions}
    assert regions["_compute_partial"] == (2, 2 * 512**3) and regions["_compute_full"] == (1, 2 * 512**3)
    assert p.mxu_cycles == 3 * 2048
    assert p.mxu_cycles < p.cycles < p.raw + 2 * p.mxu_cycles, (p.cycles, p.raw, p.walk, p.zero)
