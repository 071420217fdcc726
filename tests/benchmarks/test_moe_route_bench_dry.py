"""``benchmarks/moe_route_bench.py`` on CPU at tiny sizes: its checks run, every peer is timed and reported.

A subprocess under ``TRITON_INTERPRET=1`` (Triton picks interpreter or compiler when a kernel module is
imported); the Inductor peer is skipped (``--no-compile``) to keep it to seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import moe_route_bench as bench  # noqa: E402  (imports no kernel at module level)
from bench_dry import assert_peer_rates, run_bench  # noqa: E402


def test_dry_run_checks_and_reports_every_case(tmp_path):
    report, _ = run_bench("moe_route_bench.py", tmp_path / "route.json", "--device", "cpu", "--rows", "5",
                          "--no-compile")
    assert [(c["case"], c["rows"]) for c in report["cases"]] == [("v32", 5), ("glm5", 5)]
    for case in report["cases"]:
        assert case["bytes"] == bench.traffic(5, 256, 8)
        assert set(case["results"]) == {"ours", "torch", "copy"}
        assert_peer_rates(case)


def test_the_torch_peer_is_the_routing_the_op_replaced():
    """The peer chooses what the op chooses (as sets; on random scores nothing ties)."""
    from cpgraph.ops.moe_route import moe_route_reference

    g = torch.Generator().manual_seed(0)
    scores, bias = torch.rand(33, 256, generator=g), torch.randn(256, generator=g) / 64
    ids, w = bench.torch_route(scores, bias, 8, 4, 8, 2.5)
    want_ids, want_w = moe_route_reference(scores, bias, 8, 4, 8, True, 2.5)
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    assert torch.allclose(w.gather(1, order), want_w.gather(1, want_order), rtol=1e-6, atol=0)
