"""``benchmarks/swiglu_bench.py`` on CPU at tiny sizes: it runs, checks our kernel against eager, reports every peer.

The script runs in a subprocess under ``TRITON_INTERPRET=1``: Triton picks interpreter or compiler
when a kernel module is imported, so an in-process run would depend on what the suite imported
first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import swiglu_bench as bench  # noqa: E402  (imports no kernel at module level)
from bench_dry import assert_peer_rates, run_bench  # noqa: E402


def _run(tmp_path, *extra: str) -> dict:
    report, stdout = run_bench("swiglu_bench.py", tmp_path / "swiglu.json", "--device", "cpu", "--rows", "24",
                               "--inter", "80", "--experts", "4", "--repeat", "1", *extra)
    assert "ours vs eager" in stdout
    return report


def test_dry_run_matches_eager_bits_and_times_every_peer(tmp_path):
    report = _run(tmp_path, "--routed", "1.0", "0.4", "--no-compile")
    assert [c["routed_rows"] for c in report["cases"]] == [24, 10]  # 0.4 * 24 rounded
    for case in report["cases"]:
        # the kernel rounds as the eager form does (silu to bf16, then the product): at this size every
        # value is bit-equal on CPU (the interpreter's exp and torch's agree here)
        assert case["ours_vs_eager"] == {"exact_share": 1.0, "max_ulps": 0}
        assert case["bytes"] == 3 * case["routed_rows"] * 80 * 2
        assert set(case["results"]) == {"ours", "eager", "copy"}
        assert_peer_rates(case)
        assert case["results"]["copy"]["of_copy"] == pytest.approx(1.0)
        assert case["results"]["ours"]["ours_speedup"] == pytest.approx(1.0)


@pytest.mark.slow
def test_dry_run_with_the_compiled_peer(tmp_path):
    """The ``torch.compile`` peer (Inductor's C++ kernel on CPU, about 10 s to compile) runs and is compared."""
    (case,) = _run(tmp_path, "--routed", "0.5")["cases"]
    assert set(case["results"]) == {"ours", "eager", "copy", "compiled"}
    assert 0 < case["compiled_vs_eager"]["exact_share"] <= 1.0


def test_compare_counts_ulps_across_zero():
    """The bench's gate: bit-equal share and the largest distance in ulps, signed values ordered correctly."""
    want = torch.tensor([1.0, -1.0, 0.0, 3.0], dtype=torch.bfloat16)
    bits = want.view(torch.int16).clone()
    bits[0] += 1  # one ulp up from 1.0
    bits[1] += 2  # two ulps away from zero from -1.0 (sign-magnitude)
    bits[2] = -0x8000 + 1  # the smallest negative subnormal: one ulp below +0
    got = bits.view(torch.bfloat16)
    assert bench.compare(got, want) == {"exact_share": 0.25, "max_ulps": 2}
    assert bench.compare(want, want) == {"exact_share": 1.0, "max_ulps": 0}
