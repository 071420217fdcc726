"""CP collective ops on spawned gloo ranks (2 and 4) against the unsplit batch.

Every rank builds its compute rows from the planner's ``token_index`` and a
table of per-token values shared by all ranks; the expected results are
built from the table with plain Python loops over requests and tokens (the
global order is "request 0's extend tokens, then request 1's, ...").  The
fake process group covers tracing and compiling in this process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import cpgraph.ops  # noqa: F401  (registers take_rows & co)
from cpgraph.ops.collectives import (
    cp_all_gather_rows,
    cp_all_gather_rows_decomposed,
    cp_last_tokens,
    cp_last_tokens_decomposed,
    cp_rerange,
    cp_rerange_decomposed,
)
from cpgraph.passes.lint import host_sync_nodes
from cpgraph.plan import plan_prefill

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import collective_calls, fake_group, shared_pool  # noqa: E402

pytestmark = pytest.mark.slow

SENTINEL = 4242.0  # value of dummy rows: must never show up in an output

# (prefix_lens, extend_lens, page_size, row_align): tiny extends (fewer pages
# than ranks, a single token), cached prefixes, many requests, static padding.
BATCHES = [
    ([0, 8, 0], [5, 1, 19], 4, 1),
    ([4, 0, 12, 0, 8, 4, 0, 0, 16, 4, 0, 8], [1, 2, 3, 7, 9, 16, 1, 33, 4, 17, 2, 40], 4, 8),
    ([0, 0], [1, 1], 2, 1),
    ([32, 0, 8], [64, 3, 130], 8, 4),
]
ROW_SHAPES = [(), (3,), (2, 3)]


def _table(num_tokens: int, trailing: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Per-token values, identical on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn((num_tokens, *trailing), generator=g).to(dtype)
    return torch.randint(-1000, 1000, (num_tokens, *trailing), generator=g).to(dtype)


def _rank_rows(table: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """A rank's compute rows: its tokens' values, SENTINEL for dummy rows (plain loop)."""
    rows = []
    for t in token_index.tolist():
        rows.append(table[t] if t >= 0 else torch.full(table.shape[1:], SENTINEL).to(table.dtype))
    return torch.stack(rows)


def _expected_last(table: torch.Tensor, extend_lens: list[int]) -> torch.Tensor:
    out, start = [], 0
    for e in extend_lens:
        start += e
        out.append(table[start - 1])
    return torch.stack(out)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (dtype, shape and bytes; -0.0 != +0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ------------------------------------------------------------ rank-side jobs
def job_collectives(ctx, batch, trailing, dtype, seed):
    prefix, extend, page, align = batch
    plan = plan_prefill(prefix, extend, cp_size=ctx.world_size, page_size=page, row_align=align)
    table = _table(sum(extend), trailing, dtype, seed)
    rp = plan.rank(ctx.rank, rerange=True)
    rows = _rank_rows(table, rp.token_index)
    gn, ws = ctx.group_name, ctx.world_size

    # all-gather: rank-major concatenation of every rank's rows.
    expected_all = torch.cat([_rank_rows(table, plan.rank(r).token_index) for r in range(ws)])
    got = cp_all_gather_rows(rows, gn, ws)
    assert _same(got, expected_all)
    assert _same(cp_all_gather_rows_decomposed(rows, gn, ws), got)

    # rerange: the unsplit batch's tokens in global order == the table itself.
    got = cp_rerange(rows, rp.rerange_index, gn, ws)
    assert _same(got, table), "rerange differs from the unsplit order"
    assert _same(cp_rerange_decomposed(rows, rp.rerange_index, gn, ws), got)

    # last tokens: bit-exact copies, and only from their owners.
    expected_last = _expected_last(table, extend)
    got = cp_last_tokens(rows, rp.last_token_index, gn, ws)
    assert _same(got, expected_last), "last tokens differ"
    assert _same(cp_last_tokens_decomposed(rows, rp.last_token_index, gn, ws), got)
    return rows.shape[0]


def job_signed_zero(ctx):
    """A last token whose value is -0.0 / +0.0 comes back bit for bit."""
    plan = plan_prefill([0, 0], [3, 5], cp_size=ctx.world_size, page_size=1)
    rp = plan.rank(ctx.rank)
    table = torch.tensor([[1.0, 2.0], [3.0, 4.0], [-0.0, 0.0], [5.0, 6.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0],
                          [0.0, -0.0]])
    rows = _rank_rows(table, rp.token_index)
    got = cp_last_tokens(rows, rp.last_token_index, ctx.group_name, ctx.world_size)
    assert _same(got, torch.tensor([[-0.0, 0.0], [0.0, -0.0]]))


def job_count(ctx):
    """Each op issues exactly its one collective (functional op and gloo call)."""
    plan = plan_prefill([0, 4], [9, 6], cp_size=ctx.world_size, page_size=2)
    rp = plan.rank(ctx.rank, rerange=True)
    rows = _rank_rows(_table(15, (4,), torch.float32, 0), rp.token_index)
    gn, ws = ctx.group_name, ctx.world_size
    return {
        "all_gather": collective_calls(lambda: cp_all_gather_rows(rows, gn, ws)),
        "rerange": collective_calls(lambda: cp_rerange(rows, rp.rerange_index, gn, ws)),
        "last_tokens": collective_calls(lambda: cp_last_tokens(rows, rp.last_token_index, gn, ws)),
    }


def job_opcheck(ctx):
    gn, ws = ctx.group_name, ctx.world_size
    for k, (batch, trailing, dtype) in enumerate(
        [(BATCHES[0], (), torch.float32), (BATCHES[1], (3,), torch.bfloat16), (BATCHES[3], (2, 3), torch.float32)]
    ):
        prefix, extend, page, align = batch
        plan = plan_prefill(prefix, extend, cp_size=ws, page_size=page, row_align=align)
        rp = plan.rank(ctx.rank, rerange=True)
        rows = _rank_rows(_table(sum(extend), trailing, dtype, k), rp.token_index)
        torch.library.opcheck(torch.ops.cpgraph.cp_all_gather_rows.default, (rows, gn, ws))
        torch.library.opcheck(torch.ops.cpgraph.cp_rerange.default, (rows, rp.rerange_index, gn, ws))
        torch.library.opcheck(torch.ops.cpgraph.cp_last_tokens.default, (rows, rp.last_token_index, gn, ws))


# ------------------------------------------------------------------- tests
@pytest.mark.parametrize("world_size", [2, 4])
def test_ops_match_unsplit_batch(world_size):
    pool = shared_pool(world_size)
    cases = [
        (BATCHES[0], ROW_SHAPES[0], torch.float32),
        (BATCHES[1], ROW_SHAPES[1], torch.float32),
        (BATCHES[1], ROW_SHAPES[2], torch.bfloat16),
        (BATCHES[2], ROW_SHAPES[1], torch.float16),
        (BATCHES[3], ROW_SHAPES[2], torch.float32),
        (BATCHES[3], ROW_SHAPES[0], torch.int32),
    ]
    for seed, (batch, trailing, dtype) in enumerate(cases):
        num_rows = pool.run(job_collectives, batch, trailing, dtype, seed)
        assert len(set(num_rows)) == 1  # uniform row counts on every rank


@pytest.mark.parametrize("world_size", [2, 4])
def test_last_tokens_keeps_signed_zeros(world_size):
    shared_pool(world_size).run(job_signed_zero)


def test_one_collective_each():
    for counts in shared_pool(2).run(job_count):
        assert counts["all_gather"] == {"_c10d_functional::all_gather_into_tensor": 1, "gloo:all_gather": 1}
        assert counts["rerange"] == {"_c10d_functional::all_gather_into_tensor": 1, "gloo:all_gather": 1}
        # The narrow gather never moves the full rows: one all-gather of [B, ...] rows.
        assert counts["last_tokens"] == {"_c10d_functional::all_gather_into_tensor": 1, "gloo:all_gather": 1}


def test_opcheck():
    shared_pool(2).run(job_opcheck)


# ---------------------------------------------------- fake group (this process)
def _fake_inputs(world_size=4, rank=1):
    plan = plan_prefill([0, 8, 4], [5, 1, 23], cp_size=world_size, page_size=4, row_align=2)
    rp = plan.rank(rank, rerange=True)
    rows = torch.randn(rp.num_rows, 6)
    return plan, rp, rows


def test_trace_and_compile_with_fake_group():
    with fake_group(world_size=4, rank=1) as gn:
        plan, rp, rows = _fake_inputs()
        T, B, M = plan.num_tokens, plan.num_requests, rp.num_rows

        def ops(rows, rerange_index, last_token_index):
            a = torch.ops.cpgraph.cp_all_gather_rows(rows, gn, 4)
            b = torch.ops.cpgraph.cp_rerange(rows * 2, rerange_index, gn, 4)
            c = torch.ops.cpgraph.cp_last_tokens(rows + 1, last_token_index, gn, 4)
            return a, b, c

        def decomposed(rows, rerange_index, last_token_index):
            a = cp_all_gather_rows_decomposed(rows, gn, 4)
            b = cp_rerange_decomposed(rows * 2, rerange_index, gn, 4)
            c = cp_last_tokens_decomposed(rows + 1, last_token_index, gn, 4)
            return a, b, c

        args = (rows, rp.rerange_index, rp.last_token_index)
        want = [(4 * M, 6), (T, 6), (B, 6)]
        for fn in (ops, decomposed):
            gm = torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode="fake")(*args)
            targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            if fn is ops:
                assert sum("cpgraph.cp_" in t for t in targets) == 3
            else:
                assert sum("all_gather_into_tensor" in t for t in targets) == 3
                assert not any("all_reduce" in t for t in targets)
            assert not host_sync_nodes(gm.graph), "host sync in a traced CP op"
            assert [tuple(o.shape) for o in gm(*args)] == want
            compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
            assert [tuple(o.shape) for o in compiled(*args)] == want

        # Dynamic row count and world_size argument: the shape rules are symbolic.
        def dyn(rows, rerange_index, last_token_index, world_size):
            a = torch.ops.cpgraph.cp_all_gather_rows(rows, gn, world_size)
            b = torch.ops.cpgraph.cp_rerange(rows, rerange_index, gn, world_size)
            c = torch.ops.cpgraph.cp_last_tokens(rows, last_token_index, gn, world_size)
            return a, b, c

        torch._dynamo.reset()
        compiled = torch.compile(dyn, backend="aot_eager", fullgraph=True, dynamic=True)
        for m in (M, M + 3):
            out = compiled(torch.randn(m, 6), rp.rerange_index, rp.last_token_index, 4)
            assert [tuple(o.shape) for o in out] == [(4 * m, 6), (T, 6), (B, 6)]


def test_world_size_must_match_group():
    with fake_group(world_size=4, rank=0) as gn:
        rows = torch.randn(3, 2)
        with pytest.raises(ValueError, match="world_size"):
            cp_all_gather_rows(rows, gn, 2)
        with pytest.raises(ValueError, match="world_size"):
            cp_rerange(rows, torch.zeros(2, dtype=torch.int64), gn, 3)
        with pytest.raises(ValueError, match="world_size"):
            cp_last_tokens(rows, torch.zeros(2, dtype=torch.int64), gn, 8)
        with pytest.raises(ValueError, match="group_name"):
            cp_all_gather_rows(rows, "no-such-group", 4)


# ------------------------------------------------------ bad inputs (no group)
IDX = torch.zeros(4, dtype=torch.int64)


def test_bad_rows_rank():
    with pytest.raises(ValueError, match="'rows'"):
        cp_all_gather_rows(torch.tensor(1.0), "g", 2)
    with pytest.raises(ValueError, match="'rows'"):
        cp_rerange(torch.tensor(1.0), IDX, "g", 2)


def test_bad_index_dtype():
    with pytest.raises(ValueError, match="'rerange_index'.*int64"):
        cp_rerange(torch.randn(4, 2), IDX.float(), "g", 2)
    with pytest.raises(ValueError, match="'last_token_index'.*int64"):
        cp_last_tokens(torch.randn(4, 2), IDX.to(torch.int32), "g", 2)


def test_bad_index_shape():
    with pytest.raises(ValueError, match="'rerange_index'.*1-D"):
        cp_rerange(torch.randn(4, 2), IDX.view(2, 2), "g", 2)
    with pytest.raises(ValueError, match="'last_token_index'.*1-D"):
        cp_last_tokens(torch.randn(4, 2), IDX.view(2, 2), "g", 2)


def test_bad_world_size_and_group_name():
    for bad in (0, -1):
        with pytest.raises(ValueError, match="'world_size'"):
            cp_all_gather_rows(torch.randn(4, 2), "g", bad)
    with pytest.raises(ValueError, match="'group_name'"):
        cp_rerange(torch.randn(4, 2), IDX, "", 2)


def test_device_mix():
    # "meta" stands in for a second device on CPU-only machines.
    with pytest.raises(ValueError, match="one device"):
        cp_rerange(torch.randn(4, 2), IDX.to("meta"), "g", 2)
    with pytest.raises(ValueError, match="one device"):
        cp_last_tokens(torch.randn(4, 2, device="meta"), IDX, "g", 2)


def test_range_checked_in_debug_mode(monkeypatch):
    monkeypatch.setenv("CPGRAPH_DEBUG", "1")
    with pytest.raises(ValueError, match="rerange_index"):
        cp_rerange_decomposed(torch.randn(4, 2), torch.tensor([0, 8]), "g", 2)
    with pytest.raises(ValueError, match="last_token_index"):
        cp_last_tokens_decomposed(torch.randn(4, 2), torch.tensor([-1]), "g", 2)
