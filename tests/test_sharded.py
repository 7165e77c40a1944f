"""Every kernel on a device mesh (language v2, section 4): `sharded(mesh, b="data", ...)`.

On 8 host CPU devices, in one subprocess for the module's tests (`tests/mesh_runner.py`, run
by `tests/mesh_jobs.py`: the device count is set before jax is imported there), in the CPU
interpreter: example kernels split over indices they allow, several at once on a 2x4
mesh, equal the kernel unsplit and `reference`, values and `jax.grad` (every example over
each index alone: tests/test_sharded_sweep.py); a summed index split into partial sums
added with psum (a coo output's too); a coo input's stored blocks dealt by their
coordinates (or whole where its indices are not split); conditions comparing a split
index's position with an integer input (grouped_matmul over its experts); arguments
arriving sharded otherwise, an explicit mesh, jit. Here, in the test process (one device):
the split rule of the examples' indices (`sparsegen/mesh.py`), every refusal's message,
hostile names. The GPU modules' ring: tests/test_sharded_gpu.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SWEEP, build, spec_text, with_tiles
from mesh_jobs import MESH, MeshJobs, assert_case, one_device_mesh, run_on_mesh

from sparsegen.callconv import convention
from sparsegen.compiler import lower_source
from sparsegen.mesh import mesh_plan
from sparsegen.names import ModuleNames
from sparsegen.source import SourceFile
from sparsegen.testing import example_args

BATCHED = """
kernel batched {
    in  x: f32[B, M, K]
    in  y: f32[B, K, N]
    out o: f32[B, M, N]
    o[b, m, n] = x[b, m, k] * y[b, k, n]
    tile b = 1, m = 128, n = 128, k = 128
}"""

# ------------------------------------------------------------------- on 8 devices


MESH_JOBS = MeshJobs("sharded")


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory, worker_id):
    return MESH_JOBS.run(tmp_path_factory, worker_id)


MESH_JOBS.add("dense", (BATCHED, dict(B=2, M=128, K=256, N=256), [
    {**MESH, "axes": {"b": "data", "m": "model"}},
    {**MESH, "axes": {"k": "model", "n": "data"}},  # k: partial sums added with psum
    {**MESH, "axes": {"b": "data", "k": "model"}, "jit": True, "explicit": True},
    {**MESH, "axes": {"m": "data", "n": "model"}, "presharded": True, "grad": False},
    {**MESH, "axes": {"b": "model"}},  # B = 2 on 4 devices
]))


def test_dense_einsum_split_summed_jit_explicit_and_resharded(mesh_results):
    kernel, env, res = run_on_mesh(mesh_results, "dense")
    assert assert_case(kernel, env, res, 0, ["P('data', 'model')"]) == 2
    assert assert_case(kernel, env, res, 1, ["P(None, None, 'data')"], parts=4) == 2
    assert assert_case(kernel, env, res, 2, parts=4) == 2
    assert_case(kernel, env, res, 3, ["P(None, 'data', 'model')"])
    assert str(res["case4_error"]) == ("batched: sharded: index b cannot be split over mesh axis 'model' of 4 devices: "
                                        "B = 2 is not divisible by 4")


# causal_attention over batch and heads: a case of the ring's causal job below (one unsplit
# run and `reference` for both).
def test_causal_attention_split_over_batch_and_heads(mesh_results):
    (kernel, env, res), _, _ = run_on_mesh(mesh_results, "ring")
    assert assert_case(kernel, env, res, 2 if SWEEP else 1, ["P('data', 'model')", "P('data', 'model')"]) == 3


# A paged decode over batch and heads, in the TPU simulator (memory no step writes is NaN):
# the page table and lengths are cut with the batch, the cache with its key heads (h // 8),
# whole along its pages. Values only: a paged walk derives no gradient.
# A table whose entries all lie past the cache's pages is refused as the unsplit call refuses
# it (it checked the table, the sharded call clamped the entries on each device).
MESH_JOBS.add("paged", (spec_text("paged_decode"), dict(B=4, H=32, D=128, T=16, NP=8),
                        [{**MESH, "axes": {"b": "data", "h": "model"}, "interpret": "simulator"},
                         {**MESH, "axes": {"b": "data", "h": "model"}, "fill": {"3": 4096}}]))


def test_paged_decode_split_over_batch_and_heads_in_the_simulator(mesh_results):
    kernel, env, res = run_on_mesh(mesh_results, "paged")
    assert assert_case(kernel, env, res, 0, ["P('data', 'model')"]) == 0
    message = "paged_decode: pages entry (0, 0) is 4096, outside the 1024 pages (read as pages[b, j // T])"
    assert str(res["case1_unsplit_error"]) == str(res["case1_error"]) == message


# The mask is cut with the rows: each device classifies its own blocks.
MESH_JOBS.add("masked", (spec_text("masked_attention"), dict(H=2, S=256, T=128, D=128), [{**MESH, "axes": {"h": "data", "i": "model"}}]))


def test_masked_attention_split_over_heads_and_rows(mesh_results):
    kernel, env, res = run_on_mesh(mesh_results, "masked")
    assert assert_case(kernel, env, res, 0, ["P('data', 'model')"]) == 3


# k and v are read as h // 4: their group dimension is split with h (a case of the ring's
# local_gqa_attention job below).
def test_grouped_heads_split_with_their_groups(mesh_results):
    _, (kernel, env, res), _ = run_on_mesh(mesh_results, "ring")
    assert assert_case(kernel, env, res, 1, ["P(None, 'model')"]) == 3


DSD = with_tiles(spec_text("dsd_matmul"), m=128, n=128, k=128)
DDS = with_tiles(spec_text("dds_matmul"), m=128, n=128, k=128)


def skewed_dds(rng):
    """dds_matmul's arguments (M=256, K=256, N=512) whose stored blocks of y all lie in its
    first column block, one repeated, with two padding entries: split over n, the first
    device gets every block and the others only padding."""
    x = rng.standard_normal((256, 256)).astype(np.float32).astype(jnp.bfloat16)
    coords = np.array([[1, 0], [-1, -1], [0, 0], [1, 0], [-1, -1]], np.int32)
    blocks = rng.standard_normal((len(coords), 128, 128)).astype(np.float32).astype(jnp.bfloat16)
    return [x, blocks, coords[:, 0].copy(), coords[:, 1].copy()]


MESH_JOBS.add("coo",
        (DSD, dict(M=512, K=256, N=256), [
            {**MESH, "axes": {"n": "model"}},
            {**MESH, "axes": {"m": "data", "n": "model"}},
            {**MESH, "axes": {"m": "model"}},
            {**MESH, "axes": {"m": "model", "k": "data"}, "jit": True},
            {**MESH, "axes": {"k": "model"}, "grad": False},  # K = 256: 64 rows a device
        ], "duplicates"),
        (DDS, dict(M=256, K=256, N=512), [{**MESH, "axes": {"n": "model"}},
                                          {**MESH, "axes": {"m": "data", "n": "model"}, "jit": True, "explicit": True}],
         skewed_dds(np.random.default_rng(4))),
        (with_tiles(spec_text("sdd_matmul"), m=128, n=128, k=128), dict(M=256, K=512, N=256),
         [{**MESH, "axes": {"k": "model"}}], "padded"))


def test_coo_kernels_split(mesh_results):
    """dsd: x's stored blocks dealt by their coordinates along its rows m (alone, with n
    on the other mesh axis; with k under jit, where the coordinates are traced and each
    device's bucket is every block; k's partial sums added with psum), or whole on every
    device (n alone: its gradient the sum of every device's); repeated blocks add up. dds,
    skewed: every stored block of y in one device's columns (also on an explicit mesh,
    under jit). sdd: the stored output blocks are partial sums over k, added with psum (a
    coo output's own indices are refused). A slice that is not a whole number of stored
    blocks is refused at the call."""
    (k1, env1, res1), (k2, env2, res2), (k3, env3, res3) = run_on_mesh(mesh_results, "coo")
    assert assert_case(k1, env1, res1, 0, ["P(None, 'model')"]) == 2
    assert assert_case(k1, env1, res1, 1, ["P('data', 'model')"]) == 2
    assert assert_case(k1, env1, res1, 2, ["P('model',)"]) == 2
    assert assert_case(k1, env1, res1, 3, ["P('model',)"], parts=2) == 2
    assert str(res1["case4_error"]) == ("dsd_matmul: sharded: index k cannot be split over mesh axis 'model' of 4 devices: "
                                        "a device's slice of K (64) is not a whole number of stored blocks (128 along k)")
    assert assert_case(k2, env2, res2, 0, ["P(None, 'model')"]) == 2
    assert assert_case(k2, env2, res2, 1, ["P('data', 'model')"]) == 2
    assert assert_case(k3, env3, res3, 0, ["P()"], parts=4) == 2


def test_coo_deal_matches_block_coo_split():
    """A module's deal of a coo input's stored blocks (`_coo_deal`, jax.numpy, what each
    device is given) is `BlockCOO.split`'s, and both are a plain per-shard filter: shard s's
    blocks in the caller's order, coordinates made local, padded with -1 entries to the
    bucket the module counts on the host (the most any shard gets)."""
    from sparsegen.formats import BlockCOO

    kernel, mod = build(DSD, formatted=False)
    rng = np.random.default_rng(7)
    c0, c1 = rng.integers(0, 8, 30).astype(np.int32), rng.integers(0, 4, 30).astype(np.int32)
    c0[[3, 11]] = c1[[3, 11]] = -1  # padding
    c0[20:] = 5  # skewed: a third of the blocks in one row block
    blocks = rng.standard_normal((30, 2, 3)).astype(np.float32)
    x = BlockCOO(blocks, (c0, c1), (16, 12))
    for dims, ns in ((0, 4), ((0, 1), (2, 2)), (1, 4), (0, 1)):
        dims, ns = ((dims,), (ns,)) if isinstance(dims, int) else (dims, ns)
        split = x.split(dims, ns)
        per = [x.shape[d] // n // x.block_shape[d] for d, n in zip(dims, ns)]
        # The plain filter: shard s (row-major over `dims`) holds the blocks whose coordinates fall in its slices.
        shards = [[b for b in range(30) if c0[b] >= 0 and all(x.coords[d][b] // p == i for d, p, i in zip(dims, per, idx))]
                  for idx in np.ndindex(*ns)]
        assert split.bucket == max(len(s) for s in shards)
        want = np.concatenate([s + [-1] * (split.bucket - len(s)) for s in shards])
        np.testing.assert_array_equal(split.source, want)
        for d in range(2):
            local = x.coords[d][want] % (per[dims.index(d)] if d in dims else 1 << 30)
            np.testing.assert_array_equal(split.coo.coords[d], np.where(want >= 0, local, -1))
        np.testing.assert_array_equal(split.coo.blocks, np.where((want >= 0)[:, None, None], blocks[want], 0))
        assert split.coo.shape == tuple(s // ns[dims.index(d)] if d in dims else s for d, s in enumerate(x.shape))
        cut = tuple((d, f"axis{d}", n, p) for d, n, p in zip(dims, ns, per))
        dealt, coords, source = mod._coo_deal(jnp.asarray(blocks), [jnp.asarray(c0), jnp.asarray(c1)], cut, split.bucket)
        np.testing.assert_array_equal(np.asarray(source), split.source)
        np.testing.assert_array_equal(np.asarray(dealt), split.coo.blocks)
        for got, expected in zip(coords, split.coo.coords):
            np.testing.assert_array_equal(np.asarray(got), expected)
    # The bucket `sharded` counts on the host (here for the rows over 4 devices), and under jit.
    mesh = jax.sharding.AbstractMesh((4,), ("data",))
    blocks = np.zeros((30, 128, 128), np.float32)
    coords = (c0, c1)
    got = []
    original = mod._on_mesh
    try:
        mod._on_mesh = lambda *args: got.append(args[-1])
        mod._on_mesh_coo((blocks, *coords, None), (None, mesh, (("m", "data"),)), (("M", 256), ("K", 512), ("N", 128)), True)
        jax.jit(lambda c: mod._on_mesh_coo((blocks, c, c1, None), (None, mesh, (("m", "data"),)),
                                           (("M", 256), ("K", 512), ("N", 128)), True) or 0)(c0)
    finally:
        mod._on_mesh = original
    assert got == [(BlockCOO(blocks, coords, (1024, 512)).split(0, 4).bucket,), (30,)]
    assert x.split(0, 2).bucket == 19  # rows 4-7: 9 of the first 20 entries (2 are padding), and the last 10
    with pytest.raises(ValueError, match="a shard gets 19 stored blocks, more than the bucket 4"):
        x.split(0, 2, bucket=4)
    with pytest.raises(ValueError, match="dim 1 of size 12 cannot be cut into 8 slices of whole blocks"):
        x.split(1, 8)


GROUPED = with_tiles(spec_text("grouped_matmul"), m=128, k=128, n=128, g=1)

LENGTHS = """kernel ragged_sum {
    in  x: f32[B, M, K]
    in  y: f32[B, K, N]
    in  lens: i32[B]
    out o: f32[B, M, N]
    o[b, m, n] = x[b, m, k] * y[b, k, n] where k < lens[b]
    tile b = 1, m = 128, k = 128, n = 128
}"""


def _conditions_jobs():
    rng = np.random.default_rng(3)
    group_sizes = [100, 0, 120, 36]
    gid = np.repeat(np.arange(4, dtype=np.int32), group_sizes)
    x, w = (rng.standard_normal(s).astype(np.float32).astype(jnp.bfloat16) for s in ((256, 256), (4, 256, 128)))
    a, b = (rng.standard_normal(s).astype(np.float32) for s in ((2, 128, 512), (2, 512, 128)))
    lens = np.array([300, 77], np.int32)
    MESH_JOBS.add("conditions",
            (GROUPED, dict(M=256, K=256, N=128, E=4), [{**MESH, "axes": {"m": "data", "g": "model"}},
                                                      {**MESH, "axes": {"k": "data", "g": "model"}, "grad": False}], [x, w, gid]),
            (LENGTHS, dict(B=2, M=128, K=512, N=128), [{**MESH, "axes": {"k": "model", "b": "data"}}], [a, b, lens]))


_conditions_jobs()


def test_conditions_compare_global_positions(mesh_results):
    """A condition comparing a split index's position with an integer input (`gid[m] == g`,
    `k < lens[b]`) sees global positions: each device is given that input less its slice's
    start. grouped_matmul split over its experts g (expert parallelism: the experts' partial
    products added with psum), with its rows or its k; a ragged sum split over k."""
    (k1, env1, res1), (k2, env2, res2) = run_on_mesh(mesh_results, "conditions")
    assert assert_case(k1, env1, res1, 0, ["P('data',)"], parts=4) == 2
    assert_case(k1, env1, res1, 1, ["P()"], parts=8)
    assert assert_case(k2, env2, res2, 0, ["P('data',)"], parts=4) == 2


RING_TILES = dict(b=1, h=1, i=128, j=128, d=128, e=128)
# local_gqa_attention with a window that bites at these sizes (200 positions: a row block
# sees its own key block and the two before).
WINDOWED = with_tiles(spec_text("local_gqa_attention"), **RING_TILES).replace("i - j < 1024", "i - j < 200")


RING = {"mesh": [2, 4], "names": ["data", "seq"]}
# causal in zigzag order beside a head split (11 CPU-seconds; zigzag with gradients:
# tests/test_sharded_sweep.py, on 8 devices: document_attention's below) under SPARSEGEN_SWEEP=1.
MESH_JOBS.add("ring",
        (with_tiles(spec_text("causal_attention"), **RING_TILES), dict(B=2, H=2, S=512, D=128),
         [{**RING, "axes": {"b": "data", "i": "seq", "j": "seq"}},
          *([{**RING, "axes": {"h": "data", "i": ["seq", "zigzag"], "j": "seq"}}] if SWEEP else []),
          {"mesh": [2, 2], "names": ["data", "model"], "axes": {"b": "data", "h": "model"}}]),
        (WINDOWED, dict(B=1, H=8, S=512, D=128), [{**RING, "axes": {"h": "data", "i": "seq", "j": "seq"}},
                                                  {"mesh": [2], "names": ["model"], "axes": {"h": "model", "b": None}},
                                                  {**RING, "axes": {"h": "data", "j": "seq"}}]),  # test_self_attention_key_index_alone
        (with_tiles(spec_text("document_attention"), b=1, h=1, i=128, j=128, d=64, e=64), dict(B=2, H=1, S=1024, D=64),
         [{**RING, "axes": {"b": "data", "i": "seq", "j": "seq"}},
          {**RING, "axes": {"i": ["seq", "zigzag"], "j": "seq"}, "grad": False}]))


def test_ring_attention_causal_local_document_and_zigzag(mesh_results):
    """The key index split with the rows over one mesh axis (a ring), values and gradients:
    causal in order beside a batch split (in zigzag order beside a head split too under
    SPARSEGEN_SWEEP=1); a sliding window
    with grouped heads and soft caps; packed documents (segment ids: the rows keep theirs,
    the keys' travel with them), in zigzag order too. Each device's keys are sent only
    where some row sees them; partial results merge by their logsumexp."""
    (k1, env1, res1), (k2, env2, res2), (k3, env3, res3) = run_on_mesh(mesh_results, "ring")
    specs = ["P('data', None, 'seq')", "P('data', None, 'seq')"]
    assert assert_case(k1, env1, res1, 0, specs, parts=4) == 3
    if SWEEP:
        assert assert_case(k1, env1, res1, 1, ["P(None, 'data', 'seq')"] * 2, parts=8) == 3
    assert assert_case(k2, env2, res2, 0, ["P(None, 'data', 'seq')"], parts=4) == 3
    assert assert_case(k3, env3, res3, 0, ["P('data', None, 'seq')"], parts=4) == 3
    assert_case(k3, env3, res3, 1, ["P(None, None, 'seq')"], parts=8)


# Cross attention: rows and keys of their own sizes, a condition between their positions.
CROSS = """
kernel cross {
    in  q: f32[B, S, D]
    in  k: f32[B, T, D]
    in  v: f32[B, T, E]
    out o: f32[B, S, E]
    out lse: f32[B, S]
    s[b, i, j] = q[b, i, d] * k[b, j, d] where j <= i + 200
    o[b, i, e] = softmax(s[b, i, j], j) * v[b, j, e]
    lse[b, i] = logsumexp(s[b, i, j], j)
    tile b = 1, i = 128, j = 128, d = 128, e = 128
}"""
MESH_JOBS.add("alone", (CROSS, dict(B=2, S=256, T=1024, D=128), [{**RING, "axes": {"b": "data", "j": "seq"}},
                                                           {**RING, "axes": {"i": "seq", "j": "seq"}}]))


def test_key_index_alone_merges_across_the_axis(mesh_results):
    """The key index split alone: every device attends all rows over its keys, the partial
    results merged across the axis by their logsumexp (values and gradients; the rows'
    gradient summed over the devices). The same kernel as a ring, rows and keys of two
    sizes."""
    kernel, env, res = run_on_mesh(mesh_results, "alone")
    assert assert_case(kernel, env, res, 0, ["P('data',)", "P('data',)"], parts=4) == 3
    assert assert_case(kernel, env, res, 1, ["P(None, 'seq')", "P(None, 'seq')"], parts=4) == 3


# Self-attention's key index split alone (language v2, section 4; issue 37, item 10): the
# rows share the keys' size, so each device runs its whole rows in chunks of its keys'
# length against its keys, and the partial results merge across the axis. S = 384: over 2
# devices chunks of 192 and over 4 of 96 positions, neither a multiple of the 128-tile.
def _packed_documents(rng):
    """document_attention's arguments (B=2, S=384): batch 0 packs four documents (one
    crossing every device boundary over 2 and 4), batch 1 holds one."""
    q, k, v = (rng.standard_normal((2, 1, 384, 64)).astype(np.float32).astype(jnp.bfloat16) for _ in range(3))
    seg = np.stack([np.repeat(np.arange(4, dtype=np.int32), [50, 150, 100, 84]), np.zeros(384, np.int32)])
    return [q, k, v, seg]


def _masked_with_holes(rng, S, T):
    """masked_attention's arguments (H=2): a random mask with a row that sees no key (its
    merged logsumexp is minus infinity on every device), a row that sees keys of the last
    device only, and a 128 x 128 block (the first rows against the second key block) empty.
    q is scaled by 1/sqrt(D), as attention's scores are (this spec has no scale): scores of
    standard deviation 11 put logsumexps near 35, whose f32 rounding in the merge reaches
    dk at 1e-4 (gradients up to 37; unsplit, 4e-5 from `reference`), past f32 tolerances."""
    q = (rng.standard_normal((2, S, 128)) / np.sqrt(128)).astype(np.float32)
    k, v = (rng.standard_normal((2, T, 128)).astype(np.float32) for _ in range(2))
    keep = (rng.random((S, T)) < 0.3).astype(np.int8)
    keep[:128, 128:256] = 0
    keep[5] = 0
    keep[S - 1, : T - T // 4] = 0
    return [q, k, v, keep]


ONE_AXIS = {"mesh": [2], "names": ["seq"]}
FOUR = {"mesh": [4], "names": ["seq"]}
MESH_JOBS.add("key_alone",
              (with_tiles(spec_text("causal_attention"), **RING_TILES), dict(B=2, H=1, S=384, D=128),
               [{**RING, "axes": {"b": "data", "j": "seq"}}, {**FOUR, "axes": {"j": "seq"}, "interpret": "simulator"},
                *([{**ONE_AXIS, "axes": {"j": "seq"}}] if SWEEP else [])]),
              (with_tiles(spec_text("document_attention"), b=1, h=1, i=128, j=128, d=64, e=64), dict(B=2, H=1, S=384, D=64),
               [{**FOUR, "axes": {"j": "seq"}}, *([{**ONE_AXIS, "axes": {"j": "seq"}}] if SWEEP else [])],
               _packed_documents(np.random.default_rng(8))),
              (spec_text("masked_attention"), dict(H=2, S=256, T=256, D=128), [{**ONE_AXIS, "axes": {"j": "seq"}}],
               _masked_with_holes(np.random.default_rng(9), 256, 256)),
              *([(spec_text("masked_attention"), dict(H=2, S=128, T=512, D=128), [{**FOUR, "axes": {"j": "seq"}}],
                  _masked_with_holes(np.random.default_rng(10), 128, 512))] if SWEEP else []))


def test_self_attention_key_index_alone(mesh_results):
    """The key index split alone where the rows share its size: each device attends every
    row over its keys (the rows in chunks of the keys' length, whose first positions the
    kernels take: causal and window conditions compare global positions), the partial
    results merged by their logsumexp across the axis: causal (its `lse` output merged as
    a logsumexp) over 4 devices beside a batch split, and alone over 4 in the TPU
    simulator (memory no step writes is NaN; it runs each kernel call on every device
    together, so every device runs every chunk's kernels), packed documents over 4 (segment
    ids: the rows' whole, the keys' side this device's slice), a sliding window with
    grouped heads over 4 beside a head split, and a mask with a row no device sees
    anything of (minus infinity merged without NaN) and an empty block over 2, rows and
    keys of equal sizes. Under SPARSEGEN_SWEEP=1 also causal and documents over 2 devices
    (chunks of 192), and a mask with rows and keys of unequal sizes over 4. Values and
    every gradient, against the kernel unsplit and `reference`."""
    causal, document, masked, *unequal = run_on_mesh(mesh_results, "key_alone")
    kernel, env, res = causal
    assert assert_case(kernel, env, res, 0, ["P('data',)", "P('data',)"], parts=4) == 3
    assert assert_case(kernel, env, res, 1, ["P()", "P()"], parts=4) == 3  # in the TPU simulator
    if SWEEP:
        assert assert_case(kernel, env, res, 2, ["P()", "P()"], parts=2) == 3
    kernel, env, res = document
    for c in range(1 + SWEEP):
        assert assert_case(kernel, env, res, c, ["P()"], parts=4 // (c + 1)) == 3
    kernel, env, res = run_on_mesh(mesh_results, "ring")[1]  # the window, beside a head split
    assert assert_case(kernel, env, res, 2, ["P(None, 'data')"], parts=4) == 3
    kernel, env, res = masked
    assert assert_case(kernel, env, res, 0, ["P()"], parts=2) == 3
    assert all(np.isfinite(res[f"case0_{x}"]).all() for x in ("out0", "grad0", "grad1", "grad2"))
    assert not res["case0_out0"][:, 5].any()  # the row that sees nothing
    assert len(unequal) == SWEEP
    for kernel, env, res in unequal:
        assert assert_case(kernel, env, res, 0, ["P()"], parts=4) == 3


def test_ring_pairs_that_see_nothing_exchange_and_compute_nothing():
    """Causal over 8 shards in order: 36 of the 64 (rows, keys) shard pairs see something,
    and the keys travel only to those (step t: the 8 - t devices whose keys are t behind).
    In zigzag order every device pair has work, and each device's share is the same."""
    kernel, mod = build(with_tiles(spec_text("causal_attention"), **RING_TILES), formatted=False)
    sizes = (1, 1, 1024 // 8, 128)  # one device's
    live, chunk, lengths = mod._ring_plan(sizes, 8, 1)
    assert live.shape == (8, 8) and int(live.sum()) == 36 and lengths == (128, 128)
    assert np.array_equal(live, np.tril(np.ones((8, 8), bool)))
    assert [len(mod._ring_senders(live, t, 8, 1)) for t in range(8)] == [8, 7, 6, 5, 4, 3, 2, 1]
    live, chunk, lengths = mod._ring_plan(sizes, 8, 2)
    assert live.shape == (16, 16) and lengths == (64, 64) and int(live.sum()) == 136
    assert [len(mod._ring_senders(live, t, 8, 2)) for t in range(8)] == [8] * 8
    share = [sum(live[mod._ring_chunk(d, a, 8, 2), :].sum() for a in range(2)) for d in range(8)]
    assert share == [17] * 8


@pytest.mark.parametrize("interpret", ["cpu", "simulator"])
def test_kernels_compare_global_positions(interpret):
    """A row kernel given the first positions of its rows and keys (`origin`: a shard's, as
    the ring passes them) evaluates its condition on global positions, in both interpreters
    (the simulator fills memory no step writes with NaN), values and gradients."""
    from jax.experimental.pallas import tpu as pltpu

    kernel, mod = build(WINDOWED, formatted=False)
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((1, 4, 256, 128)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, 1, 256, 128)), jnp.bfloat16) for _ in range(2))
    q, k, v, sizes = mod._prepare(q, k, v, *(None for _ in mod._MESH_SIZES))
    mode = True if interpret == "cpu" else pltpu.InterpretParams()
    for origin in ((300, 0), (256, 128), (0, 256)):
        o, row_lse = mod._impl(q, k, v, sizes, None, mode, origin=jnp.asarray(origin, jnp.int32))
        qf, kf, vf = (np.asarray(x, np.float64) for x in (q, k, v))
        s = np.einsum("bhid,bjd->bhij", qf, kf[:, 0]) * 0.08838834764831845
        s = 50.0 * np.tanh(s / 50.0)
        i = np.arange(256)[:, None] + origin[0]
        j = np.arange(256)[None, :] + origin[1]
        s = np.where((i >= j) & (i - j < 200), s, -np.inf)
        m = np.max(s, axis=-1, keepdims=True)
        p = np.exp(s - np.where(np.isneginf(m), 0, m))
        total = p.sum(-1, keepdims=True)
        want = np.einsum("bhij,bje->bhie", p / np.where(total == 0, 1, total), vf[:, 0])
        np.testing.assert_allclose(np.asarray(o, np.float64), want, atol=2e-2, err_msg=str(origin))
        lse = np.where(total[..., 0] == 0, -np.inf, m[..., 0] + np.log(np.where(total[..., 0] == 0, 1, total[..., 0])))
        np.testing.assert_allclose(np.asarray(row_lse), lse, atol=2e-2, err_msg=str(origin))
    if interpret == "simulator":
        pltpu.reset_tpu_interpret_mode_state()


