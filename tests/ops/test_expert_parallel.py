"""Expert-parallel dispatch/combine: routing layout, round trip on gloo ranks (2 and 4), overflow policy.

The routing layout is checked against a plain loop over pairs.  On the
ranks, every rank holds ``E / W`` experts of one seeded expert set and its
own rows; dispatch -> local ``moe_experts`` -> combine must give what
``moe_experts`` computes on the same rows with *all* experts (fp32: the
weighted sum runs over the top-k slots instead of the dense E columns, so
agreement is to rounding, bounded below).  Rows past ``num_valid`` must
take no slot anywhere and come back as exact zeros.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import cpgraph.ops  # noqa: F401
from cpgraph.ops.expert_parallel import (
    NOT_ROUTED,
    OVERFLOW,
    moe_combine_decomposed,
    moe_dispatch_decomposed,
    route_to_ranks,
)
from cpgraph.ops.moe import moe_experts_reference
from cpgraph.passes.lint import host_sync_nodes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import collective_calls, fake_group, shared_pool  # noqa: E402

pytestmark = pytest.mark.slow

H, I = 16, 8
TOL = 1e-5  # fp32 relative to the largest output: different summation order only


def _routes_loop(ids, num_valid, E, W, capacity):
    """Reference layout: pairs in row-major order fill their destination block from the front."""
    m, k = ids.shape
    per = E // W
    n = W * capacity
    send_row, send_expert = [-1] * n, [-1] * n
    slot = [[NOT_ROUTED] * k for _ in range(m)]
    filled = [0] * W
    for r in range(m):
        for j in range(k):
            e = int(ids[r, j])
            if r >= num_valid or not 0 <= e < E:
                continue
            d = e // per
            if filled[d] >= capacity:
                slot[r][j] = OVERFLOW
                continue
            w = d * capacity + filled[d]
            filled[d] += 1
            send_row[w], send_expert[w], slot[r][j] = r, e % per, w
    return send_row, send_expert, slot


def _router_ids(m, k, E, seed, skew_to=None):
    """Distinct top-k ids per row (a router's), optionally all inside experts ``skew_to`` (a range)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(m, E, generator=g)
    if skew_to is not None:
        scores[:, skew_to] += 10.0
    return scores.topk(k, dim=-1).indices


@pytest.mark.parametrize(
    "m,k,E,W,slots,num_valid,skew",
    [
        (7, 2, 8, 2, 2, 5, None),
        (9, 3, 12, 4, 3, 9, None),
        (6, 2, 8, 4, 2, 6, range(0, 2)),  # every route to rank 0
        (6, 2, 8, 2, 1, 6, range(4, 8)),  # capacity 1 slot/row: half the pairs overflow
        (4, 2, 8, 2, 2, 0, None),  # no real row: nothing routed
        (5, 1, 4, 4, 1, 3, None),
    ],
)
def test_route_layout_matches_a_loop(m, k, E, W, slots, num_valid, skew):
    ids = _router_ids(m, k, E, seed=m * 31 + k, skew_to=skew)
    ids[0, 0] = -1 if m > 1 else ids[0, 0]  # an id out of range routes nowhere
    got = route_to_ranks(ids, torch.tensor([num_valid]), E, W, m * slots)
    row, expert, slot = _routes_loop(ids, num_valid, E, W, m * slots)
    assert got.send_row.tolist() == row
    assert got.send_expert.tolist() == expert
    assert got.send_slot.tolist() == slot
    # Each routed pair that fits is on the wire exactly once; dummy rows never are.
    sent = [w for w in got.send_row.tolist() if w >= 0]
    assert all(r < num_valid for r in sent)
    assert len(sent) == int((got.send_slot >= 0).sum())


def test_dispatch_graph_has_no_host_sync():
    from torch.fx.experimental.proxy_tensor import make_fx

    with fake_group(world_size=4) as gn:
        x, ids = torch.randn(6, H), _router_ids(6, 2, 8, 0)

        def round_trip(x, ids, nv, w):
            rx, rids, nrecv, order, slot = moe_dispatch_decomposed(x, ids, nv, 8, 2, gn, 4)
            return moe_combine_decomposed(rx * 2, order, slot, w, gn, 4)

        gm = make_fx(round_trip, tracing_mode="symbolic")(x, ids, torch.tensor([4]), torch.rand(6, 2))
    assert host_sync_nodes(gm.graph) == []
    names = [str(n.target) for n in gm.graph.nodes if "all_to_all" in str(n.target)]
    assert len(names) == 3, names  # rows out, ids out, outputs back


def test_bad_arguments_are_one_line_errors():
    x, ids = torch.randn(4, H), _router_ids(4, 2, 8, 0)
    cases = [
        ((x, ids.float(), None, 8, 2, "g", 2), "'topk_ids' must have dtype"),
        ((x, ids[:3], None, 8, 2, "g", 2), "'topk_ids' must have shape"),
        ((x, ids, torch.tensor([1, 2]), 8, 2, "g", 2), "'num_valid' must have shape"),
        ((x, ids, None, 9, 2, "g", 2), "'num_experts' (9) must split evenly"),
        ((x, ids, None, 8, 0, "g", 2), "'capacity_slots' must be an int >= 1"),
        ((x, ids, None, 8, 2, "", 2), "'group_name'"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=None) as info:
            torch.ops.cpgraph.moe_dispatch(*args)
        assert msg in str(info.value) and "\n" not in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="'topk_w' must have dtype"):
        torch.ops.cpgraph.moe_combine(x, torch.arange(4), ids, torch.ones(4, 2, dtype=torch.float64), "g", 2)


# ------------------------------------------------------------ rank-side jobs
def _experts(E, dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    return (0.3 * torch.randn(E, 2 * I, H, generator=g)).to(dtype), (0.3 * torch.randn(E, H, I, generator=g)).to(dtype)


def _rank_inputs(rank, m, k, E, dtype, skew):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(m, H, generator=g).to(dtype)
    ids = _router_ids(m, k, E, seed=200 + rank, skew_to=skew)
    w = torch.rand(m, k, generator=g)
    return x, ids, w


def _round_trip(ctx, x, ids, w, num_valid, E, slots, gate_up, down):
    """Dispatch -> this rank's experts -> combine; returns (output, num_recv)."""
    W = ctx.world_size
    lo = ctx.rank * (E // W)
    gu_local, d_local = gate_up[lo: lo + E // W], down[lo: lo + E // W]
    rx, rids, nrecv, order, slot = torch.ops.cpgraph.moe_dispatch(x, ids, num_valid, E, slots, ctx.group_name, W)
    y = torch.ops.cpgraph.moe_experts(rx, rids, torch.ones(rids.shape, dtype=torch.float32), gu_local, d_local, nrecv)
    out = torch.ops.cpgraph.moe_combine(y, order, slot, w, ctx.group_name, W)
    return out, int(nrecv), (rx, rids, nrecv, order, slot, y)


def job_round_trip(ctx, cases):
    results = []
    for m, k, E, valid_by_rank, dtype, skew in cases:
        gate_up, down = _experts(E, dtype)
        x, ids, w = _rank_inputs(ctx.rank, m, k, E, dtype, skew)
        nv = valid_by_rank[ctx.rank]
        num_valid = None if nv is None else torch.tensor([nv])
        slots = min(k, E // ctx.world_size)
        out, nrecv, parts = _round_trip(ctx, x, ids, w, num_valid, E, slots, gate_up, down)
        ref = moe_experts_reference(x, ids, w, gate_up, down, num_valid)
        # The ops and their decompositions give the same bits.
        rx, rids, n, order, slot, y = parts
        again = moe_dispatch_decomposed(x, ids, num_valid, E, slots, ctx.group_name, ctx.world_size)
        assert all(torch.equal(a, b) for a, b in zip(again, (rx, rids, n, order, slot)))
        assert torch.equal(moe_combine_decomposed(y, order, slot, w, ctx.group_name, ctx.world_size), out)
        real = m if nv is None else nv
        err = float((out[:real].float() - ref[:real].float()).abs().max()) if real else 0.0
        scale = float(ref.float().abs().max().clamp_min(1e-30))
        results.append({
            "rel": err / scale,
            "tail_zero": bool((out[real:] == 0).all()),
            "finite": bool(out.isfinite().all()),
            "num_recv": nrecv,
            "routed": real * k,
        })
    return results


def job_collective_count(ctx):
    gate_up, down = _experts(8, torch.float32)
    x, ids, w = _rank_inputs(ctx.rank, 5, 2, 8, torch.float32, None)
    slots = min(2, 8 // ctx.world_size)
    return collective_calls(lambda: _round_trip(ctx, x, ids, w, torch.tensor([4]), 8, slots, gate_up, down))


def job_overflow(ctx, debug):
    """Capacity of 1 slot/row while every route goes to rank 0's experts: pairs overflow."""
    E, k, m = 8, 2, 4
    gate_up, down = _experts(E, torch.float32)
    x, ids, w = _rank_inputs(ctx.rank, m, k, E, torch.float32, range(0, E // ctx.world_size))
    old = os.environ.get("CPGRAPH_DEBUG")
    os.environ["CPGRAPH_DEBUG"] = "1" if debug else "0"
    try:
        out, _, parts = _round_trip(ctx, x, ids, w, torch.tensor([m]), E, 1, gate_up, down)
    finally:
        if old is None:
            os.environ.pop("CPGRAPH_DEBUG")
        else:
            os.environ["CPGRAPH_DEBUG"] = old
    slot = parts[4]
    lost_rows = (slot == OVERFLOW).any(1)
    return {"lost": lost_rows.tolist(), "nan_rows": out.isnan().all(1).tolist(),
            "finite_rows": out[~lost_rows].isfinite().all().item()}


def job_opcheck(ctx):
    W, gn = ctx.world_size, ctx.group_name
    E = 4 * W
    for m, k, dtype, nv in [(6, 2, torch.float32, 4), (3, 3, torch.bfloat16, None), (1, 1, torch.float32, 0)]:
        gate_up, down = _experts(E, dtype)
        x, ids, w = _rank_inputs(ctx.rank, m, k, E, dtype, None)
        num_valid = None if nv is None else torch.tensor([nv])
        torch.library.opcheck(torch.ops.cpgraph.moe_dispatch.default, (x, ids, num_valid, E, k, gn, W))
        rx, rids, nrecv, order, slot = torch.ops.cpgraph.moe_dispatch(x, ids, num_valid, E, k, gn, W)
        y = torch.ops.cpgraph.moe_experts(rx, rids, torch.ones(rids.shape), gate_up[:4], down[:4], nrecv)
        torch.library.opcheck(torch.ops.cpgraph.moe_combine.default, (y, order, slot, w, gn, W))


# ------------------------------------------------------------------- tests
CASES = [
    # (rows per rank, top_k, E, real rows per rank (None = all), dtype, route every row to one rank's experts)
    (7, 2, 8, None, torch.float32, None),
    (9, 2, 8, "tail", torch.float32, None),
    (6, 2, 8, None, torch.float32, "rank0"),
    (5, 2, 8, "none-on-0", torch.float32, None),  # a rank with no real rows (a tiny extend)
    (6, 2, 8, "tail", torch.bfloat16, None),
]


def _cases(world):
    out = []
    for m, k, E, valid, dtype, skew in CASES:
        if valid is None:
            by_rank = [None] * world
        elif valid == "tail":
            by_rank = [m - 1 - (r % 3) for r in range(world)]
        else:
            by_rank = [0] + [m] * (world - 1)
        out.append((m, k, E, by_rank, dtype, range(0, E // world) if skew else None))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_round_trip_equals_all_experts_on_one_rank(world):
    results = shared_pool(world).run(job_round_trip, _cases(world))
    for c, case in enumerate(CASES):
        per_rank = [r[c] for r in results]
        tol = TOL if case[4] == torch.float32 else 2e-2  # bf16: expert outputs round to bf16 before the sum
        for r in per_rank:
            assert r["rel"] <= tol, (case, r)
            assert r["tail_zero"] and r["finite"], (case, r)
        # Every routed pair of every rank was received exactly once somewhere.
        assert sum(r["num_recv"] for r in per_rank) == sum(r["routed"] for r in per_rank), case
        if case[5] == "rank0":
            assert per_rank[0]["num_recv"] == sum(r["routed"] for r in per_rank)
            assert all(r["num_recv"] == 0 for r in per_rank[1:])
    print(f"\nround trip vs all experts, max relative error per case, {world} ranks:",
          [f"{max(r[c]['rel'] for r in results):.1e}" for c in range(len(CASES))])


def test_three_all_to_alls_per_round_trip():
    counts = shared_pool(2).run(job_collective_count)
    for c in counts:
        functional = {k: v for k, v in c.items() if k.startswith("_c10d_functional::")}
        assert functional == {"_c10d_functional::all_to_all_single": 3}, c


def test_overflow_poisons_rows_without_debug():
    results = shared_pool(2).run(job_overflow, False)
    for r in results:
        assert any(r["lost"]), r  # the case does overflow
        assert r["nan_rows"] == r["lost"] and r["finite_rows"], r


def test_overflow_raises_on_every_rank_in_debug_mode():
    with pytest.raises(AssertionError) as info:
        shared_pool(2).run(job_overflow, True)
    msg = str(info.value)
    assert "--- rank 0 ---" in msg and "--- rank 1 ---" in msg
    assert msg.count("routed pairs overflow the 4 slots per destination rank (capacity_slots=1)") == 2


def test_opcheck():
    shared_pool(2).run(job_opcheck)
