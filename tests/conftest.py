"""Suite-wide pytest hooks: the suite's thread count, and time per test file (CI keeps an eye on its budget).

``CPGRAPH_TEST_THREADS=N`` runs the pytest process and every spawned gloo
rank (``tests/dist_utils.py``) at ``N`` threads; unset, the pytest process
keeps the machine's default and ranks use 1.

A test marked ``bitexact`` compares two differently shaped runs bit for bit
(CP ranks against one device, a cache hit against a cold run): it runs in
this process with fixed-order matrix products (``tests/row_invariant.py``),
and the jobs it sends to spawned ranks enter them there.  CI re-runs these
tests at 4 and at 1 thread: such an assertion must hold by construction at
any thread count (docs/bitwise.md).
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_utils import THREADS_ENV, rank_threads, suite_threads  # noqa: E402

import pytest  # noqa: E402

_FILE_SECONDS: dict[str, float] = defaultdict(float)


def pytest_configure(config):
    threads = suite_threads()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for the subprocesses tests start


def pytest_report_header(config):
    import torch

    return f"threads: {torch.get_num_threads()} in this process, {rank_threads()} per spawned rank ({THREADS_ENV})"


@pytest.fixture(autouse=True)
def _bitexact_products(request):
    """``bitexact`` tests compute their matrix products in a fixed order (row- and thread-invariant)."""
    if request.node.get_closest_marker("bitexact") is None:
        yield
        return
    from row_invariant import row_invariant_matmul

    with row_invariant_matmul(expect_products=False):  # a CP test's products run in its ranks
        yield


def pytest_runtest_logreport(report):
    _FILE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    terminalreporter.write_sep("=", "time per test file")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
