"""The bad-spec corpus: one file per diagnostic, each checked for LINE:COL and message.

Each file in tests/bad/ starts with `# expect: LINE:COL: MESSAGE-FRAGMENT`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sparsegen.compiler import compile_file
from sparsegen.source import SpecError

BAD = sorted((Path(__file__).parent / "bad").glob("*.spk"))


def expectation(path: Path) -> tuple[str, str]:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), path
    where, message = first[len("# expect: ") :].split(": ", 1)
    return where, message


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_spec_is_reported_at_its_token(path):
    where, message = expectation(path)
    with pytest.raises(SpecError) as info:
        compile_file(path)
    report = info.value.render()
    head = report.splitlines()[0]
    assert head.startswith(f"{path}:{where}: error: "), report
    assert message in head, report
    # The source line and a caret under the offending column follow.
    line, col = map(int, where.split(":"))
    lines = report.splitlines()
    if path.read_text().splitlines() and line <= len(path.read_text().splitlines()):
        assert lines[1] == "    " + path.read_text().splitlines()[line - 1].expandtabs(4)
        assert lines[2].index("^") == 4 + col - 1


def test_corpus_covers_every_check():
    """One file per diagnostic: the corpus grows with the checker."""
    assert len(BAD) >= 60
    messages = [expectation(p)[1] for p in BAD]
    assert len(set(messages)) == len(messages), "two corpus files test the same message"


def test_all_problems_of_a_file_are_reported_together(tmp_path):
    spec = tmp_path / "two.spk"
    spec.write_text("kernel a {\n    in  x: f64[M]\n    out o: f32[M]\n    o[i] = x[i]\n    tile i = 128\n}\n"
                    "kernel b {\n    in  x: f32[1000]\n    out o: f32[1000]\n    o[i] = x[i]\n    tile i = 300\n}\n")
    with pytest.raises(SpecError) as info:
        compile_file(spec)
    heads = [line for line in info.value.render().splitlines() if ": error: " in line]
    assert [h.split(": error: ")[0] for h in heads] == [f"{spec}:2:12", f"{spec}:11:14"]


def test_not_utf8_is_an_error_at_its_byte(tmp_path):
    spec = tmp_path / "latin1.spk"
    spec.write_bytes(b"kernel k {\n    in  x: f32[M] # caf\xe9\n}\n")
    with pytest.raises(SpecError) as info:
        compile_file(spec)
    assert info.value.render().startswith(f"{spec}:2:24: error: file is not UTF-8 text (invalid byte 0xe9)")


@pytest.mark.parametrize("newline", ["\r", "\r\n"], ids=["cr", "crlf"])
def test_cr_and_crlf_line_endings_are_newlines(tmp_path, newline):
    """A spec saved with classic Mac (\r) or Windows (\r\n) line endings builds the same
    module as with \n, and its problems are reported at the same LINE:COL with their line."""
    from sparsegen.compiler import compile_source
    from sparsegen.source import SourceFile

    good = Path(__file__).parents[1] / "specs" / "dsd_matmul.spk"
    converted = tmp_path / "dsd_matmul.spk"
    converted.write_bytes(good.read_bytes().replace(b"\n", newline.encode()))
    (expected,) = compile_source(SourceFile("dsd_matmul.spk", good.read_text()))
    (module,) = compile_file(converted, origin="dsd_matmul.spk")
    assert module.code == expected.code
    bad = Path(__file__).parent / "bad" / "tile_zero.spk"
    where, message = expectation(bad)
    spec = tmp_path / "tile_zero.spk"
    spec.write_bytes(bad.read_bytes().replace(b"\n", newline.encode()))
    with pytest.raises(SpecError) as info:
        compile_file(spec)
    report = info.value.render().splitlines()
    assert report[0].startswith(f"{spec}:{where}: error: ") and message in report[0], report
    line, col = map(int, where.split(":"))
    assert report[1] == "    " + bad.read_text().splitlines()[line - 1] and report[2].index("^") == 4 + col - 1


def test_binary_file_is_an_error(tmp_path):
    spec = tmp_path / "binary.spk"
    spec.write_bytes(b"kernel\x00k {}")
    with pytest.raises(SpecError) as info:
        compile_file(spec)
    assert "file is not text" in info.value.render()


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(SpecError) as info:
        compile_file(tmp_path / "nope.spk")
    assert info.value.render().startswith(f"{tmp_path / 'nope.spk'}: error: cannot read file")


def test_int8_matmul_is_rejected_on_v4_only(tmp_path):
    spec = tmp_path / "int8.spk"
    spec.write_text(
        "kernel q {\n    in  x: i8[M, K]\n    in  y: i8[K, N]\n    out o: i32[M, N]\n"
        "    o[m, n] = x[m, k] * y[k, n]\n    tile m = 128, n = 128, k = 128\n}\n"
    )
    compile_file(spec, "v5e")
    with pytest.raises(SpecError) as info:
        compile_file(spec, "v4")
    assert info.value.render().startswith(f"{spec}:2:12: error: v4 has no int8 matmul: 'x' is i8")


def test_an_error_in_a_scores_where_is_reported_once():
    """The score's statement failing does not make every later read of it "not declared"."""
    path = Path(__file__).parent / "bad" / "attention_where_unknown_name.spk"
    with pytest.raises(SpecError) as info:
        compile_file(path)
    assert len(info.value.diagnostics) == 1, info.value.render()


@pytest.mark.parametrize("name", ["condition_misspelt_operand", "condition_misread_operand"])
def test_a_misread_operand_in_a_where_is_the_only_error(name):
    """A `where` that misspells (or misreads) the operand it meant is the one error reported:
    not also, nor instead, that operand's shape or that it is never used (both consequences)."""
    path = Path(__file__).parent / "bad" / f"{name}.spk"
    with pytest.raises(SpecError) as info:
        compile_file(path)
    heads = [line for line in info.value.render().splitlines() if ": error: " in line]
    assert heads == [f"{path}:{expectation(path)[0]}: error: " + heads[0].split(": error: ", 1)[1]] and len(heads) == 1
