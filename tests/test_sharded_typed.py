"""`sharded` typed by the mesh axes each value varies over (shard_map's check_vma), as it
runs compiled and in the TPU simulator: each pallas_call's outputs vary over the axes its
operands vary over (`_typed`), a gradient is added up across an axis its argument is whole
on (`_typed_gradients`), and shard_map's transpose adds nothing else. The CPU interpreter
runs untyped (jax's cannot evaluate kernel bodies typed), so these cases run in the
simulator, on 8 host devices (tests/mesh_runner.py): values and
gradients equal the unsplit kernel's and `reference`'s. What the compiled HLO holds (no
redundant all-reduce) is tests/test_sharded_aot.py's.

Each case exercises one typing rule: a summed index split (einsum k: psum of typed
partial sums, its transpose no communication), an argument whole on the axis that splits
the other (dsd's x when n is split: its gradient added across the axis), experts split
with rows (grouped_matmul: AOT only, the simulator fails on its index maps typed),
attention over batch and heads (several outputs of one pallas_call).
"""

from __future__ import annotations

import pytest
from conftest import spec_text
from mesh_jobs import MESH, MeshJobs, assert_case, run_on_mesh
from test_sharded import BATCHED, DSD

SIM = {**MESH, "interpret": "simulator", "typed": True}
MESH_JOBS = MeshJobs("sharded_typed")


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory, worker_id):
    return MESH_JOBS.run(tmp_path_factory, worker_id)


def _jobs():
    MESH_JOBS.add("typed",
            (BATCHED, dict(B=2, M=128, K=512, N=128), [{**SIM, "axes": {"b": "data", "k": "model"}}]),
            (DSD, dict(M=128, K=256, N=512), [{**SIM, "axes": {"n": "model"}}]),
            (spec_text("causal_attention"), dict(B=2, H=4, S=128, D=128), [{**SIM, "axes": {"b": "data", "h": "model"}}]))


_jobs()


def test_typed_sharding_in_the_simulator(mesh_results):
    (ke, enve, rese), (kd, envd, resd), (ka, enva, resa) = run_on_mesh(mesh_results, "typed")
    assert assert_case(ke, enve, rese, 0, ["P('data',)"], parts=4) == 2
    assert assert_case(kd, envd, resd, 0, ["P(None, 'model')"]) == 2
    assert assert_case(ka, enva, resa, 0) == 3
