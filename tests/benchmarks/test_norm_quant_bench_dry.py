"""``benchmarks/norm_quant_bench.py`` on CPU at tiny sizes: it checks the kernel against the reference and reports.

The script runs in a subprocess under ``TRITON_INTERPRET=1`` (Triton picks interpreter or compiler when a
kernel module is imported); the Inductor peers are skipped (``--no-compile``) to keep it to seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import norm_quant_bench as bench  # noqa: E402  (imports no kernel at module level)
from bench_dry import assert_peer_rates, run_bench  # noqa: E402


def test_dry_run_checks_the_kernel_and_reports_every_case(tmp_path):
    report, _ = run_bench("norm_quant_bench.py", tmp_path / "nq.json", "--device", "cpu", "--rows", "5",
                          "--no-compile")
    assert [(c["case"], c["rows"]) for c in report["cases"]] == [("attn_input", 5), ("q_latent", 5)]
    for case in report["cases"]:
        assert case["bytes"] == bench.traffic(5, case["K"], case["residual"], case["emit_normed"])
        assert set(case["results"]) == {"ours", "copy"}
        assert_peer_rates(case)


def test_traffic_counts_what_the_kernel_reads_and_writes():
    # attention input: x and res read, sum and normed written (bf16), codes (1 byte) and 56 scales per row
    assert bench.traffic(2, 7168, True, True) == 2 * 7168 * 2 * 2 + 2 * 7168 * 2 * 2 + 2 * 7168 + 2 * 56 * 4
    # query latent: x read, codes and 12 scales written
    assert bench.traffic(3, 1536, False, False) == 3 * 1536 * 2 + 3 * 1536 + 3 * 12 * 4
