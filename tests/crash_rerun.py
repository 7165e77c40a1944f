"""A test whose worker process dies (a segfault, an abort) runs once more, in a new worker.

Twice in four full runs of the suite, a test worker died in XLA:CPU's compiler
(`backend_compile_and_load`, a segfault), each time in a test that passes alone and with its
whole file (tests/test_paged.py, tests/test_nonfinite.py): one crash failed the whole CI run.
pytest-xdist asks this hook what to do with the test a dead worker was running; we run it
once more in a fresh worker. Only a crash is run again (a test that fails is never rerun),
and only once: a test that crashes twice fails. Every rerun is listed at the end of the
run ("R" in the progress line, "N rerun" in the summary), so a crash is never hidden.
"""

from __future__ import annotations

import pytest

_crashed: set[str] = set()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    if crashitem in _crashed:
        return
    _crashed.add(crashitem)
    sched.mark_test_pending(crashitem)
    report.outcome = "rerun"
    report.longrepr = f"{report.longrepr}; run again once, in a new worker"


def pytest_report_teststatus(report, config):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})


def pytest_terminal_summary(terminalreporter):
    reruns = terminalreporter.stats.get("rerun", [])
    if reruns:
        terminalreporter.section("tests whose worker crashed, run again", sep="-", yellow=True)
        for rep in reruns:
            terminalreporter.line(f"RERUN {rep.nodeid}: {rep.longrepr}")
