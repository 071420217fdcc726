"""Running a benchmark script on CPU at tiny sizes, for the ``tests/benchmarks/*_dry.py`` tests.

A subprocess under ``TRITON_INTERPRET=1``: Triton picks interpreter or compiler when a kernel module is
imported, so an in-process run would depend on what the suite imported first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, json_path: Path, *args: str) -> tuple[dict, str]:
    """``benchmarks/<script> --json json_path *args`` on the interpreter: ``(the JSON report, stdout)``."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(json_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(json_path.read_text()), proc.stdout


def assert_peer_rates(case: dict) -> None:
    """Every peer of a ``peer_rates`` case was timed, and its GB/s is the case's bytes over its time."""
    for r in case["results"].values():
        assert r["ms"] > 0 and r["gbs"] == pytest.approx(case["bytes"] / r["ms"] / 1e6)
