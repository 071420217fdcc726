"""benchmarks/l3_bench.py end to end at tiny sizes on CPU (the H200 run has little device time to spare).

One store case, one fetch case and one TTFT case, file backend only (no Mooncake processes): the script's
JSON must hold every figure it prints, the restored prefix must be a full L3 hit, and the
restored logits must match the cold pass's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import l3_bench  # noqa: E402


def test_dry_run(tmp_path, monkeypatch):
    out = tmp_path / "l3.json"
    monkeypatch.setattr(sys, "argv", ["l3_bench.py", "--tokens", "256", "--ttft-tokens", "128", "--page", "16",
                                      "--reps", "1", "--no-mooncake", "--dir", str(tmp_path / "d"),
                                      "--json", str(out)])
    assert l3_bench.main() == 0
    report = json.loads(out.read_text())
    (store,) = report["store"]
    assert store["pages"] == 16 and store["page_bytes"] > 0
    assert all(store[k] > 0 for k in ("file_write_gbps", "file_warm_gbps", "file_cold_gbps"))
    (fetch,) = report["fetch"]
    _check_fetch(fetch, 16, None)
    (ttft,) = report["ttft"]
    assert ttft["cold"]["hits"]["computed"] == 129
    for case in ("file_warm", "file_cold"):
        r = ttft[case]
        assert r["hits"] == {"device": 0, "host": 0, "l3": 128, "computed": 1}
        assert r["max_abs_diff_vs_cold"] <= 1e-5 and r["fetch_s"] > 0 and r["load_back_s"] > 0


def _check_fetch(case, pages: int, parts: int | None):
    assert case["pages"] == pages and case["page_bytes"] > 0
    assert parts is None or case["parts_per_page"] == parts
    for name in ("get_iso", "get_l2", "fetch", "fetch_touch", "load_back"):
        assert case[f"{name}_ms"] > 0 and case[f"{name}_cpu_ms"] >= 0 and case[f"{name}_gbps"] > 0
        assert len(case[f"{name}_samples_ms"]) == case["reps"]
    assert "overhead_us_per_page" in case and "overhead_cpu_us_per_page" in case


def test_fetch_only_production_shaped_builds_no_weights(tmp_path, monkeypatch):
    """``--fetch-only``: the fetch section alone, at production-shaped page sizes, with no model built."""
    import production_shape

    def no_weights(*a, **k):
        raise AssertionError("--fetch-only must not build the model")

    monkeypatch.setattr(production_shape, "build_random_model", no_weights)
    out = tmp_path / "fetch.json"
    monkeypatch.setattr(sys, "argv", ["l3_bench.py", "--fetch-only", "--model", "production-shaped", "--tokens", "256",
                                      "--page", "16", "--reps", "2", "--dir", str(tmp_path / "d"), "--json", str(out)])
    assert l3_bench.main() == 0
    report = json.loads(out.read_text())
    assert report["store"] == [] and report["ttft"] == []
    (case,) = report["fetch"]
    _check_fetch(case, 16, 4)  # two layers: MLA records and index-K pages of each
    assert case["page_bytes"] == 2 * 16 * (512 + 64) * 2 + 2 * 16 * 128 * 2  # bf16 records + index-K, 16 tokens
