"""Folded P2P rerange (``cpgraph.kernels.p2p``) against the all-gather rerange, on 2 gloo CPU ranks.

The run planner is checked against a brute-force loop over ``rerange_index``;
the transfer must give the same bytes as ``cp_rerange_decomposed`` (all-gather
+ placement) for plans with uneven requests, empty ranks and dummy rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import cpgraph.ops  # noqa: F401
from cpgraph.kernels import p2p
from cpgraph.ops.collectives import cp_rerange_decomposed
from cpgraph.ops.providers import active_provider, unregister_provider
from cpgraph.plan import plan_prefill

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import shared_pool  # noqa: E402

# (prefix_lens, extend_lens, page_size, row_align): uneven requests, a request too
# small for every rank to get a chunk, static row padding.
PLANS = [
    ([0, 0, 0], [37, 5, 64], 4, 1),
    ([8, 0], [1, 23], 2, 8),
    ([0], [3], 4, 1),
    ([0, 8, 0, 0], [16, 16, 9, 40], 8, 4),
]


def _plan(k: int, cp: int):
    prefix, extend, page, align = PLANS[k]
    return plan_prefill(prefix, extend, cp_size=cp, page_size=page, row_align=align)


# ------------------------------------------------------------ run planning
def _brute_runs(index: list[int], m: int) -> list[tuple[int, int, int, int]]:
    runs = []
    for t, g in enumerate(index):
        q, s = divmod(g, m)
        if runs and runs[-1][0] == q and runs[-1][1] + runs[-1][3] == s and runs[-1][2] + runs[-1][3] == t:
            q0, s0, d0, n0 = runs[-1]
            runs[-1] = (q0, s0, d0, n0 + 1)
        else:
            runs.append((q, s, t, 1))
    return runs


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("k", range(len(PLANS)))
def test_runs_match_brute_force(k, cp):
    plan = _plan(k, cp)
    runs = p2p.rerange_runs(plan)
    assert runs == _brute_runs([int(g) for g in plan.rerange_index], plan.num_rows)
    # the runs rebuild the index exactly and cover every output row once
    rebuilt = [None] * plan.num_tokens
    for q, s, d, n in runs:
        for j in range(n):
            assert rebuilt[d + j] is None
            rebuilt[d + j] = q * plan.num_rows + s + j
    assert rebuilt == [int(g) for g in plan.rerange_index]


def test_runs_per_request_chunks():
    """Two ranks, one long request: rank 0 holds chunks 0 and 3, rank 1 chunks 1-2 (one run)."""
    plan = plan_prefill([0], [64], cp_size=2, page_size=4)
    runs = p2p.rerange_runs(plan)
    assert [r[0] for r in runs] == [0, 1, 0]
    assert sum(r[3] for r in runs) == 64


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("k", range(len(PLANS)))
def test_send_blocks_and_receive_rule(k, cp):
    """Blocks cover each rank's valid rows exactly (valid rows first); direct receive iff one run per peer."""
    plan = _plan(k, cp)
    runs = p2p.rerange_runs(plan)
    blocks = p2p.send_blocks(runs, cp)
    for q in range(cp):
        kinds = plan.rank(q).row_kind.tolist()
        valid = [j for j, kind in enumerate(kinds) if kind == 0]
        if not valid:
            assert blocks[q] is None
        else:
            assert blocks[q] == (0, len(valid)) and valid == list(range(len(valid)))
    for rank in range(cp):
        per_peer = [sum(1 for r in runs if r[0] == q) for q in range(cp) if q != rank]
        assert p2p.receive_direct(runs, cp, rank) == all(c <= 1 for c in per_peer)


def test_receive_rule_single_request_two_ranks():
    """cp 2, one request: rank 0 gets rank 1's chunks 1-2 as one run (direct); rank 1 gets two runs (staged)."""
    runs = p2p.rerange_runs(plan_prefill([0], [64], cp_size=2, page_size=4))
    assert p2p.receive_direct(runs, 2, 0) and not p2p.receive_direct(runs, 2, 1)


def test_runs_bad_input():
    with pytest.raises(ValueError, match="num_rows"):
        p2p.runs_from_rerange_index([0, 1], 0)
    with pytest.raises(ValueError, match="rerange_index"):
        p2p.runs_from_rerange_index([[0, 1]], 4)
    with pytest.raises(ValueError, match="negative"):
        p2p.runs_from_rerange_index([0, -1], 4)


# ------------------------------------------------------------ rank-side jobs
def _rows(plan, rank: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + plan.num_rows)
    x = torch.randn((plan.num_rows, *shape), generator=g) * 3
    x[0].view(-1)[0] = -0.0  # bytes, not values
    return x.to(dtype)


def job_rerange_p2p(ctx, k: int):
    import torch.distributed as dist

    plan = _plan(k, ctx.world_size)
    index = plan.rank(ctx.rank, rerange=True).rerange_index
    runs = p2p.rerange_runs(plan)
    for shape, dtype in (((6,), torch.float32), ((3, 5), torch.bfloat16), ((4,), torch.int64)):
        rows = _rows(plan, ctx.rank, shape, dtype)
        want = cp_rerange_decomposed(rows, index, ctx.group_name, ctx.world_size)
        got = p2p.rerange_p2p(rows, runs, dist.group.WORLD)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (shape, dtype)
        # with the device index: one placement launch per side (Triton, under the interpreter here)
        got = p2p.rerange_p2p(rows, runs, dist.group.WORLD, num_out=index.shape[0], rerange_index=index)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (shape, dtype, "indexed")
    # provider entry point: runs attached to this index tensor; none attached -> all-gather path
    rows = _rows(plan, ctx.rank, (6,), torch.float32)
    want = cp_rerange_decomposed(rows, index, ctx.group_name, ctx.world_size)
    got = p2p.cp_rerange_p2p(rows, p2p.attach_runs(index, runs), ctx.group_name, ctx.world_size)
    fallback = p2p.cp_rerange_p2p(rows, index.clone(), ctx.group_name, ctx.world_size)
    assert torch.equal(got, want) and torch.equal(fallback, want)
    return len(runs)


def job_bad_runs(ctx):
    rows = torch.zeros(4, 2)
    for bad in ([(2, 0, 0, 1)], [(0, 3, 0, 2)], [(0, 0, -1, 1)]):
        with pytest.raises(ValueError, match="out of range"):
            p2p.rerange_p2p(rows, bad)
    return True


@pytest.mark.parametrize("k", range(len(PLANS)))
def test_rerange_p2p_matches_all_gather(k):
    results = shared_pool(2).run(job_rerange_p2p, k)
    assert len(set(results)) == 1  # both ranks planned the same runs


def test_rerange_p2p_bad_runs():
    assert shared_pool(2).run(job_bad_runs) == [True, True]


# ------------------------------------------------------------ selection
def test_p2p_provider_is_opt_in(monkeypatch):
    import cpgraph.kernels as kernels

    monkeypatch.delenv(p2p.ENV, raising=False)
    assert not kernels.register_rerange_p2p(("cuda",))
    assert active_provider("cp_rerange", "cuda") != p2p.PROVIDER_NAME
    monkeypatch.setenv(p2p.ENV, "p2p")
    try:
        assert kernels.register_rerange_p2p(("cuda",))
        assert active_provider("cp_rerange", "cuda") == p2p.PROVIDER_NAME
    finally:
        unregister_provider("cp_rerange", "cuda")
