"""Every example at the tiles it ships with (issue 44, item 1): in the TPU simulator and in
the Mosaic GPU interpreter, against `reference`, values and one gradient per walk family.

Elsewhere the examples are mostly retiled small: a GPU block of 64 or 128 rows holds one CTA
row tile, a TPU grid of one block along an axis has no second block to index. A term that
is zero with one sub-tile or one block (a CTA's row offset inside its block, the copy of a
group-id tile, a block's offset along an axis, the last block cut short) passes those. Here:

- TPU: every kernel of specs/*.spk and examples/moe_transformer/specs/*.spk at its own
  tiles, two blocks along every blocked axis (tile-1 lead axes too: batch, heads), the last
  ragged where the size may be (TPU_SIZES), in the simulator (NaN-filled memory, bounds and
  revisit checks);
- GPU: every example that builds for h200, in the Mosaic GPU interpreter. By default at
  blocks of 256 rows where the spec's are larger (two CTA row tiles of 128 a block, or two
  CTAs of two 64-row consumer warpgroups), columns of 512 where the spec's are (two CTA
  column tiles), k tiles of 128 (two steps of 64), two blocks of rows, the second ragged
  (GPU_DEFAULT); at the spec's own tiles and TPU_SIZES under SPARSEGEN_SWEEP=1 (a minute or
  more a case in the interpreter);
- gradients: jax.grad through the kernel against jax.grad through `reference`, for an
  einsum (dsd_matmul, with padding entries), a condition walk (grouped_matmul) and a row
  walk (causal_attention); paged kernels are forward only.

`test_the_tables_cover_every_example` fails when an example is added without its sizes here.
An example another test already runs so (COVERED_TPU, COVERED_GPU, which name it) runs here
under SPARSEGEN_SWEEP=1 only.
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, SWEEP, assert_matches, build, with_tiles

from sparsegen.compiler import lower_source
from sparsegen.source import SourceFile, SpecError
from sparsegen.testing import example_args, resolve_sizes, tolerance

SPEC_DIRS = [ROOT / "specs", ROOT / "examples" / "moe_transformer" / "specs"]


def _examples() -> dict[str, str]:
    """Every kernel of the example specs, by name: its text as shipped."""
    out = {}
    for folder in SPEC_DIRS:
        for path in sorted(folder.glob("*.spk")):
            for chunk in ("\n" + path.read_text()).split("\nkernel ")[1:]:
                out[chunk.split()[0]] = "kernel " + chunk[: chunk.index("\n}") + 2]
    return out


EXAMPLES = _examples()

# Two blocks along every blocked axis at the spec's tiles, the second ragged where the size
# may be (a size read as `h // n` is a multiple of n; a page size divides the key block; a
# dimension one block spans is its tile). Paged kernels: pages of 128 (four a key block of
# 512), five pages a sequence (two key blocks, the second ragged).
PAGED = dict(B=2, H=16, G=2, D=128, T=128, NP=5, P=12)
TPU_SIZES = {
    "batched_dsd": dict(B=2, M=612, K=300, N=300),
    "block_slice": {},  # fixed sizes: four blocks of x along each axis, the offsets drawn
    "causal_attention": dict(B=2, H=2, S=612, D=128),
    "dds_matmul": dict(M=300, K=600, N=300),
    "document_attention": dict(B=2, H=2, S=300, D=64),
    "dsd_matmul": dict(M=612, K=612, N=612),
    "expert_matmul": dict(M=200, K=200, N=200, E=3),
    "gqa_attention": dict(B=2, H=4, S=40, D=64),
    "grouped_matmul": dict(M=612, K=612, N=612, E=3),
    "local_gqa_attention": dict(B=2, H=8, S=612, D=128),
    "masked_attention": dict(H=2, S=200, T=300, D=128),
    "masked_matmul": dict(M=612, K=1100, N=612),
    "masked_matmul_dx": dict(M=612, K=612, N=612),
    "masked_matmul_dy": dict(M=612, K=612, N=612),
    "masked_softmax": dict(S=200, T=300),
    "paged_decode": PAGED,
    "paged_gqa_speculative_decode": PAGED,
    "paged_mqa_decode": {k: v for k, v in PAGED.items() if k != "G"},
    "paged_softcap_decode": PAGED,
    "paged_speculative_decode": dict(PAGED, S=16),
    "paged_window_decode": dict(PAGED, NP=10, P=24),  # past its window of 1024 keys
    "sdd_matmul": dict(M=200, K=600, N=200),
    "tril_matmul": dict(M=612, N=612),
    "w8a8_matmul": dict(M=612, K=1100, N=612),
}

# The GPU's refusals (said at the spec; tests/test_gpu.py, tests/test_gpu_attention.py).
GPU_REFUSED = {
    "masked_softmax": "not lowered for GPUs yet: scores read from stored operands",
    "gqa_attention": "on h200 the key block is a multiple of 64",
}

# The default GPU run: (tiles, sizes); tiles None: the spec's (at most 256 rows a block
# already), sizes None: TPU_SIZES'. Blocks of 256 rows: two CTA row tiles of 128 (einsum,
# condition walks), or two CTAs of two 64-row consumers (attention); a column block of 512
# where the spec's is (two CTA column tiles of a warp-specialized product), else 256 (two of
# a 128-wide CTA tile, or two 128-wide consumers); k tiles of 128 (two steps of 64). Two
# blocks of rows, the second ragged; one block along an axis whose indexing is not the
# walk's own (the interpreter runs every CTA and step: seconds each).
GPU_DEFAULT = {
    "batched_dsd": (dict(b=1, m=256, n=256, k=128), dict(B=2, M=300, K=128, N=256)),
    "block_slice": (None, None),
    "causal_attention": (dict(b=1, h=1, i=256, j=256, d=128, e=128), dict(B=1, H=2, S=300, D=128)),
    "dds_matmul": (dict(m=256, n=256, k=128), dict(M=300, K=200, N=256)),  # y's blocks: two along k
    "document_attention": (None, dict(B=2, H=1, S=300, D=64)),
    "dsd_matmul": (dict(m=256, n=512, k=128), dict(M=300, K=128, N=512)),
    "expert_matmul": (None, dict(M=200, K=128, N=128, E=3)),
    "grouped_matmul": (dict(m=256, k=128, n=256, g=1), dict(M=300, K=128, N=256, E=3)),
    "local_gqa_attention": (dict(b=1, h=1, i=256, j=256, d=128, e=128), dict(B=1, H=4, S=300, D=128)),
    "masked_attention": (None, None),
    "masked_matmul": (dict(m=256, n=512, k=128), dict(M=300, K=128, N=512)),
    "masked_matmul_dx": (dict(m=256, n=256, k=128), dict(M=300, K=128, N=256)),
    "masked_matmul_dy": (dict(m=128, n=256, k=256), dict(M=200, K=300, N=256)),  # dy's rows are k
    "sdd_matmul": (None, dict(M=200, K=300, N=128)),  # as shipped: 128-row blocks, one CTA each
    "tril_matmul": (dict(m=256, k=256, n=256), dict(M=300, N=256)),
    "w8a8_matmul": (dict(m=256, n=512, k=128), dict(M=300, K=300, N=512)),
    # Paged kernels as shipped, one block of 8 heads (a CTA's rows either way).
    **{name: (None, {k: v for k, v in dict(sizes, H=8, G=1).items() if k in sizes})
       for name, sizes in TPU_SIZES.items() if name.startswith("paged")},
}
# The gradients' default GPU runs (tiles, sizes): the backward runs two or three kernels
# more, so fewer columns and heads; each kernel still has two CTA row tiles a block (dsd's dx
# is a coo output walk of 256-row blocks, dy a column walk; grouped's dx and dw condition
# walks; causal's dq and dk/dv row walks of two CTAs of two consumers).
GPU_GRADIENT = {"dsd_matmul": (dict(m=256, n=256, k=128), dict(M=300, K=128, N=256)),
                "grouped_matmul": (dict(m=256, k=128, n=256, g=1), dict(M=300, K=128, N=256, E=2)),
                "causal_attention": (dict(b=1, h=1, i=256, j=256, d=128, e=128), dict(B=1, H=1, S=300, D=128))}


# Examples other tests already run at their own tiles, two blocks along every axis and a
# ragged end (or fixed sizes), in the same mode: here under SPARSEGEN_SWEEP=1 only.
COVERED_TPU = {
    "block_slice": "tests/test_kernels.py::test_kernel_matches_reference (the simulator at its tiles, three offsets)",
    "paged_decode": "tests/test_paged.py::test_paged_decode_against_the_oracle (the simulator: 5 sequences up to 640 keys, "
                    "2 groups of 8 heads)",
    "paged_window_decode": "tests/test_paged.py::test_serving_examples_in_the_simulator (1100 keys, past the window)",
}
COVERED_GPU = {
    "block_slice": "tests/test_gpu.py::test_example_matches_reference_in_the_gpu_interpreter (its tiles)",
    "paged_decode": "tests/test_gpu_decode.py::test_paged_decode_in_the_gpu_interpreter (5 sequences up to the whole table, "
                    "2 groups of 8 heads)",
    "paged_window_decode": "tests/test_gpu_decode.py::test_serving_examples_in_the_gpu_interpreter (1100 and 1283 keys)",
    "paged_gqa_speculative_decode": "tests/test_gpu_decode.py::test_heads_packed_with_new_tokens_in_the_gpu_interpreter "
                                    "(2 groups of 16 heads, 530 keys)",
}


def pattern_of(kernel) -> str:
    """Padding entries among random blocks where an operand is coo; random elsewhere."""
    return "padded" if any(op.sparsity == "coo" for op in kernel.operands) else "random"


def draw(kernel, sizes, seed_text):
    """example_args, but for what it draws as plain integers: group ids sorted (as a router
    sorts tokens: ragged groups, blocks straddling two, whole blocks of one), and a paged
    kernel's lengths over both key blocks (the last cut one key into it), not a few tokens."""
    rng = np.random.default_rng(zlib.crc32(seed_text.encode()))
    args, keywords = example_args(kernel, sizes, pattern_of(kernel), rng)
    env = resolve_sizes(kernel, sizes)
    names = [op.name for op in kernel.inputs]
    if "gid" in names:
        args[names.index("gid")] = np.sort(rng.integers(0, env["E"], env["M"])).astype(np.int32)
    if "lens" in names:
        keys = env["NP"] * env["T"]
        j = kernel.index("j").tile
        args[names.index("lens")] = np.array([keys, (keys - 1) // j * j + 1][: env["B"]], np.int32)
    return args, keywords


def test_the_tables_cover_every_example():
    """Every example kernel has its sizes here; each size holds two blocks of its index's tile
    (one where the block spans it: a head dimension, the spec's fixed sizes); the GPU tables
    name every example the GPU takes, and those it refuses are refused."""
    assert set(TPU_SIZES) == set(EXAMPLES), set(EXAMPLES) ^ set(TPU_SIZES)
    assert set(GPU_DEFAULT) == set(EXAMPLES) - set(GPU_REFUSED)
    assert set(COVERED_TPU) <= set(EXAMPLES) and set(COVERED_GPU) <= set(GPU_DEFAULT)
    for name, text in EXAMPLES.items():
        kernel, _ = build(text)
        env = resolve_sizes(kernel, TPU_SIZES[name])
        for index in kernel.indices:
            symbol = index.size.symbol
            if symbol is None or index.size.literal is not None or env[symbol] == index.tile:
                continue
            assert math.ceil(env[symbol] / index.tile) >= 2, (name, index.name, env[symbol], index.tile)
    for name, why in GPU_REFUSED.items():
        with pytest.raises(SpecError) as info:
            lower_source(SourceFile(f"{name}.spk", EXAMPLES[name]), "h200")
        assert why in info.value.render()


# ------------------------------------------------------------------ TPU: the simulator

@pytest.mark.parametrize("name", [n for n in sorted(EXAMPLES) if SWEEP or n not in COVERED_TPU])
def test_tpu_example_at_its_tiles(name, interpret):
    kernel, mod = build(EXAMPLES[name])
    sizes = TPU_SIZES[name]
    args, keywords = draw(kernel, sizes, name)
    out = jax.block_until_ready(getattr(mod, kernel.name)(*args, **keywords, interpret=interpret))
    assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, sizes))


