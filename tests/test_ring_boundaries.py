"""Rings where their positions can go wrong (issue 44, item 3): rows and keys of different
lengths (S != T), so that each device's chunk of rows and of keys differ, in order and in
zigzag order, on 8 host CPU devices (tests/mesh_jobs.py, one subprocess).

With S == T and equal chunks (tests/test_sharded.py's self-attention rings) a key chunk's
first position computed from the query chunks' length equals the right one, and so does a
zigzag chunk numbered from the wrong side of the sequence's middle when both halves are of
one size. Here the condition compares the two positions (`i + 256 >= j`: each row sees the
keys up to 256 past its own position, so the key side's origin moves every row's cut), the
key side is twice the rows' length, and the gradients (rows' and keys', the latter sent back
around the ring) are compared too. The GPU modules render the same ring
(templates/ring.py.j2): one GPU case under SPARSEGEN_SWEEP=1 (tests/test_sharded_gpu.py).
"""

from __future__ import annotations

import pytest
from conftest import SWEEP
from mesh_jobs import MeshJobs, assert_case, run_on_mesh

# Rows of S, keys of T = 2S, a condition between their positions; lse too (its merge).
OFFSET_CAUSAL = """
kernel offset_causal {
    in  q: f32[B, S, D]
    in  k: f32[B, T, D]
    in  v: f32[B, T, E]
    out o: f32[B, S, E]
    out lse: f32[B, S]
    s[b, i, j] = q[b, i, d] * k[b, j, d] where i + 256 >= j
    o[b, i, e] = softmax(s[b, i, j], j) * v[b, j, e]
    lse[b, i] = logsumexp(s[b, i, j], j)
    tile b = 1, i = 128, j = 128, d = 64, e = 64
}"""

MESH_JOBS = MeshJobs("ring_boundaries")


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory, worker_id):
    return MESH_JOBS.run(tmp_path_factory, worker_id)


SEQ4 = {"mesh": [2, 4], "names": ["data", "seq"]}
SEQ2 = {"mesh": [2, 4], "names": ["seq", "model"]}
# S = 512 rows, T = 1024 keys: in order on 4 devices, chunks of 128 rows and 256 keys; in
# zigzag order on 2 devices, chunks of 128 and 256 (four each), device 0 holding the first
# and the last.
MESH_JOBS.add("unequal", (OFFSET_CAUSAL, dict(B=2, S=512, T=1024, D=64), [
    {**SEQ4, "axes": {"b": "data", "i": "seq", "j": "seq"}},
    {**SEQ2, "axes": {"i": ["seq", "zigzag"], "j": "seq"}},
    *([{**SEQ4, "axes": {"b": "data", "i": ["seq", "zigzag"], "j": "seq"}}] if SWEEP else []),
]))
if SWEEP:
    # Fewer keys than rows (T = S / 2): the chunks unequal the other way.
    MESH_JOBS.add("fewer_keys", (OFFSET_CAUSAL, dict(B=1, S=1024, T=512, D=64), [
        {**SEQ4, "axes": {"i": "seq", "j": "seq"}},
        {**SEQ4, "axes": {"i": ["seq", "zigzag"], "j": "seq"}},
    ]))


def test_ring_with_rows_and_keys_of_different_lengths(mesh_results):
    """Values and gradients (q's, k's, v's) against the kernel unsplit and `reference`."""
    kernel, env, res = run_on_mesh(mesh_results, "unequal")
    assert assert_case(kernel, env, res, 0, ["P('data', 'seq')", "P('data', 'seq')"], parts=4) == 3
    assert assert_case(kernel, env, res, 1, ["P(None, 'seq')", "P(None, 'seq')"], parts=2) == 3
    if SWEEP:
        assert assert_case(kernel, env, res, 2, ["P('data', 'seq')", "P('data', 'seq')"], parts=8) == 3
        kernel, env, res = run_on_mesh(mesh_results, "fewer_keys")
        assert assert_case(kernel, env, res, 0, ["P(None, 'seq')", "P(None, 'seq')"], parts=4) == 3
        assert assert_case(kernel, env, res, 1, ["P(None, 'seq')", "P(None, 'seq')"], parts=8) == 3
