"""`where` conditions on GPU products that read a summed index walked one value at a time
(issue 37, items 1 and 2 on the GPU). Where the indices such a condition spans are all the
output's (`n < width[g]`, `m < rows[b]`), the condition changes from step to step, so no
factor's tile and no single selection of the accumulator can apply it: each step's product
is computed apart (a second accumulator) and selected at a partial step before it is added
(`Selection` "step"). A condition over two summed indices (`g`, `k`) walks the (row, column)
pairs of its classification, tables built from expression trees. Values against numpy
oracles written from the math, in the Mosaic GPU interpreter; the verbatim tiles lowered
under an abstract H200 and compiled by ptxas (no spill).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build, with_tiles

from sparsegen.compiler import lower_source
from sparsegen.source import SourceFile

# Experts of different widths: row m uses expert gid[m], its columns n < width[g].
WIDTH = """kernel expert_width {
    in  x: bf16[M, K]
    in  w: bf16[E, K, N]
    in  gid: i32[M]
    in  width: i32[E]
    out o: bf16[M, N]

    o[m, n] = x[m, k] * w[g, k, n] where gid[m] == g and n < width[g]

    tile m = 128, k = 128, n = 128, g = 1
}
"""

# A sum of ragged products: batch b contributes its rows[b] x cols[b] corner.
RAGGED = """kernel ragged_sum {
    in  x: f32[B, M, K]
    in  y: f32[B, K, N]
    in  rows: i32[B]
    in  cols: i32[B]
    out o: f32[M, N]

    o[m, n] = x[b, m, k] * y[b, k, n] where m < rows[b] and n < cols[b]

    tile m = 128, k = 64, n = 128, b = 1
}
"""

# Grouped, over the first 100 entries of k only: the condition spans two summed indices.
PREFIX = """kernel grouped_prefix {
    in  x: bf16[M, K]
    in  w: bf16[E, K, N]
    in  gid: i32[M]
    out o: bf16[M, N]

    o[m, n] = x[m, k] * w[g, k, n] where gid[m] == g and k < 100

    tile m = 128, k = 128, n = 128, g = 1
}
"""

# A condition on the output alone beside a summed index of tile 1 (walked, not read).
BATCH_SUM = """kernel lower_batch_sum {
    in  x: f32[B, M, K]
    in  y: f32[B, K, N]
    out o: f32[M, N]

    o[m, n] = x[b, m, k] * y[b, k, n] where n <= m

    tile m = 64, k = 64, n = 64, b = 1
}
"""

GID = np.repeat([0, 1], [64, 64]).astype(np.int32)


def small(text: str, **tiles: int) -> str:
    """The spec at the interpreter's tiles (64: two row blocks of 64 for 128 rows)."""
    line = re.search(r"tile (.*)", text).group(1)
    old = dict(part.split(" = ") for part in line.split(", "))
    return with_tiles(text, **{k: tiles.get(k, int(v) if int(v) == 1 else 64) for k, v in old.items()})


def bf16(a) -> tuple[jax.Array, np.ndarray]:
    """An array as the kernel takes it (bf16), and its values in float64 for the oracle."""
    b = jnp.asarray(a, jnp.bfloat16)
    return b, np.asarray(b, np.float64)


def close(got, want, what: str, rtol: float = 0.02):
    got = np.asarray(got, np.float64)
    scale = max(1.0, float(np.sqrt(np.mean(want**2))))
    assert np.isfinite(got).all(), what
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=what)


def passes(text: str):
    (m,) = lower_source(SourceFile("t.spk", text), "h200")
    return m


def test_a_condition_over_two_summed_indices_walks_the_right_blocks():
    """`gid[m] == g and k < 100`: the walk's columns are (k block, g) pairs, E * cdiv(K, 64) of
    them a row; each step's row and column came from `arange(R * C) // C` and `order % C`,
    written without parentheses around C = cdiv(K, 64) * E (off by 37 here before)."""
    text = small(PREFIX)
    kernel, mod = build(text, "h200")
    (p,) = passes(text).passes
    assert p.walk == "condition" and p.selection.on == "a", (p.walk, p.selection.on)
    rng = np.random.default_rng(0)
    M, K, E, N = 128, 192, 2, 64
    (x, xf), (w, wf) = bf16(rng.standard_normal((M, K))), bf16(rng.standard_normal((E, K, N)))
    want = np.stack([xf[m, :100] @ wf[GID[m], :100] for m in range(M)])
    close(mod.grouped_prefix(x, w, jnp.asarray(GID), interpret=True), want, "o")


