"""`plan --pattern` on attention-like kernels: the generated row walk's own tables and index
maps, counted; visited blocks against a brute-force count over elements."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import SPECS

from sparsegen.cli import main
from sparsegen.patterns import PatternError, parse_pattern, segment_ids


def _blocks(present: np.ndarray, ti: int, tj: int) -> int:
    """Brute force: (row block, key block) pairs with some present element."""
    s, t = present.shape
    padded = np.pad(present, [(0, -s % ti), (0, -t % tj)])
    return int(padded.reshape(-(-s // ti), ti, -(-t // tj), tj).any(axis=(1, 3)).sum())


def _plan(capsys, spec, *argv) -> dict:
    assert main(["plan", str(spec), *argv, "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    return report


def test_causal_visits_exactly_the_non_empty_blocks(tmp_path, capsys):
    """Ragged S = 1000 with query blocks of 128 and key blocks of 256, two heads."""
    spec = tmp_path / "causal.spk"
    spec.write_text((SPECS / "causal_attention.spk").read_text().replace("i = 512, j = 512", "i = 128, j = 256"))
    report = _plan(capsys, spec, "--pattern", "tril", "--shape", "B=1,H=2,S=1000")
    i, j = np.arange(1000)[:, None], np.arange(1000)[None, :]
    expected = 2 * _blocks(i >= j, 128, 256)
    assert expected == 2 * (1 + 1 + 2 + 2 + 3 + 3 + 4 + 4)  # row block r reaches key blocks up to r // 2
    assert report["block_products"] == expected
    assert report["grid"] == [1, 2, expected // 2] and report["grid_steps"] == expected  # one step per visited block
    assert report["dense_block_products"] == 2 * 8 * 4
    # q is copied once per row block, the outputs written once per row block: o and lse (a call
    # with no gradient, as plan walks it, writes no residual logsumexp).
    assert report["copies"]["q[b, h, i, d]"] == 2 * 8 and report["write_backs"] == 2 * 2 * 8
    assert report["wasted_copies"] == 0
    assert report["flops"] == expected * 2 * 128 * 256 * (128 + 128)
    assert report["estimate"]["v5e"]["speedup"] > 1
    assert "sizes only" in report["notes"][0]


@pytest.mark.parametrize(("spec", "pattern", "shape"), [
    ("masked_attention.spk", "band=200", "H=2,S=1024,T=1024"),
    ("document_attention.spk", "band=300", "B=2,H=1,S=1000"),
])
def test_pattern_gives_the_condition_its_data(capsys, spec, pattern, shape):
    """A mask from the pattern (masked_attention), segment ids (document_attention: band=W
    is documents of W positions); a traced condition's grid runs the steps the data needs,
    the visited blocks are the brute force's."""
    report = _plan(capsys, SPECS / spec, "--pattern", pattern, "--shape", shape)
    sizes = report["shapes"]
    i, j = np.arange(sizes["S"])[:, None], np.arange(sizes.get("T", sizes["S"]))[None, :]
    if spec.startswith("masked"):
        present, lead, ti, tj = np.abs(i - j) < 200, 2, 128, 128
    else:
        present, lead, ti, tj = (i // 300 == j // 300) & (i >= j), 2, 256, 256
    assert report["block_products"] == lead * _blocks(present, ti, tj)
    # The grid runs the steps the data needs (a traced extent): each row block its non-empty
    # key blocks, or one step; the tables keep the dense count.
    rows, cols = -(-present.shape[0] // ti), -(-present.shape[1] // tj)
    padded = np.zeros((rows * ti, cols * tj), bool)
    padded[: present.shape[0], : present.shape[1]] = present
    per_row = padded.reshape(rows, ti, cols, tj).any(axis=(1, 3)).sum(axis=1)
    assert report["grid_steps"] == lead * int(np.maximum(per_row, 1).sum())
    assert report["dense_block_products"] == lead * rows * cols
    assert report["wasted_copies"] == 0
    assert "max_steps=" in report["notes"][0]


def test_segment_ids_from_patterns(tmp_path):
    assert segment_ids(parse_pattern("tril"), "seg", (2, 5), 2, 0).tolist() == [[0] * 5] * 2
    assert segment_ids(parse_pattern("band=2"), "seg", (1, 5), 2, 0).tolist() == [[0, 0, 1, 1, 2]]
    assert segment_ids(parse_pattern("density=1"), "seg", (6,), 2, 0).tolist() == [0] * 6
    assert segment_ids(parse_pattern("density=0"), "seg", (6,), 2, 0).tolist() == [0, 0, 1, 1, 2, 2]
    np.save(tmp_path / "ids.npy", np.array([0, 0, 3, 3]))
    assert segment_ids(parse_pattern(str(tmp_path / "ids.npy")), "seg", (2, 4), 2, 0).tolist() == [[0, 0, 3, 3]] * 2
    np.save(tmp_path / "float.npy", np.zeros(4))
    with pytest.raises(PatternError, match="'seg' takes integer ids"):
        segment_ids(parse_pattern(str(tmp_path / "float.npy")), "seg", (4,), 2, 0)
    with pytest.raises(PatternError, match=r"ids of shape \(2, 5\) or \(5,\)"):
        segment_ids(parse_pattern(str(tmp_path / "ids.npy")), "seg", (2, 5), 2, 0)


def test_bad_ids_file_is_a_usage_error(tmp_path, capsys):
    np.save(tmp_path / "ids.npy", np.zeros(3, np.int32))
    assert main(["plan", str(SPECS / "document_attention.spk"), "--pattern", str(tmp_path / "ids.npy"), "--shape", "B=1,H=1,S=512"]) == 2
    err = capsys.readouterr().err
    assert "sparsegen plan: pattern file" in err and "'seg' takes ids of shape (1, 512) or (512,)" in err


def test_png_is_refused_for_attention(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["plan", str(SPECS / "causal_attention.spk"), "--pattern", "tril", "--png", str(tmp_path / "x.png")]) == 2
    assert "is attention-like" in capsys.readouterr().err


@pytest.mark.parametrize(("spec", "tiles", "shape", "pattern"), [
    ("document_attention.spk", {"i": 128, "j": 256}, dict(B=2, H=1, S=1000), "band=300"),
    ("document_attention.spk", {"i": 256, "j": 128}, dict(B=1, H=2, S=768), "density=0.3"),
    ("masked_attention.spk", {"i": 128, "j": 128}, dict(H=2, S=512, T=640), "tril"),
    ("masked_softmax.spk", {"i": 64, "j": 128}, dict(S=300, T=512), "density=0.2"),
    ("causal_attention.spk", {"i": 128, "j": 256}, dict(B=1, H=2, S=1000), "tril"),
])
def test_the_walk_on_numpy_is_the_walk_on_jax(monkeypatch, spec, tiles, shape, pattern):
    """The simulator runs the generated wrapper, without its backward, with numpy for `jnp`
    and `lax` (no XLA compile per operation and shape: variants of a data-dependent walk took
    seconds each), classifying once per set of arguments; its report is the one running the
    whole module on jax gives, classifying at every call, grid extent, tables and notes
    included."""
    from sparsegen.compiler import lower_source
    from sparsegen.source import SourceFile
    from sparsegen.tpu.attention import simulate as walk

    from sparsegen.variants import default_sizes, expand

    (plan,) = lower_source(SourceFile(spec, (SPECS / spec).read_text()))
    options = {k: [v] for k, v in tiles.items()}
    (variant,) = expand(plan.kernel, spec, options)
    (plan,) = lower_source(variant.source)
    shape = {**default_sizes(plan.kernel, options), **shape}
    on_numpy = walk.analyse_attention(plan, shape, pattern).to_json()
    monkeypatch.setattr(walk, "_host", lambda module: module)  # the generated module as written: jax
    monkeypatch.setattr(walk, "_forward_only", lambda plan: plan)  # and all of it
    monkeypatch.setattr(walk, "_once", lambda classify, found: classify)  # classifying at every call
    on_jax = walk.analyse_attention(plan, shape, pattern).to_json()
    assert on_numpy == on_jax
    assert on_numpy["grid_steps"] < on_numpy["dense_block_products"] or spec == "masked_softmax.spk"