# ------------------------------------------------------------------ GPU: the Mosaic GPU interpreter

def gpu_case(name: str, shipped: bool):
    """(spec text, sizes) of an example's GPU run."""
    tiles, sizes = GPU_DEFAULT[name]
    if shipped:
        return EXAMPLES[name], TPU_SIZES[name]
    return with_tiles(EXAMPLES[name], **tiles) if tiles else EXAMPLES[name], sizes or TPU_SIZES[name]


# Under SPARSEGEN_SWEEP=1 every example at its own tiles and TPU_SIZES too.
GPU_CASES = [(name, False) for name in sorted(GPU_DEFAULT) if SWEEP or name not in COVERED_GPU] + [
    (name, True) for name in sorted(GPU_DEFAULT) if SWEEP]


@pytest.mark.parametrize("name,shipped", GPU_CASES, ids=[f"{n}-{'shipped' if s else 'default'}" for n, s in GPU_CASES])
def test_gpu_example_at_its_tiles(name, shipped):
    text, sizes = gpu_case(name, shipped)
    kernel, mod = build(text, "h200")
    args, keywords = draw(kernel, sizes, name)
    out = getattr(mod, kernel.name)(*args, **keywords, interpret=True)
    assert_matches(kernel, out, mod.reference(*args, **keywords), resolve_sizes(kernel, sizes))