# --------------------------------------------------------- the rule, and refusals


def plan_of(name: str):
    rules = {}
    for plan in lower_source(SourceFile(f"{name}.spk", spec_text(name)), "v5e"):
        p = mesh_plan(plan.kernel, convention(plan.kernel, ModuleNames(plan.kernel)), ring=True)
        rules[plan.kernel.name] = {r.index: r.how for r in p.rules}
    return rules


@pytest.mark.parametrize("name,expected", [
    ("causal_attention", {"causal_attention": dict(b="split", h="split", i="ring", j="ring", d=None, e=None)}),
    ("document_attention", {"document_attention": dict(b="split", h="split", i="ring", j="ring", d=None, e=None)}),
    ("masked_attention", {"masked_attention": dict(h="split", i="split", j="ring", d=None, e=None)}),
    ("masked_matmul", {"masked_matmul": dict(m="split", n="split", k="sum")}),
    ("masked_backward", {"masked_matmul_dx": dict(m="split", k="split", n="sum"), "masked_matmul_dy": dict(k="split", n="split", m="sum")}),
    ("dsd_matmul", {"dsd_matmul": dict(m="split", n="split", k="sum")}),
    ("dds_matmul", {"dds_matmul": dict(m="split", n="split", k="sum")}),
    ("batched_dsd", {"batched_dsd": dict(b="split", m="split", n="split", k="sum")}),
    ("sdd_matmul", {"sdd_matmul": dict(m=None, n=None, k="sum")}),
    ("grouped_matmul", {"grouped_matmul": dict(m="split", n="split", k="sum", g="sum")}),
    ("block_slice", {"block_slice": dict(i=None, j=None)}),
    ("tril_matmul", {"tril_matmul": dict(m=None, n="split", k=None)}),
])
def test_split_rule_of_examples(name, expected):
    assert plan_of(name) == expected