def test_grad_of_x_through_a_condition_over_two_summed_indices():
    """The derived d_x[m, k] = g_o[m, n] * w[g, k, n] where gid[m] == g and k < 100 spans the
    output's m and k but reads the summed g: each step's product is selected, not the
    accumulator once at the end (before: no GPU lowering; the TPU applied the last step's g)."""
    text = small(PREFIX)
    kernel, mod = build(text, "h200")
    (dx,) = [p for p in passes(text).backward_module.passes if p.output == "d_x"]
    assert dx.walk == "condition" and dx.selection.on == "step"
    rng = np.random.default_rng(1)
    M, K, E, N = 128, 192, 2, 64
    (x, xf), (w, wf) = bf16(rng.standard_normal((M, K))), bf16(rng.standard_normal((E, K, N)))
    ct = rng.standard_normal((M, N))
    got = jax.grad(lambda x: jnp.sum(mod.grouped_prefix(x, w, jnp.asarray(GID), interpret=True).astype(jnp.float32) * ct))(x)
    want = np.zeros((M, K))
    for m in range(M):
        want[m, :100] = wf[GID[m], :100] @ ct[m]
    close(got, want, "d_x")


def test_experts_of_different_widths():
    """`gid[m] == g and n < width[g]`: the condition spans m and n (no factor holds both) and
    reads the summed g. Rows of expert 0 use all 128 columns, rows of expert 1 the first 60
    (before: refused on GPUs; the TPU selected with the last step's g). The gradients of x
    and w against the math too."""
    text = small(WIDTH)
    kernel, mod = build(text, "h200")
    (p,) = passes(text).passes
    assert p.walk == "condition" and p.selection.on == "step"
    rng = np.random.default_rng(2)
    M, K, E, N = 128, 128, 2, 128
    width = np.array([128, 60], np.int32)
    (x, xf), (w, wf) = bf16(rng.standard_normal((M, K))), bf16(rng.standard_normal((E, K, N)))
    present = np.arange(N)[None, :] < width[GID][:, None]
    want = np.where(present, np.stack([xf[m] @ wf[GID[m]] for m in range(M)]), 0.0)
    args = (jnp.asarray(GID), jnp.asarray(width))
    close(mod.expert_width(x, w, *args, interpret=True), want, "o")
    ct = rng.standard_normal((M, N)) * present
    gx, gw = jax.grad(lambda x, w: jnp.sum(mod.expert_width(x, w, *args, interpret=True).astype(jnp.float32) * ct),
                      argnums=(0, 1))(x, w)
    close(gx, np.stack([wf[GID[m]] @ ct[m] for m in range(M)]), "d_x")
    want_w = np.zeros((E, K, N))
    for m in range(M):
        want_w[GID[m]] += np.outer(xf[m], ct[m])
    close(gw, want_w, "d_w")