# ------------------------------------------------------------------ gradients, one per walk family

def _gradients_match(kernel, mod, args, keywords, interpret, env):
    """jax.grad of sum(output * weight) through the kernel and through `reference`, for every
    float input that is not a mask."""
    from test_gradients import differentiable

    which = tuple(differentiable(kernel))
    ref = mod.reference(*args, **keywords)
    refs = ref if isinstance(ref, tuple) else (ref,)
    rng = np.random.default_rng(8)
    weights = [jnp.asarray(rng.standard_normal(r.shape), jnp.float32) for r in refs]

    def loss(fn):
        def total(*a):
            out = fn(*a, **keywords)
            return sum(jnp.sum(o.astype(jnp.float32) * w) for o, w in zip(out if isinstance(out, tuple) else (out,), weights))
        return total

    got = jax.grad(loss(lambda *a, **k: getattr(mod, kernel.name)(*a, **k, interpret=interpret)), argnums=which)(*args)
    want = jax.grad(loss(mod.reference), argnums=which)(*args)
    bf16 = any(op.dtype.name == "bf16" for op in kernel.operands)
    for n, g, w in zip(which, got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape and not np.isnan(g).any(), n
        tol = max(tolerance(kernel, o.name, env)[1] for o in kernel.outputs) + (4 * 2.0**-8 if bf16 else 1e-5)
        scale = max(1.0, float(np.sqrt(np.mean(w**2))))
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale, err_msg=f"argument {n}")


