"""``benchmarks/invariant_gemm_bench.py`` end to end on CPU (interpreter, tiny shapes): it runs, checks, reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_dry_run_times_every_shape_and_a_swept_config(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import invariant_gemm_bench as bench

    out = tmp_path / "gemm.json"
    report = bench.main(["--device", "cpu", "--repeat", "1", "--tiles-f32", "32,32,16,4,1",
                         "--json", str(out)])
    assert json.loads(out.read_text())["rows_m"] == report["rows_m"] == 70
    names = [r["name"] for r in report["shapes"]]
    assert names == [n for n, _, _ in bench.TINY]
    for row in report["shapes"]:  # every config was checked against torch.mm and timed (no error entry)
        assert row["ours_ms"] > 0 and not any(k.startswith("error") for k in row), row
    f32 = next(r for r in report["shapes"] if r["name"].endswith("_f32"))
    assert f32["ms (32, 32, 16, 4, 1)"] > 0 and f32["default_tiles"] == [64, 64, 64, 4, 1]
    assert set(report["best_single_config"]) == {"bf16", "fp32"}
