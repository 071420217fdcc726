"""``benchmarks/serve_bench.py --idle-only`` on CPU at tiny sizes: the idle phase runs and its report holds together.

A subprocess, as ``cpgraph serve`` would run: its own server thread, event loop and lean client process.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_idle_phase_reports_each_clients_overheads(tmp_path):
    out = tmp_path / "serve.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_bench.py"), "--device", "cpu", "--model", "tiny",
           "--system-len", "32", "64", "--suffix-len", "8", "32", "--requests", "8", "--token-budget", "256",
           "--threads", "1", "--idle", "4", "--idle-only", "--out", str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    idle = json.loads(out.read_text())["idle"]
    assert idle["requests"] == 4 and len(idle["forward_ms"]) == 4 * 2  # two HTTP clients a round in-process
    for kind in ("aiohttp", "lean", "remote"):
        k = idle[kind]
        assert all(math.isfinite(v) for v in k.values()), k
        assert k["http_overhead_ms_p50"] > 0 and k["http_floor_ms_p50"] > 0 and k["unloaded_ttft_ms_p50"] > 0
        # against direct calls = the server's overhead less the direct calls' own (medians of the same run)
        assert k["overhead_vs_direct_ms_p50"] == pytest.approx(
            k["server_overhead_ms_p50"] - idle["direct_scheduling_overhead_ms_p50"], abs=1e-9)
        assert f"against direct engine calls: {k['overhead_vs_direct_ms_p50']:.3f} ms" in proc.stdout
        # and against a caller that steps the engine itself (the stricter base: no thread hand-off)
        assert k["overhead_vs_caller_steps_ms_p50"] == pytest.approx(
            k["server_overhead_ms_p50"] - idle["caller_steps_scheduling_overhead_ms_p50"], abs=1e-9)
    assert 0 < idle["caller_steps_scheduling_overhead_ms_p50"] < 1e3


@pytest.mark.slow
def test_a_rate_over_several_arrival_draws_pools_its_ttfts(tmp_path):
    """``--rate-seeds``: the 0.8 x phase over three Poisson draws; the pooled p99 is the p99 of every draw's TTFTs,
    and the pooled ratio divides it by the unloaded p99."""
    import numpy as np

    out = tmp_path / "serve.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_bench.py"), "--device", "cpu", "--model", "tiny",
           "--system-len", "32", "64", "--suffix-len", "8", "32", "--requests", "8", "--token-budget", "128",
           "--threads", "1", "--idle", "2", "--rates", "0.8", "--rate-seeds", "3", "--model-budgets", "128",
           "--out", str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    (r,) = report["rates"]
    assert len(r["draws"]) == 3 and r["pooled"]["requests"] == 24
    assert r["draws"][0]["ttft_ms"] == r["ttft_ms"]  # the first draw is the phase's own line
    assert len({tuple(d["ttft_ms"]) for d in r["draws"]}) == 3  # three draws, not one counted thrice
    for d in r["draws"]:
        assert len(d["ttft_ms"]) == 8 and d["ttft_ms_p99"] == pytest.approx(np.percentile(d["ttft_ms"], 99))
    pooled = np.percentile([t for d in r["draws"] for t in d["ttft_ms"]], 99)
    assert r["pooled"]["ttft_ms_p99"] == pytest.approx(pooled)
    unloaded = report["idle"]["unloaded_ttft_ms_p99"]
    assert report["p99_at_0.8_over_unloaded_p99_pooled"] == pytest.approx(r["pooled"]["ttft_ms_p99"] / unloaded)
    assert len(report["p99_at_0.8_over_unloaded_p99_per_draw"]) == 3
    assert "over 3 arrival draws: pooled" in proc.stdout


def test_queueing_model_alone_from_a_given_step_cost(tmp_path):
    """``--model-cost``: only the queueing model, no model or server; the budgets asked for, in order, and a larger
    budget never saturates lower when every step pays a fixed cost (more tokens share each step's fixed part)."""
    out = tmp_path / "qm.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_bench.py"), "--model-cost", "9.6", "0.0059",
           "--requests", "24", "--page", "64", "--token-budget", "4096", "--model-budgets", "8192", "1024", "4096",
           "--out", str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    qm = json.loads(out.read_text())["queueing_model"]
    assert qm["step_ms"] == {"fixed": 9.6, "per_token": 0.0059}
    assert list(qm["budgets"]) == ["1024", "4096", "8192"]
    sat = [qm["budgets"][b]["saturation_rps"] for b in ("1024", "4096", "8192")]
    assert sat == sorted(sat) and sat[0] < sat[-1], sat
    for v in qm["budgets"].values():
        assert v["p99_over_unloaded_p10"] <= v["p99_over_unloaded_p50"] <= v["p99_over_unloaded_p90"]
    assert "budget 4096:" in proc.stdout and "ideal FIFO server" in proc.stdout
    bad = subprocess.run(cmd[:2] + ["--model-cost", "0", "0"], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--model-cost takes FIXED_MS >= 0" in bad.stderr
