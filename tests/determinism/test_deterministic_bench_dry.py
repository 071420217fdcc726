"""``benchmarks/production_shape.py --deterministic`` on CPU: the dry run of the mode the lead times on the H200.

Tiny sizes, ``aot_eager``: the figures mean nothing; what is checked is
that the deterministic compile is timed beside the default one on the same
batch, reported as a ratio with its logit difference and repeat bits, and
never taken as the case's best mode.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import production_shape as ps  # noqa: E402

pytestmark = pytest.mark.slow


def test_deterministic_mode_needs_the_compiled_one():
    assert "deterministic" in ps.parse_args(["--deterministic"]).modes_list
    with pytest.raises(SystemExit):
        ps.parse_args(["--modes", "graphed", "--deterministic"])


def test_dry_run_times_the_deterministic_compile_beside_the_default(tmp_path, capsys):
    out = tmp_path / "ps.json"
    assert ps.main(["--device", "cpu", "--variants", "bf16/bf16", "--cases", "8K", "--repeat", "1", "--modes",
                    "compiled", "--deterministic", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["cases"]
    det, default = row["modes"]["deterministic"], row["modes"]["compiled"]
    assert row["best_mode"] == "compiled" and det["graphs_compiled"] == 1
    assert det["vs_compiled"] == pytest.approx(det["ms"] / default["ms"])
    assert det["repeat_bitwise"] is True and 0 <= det["max_abs_diff_vs_compiled"] < float("inf")
    # the mode has its own plan (fp32 copies of x for the fp32 products), which never books less than the default's
    assert det["memory_plan"]["total"] >= row["memory_plan"]["total"] > 0
    assert {"invariant_mm", "invariant_moe_experts", "invariant_mla_query"} <= set(row["providers"])
    assert "deterministic (CPConfig(deterministic=True)) vs the default compile" in capsys.readouterr().out
    torch._dynamo.reset()
