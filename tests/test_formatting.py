"""The fast formatter is byte-identical to black on whole modules."""

from __future__ import annotations

import black
import pytest
from conftest import SPECS, spec_text, with_tiles
from hygiene_specs import MASKED_SDD, NASTY, NASTY_MASK, TRANSPOSED, XMASK, XMASK_SDD
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsegen.compiler import compile_source
from sparsegen.tpu.emit import _Emitter
from sparsegen.formatting import BLACK_MODE, format_module
from sparsegen.source import SourceFile, SpecError

TEXTS = [spec_text(p.stem) for p in sorted(SPECS.glob("*.spk"))] + [NASTY, NASTY_MASK, TRANSPOSED, XMASK, MASKED_SDD, XMASK_SDD]


def raw_and_name(text):
    module, *_ = compile_source(SourceFile("f.spk", text))
    return _Emitter(module.plan).module("f.spk"), module.plan.name


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_identical_to_black(text):
    raw, name = raw_and_name(text)
    assert format_module(raw, names=(name,)) == black.format_str(raw, mode=BLACK_MODE)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.sampled_from(["dsd_matmul", "dds_matmul", "masked_matmul", "sdd_matmul"]), st.lists(st.sampled_from([16, 64, 128, 256, 512, 1024, 2048, 4096]), min_size=3, max_size=3))
def test_identical_to_black_on_variants(name, tiles):
    try:
        raw, kernel = raw_and_name(with_tiles(spec_text(name), m=tiles[0], n=tiles[1], k=tiles[2]).replace(f"kernel {name}", f"kernel {name}_v{tiles[0]}"))
    except SpecError:
        return  # a tiling the checks reject
    assert format_module(raw, names=(kernel,)) == black.format_str(raw, mode=BLACK_MODE)