CHAINED = """
kernel chained {
    in  x: f32[M, K]
    in  y: f32[K, N]
    in  z: f32[N, P]
    out t: f32[M, N]
    out u: f32[M, P]
    t[m, n] = x[m, k] * y[k, n]
    u[m, p] = t[m, n] * z[n, p]
    tile m = 128, n = 128, k = 128, p = 128
}"""

FIXED = """
kernel fixed {
    in  x: f32[256, K]
    in  y: f32[K, N]
    out o: f32[256, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}"""

WINDOW = """
kernel window {
    in  x: f32[M, T]
    out p: f32[M, T]
    s[i, j] = x[i, j] where i - j < 64 and j <= i
    p[i, j] = softmax(s[i, j], j)
    tile i = 128, j = 128
}"""

WIDE_VALUES = """
kernel wide_values {
    in  q: f32[S, D]
    in  k: f32[T, D]
    in  v: f32[T, E]
    out o: f32[S, E]
    s[i, j] = q[i, d] * k[j, d]
    o[i, e] = softmax(s[i, j], j) * v[j, e]
    tile i = 128, j = 128, d = 128, e = 128
}"""

NARROW = """
kernel narrow {
    in  x: f32[M, K]
    out o: f32[M]
    o[m] = x[m, k]
    tile m = 128, k = 64
}"""