GRADIENTS = ["dsd_matmul", "grouped_matmul", "causal_attention"]
# The TPU gradients' sizes: TPU_SIZES' rows and sums (two blocks, ragged), one block of
# columns and of lead axes (the backward runs two kernels more); TPU_SIZES' under
# SPARSEGEN_SWEEP=1.
TPU_GRADIENT_SIZES = {"dsd_matmul": dict(M=612, K=612, N=512), "grouped_matmul": dict(M=612, K=612, N=512, E=3),
                      "causal_attention": dict(B=1, H=1, S=612, D=128)}


@pytest.mark.parametrize("name", GRADIENTS)
def test_tpu_gradient_at_its_tiles(name, interpret):
    kernel, mod = build(EXAMPLES[name])
    sizes = TPU_SIZES[name] if SWEEP else TPU_GRADIENT_SIZES[name]
    args, keywords = draw(kernel, sizes, name + "-grad")
    _gradients_match(kernel, mod, args, keywords, interpret, resolve_sizes(kernel, sizes))


GPU_GRADIENTS = [(name, False) for name in GRADIENTS] + [(name, True) for name in GRADIENTS if SWEEP]


@pytest.mark.parametrize("name,shipped", GPU_GRADIENTS, ids=[f"{n}-{'shipped' if s else 'default'}" for n, s in GPU_GRADIENTS])
def test_gpu_gradient_at_its_tiles(name, shipped):
    if shipped:
        text, sizes = EXAMPLES[name], TPU_SIZES[name]
    else:
        tiles, sizes = GPU_GRADIENT[name]
        text = with_tiles(EXAMPLES[name], **tiles)
    kernel, mod = build(text, "h200")
    args, keywords = draw(kernel, sizes, name + "-grad")
    _gradients_match(kernel, mod, args, keywords, True, resolve_sizes(kernel, sizes))
