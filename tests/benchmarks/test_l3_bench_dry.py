"""benchmarks/l3_bench.py end to end at tiny sizes on CPU (the H200 run has little device time to spare).

One store case and one TTFT case, file backend only (no Mooncake processes): the script's
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
    (ttft,) = report["ttft"]
    assert ttft["cold"]["hits"]["computed"] == 129
    for case in ("file_warm", "file_cold"):
        r = ttft[case]
        assert r["hits"] == {"device": 0, "host": 0, "l3": 128, "computed": 1}
        assert r["max_abs_diff_vs_cold"] <= 1e-5 and r["fetch_s"] > 0 and r["load_back_s"] > 0