CHECKED_IDS = """
kernel gmm_checked {
    in  x: bf16[M, K]
    in  w: bf16[E, K, N]
    in  gid: i32[M]
    out o: bf16[M, N]
    o[m, n] = x[m, k] * w[g, k, n] where gid[m] == g and gid[m] >= 0
    tile m = 128, k = 128, n = 128, g = 1
}"""

WIDE_SEG = """
kernel float_both {
    in  q: f32[S, D]
    in  k: f32[S, D]
    in  v: f32[S, E]
    in  bias: f32[S]
    out o: f32[S, E]
    raw[i, j] = q[i, d] * k[j, d]
    s[i, j] = raw[i, j] + bias[i] * bias[j]
    o[i, e] = softmax(s[i, j], j) * v[j, e]
    tile i = 128, j = 128, d = 128, e = 128
}"""

# Unsigned ids: a shard would be given them less its offset, in their type.
GROUPED_U32 = spec_text("grouped_matmul").replace("gid: i32", "gid: u32")

REFUSALS = [
    (BATCHED, {"q": "data"}, "the spec has no index 'q' (its indices: b, m, n, k)"),
    (BATCHED, {"b": "rows"}, "index b is mapped to 'rows', which is not an axis of the mesh (its axes: data, model)"),
    (BATCHED, {"b": "data", "k": "data"}, "mesh axis 'data' is given to both b and k; an axis splits one index"),
    ("causal_attention", {"i": "data", "j": "model"}, "the key index j and the query index i are split over two mesh axes: "
     "map both to one (a ring: sharded(mesh, i=AXIS, j=AXIS)) or split the key index alone (sharded(mesh, j=AXIS))"),
    ("masked_attention", {"i": "data", "j": "data"}, "the key index j cannot travel with the query index i as a ring: keep "
     "is read along both i and j, so it can neither travel nor stay; it may be split alone (sharded(mesh, j=AXIS))"),
    ("masked_attention", {"i": "data", "j": "model"}, "the key index j and the query index i are split over two mesh axes: "
     "split the key index alone (sharded(mesh, j=AXIS))"),
    ("causal_attention", {"b": ("data", "zigzag")}, "only a ring's query index i may be split in zigzag order"),
    # The reason was "reads its position other than compared with an integer input's values".
    (GROUPED_U32, {"g": "data"}, "index g cannot be split: `o[m, n] = x[m, k] * w[g, k, n] where gid[m] == g` compares its "
     "position with gid, an unsigned input (u32): each shard is given it less the shard's offset, which would wrap below "
     "zero (declare it i32 or index)"),
    # A tuple of mesh axes was "not an axis of the mesh".
    (BATCHED, {"b": ("data", "model")}, "index b is mapped to ('data', 'model'), several mesh axes: an index is split over "
     "one axis of the mesh (its axes: data, model)"),
    ("causal_attention", {"d": "data"}, "index d cannot be split: it is summed into the local s (`s[b, h, i, j] = q[b, h, i, d] * "
     "k[b, h, j, d] * 0.08838834764831845 where i >= j`), which a nonlinear step reads (softmax, an elementwise function): "
     "partial sums cannot be added after it"),
    ("causal_attention", {"i": "data"}, "the key index j is split with the query index i, as a ring: map both to one mesh axis "
     "(sharded(mesh, i=AXIS, j=AXIS))"),
    ("document_attention", {"i": "data"}, "the key index j is split with the query index i, as a ring: map both to one mesh "
     "axis (sharded(mesh, i=AXIS, j=AXIS))"),
    (WIDE_SEG, {"j": "data"}, "index j cannot be split: it is the key index of an attention-like kernel: splitting it (a ring, "
     "with i) is not supported yet: bias dim 0 is read as i and as j, and only arguments read along one of them (or integers "
     "read along both) travel or stay"),
    ("sdd_matmul", {"n": "data"}, "index n cannot be split: the sparse coo output o is indexed by it (o[m, n]): "
     "splitting a coo output's requested blocks is not supported yet (a coo input's stored blocks are split by their "
     "coordinates)"),
    ("block_slice", {"i": "data"}, "index i cannot be split: x[start[0] + i, start[1] + j] reads it at an offset "
     "(start[0] + i), which a slice would move"),
    (WINDOW, {"i": "data"}, "index i cannot be split: `s[i, j] = x[i, j] where ((i - j) < 64) and (j <= i)` reads its "
     "position other than compared with an integer input's values, and adding each shard's offset to a position is not "
     "supported yet"),
    # gid less each shard's offset would also change `gid[m] >= 0`.
    (CHECKED_IDS, {"g": "data"}, "index g cannot be split: gid is compared with the position of g and also read otherwise, "
     "so a shard cannot be given it less its offset; adding each shard's offset to a position is not supported yet"),
    (CHAINED, {"k": "data"}, "index k cannot be split: it is summed into t (`t[m, n] = x[m, k] * y[k, n]`), which "
     "`u[m, p] = t[m, n] * z[n, p]` reads: its partial sums would meet the next statement before they are added"),
    (WIDE_VALUES, {"e": "data"}, "index e cannot be split: its blocks span E whole (a tile of 128), so a slice would be "
     "smaller than its tile"),
    # A TPU block that breaks the (8, 128) layout rule must span its dimension.
    (NARROW, {"k": "data"}, "index k cannot be split: its blocks span K whole (a tile of 64), so a slice would be smaller "
     "than its tile"),
    (FIXED, {"m": "data"}, "index m cannot be split: its size is fixed by the spec (256), so a shard's slice cannot have it"),
]


