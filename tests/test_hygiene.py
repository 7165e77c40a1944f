"""Spec identifiers may be any non-keyword name: generated code keeps its own names apart."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_matches, build
from oracle import oracle

from sparsegen.testing import example_args

from hygiene_specs import MASKED_SDD, NASTY, NASTY_MASK, TRANSPOSED, XMASK_SDD  # noqa: E402


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


@pytest.mark.parametrize("pattern", ["tril", "random", "all_empty", "all_full", "duplicates"])
def test_mask_input_with_coo_output(pattern, interpret):
    run(MASKED_SDD, dict(S=384, D=256, T=384), pattern, interpret)
    run(XMASK_SDD, dict(M=256, K=384, N=256), pattern, interpret)
