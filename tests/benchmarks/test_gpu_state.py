"""benchmarks/gpu_state.py: the clock windows' summaries, and a clean refusal where NVML is absent."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_state  # noqa: E402


def test_reason_bits_name_every_documented_reason_and_keep_unknown_bits():
    assert gpu_state.reason_names(0) == []
    assert gpu_state.reason_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert gpu_state.reason_names(0x1 | 0x1000) == ["gpu_idle", "0x1000"]


def test_window_summarises_only_its_samples():
    fed = iter([(1.0, 1980, 3201, 500.0, 50, 0), (2.0, 1755, 3201, 690.0, 61, 0x4), (3.0, 1650, 3201, 700.0, 63, 0x4),
                (9.0, 345, 3201, 90.0, 40, 0x1)])
    state = gpu_state.GpuState(lambda: next(fed))
    state.samples = list(fed)
    w = state.window(1.5, 3.5)
    assert w["samples"] == 2 and w["sm_mhz"] == {"median": 1702.5, "min": 1650, "max": 1755}
    assert w["power_w"]["max"] == 700.0 and w["temp_c"] == 63 and w["throttle"] == {"sw_power_cap": 1.0}
    assert gpu_state.describe(w) == "SM 1702 MHz (1650-1755), 695 W, 63 C, sw_power_cap 100%"
    assert state.window(4.0, 8.0) is None and gpu_state.describe(None) == "no clock samples"
    idle = state.window(0.0, 10.0)
    assert idle["throttle"] == {"sw_power_cap": 0.5, "gpu_idle": 0.25}
    assert gpu_state.describe(state.window(8.5, 9.5)).endswith(", no throttle reason")  # idle is not a hold-down


def test_sampler_thread_polls_until_stopped_and_survives_a_failing_read():
    n = {"calls": 0}

    def read():
        n["calls"] += 1
        if n["calls"] > 3:
            raise OSError("device lost")
        return (time.perf_counter(), 1980, 3201, 100.0, 40, 0)

    state = gpu_state.GpuState(read, period_s=0.001)
    state._thread = __import__("threading").Thread(target=state._poll, daemon=True)
    state._thread.start()
    state._thread.join(timeout=5)
    assert len(state.samples) == 3 and state.why == "NVML read failed: device lost"
    state.stop()


def test_start_without_nvml_says_why(monkeypatch):
    monkeypatch.setenv("CPGRAPH_BENCH_NO_NVML", "1")
    state = gpu_state.GpuState.start(0)
    assert not state.available and state.why == "CPGRAPH_BENCH_NO_NVML is set"
    assert state.window(0, 1e12) is None
    state.stop()
    monkeypatch.delenv("CPGRAPH_BENCH_NO_NVML")
    state = gpu_state.GpuState.start(0)  # this CPU machine has no driver: a reason, never an exception
    try:
        if state.available:
            pytest.skip("this machine has NVML")
        assert state.why.startswith("no NVML (")
    finally:
        state.stop()
