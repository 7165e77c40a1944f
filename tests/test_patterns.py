"""Patterns for `plan --pattern` and `variants`: every bad one is a PatternError naming the
file or value, reported by the CLI before any simulation (exit 2, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, SPECS

from sparsegen.cli import main
from sparsegen.patterns import PatternError, parse_pattern


def bad_files(folder):
    """{name: what the message must say} for files that are not usable patterns."""
    (folder / "dir.npy").mkdir()
    (folder / "text.npy").write_text("1 0\n0 1\n")
    (folder / "empty.npy").write_bytes(b"")
    np.savez(folder / "archive.npz", a=np.eye(8))
    (folder / "archive.npz").rename(folder / "renamed.npy")
    np.save(folder / "strings.npy", np.array([["1", "0"], ["0", "1"]]))
    np.save(folder / "objects.npy", np.array([[None, 1], [1, None]], dtype=object), allow_pickle=True)
    np.save(folder / "complex.npy", np.eye(8, dtype=complex))
    np.save(folder / "ok.npy", np.eye(8))
    (folder / "truncated.npy").write_bytes((folder / "ok.npy").read_bytes()[:140])
    (folder / "mask.txt").write_text("1 0\n")
    return {
        "missing.npy": "does not exist",
        "dir.npy": "is a directory",
        "text.npy": "is not a .npy array (numpy.save format)",
        "empty.npy": "is not a .npy array (numpy.save format)",
        "renamed.npy": "is an .npz archive (numpy.savez), not a .npy array",
        "strings.npy": "holds strings (dtype <U1); expected bool or numbers",
        "objects.npy": "holds Python objects (dtype object); expected bool or numbers",
        "complex.npy": "holds complex128 values; expected bool or numbers",
        "truncated.npy": "is not a readable .npy array",
        "mask.txt": "is not a .npy file: save the pattern with numpy.save",
    }


BAD_VALUES = {
    "density=2": "density=2: the fraction of blocks must be a number from 0 to 1",
    "density=-0.1": "density=-0.1: the fraction of blocks must be a number from 0 to 1",
    "density=abc": "density=abc: the fraction of blocks must be a number from 0 to 1",
    "density=nan": "density=nan: the fraction of blocks must be a number from 0 to 1",
    "density=": "density=: the fraction of blocks must be a number from 0 to 1",
    "band=-5": "band=-5: the band's width must be a whole number of elements, at least 1",
    "band=0": "band=0: the band's width must be a whole number of elements, at least 1",
    "band=1.5": "band=1.5: the band's width must be a whole number of elements, at least 1",
    "band=x": "band=x: the band's width must be a whole number of elements, at least 1",
    "zigzag": "unknown pattern 'zigzag': use tril, density=F, band=W or FILE.npy",
}


def test_bad_patterns_are_pattern_errors_naming_the_file_or_value(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, says in bad_files(tmp_path).items():
        with pytest.raises(PatternError) as caught:
            parse_pattern(name)
        assert str(caught.value).startswith(f"pattern file {name} ") and says in str(caught.value), (
            name,
            str(caught.value),
        )
    for value, says in BAD_VALUES.items():
        with pytest.raises(PatternError, match="^" + says.replace(".", r"\.") + "$"):
            parse_pattern(value)
    assert issubclass(PatternError, ValueError)


def test_good_patterns_parse(tmp_path):
    np.save(tmp_path / "ok.npy", np.eye(8, dtype=bool))
    assert parse_pattern(str(tmp_path / "ok.npy")).data.shape == (8, 8)
    assert parse_pattern("density=0").value == 0 and parse_pattern("density=1.0").value == 1
    assert parse_pattern("band=1").value == 1 and parse_pattern("tril").kind == "tril"


def test_plan_rejects_bad_patterns_up_front(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cases = {name: f"sparsegen plan: pattern file {name} " for name in bad_files(tmp_path)}
    cases.update({value: f"sparsegen plan: {says}" for value, says in BAD_VALUES.items()})
    for pattern, says in cases.items():
        assert main(["plan", str(SPECS / "dsd_matmul.spk"), "--pattern", pattern]) == 2, pattern
        err = capsys.readouterr().err
        assert err.startswith(says) and err.count("\n") == 1, (pattern, err)


def test_bad_pattern_is_reported_before_jax_loads(tmp_path):
    """Through a real process: no traceback, exit 2, and nothing simulated (jax never imported)."""
    code = (
        "import sys\n"
        "from sparsegen.cli import main\n"
        f"rc = main(['plan', {str(SPECS / 'dsd_matmul.spk')!r}, '--pattern', {str(tmp_path / 'missing.npy')!r}])\n"
        "assert 'jax' not in sys.modules, 'jax was imported'\n"
        "sys.exit(rc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"sparsegen plan: pattern file {tmp_path / 'missing.npy'} does not exist\n"


def test_variants_rejects_a_bad_pattern_up_front(capsys):
    argv = ["variants", str(SPECS / "dsd_matmul.spk"), "--tile", "n=256,512", "--pattern", "band=0", "--no-compile"]
    assert main(argv) == 2
    assert (
        capsys.readouterr().err
        == "sparsegen variants: band=0: the band's width must be a whole number of elements, at least 1\n"
    )


def test_a_file_of_the_wrong_shape_is_named(tmp_path, capsys):
    np.save(tmp_path / "small.npy", np.eye(3))
    assert main(["plan", str(SPECS / "dsd_matmul.spk"), "--pattern", str(tmp_path / "small.npy")]) == 2
    assert f"pattern file {tmp_path / 'small.npy'} has shape (3, 3)" in capsys.readouterr().err
