"""The ring of Mosaic GPU attention modules (--target h200) on a device mesh.

They render the same ring as the TPU's (templates/ring.py.j2; tests/test_sharded.py)
around their own `_impl` and `_run_backward`, whose kernels take the first positions
(`origin`) and the key side of segment ids (`keys`). On 8 host CPU devices, in the Mosaic
GPU interpreter (mesh_runner.py's `interpret=True`), in one subprocess for the module's
tests (tests/mesh_jobs.py), against the kernel unsplit and `reference`: values and
jax.grad. GPU-sized tiles (a CTA takes 64 rows). The interpreter's kernel calls are slow
(seconds a case): by default one ring in order (document_attention: its segment ids' key
side is what the GPU kernels add to a ring); causal_attention in order and in zigzag order,
and cross attention's key index alone and as a ring, under SPARSEGEN_SWEEP=1 (the
ring's zigzag order and its rows and keys of two sizes are the template's, run by default
on the TPU modules). Here, in the test process: the GPU kernels given first positions, in
the interpreter and lowered for H200; a module without a backward refuses the ring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SWEEP, build, spec_text, with_tiles
from mesh_jobs import MeshJobs, one_device_mesh
from test_sharded import CROSS, RING

MESH_JOBS = MeshJobs("sharded_gpu")


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory, worker_id):
    return MESH_JOBS.run(tmp_path_factory, worker_id)


GPU_TILES = dict(b=1, h=1, i=64, j=64, d=64, e=64)


def assert_gpu_case(kernel, env, res, c: int, specs) -> int:
    """Case `c`'s outputs and gradients against the kernel unsplit and `reference`, within
    the GPU kernels' own rounding (WGMMA multiplies f32 tiles as tf32, the backward's ds in
    bf16 for bf16 arguments), relative to each array's largest element as
    tests/test_gpu_attention.py compares them; minus infinity (an lse's row that sees
    nothing) where `reference` has it. Returns how many gradients were compared."""
    tag = f"case{c}_"
    assert f"{tag}error" not in res, str(res[f"{tag}error"])

    def compare(what, got, unsplit, ref):
        assert np.array_equal(np.isneginf(got), np.isneginf(ref)), what
        seen = np.isfinite(ref)
        assert np.isfinite(got[seen]).all(), what
        scale = float(np.abs(ref[seen]).max())
        assert scale > 0.1, (what, scale)  # a comparison that can fail
        np.testing.assert_allclose(got[seen], unsplit[seen], atol=0.01 * scale, err_msg=f"case {c}: {what} against the kernel")
        np.testing.assert_allclose(got[seen], ref[seen], atol=0.015 * scale, err_msg=f"case {c}: {what} against reference")

    for n, op in enumerate(kernel.outputs):
        compare(op.name, *(res[f"{t}out{n}"].astype(np.float64) for t in (tag, "kernel_", "reference_")))
        assert str(res[f"{tag}spec{n}"]) == specs[n], (op.name, str(res[f"{tag}spec{n}"]))
    grads = [key[len(f"{tag}grad"):] for key in res if key.startswith(f"{tag}grad")]
    for n in grads:
        compare(f"gradient {n}", *(res[f"{t}grad{n}"].astype(np.float64) for t in (tag, "kernel_", "reference_")))
    return len(grads)


# document_attention in order beside a batch split (4 devices), and its key index alone
# (the rows in chunks of 96 positions, one and a half tiles, against each device's keys:
# issue 37, item 10); under SPARSEGEN_SWEEP=1 causal_attention too, in order and in zigzag
# order (four pairs a step over a 2-device ring) beside batch and head splits, and alone.
CUBE = {"mesh": [2, 2, 2], "names": ["data", "model", "seq"]}
MESH_JOBS.add("gpu_ring",
              (with_tiles(spec_text("document_attention"), **GPU_TILES), dict(B=2, H=1, S=192, D=64),
               [{**RING, "axes": {"b": "data", "i": "seq", "j": "seq"}},
                {"mesh": [2], "names": ["seq"], "axes": {"j": "seq"}}], "random", 0, "h200"),
              *([(with_tiles(spec_text("causal_attention"), **GPU_TILES), dict(B=2, H=2, S=256, D=64),
                  [{**RING, "axes": {"b": "data", "i": "seq", "j": "seq"}},
                   {**CUBE, "axes": {"b": "data", "h": "model", "i": ["seq", "zigzag"], "j": "seq"}},
                   {**RING, "axes": {"h": "data", "j": "seq"}}], "random", 0, "h200")]
                if SWEEP else []))


def test_gpu_ring_attention_document_causal_and_zigzag(mesh_results):
    """document_attention (and under SPARSEGEN_SWEEP=1 causal_attention) built for H200, the
    key index split with the rows over one mesh axis: in order beside a batch split (4
    devices), segment ids' key side travelling with the keys; causal in zigzag order beside
    batch and head splits (2 devices). The key index alone: every row over each device's
    keys, merged across the axis (document: segment ids' key side sliced on each device;
    causal beside a head split, its `lse` merged as a logsumexp)."""
    (k1, env1, res1), *causal = mesh_results["gpu_ring"]
    assert assert_gpu_case(k1, env1, res1, 0, ["P('data', None, 'seq')"]) == 3
    assert assert_gpu_case(k1, env1, res1, 1, ["P()"]) == 3
    assert len(causal) == SWEEP
    for k2, env2, res2 in causal:
        assert assert_gpu_case(k2, env2, res2, 0, ["P('data', None, 'seq')"] * 2) == 3
        assert assert_gpu_case(k2, env2, res2, 1, ["P('data', 'model', 'seq')"] * 2) == 3
        assert assert_gpu_case(k2, env2, res2, 2, ["P(None, 'data')"] * 2) == 3


# paged_decode built for H200 (its hand-written double-buffered page walk) split over the
# batch and the heads at once (2 x 2 devices): `pages` and `lens` are cut with the batch,
# the cache with the heads' key heads (G = H / 8) and whole along its pages (the table's
# entries address them). Values only: a paged walk derives no gradient (issue 19).
MESH_JOBS.add("gpu_paged", (spec_text("paged_decode"), dict(B=2, H=16, D=128, T=16, NP=8), [
    {"mesh": [2, 2], "names": ["data", "model"], "axes": {"b": "data", "h": "model"}}], "random", 0, "h200"))


def test_gpu_paged_decode_split_over_batch_and_heads(mesh_results):
    """paged_decode's GPU module on a 2 x 2 mesh, its batch over one axis and its heads over
    the other, equals the kernel unsplit and `reference` (ragged lengths drawn per sequence)."""
    (kernel, env, res), = mesh_results["gpu_paged"]
    assert assert_gpu_case(kernel, env, res, 0, ["P('data', 'model')"]) == 0


# Cross attention at GPU tiles (f32: tf32 WGMMA tiles), rows and keys of their own sizes:
# the key index alone, and as a ring; under SPARSEGEN_SWEEP=1 only (10 CPU-seconds: the
# merge across the axis is templates/ring.py.j2's, the TPU modules' too, whose key index
# alone tests/test_sharded.py runs; the GPU kernel's origins run in the ring above).
GPU_CROSS = with_tiles(CROSS, b=1, i=64, j=64, d=64, e=64)
if SWEEP:
    MESH_JOBS.add("gpu_alone", (GPU_CROSS, dict(B=2, S=128, T=256, D=64),
                                [{**RING, "axes": {"b": "data", "j": "seq"}}, {**RING, "axes": {"i": "seq", "j": "seq"}}],
                                "random", 0, "h200"))

    def test_gpu_key_index_alone_merges_across_the_axis(mesh_results):
        """The key index split alone on a GPU module: every device attends all rows over its
        keys, merged across the axis (values and gradients); the same kernel as a ring."""
        (kernel, env, res), = mesh_results["gpu_alone"]
        assert assert_gpu_case(kernel, env, res, 0, ["P('data',)", "P('data',)"]) == 3
        assert assert_gpu_case(kernel, env, res, 1, ["P(None, 'seq')", "P(None, 'seq')"]) == 3


GPU_WINDOWED = with_tiles(spec_text("local_gqa_attention"), b=1, h=1, i=64, j=128, d=64, e=64).replace("i - j < 1024", "i - j < 100")


def windowed_oracle(q, k, v, origin, window=100):
    """local_gqa_attention's output and logsumexp in numpy (one key head), its rows and keys
    starting at the global positions `origin`."""
    qf, kf, vf = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bhid,bjd->bhij", qf, kf[:, 0]) * 0.08838834764831845
    s = 50.0 * np.tanh(s / 50.0)
    i = np.arange(qf.shape[2])[:, None] + origin[0]
    j = np.arange(kf.shape[2])[None, :] + origin[1]
    s = np.where((i >= j) & (i - j < window), s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isneginf(m), 0, m))
    total = p.sum(-1, keepdims=True)
    out = np.einsum("bhij,bje->bhie", p / np.where(total == 0, 1, total), vf[:, 0])
    lse = np.where(total[..., 0] == 0, -np.inf, m[..., 0] + np.log(np.where(total[..., 0] == 0, 1, total[..., 0])))
    return out, lse


def test_gpu_kernels_compare_global_positions():
    """The GPU row kernel given its rows' and keys' first positions (`origin`, as the ring
    passes them) evaluates its window on global positions, in the Mosaic GPU interpreter:
    the window's edge inside the blocks, rows past every key (nothing seen: 0 and minus
    infinity), keys behind, keys ahead of every row. Its classification is by global
    positions too."""
    kernel, mod = build(GPU_WINDOWED, "h200")
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((1, 4, 256, 64)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, 1, 256, 64)), jnp.bfloat16) for _ in range(2))
    q, k, v, sizes = mod._prepare(q, k, v, *(None for _ in mod._MESH_SIZES))
    # (rows' first position, keys'): whether some row sees some key
    for origin, seen_any in (((300, 0), True), ((356, 0), False), ((256, 192), True), ((0, 256), False)):
        o, row_lse = mod._impl(q, k, v, sizes, True, origin=jnp.asarray(origin, jnp.int32))
        want, lse = windowed_oracle(q, k, v, origin)
        assert np.isfinite(lse).any() == seen_any, origin
        np.testing.assert_allclose(np.asarray(o, np.float64), want, atol=2e-2, err_msg=str(origin))
        np.testing.assert_array_equal(np.isneginf(np.asarray(row_lse)), np.isneginf(lse), err_msg=str(origin))
        seen = np.isfinite(lse)
        np.testing.assert_allclose(np.asarray(row_lse)[seen], lse[seen], atol=2e-2, err_msg=str(origin))
        kinds = np.asarray(mod._classify_blocks(np, sizes, origin))
        rows, keys = np.arange(4)[:, None] * 64 + origin[0], np.arange(2)[None, :] * 128 + origin[1]
        # A block is empty where no (row, key) pair of it is in the window.
        any_seen = (rows + 63 >= keys) & (rows - (keys + 127) < 100)
        np.testing.assert_array_equal(kinds.reshape(-1, 4, 2)[0] != 0, any_seen, err_msg=str(origin))


def test_gpu_kernels_with_origins_and_key_sides_lower_for_h200():
    """document_attention's forward and backward kernels, given first positions and the key
    side of the segment ids (as a ring's pair), lower under an abstract H200."""
    from sparsegen.gpu.verify import _lower

    kernel, mod = build(with_tiles(spec_text("document_attention"), **GPU_TILES), "h200")
    sizes = (1, 2, 256, 64)
    x = jax.ShapeDtypeStruct((1, 2, 256, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    origin = jax.ShapeDtypeStruct((2,), jnp.int32)

    def pair(q, k, v, seg, seg_keys, origin):
        o, row_lse = mod._impl(q, k, v, seg, sizes, False, origin=origin, keys=(seg_keys,))
        residuals = (q, k, v, seg, o, row_lse, ((), (), (), ()))
        return mod._run_backward(sizes, False, residuals, jnp.ones_like(o), origin=origin, keys=(seg_keys,))

    text = _lower(pair, [x, x, x, seg, seg, origin], {}, "h200")
    assert text.count("mosaic_gpu") >= 3, text[:2000]  # the forward, dq and dk/dv kernels


def test_gpu_module_without_a_backward_says_why_it_has_no_ring():
    """The ring merges by the rows' logsumexp, which a GPU module keeps only with its
    backward: where the backward is not lowered (its shared memory), the key index is
    refused saying so; its batch still splits."""
    text = with_tiles(CROSS, b=1, i=64, j=64, d=128, e=128)
    kernel, mod = build(text, "h200")
    assert mod._MESH_RULES["b"][0] == "split" and mod._MESH_RULES["j"][0] is None
    with pytest.raises(ValueError) as info:
        mod.sharded(one_device_mesh(), j="data")
    assert str(info.value).startswith("cross: sharded: index j cannot be split: it is the key index of an attention-like kernel: "
                                      "splitting it (a ring) merges partial results by the rows' logsumexp, which this module "
                                      "keeps only with its backward, and its backward is not lowered (the backward's "), str(info.value)
    assert callable(mod.sharded(one_device_mesh(), b="data"))