@pytest.mark.parametrize("spec,axes,message", REFUSALS, ids=[f"{n}-{','.join(a)}" for n, (_, a, _) in enumerate(REFUSALS)])
def test_refusals_name_the_index_and_why(spec, axes, message):
    kernel, mod = build(spec_text(spec) if "\n" not in spec else spec, formatted=False)
    with pytest.raises(ValueError) as info:
        mod.sharded(one_device_mesh(), **axes)
    assert str(info.value) == f"{kernel.name}: sharded: {message}"


def test_what_is_split_in_a_chain_and_the_mesh_argument():
    kernel, mod = build(CHAINED, formatted=False)
    assert mod._MESH_RULES["m"] == ("split", ("M",)) and mod._MESH_RULES["p"] == ("split", ("P",))
    assert mod._MESH_RULES["n"] == ("sum", ("N",))  # summed by u, free in t: t is split, u added
    assert mod._MESH_SUMS == (("k",), ("n",))
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh, got str"):
        mod.sharded("data", m="data")
    mod.sharded(one_device_mesh(), m="data", n=None)  # None: not split


def test_gpu_modules_have_the_same_rule():
    _, tpu = build(with_tiles(spec_text("masked_matmul"), m=128, n=128, k=128), formatted=False)
    _, gpu = build(with_tiles(spec_text("masked_matmul"), m=128, n=128, k=128), target="h200")
    for name in ("_MESH_RULES", "_MESH_ARGS", "_MESH_OUTPUTS", "_MESH_SUMS", "_MESH_SIZES"):
        assert getattr(gpu, name) == getattr(tpu, name)
    assert callable(gpu.sharded(one_device_mesh(), k="model"))
    _, tpu = build(DSD, formatted=False)
    _, gpu = build(DSD, target="h200")
    for name in ("_MESH_RULES", "_MESH_ARGS", "_MESH_COO"):
        assert getattr(gpu, name) == getattr(tpu, name)
    assert tpu._MESH_COO == ((0, (1, 2), ("m", "k"), (128, 128)),)
    assert callable(gpu.sharded(one_device_mesh(), m="data", k="model"))


