"""``benchmarks/sass_loops.py`` on a CPU machine: the selection kernel compiles for sm_90 and its loops are counted.

It runs in a subprocess: the script turns the interpreter off for itself (it compiles, never launches), and
a kernel module imported by the suite under ``TRITON_INTERPRET=1`` would stay interpreted in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _loops(tmp_path, *flags: str) -> dict:
    out = tmp_path / "loops.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_loops.py"), "--json", str(out), *flags],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "_select_kernel sm_90" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.slow
def test_counts_each_variants_loops(tmp_path):
    """Both window-pass forms and both list-walk forms compile for sm_90 and their loops are found, each named by its
    source line; the float pass's window loop (the one that loads the window and stores to the list, several keys a
    thread) holds no shared-memory moves, which is what its one-key-a-thread steps are for, and neither do the list
    walks of ``--list-step`` (the refinement's histogram passes with their copy, the collection)."""
    def window_loop(report):
        # the window pass: the loop with the most global stores among those that also load
        return max((lp for lp in report["loops"] if lp["mix"].get("LDG") and lp["mix"].get("STG")),
                   key=lambda lp: (lp["mix"]["STG"], lp["instructions"]))

    def loop_in(report, function):
        found = [lp for lp in report["loops"] if lp.get("at", "").startswith(function + ":")]
        assert found, [lp.get("at") for lp in report["loops"]]
        return max(found, key=lambda lp: lp["instructions"])

    ranks = _loops(tmp_path, "--block", "128", "--warps", "1", "--no-float-pass", "--no-list-step")
    floats = _loops(tmp_path, "--block", "128", "--warps", "1", "--float-pass", "--no-list-step")
    steps = _loops(tmp_path, "--block", "128", "--warps", "1", "--no-float-pass", "--list-step")
    for report in (ranks, floats, steps):
        assert report["instructions"] > 100 and report["loops"] and report["registers"] > 0
        assert all(lp["instructions"] >= 1 and sum(lp["mix"].values()) == lp["instructions"] for lp in report["loops"])
        assert all(sk["instructions"] < lp["instructions"] for lp in report["loops"] for sk in lp["skips"])
    assert floats["variant"]["float_pass"] and not ranks["variant"]["float_pass"]
    assert steps["variant"]["list_step"] and not ranks["variant"]["list_step"]
    assert window_loop(ranks)["mix"].get("STS", 0) > 0  # the rank-bit pass moves values between layouts
    assert window_loop(floats)["mix"].get("STS", 0) == 0
    # The list's histogram loop (the larger of _digit_hist's two): its copy is a branch, and in the BLOCK form its
    # values move between layouts; one entry a thread, only the histogram's own counts go through shared memory
    # (one STS, ATOMS and LDS a round), and the collection none.
    assert loop_in(ranks, "_digit_hist")["skips"] and loop_in(steps, "_list_hist")["skips"]
    assert loop_in(ranks, "_digit_hist")["mix"].get("STS", 0) > 1
    for function in ("_list_hist", "_collect_list"):
        mix = loop_in(steps, function)["mix"]
        assert mix.get("STS", 0) <= 1 and mix.get("LDS", 0) <= 1, (function, mix)
