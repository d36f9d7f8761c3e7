"""pytest-xdist hooks (imported by conftest.py): a test whose worker process died runs once more on
the replacement worker; a second crash fails it. The terminal summary lists every crash, so a
re-run is never silent."""
import pytest

MAX_RERUNS = 1  # a second crash of the same test fails it
_crashes: dict[str, int] = {}


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    _crashes[crashitem] = _crashes.get(crashitem, 0) + 1
    if _crashes[crashitem] <= MAX_RERUNS:
        sched.mark_test_pending(crashitem)  # worksteal and load support this; loadfile does not
        report.outcome = "rerun"


def pytest_terminal_summary(terminalreporter):
    if not _crashes:
        return
    terminalreporter.write_sep("=", "worker crashes")
    for nodeid, count in _crashes.items():
        verdict = "re-run" if count <= MAX_RERUNS else f"failed after {count} crashes"
        terminalreporter.write_line(f"{nodeid}: its worker died ({verdict})")