HOSTILE = """
kernel _on_mesh_ {
    in  _placement: f32[mesh, axes]
    in  _local_sizes: f32[axes, sharded]
    in  _on_mesh: f32[mesh, sharded]
    out _MESH_RULES: f32[mesh, sharded]
    _MESH_RULES[mesh, sharded] = _placement[mesh, axes] * _local_sizes[axes, sharded] * _on_mesh[mesh, sharded]
    tile mesh = 128, sharded = 128, axes = 128
}"""


HOSTILE_COO = """
kernel _coo_deal_ {
    in  _on_mesh_coo: f32[cut, buckets] coo
    in  _coo_cut: f32[buckets, tiles]
    out _MESH_COO: f32[cut, tiles]
    _MESH_COO[cut, tiles] = _on_mesh_coo[cut, buckets] * _coo_cut[buckets, tiles]
    tile cut = 128, tiles = 128, buckets = 128
}"""


def test_spec_names_that_sharded_uses_are_safe():
    """Operands, indices and sizes named after what `sharded` and its inner function read,
    and after what it deals a coo input with."""
    kernel, mod = build(HOSTILE, formatted=False)
    args, keywords = example_args(kernel, dict(mesh=128, axes=256, sharded=128), "random", np.random.default_rng(0))
    fn = mod.sharded(one_device_mesh(), mesh="data", axes="model")  # an index named `mesh`, one named `axes`
    np.testing.assert_allclose(fn(*args, **keywords, interpret=True), mod.reference(*args, **keywords), rtol=1e-5, atol=1e-4)
    kernel, mod = build(HOSTILE_COO, formatted=False)
    args, keywords = example_args(kernel, dict(cut=256, buckets=256, tiles=128), "padded", np.random.default_rng(0))
    fn = mod.sharded(one_device_mesh(), cut="data", buckets="model")
    np.testing.assert_allclose(fn(*args, **keywords, interpret=True), mod.reference(*args, **keywords), rtol=1e-5, atol=1e-4)


