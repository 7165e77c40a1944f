"""tests/crash_rerun.py: a test whose worker dies runs once more; a failure is never rerun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SUITE = '''
import os, pathlib

def test_dies_the_first_time(tmp_path_factory):
    mark = pathlib.Path(os.environ["CRASH_MARK"])
    if not mark.exists():
        mark.write_text("crashed once")
        os.abort()

def test_dies_every_time():
    if os.environ.get("CRASH_ALWAYS"):
        os.abort()

def test_fails():
    if os.environ.get("FAIL_ONCE_MARK"):
        mark = pathlib.Path(os.environ["FAIL_ONCE_MARK"])
        runs = int(mark.read_text()) if mark.exists() else 0
        mark.write_text(str(runs + 1))
        assert False, "an ordinary failure"
'''


def run(tmp_path, tests, **env):
    (tmp_path / "test_suite.py").write_text(SUITE)
    full = {**os.environ, "PYTHONPATH": str(HERE), "CRASH_MARK": str(tmp_path / "mark"), **env}
    return subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "crash_rerun", "-p", "no:cacheprovider",
                           "-q", *tests], cwd=tmp_path, env=full, capture_output=True, text=True, timeout=120)


def test_a_test_whose_worker_dies_once_passes_on_its_rerun_and_is_listed(tmp_path):
    out = run(tmp_path, ["test_suite.py::test_dies_the_first_time", "test_suite.py::test_dies_every_time"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 rerun" in out.stdout and "RERUN test_suite.py::test_dies_the_first_time" in out.stdout, out.stdout


def test_a_test_whose_worker_dies_twice_fails(tmp_path):
    out = run(tmp_path, ["test_suite.py::test_dies_every_time"], CRASH_ALWAYS="1")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 failed" in out.stdout and "1 rerun" in out.stdout, out.stdout


def test_an_ordinary_failure_is_not_rerun(tmp_path):
    mark = tmp_path / "fails"
    out = run(tmp_path, ["test_suite.py::test_fails"], FAIL_ONCE_MARK=str(mark))
    assert out.returncode == 1 and "1 failed" in out.stdout and "rerun" not in out.stdout, out.stdout
    assert mark.read_text() == "1"