def test_a_sum_of_ragged_products():
    """`m < rows[b] and n < cols[b]`, b summed one value at a time: each batch's corner of its
    product (before: `NameError: name 'b' is not defined` at the first call, the emitter
    taking the accumulator's selection). Rows 64.. meet no batch: their block runs no step."""
    text = small(RAGGED)
    kernel, mod = build(text, "h200")
    rng = np.random.default_rng(3)
    B, M, K, N = 3, 128, 96, 128
    x, y = rng.standard_normal((B, M, K)).astype(np.float32), rng.standard_normal((B, K, N)).astype(np.float32)
    rows, cols = np.array([60, 30, 0], np.int32), np.array([128, 50, 70], np.int32)
    want = np.zeros((M, N))
    for b in range(B):
        want[: rows[b], : cols[b]] += (x[b].astype(np.float64) @ y[b])[: rows[b], : cols[b]]
    got = mod.ragged_sum(x, y, rows, cols, interpret=True)
    assert not np.asarray(got)[64:].any()
    close(got, want, "o", rtol=1e-3)
    ct = rng.standard_normal((M, N))
    gx, gy = jax.grad(lambda x, y: jnp.sum(mod.ragged_sum(x, y, rows, cols, interpret=True) * ct), argnums=(0, 1))(x, y)
    for b in range(B):
        corner = np.zeros((M, N))
        corner[: rows[b], : cols[b]] = ct[: rows[b], : cols[b]]
        close(gx[b], corner @ y[b].T.astype(np.float64), f"d_x[{b}]", rtol=1e-3)
        close(gy[b], x[b].T.astype(np.float64) @ corner, f"d_y[{b}]", rtol=1e-3)


def test_a_condition_on_the_output_beside_a_walked_summed_index():
    """`n <= m` reads no summed index, but b (tile 1) is walked one value at a time: the
    condition's columns are its blocks, each step's product selected (before: the
    accumulator's selection, which never walked b: NameError)."""
    kernel, mod = build(BATCH_SUM, "h200")
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((3, 128, 64)).astype(np.float32), rng.standard_normal((3, 64, 128)).astype(np.float32)
    want = np.tril(np.einsum("bmk,bkn->mn", x.astype(np.float64), y))
    close(mod.lower_batch_sum(x, y, interpret=True), want, "o", rtol=1e-3)


def test_step_selections_lower_and_compile_for_h200_without_spilling():
    """The verbatim tiles (128): a kernel selecting each step's product holds two
    accumulators, so its CTA tile is 64 x 128 (at 128 x 128, ptxas spilled 1,172 bytes
    for the widths, 688 for the ragged sum). Stage 2 lowers each (forward and backward), its
    shared memory as `rules.smem_bytes` says; stage 3 compiles the widths' kernel (a copy of
    gid's tile at partial steps beside the two accumulators)."""
    from sparsegen.verify import verify_gpu_modules

    items = []
    for name, text in (("expert_width", WIDTH), ("ragged_sum", RAGGED), ("grouped_prefix", PREFIX)):
        source = SourceFile(f"{name}.spk", text)
        for m in lower_source(source, "h200"):
            steps = [p for p in (*m.passes, *m.backward_module.passes) if p.selection is not None and p.selection.on == "step"]
            assert steps and all((p.tiles.tm, p.tiles.tn) == (64, 128) for p in steps), [(p.output, p.tiles) for p in steps]
            items.append((m, source, "h200"))
    results = verify_gpu_modules(items, stage3={"expert_width"})
    for r in results:
        assert r.lowered, (r.kernel, r.raw_error)
        assert r.backward == "lowers", (r.kernel, r.backward)
        assert r.smem_used == r.smem_estimate, (r.kernel, r.smem_used, r.smem_estimate)
    if results[0].compiled is None:
        pytest.skip(f"stage 3 (ptxas for sm_90a) not run: {results[0].stage3}")
    assert results[0].compiled, results[0].raw_error
    assert results[0].spill_bytes == 0 and max(results[0].registers) <= 255, (results[0].registers, results[0].spill_bytes)


def test_step_selection_modules_are_pyflakes_clean():
    """Nothing bound and unread, nothing read and unbound (the ragged sum's `b` was) in the
    modules selecting each step's product, forward and backward."""
    from pathlib import Path

    from pyflakes import api

    class Collect:
        def __init__(self):
            self.messages = []

        def unexpectedError(self, filename, msg):
            self.messages.append(f"{filename}: {msg}")

        def syntaxError(self, filename, msg, lineno, offset, text):
            self.messages.append(f"{filename}:{lineno}: {msg}")

        def flake(self, message):
            self.messages.append(str(message))

    for text in (WIDTH, RAGGED, PREFIX, BATCH_SUM):
        path = Path(build(text, "h200")[1].__file__)
        reporter = Collect()
        api.check(path.read_text(), str(path), reporter)
        assert not reporter.messages, "\n".join(reporter.messages)