def test_keywords_besides_sizes_pass_through():
    """document_attention's `max_steps` reaches each device's call (here a one-device mesh)."""
    kernel, mod = build(spec_text("document_attention"), formatted=False)
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 1, 256, 64)), jnp.bfloat16) for _ in range(3))
    seg = np.repeat(np.array([[0, 1], [0, 0]], np.int32), 128, axis=1)
    fn = mod.sharded(one_device_mesh(), b="data", h="model")
    want = mod.document_attention(q, k, v, seg, max_steps=1, interpret=True)
    np.testing.assert_array_equal(np.asarray(fn(q, k, v, seg, max_steps=1, interpret=True), np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="max_steps must be a positive int"):
        fn(q, k, v, seg, max_steps=0, interpret=True)


PAGED_SMALL = dict(B=2, H=8, D=128, G=1, P=4, T=16, NP=2)


@pytest.mark.parametrize("target", ["v5e", "h200"])
def test_sharded_checks_the_page_table_as_the_unsplit_call(target):
    """On concrete arguments `sharded` makes the unsplit call's checks, on the whole arrays
    before they are split: a table entry a present key reaches that addresses no page is
    refused (the sharded call clamped it on each device: a wrong answer, off by 0.19 on
    paged_decode's example). Here on a one-device mesh; on eight devices, the "paged" job."""
    kernel, mod = build(spec_text("paged_decode"), target)
    args, keywords = example_args(kernel, PAGED_SMALL, "random", np.random.default_rng(0))
    q, kc, vc, pages, lens = args
    lens, pages = np.array([20, 3], np.int32), np.array([[1, 2], [7, 0]], np.int32)  # (1, 0): page 7 of 4
    with pytest.raises(ValueError) as unsplit:
        mod.paged_decode(q, kc, vc, pages, lens, **keywords, interpret=True)
    assert str(unsplit.value) == "paged_decode: pages entry (1, 0) is 7, outside the 4 pages (read as pages[b, j // T])"
    with pytest.raises(ValueError) as split:
        mod.sharded(one_device_mesh(), b="data", h="model")(q, kc, vc, pages, lens, **keywords, interpret=True)
    assert str(split.value) == str(unsplit.value)


def test_sharded_checks_max_steps_as_the_unsplit_call():
    """document_attention's `max_steps` below what the walk needs, on concrete arguments:
    refused by the sharded call as by the unsplit one (each device's call sees it traced)."""
    kernel, mod = build(spec_text("document_attention"), formatted=False)
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 1, 512, 64)), jnp.bfloat16) for _ in range(3))
    seg = np.zeros((1, 512), np.int32)  # one document: the second row block sees two key blocks
    with pytest.raises(ValueError) as unsplit:
        mod.document_attention(q, k, v, seg, max_steps=1, interpret=True)
    assert "max_steps=1 is below the" in str(unsplit.value)
    with pytest.raises(ValueError) as split:
        mod.sharded(one_device_mesh(), b="data", h="model")(q, k, v, seg, max_steps=1, interpret=True)
    assert str(split.value) == str(unsplit.value)


def test_operands_named_after_the_checks_are_safe():
    """A paged spec whose operands are named `_checked` and `_check_table` (what the kernel's
    call and `sharded` call): the parameters keep the names, the calls still work."""
    text = spec_text("paged_decode").replace(" q:", " _checked:").replace("q[", "_checked[").replace("pages", "_check_table")
    kernel, mod = build(text)
    args, keywords = example_args(kernel, PAGED_SMALL, "random", np.random.default_rng(0))
    want = mod.reference(*args, **keywords)
    got = mod.sharded(one_device_mesh(), b="data")(*args, **keywords, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    args[3] = np.full_like(args[3], 9)
    for call in (mod.paged_decode, mod.sharded(one_device_mesh(), b="data")):
        with pytest.raises(ValueError, match=r"_check_table entry \(\d, 0\) is 9, outside the 4 pages"):
            call(*args, **keywords, interpret=True)
