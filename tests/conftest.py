"""Suite-wide pytest hooks: time per test file (CI keeps an eye on the 30-minute budget)."""

from __future__ import annotations

from collections import defaultdict

_FILE_SECONDS: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _FILE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    terminalreporter.write_sep("=", "time per test file")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
