"""Spec identifiers may be any non-keyword name: generated code keeps its own names apart."""

from __future__ import annotations

import numpy as np
from conftest import assert_matches, build
from oracle import oracle

from sparsegen.testing import example_args

# Operands, indices and sizes named after things the generated module uses itself.
NASTY = """
kernel nasty {
    in  jnp: bf16[np, len] coo
    in  _kernel: bf16[len, pl]
    out interpret: bf16[np, pl]
    interpret[k, step] = jnp[k, lax] * _kernel[lax, step]
    tile k = 128, step = 128, lax = 128
}
"""

NASTY_MASK = """
kernel mask {
    in  sizes: f32[M, K]
    in  acc_ref: f32[K, N]
    in  mask: i32[M, N] mask
    out kind: f32[M, N]
    kind[cell, nxt] = mask[cell, nxt] * sizes[cell, live] * acc_ref[live, nxt]
    tile cell = 128, nxt = 128, live = 128
}
"""

TRANSPOSED = """
kernel at {
    in  a: f32[K, M]
    in  b: f32[N, K]
    in  s: f32[N] mask
    out o: f32[M, N]
    o[i, j] = s[j] * a[k, i] * b[j, k]
    tile i = 128, j = 128, k = 128
}
"""


def run(text, sizes, pattern, interpret):
    kernel, mod = build(text)
    args, keywords = example_args(kernel, sizes, pattern, np.random.default_rng(3))
    out = getattr(mod, kernel.name)(*args, **keywords, interpret=interpret)
    assert_matches(kernel, out, oracle(kernel, args, keywords))
    return mod


def test_names_that_shadow_module_names(interpret):
    mod = run(NASTY, dict(np=256, len=256, pl=256), "random", interpret)
    import inspect

    # The public signature keeps the spec's names; only clashes are renamed.
    params = list(inspect.signature(mod.nasty).parameters)
    assert params[:4] == ["jnp_blocks", "jnp_idx_0", "jnp_idx_1", "_kernel"]
    assert "np" in params and "len" in params and "interpret" in params


def test_names_that_shadow_generated_locals(interpret):
    run(NASTY_MASK, dict(M=256, K=256, N=256), "tril", interpret)


def test_transposed_reads_and_a_mask_on_one_output_index(interpret):
    run(TRANSPOSED, dict(M=256, K=384, N=384), "empty_lines", interpret)
