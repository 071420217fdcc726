"""Planner properties against a brute force written from the spec alone.

The brute force below walks pages and tokens with plain Python loops; it
shares no code with ``cpgraph.plan``.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpgraph.plan import ROW_COMPUTE_PAD, ROW_STATIC_PAD, ROW_VALID, plan_prefill


def brute_force(prefix, extend, cp, page):
    """Per-rank lists of (global token id, request, position) and page owners, from the spec text."""
    owners = []  # owners[i][j] = owner of extend page j of request i
    rank_tokens = [[] for _ in range(cp)]
    starts = []
    acc = 0
    for e in extend:
        starts.append(acc)
        acc += e
    for i, (p, e) in enumerate(zip(prefix, extend)):
        pages = math.ceil(e / page)
        base, rem = divmod(pages, 2 * cp)
        sizes = [base + (1 if c < rem else 0) for c in range(2 * cp)]
        chunk_pages = []
        first = 0
        for s in sizes:
            chunk_pages.append(list(range(first, first + s)))
            first += s
        own = [None] * pages
        for c, pg in enumerate(chunk_pages):
            r = c if c < cp else 2 * cp - 1 - c
            for j in pg:
                own[j] = r
        owners.append(own)
        for r in range(cp):
            for c in (r, 2 * cp - 1 - r):
                for j in chunk_pages[c]:
                    for off in range(j * page, min((j + 1) * page, e)):
                        rank_tokens[r].append((starts[i] + off, i, p + off))
    return owners, rank_tokens


def kv_windows(prefix, extend, page):
    start, out = 0, []
    for p, e in zip(prefix, extend):
        out.append(start)
        start += p + math.ceil(e / page) * page
    return out


@st.composite
def batches(draw):
    page = draw(st.sampled_from([1, 2, 4, 8, 16]))
    cp = draw(st.integers(1, 8))
    n = draw(st.integers(1, 6))
    prefix = [draw(st.integers(0, 5)) * page for _ in range(n)]
    extend = [draw(st.integers(1, 200)) for _ in range(n)]
    align = draw(st.sampled_from([1, 1, 4, 16]))
    return prefix, extend, cp, page, align


def check_plan(prefix, extend, cp, page, align=1):
    plan = plan_prefill(prefix, extend, cp_size=cp, page_size=page, row_align=align)
    owners, rank_tokens = brute_force(prefix, extend, cp, page)
    total = sum(extend)
    ks_of = kv_windows(prefix, extend, page)
    ranks = [plan.rank(r, rerange=True) for r in range(cp)]

    # M equal on all ranks, >= every rank's valid count, aligned, minimal.
    M = plan.num_rows
    assert all(rp.num_rows == M and rp.token_index.shape == (M,) for rp in ranks)
    want_m = max(max(len(t) for t in rank_tokens), 1)
    assert M == -(-want_m // align) * align

    seen = []
    for r, rp in enumerate(ranks):
        exp = rank_tokens[r]
        nv = rp.num_valid
        assert nv == len(exp)
        valid = rp.valid_rows.tolist()
        assert valid == [k for k in range(M) if rp.token_index[k] >= 0]
        got = [(int(rp.token_index[k]), int(rp.req_index[k]), int(rp.positions[k])) for k in valid]
        # Same tokens, same order (request-first, prev chunk then next chunk).
        assert got == exp
        seen += [g[0] for g in got]
        # Every valid token is computed by the owner of its page.
        for tok, i, pos in got:
            assert owners[i][(pos - prefix[i]) // page] == r
        # Causal windows.
        for k in valid:
            i, pos = int(rp.req_index[k]), int(rp.positions[k])
            assert int(rp.ks[k]) == ks_of[i]
            assert int(rp.ke[k]) == ks_of[i] + pos + 1
        # Dummy rows: provenance, empty window, no token.
        kinds = rp.row_kind.tolist()
        assert kinds.count(ROW_VALID) == nv
        assert kinds.count(ROW_COMPUTE_PAD) == rp.compute_padding == plan.compute_rows - nv
        assert kinds.count(ROW_STATIC_PAD) == rp.static_padding == M - plan.compute_rows
        for k in range(M):
            if kinds[k] != ROW_VALID:
                assert rp.token_index[k] == -1 and rp.req_index[k] == -1 and rp.ks[k] == rp.ke[k]
        assert int(rp.num_valid_tensor[0]) == nv

    # Valid rows of all ranks partition the batch's tokens exactly once.
    assert sorted(seen) == list(range(total))
    # Page owners.
    for i in range(len(extend)):
        assert plan.page_owners(i) == owners[i]
    # Rerange: gathering rank-major rows with rerange_index gives global order.
    gathered = torch.cat([rp.token_index for rp in ranks])
    assert torch.equal(gathered[ranks[0].rerange_index], torch.arange(total))
    # Last tokens.
    ends = np.cumsum(extend) - 1
    assert gathered[ranks[0].last_token_index].tolist() == ends.tolist()
    for i in range(len(extend)):
        r, row = plan.last_token_owner(i)
        assert int(ranks[r].token_index[row]) == ends[i]
    # Page-tail slack.
    assert plan.page_tail_slack.tolist() == [math.ceil(e / page) * page - e for e in extend]
    return plan


@settings(max_examples=150, deadline=None)
@given(batches())
def test_plan_matches_brute_force(batch):
    check_plan(*batch)


@settings(max_examples=30, deadline=None)
@given(batches())
def test_plan_is_byte_identical_when_recomputed(batch):
    prefix, extend, cp, page, align = batch
    a = plan_prefill(prefix, extend, cp_size=cp, page_size=page, row_align=align)
    b = plan_prefill(list(prefix), list(extend), cp_size=cp, page_size=page, row_align=align)
    assert json.dumps(a.to_dict(), sort_keys=True) == json.dumps(b.to_dict(), sort_keys=True)
    assert a.fingerprint() == b.fingerprint()
    for r in range(cp):
        ta, tb = a.rank(r, rerange=True).tensors(), b.rank(r, rerange=True).tensors()
        assert ta.keys() == tb.keys()
        for k in ta:
            assert ta[k].numpy().tobytes() == tb[k].numpy().tobytes(), k


@pytest.mark.parametrize(
    "prefix,extend,cp,page,align",
    [
        ([0], [1], 8, 64, 1),  # one token, eight ranks: seven ranks all padding
        ([64], [1], 8, 64, 1),  # one token after a cached page
        ([0], [5], 2, 64, 1),  # extend smaller than a page
        ([0, 128], [130, 3], 4, 64, 1),  # fewer pages than 2*cp
        ([0, 3, 9], [7, 1, 20], 3, 1, 1),  # page_size 1
        ([0] * 64, list(range(1, 65)), 4, 4, 1),  # 64 requests
        ([16, 0], [100, 37], 2, 16, 32),  # row_align > 1
        ([0, 128], [1000, 37], 4, 64, 8),
    ],
)
def test_edge_cases(prefix, extend, cp, page, align):
    check_plan(prefix, extend, cp, page, align)


def test_tiny_extend_leaves_ranks_without_work():
    plan = check_plan([0], [1], 8, 64)
    assert plan.num_rows == 1
    assert plan.rank(0).num_valid == 1
    assert [plan.rank(r).num_valid for r in range(1, 8)] == [0] * 7
    assert plan.compute_padding.tolist() == [0] + [1] * 7
    assert plan.last_token_owner(0) == (0, 0)


def test_worked_example_from_docs():
    """The drawing in docs/plan.md: 2 requests, cp=2, page=4."""
    plan = plan_prefill([4, 0], [13, 6], cp_size=2, page_size=4)
    assert plan.page_owners(0) == [0, 1, 1, 0]
    assert plan.page_owners(1) == [0, 1]
    r0, r1 = plan.rank(0), plan.rank(1)
    assert plan.num_rows == 10
    assert r0.token_index.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 16, -1]
    assert r0.positions.tolist() == [4, 5, 6, 7, 16, 0, 1, 2, 3, 0]
    assert r0.ks.tolist() == [0] * 5 + [20] * 4 + [0]
    assert r0.ke.tolist() == [5, 6, 7, 8, 17, 21, 22, 23, 24, 0]
    assert r1.token_index.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 17, 18]
    assert r1.positions.tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 4, 5]
    assert plan.kv_start.tolist() == [0, 20] and plan.kv_lens.tolist() == [20, 8]
    assert plan.rerange_index.tolist() == [0, 1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 17, 4, 5, 6, 7, 8, 18, 19]
    assert plan.last_token_owner(0) == (0, 4) and plan.last_token_owner(1) == (1, 9)
    assert plan.last_token_index.tolist() == [4, 19]
    assert plan.page_tail_slack.tolist() == [3, 2]
    assert plan.compute_padding.tolist() == [1, 0]


def test_device_bundle_moves_every_tensor():
    plan = plan_prefill([0, 64], [100, 3], cp_size=2, page_size=64)
    rp = plan.rank(1, rerange=True)
    moved = rp.to("meta")
    for name, t in moved.tensors().items():
        assert t.device.type == "meta", name
        assert t.dtype == torch.int64, name
    assert moved.num_rows == rp.num_rows and moved.num_valid == rp.num_valid
    assert rp.rerange_index is not None and plan.rank(1).rerange_index is None


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(prefix_lens=[0, 0], extend_lens=[5, 0]), "request 1: extend length must be >= 1, got 0"),
        (dict(prefix_lens=[0, -64], extend_lens=[5, 5]), "request 1: prefix length must be >= 0, got -64"),
        (dict(prefix_lens=[0, 32], extend_lens=[5, 5]), "request 1: prefix length 32 is not a multiple of page_size 64"),
        (dict(prefix_lens=[0], extend_lens=[5], page_size=48), "page_size must be a power of two, got 48"),
        (dict(prefix_lens=[0], extend_lens=[5], page_size=0), "page_size must be a power of two, got 0"),
        (dict(prefix_lens=[0], extend_lens=[5], cp_size=0), "cp_size must be >= 1, got 0"),
        (dict(prefix_lens=[0], extend_lens=[5, 6]), "prefix_lens has 1 entries but extend_lens has 2"),
        (dict(prefix_lens=[], extend_lens=[]), "the batch has no requests"),
        (dict(prefix_lens=[0], extend_lens=[5], row_align=0), "row_align must be >= 1, got 0"),
        (dict(prefix_lens=[0], extend_lens=[5.5]), "extend_lens[0] (request 0) must be an integer"),
    ],
)
def test_invalid_input_names_request_and_value(kwargs, message):
    args = dict(cp_size=2, page_size=64)
    args.update(kwargs)
    with pytest.raises(ValueError) as err:
        plan_prefill(args.pop("prefix_lens"), args.pop("extend_lens"), **args)
    assert message in str(err.value)


def test_rank_and_request_bounds():
    plan = plan_prefill([0], [10], cp_size=2, page_size=4)
    with pytest.raises(ValueError, match="rank must be in"):
        plan.rank(2)
    with pytest.raises(ValueError, match="request index must be in"):
        plan.page_owners(1)
    with pytest.raises(ValueError, match="request index must be in"):
        plan.last_token_owner(-1)


# ------------------------------------------------------------------ bounds
@pytest.mark.parametrize(
    "prefix,extend,kwargs,message",
    [
        ([0], [2**63 - 1], {}, "request 0: extend length must be < 2**31, got 9223372036854775807"),
        ([0, 0], [5, 2**31], {}, "request 1: extend length must be < 2**31, got 2147483648"),
        ([2**40], [5], {}, "request 0: prefix length must be < 2**31, got 1099511627776"),
        # Each length fits, the batch's full view does not: 2**30 + 2**30 rows.
        ([0, 0], [2**30, 2**30], dict(page_size=1), "full KV view would have 2147483648 rows"),
        # Page rounding pushes the view past the bound: 2**31 - 1 tokens in pages of 64.
        ([0], [2**31 - 1], {}, "full KV view would have 2147483648 rows"),
        ([0], [5], dict(cp_size=1025), "cp_size must be <= 1024, got 1025"),
        ([0], [5], dict(page_size=2**31), "page_size must be < 2**31, got 2147483648"),
        ([0], [5], dict(row_align=2**31), "row_align must be < 2**31, got 2147483648"),
        # cp * M gathered rows: 2 ranks x (2**30 + 1) rows.
        ([0], [5], dict(row_align=2**30 + 1), "all-gather of compute rows would have cp_size 2 x 1073741825 rows"),
        ([0] * 2049, [1] * 2049, dict(cp_size=1024), "2049 requests x 2048 chunks = 4196352 cells, more than 4194304"),
    ],
)
def test_lengths_and_sizes_are_bounded(prefix, extend, kwargs, message):
    args = dict(cp_size=2, page_size=64)
    args.update(kwargs)
    with pytest.raises(ValueError) as err:
        plan_prefill(prefix, extend, **args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_lengths_at_the_bound_do_not_wrap():
    # The largest page-aligned batch: its coordinates stay positive and exact (no int64 wrap, no int32 overflow).
    plan = plan_prefill([2**31 - 2**20 - 64], [2**20], cp_size=8, page_size=64)
    assert plan.kv_lens.tolist() == [2**31 - 64] and plan.kv_start.tolist() == [0]
    assert plan.cp_size * plan.num_rows <= 2**31 - 1
    rank, row = plan.last_token_owner(0)
    assert plan.rank(rank).positions[row] == 2**31 - 64 - 1
    assert plan_prefill([0], [5], cp_size=1024, page_size=64).num_rows == 5  # the largest cp is accepted
    assert plan_prefill([0] * 2048, [1] * 2048, cp_size=1024, page_size=64).num_requests == 2048


def test_report_and_dict_do_not_build_rows_per_rank(monkeypatch):
    """The ``cpgraph plan`` report reads the chunk table: O(requests * cp), never one rank bundle per rank."""
    from cpgraph.plan import plan as plan_mod
    from cpgraph.plan.render import render_plan

    plan = plan_prefill([0, 64], [5, 700], cp_size=1024, page_size=4)
    expected_dict = plan.to_dict()
    calls = {"last": 0}
    compute_last = plan_mod.CPPlan._compute_last_token_rank_row

    def counted(self):
        calls["last"] += 1
        return compute_last(self)

    def forbidden(self, *a, **k):
        raise AssertionError("rendering built a full rank bundle")

    monkeypatch.setattr(plan_mod.CPPlan, "_compute_last_token_rank_row", counted)
    monkeypatch.setattr(plan_mod.CPPlan, "rank", forbidden)
    fresh = plan_prefill([0, 64], [5, 700], cp_size=1024, page_size=4)
    text = render_plan(fresh)
    assert fresh.to_dict() == expected_dict
    assert calls["last"] == 1  # per-request last-token lookups share one O(B * cp) computation
    lines = text.splitlines()
    assert sum(line.startswith("  rank ") for line in lines) == 1024
    assert "  rank 1023: 0 valid row(s): (none)" in lines
    # Request 1's 175 pages in 2048 chunks: 175 one-page chunks, each on its own rank.
    assert "p16->r0, p17->r1" in text


def test_report_merges_touching_chunks_of_one_rank():
    from cpgraph.plan.render import render_plan

    text = render_plan(plan_prefill([4, 0], [13, 6], cp_size=2, page_size=4))
    assert "  rank 1: 10 valid row(s): req0[pos 8-15] req1[pos 4-5]" in text.splitlines()
    assert "pages: p1->r0, p2-3->r1, p4->r0" in text


def test_cli_plan_huge_cp_is_one_line_error(capsys):
    from cpgraph.cli import main

    assert main(["plan", "--extend", "5", "--cp", "10000000"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cp_size must be <= 1024, got 10000000" in err and "\n" not in err


def test_materialize_bounds_slots_and_gathered_rows():
    from cpgraph.plan import materialize_descriptors

    plan = plan_prefill([64], [5], cp_size=2, page_size=64)
    with pytest.raises(ValueError, match=r"page 33554432 at request 0, prefix page 0 has slots past 2147483647"):
        materialize_descriptors(plan, [[0]], [[2**25]], rank=0)
    assert materialize_descriptors(plan, [[0]], [[2**25 - 1]], rank=0).send_slots.max() == 2**31 - 1
    big = plan_prefill([2**30], [5], cp_size=2, page_size=2**20)  # 1024 prefix pages, all on rank 0
    with pytest.raises(ValueError, match=r"all-gather would have 2 ranks x \(1073741824 prefix \+ 5 compute\)"):
        materialize_descriptors(big, [[0] * 1024], [list(range(1024))], rank=0)


def _general_plan(prefix, extend, page, align):
    """The general path of ``plan_prefill`` (NumPy int lengths skip the one-request fast path)."""
    return plan_prefill([np.int64(prefix)], [np.int64(extend)], cp_size=1, page_size=page, row_align=align)


def _assert_same_plan(fast, slow):
    assert type(fast) is type(slow)
    a, b = vars(fast), vars(slow)
    assert a.keys() == b.keys()
    for k in a:
        if k == "split":
            continue
        x, y = a[k], b[k]
        if isinstance(y, np.ndarray):
            assert isinstance(x, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape, k
            assert np.array_equal(x, y), k
        else:
            assert type(x) is type(y) and x == y, k
    for k in ("cp_size", "page_size"):
        assert getattr(fast.split, k) == getattr(slow.split, k)
    for k in ("extend_lens", "num_pages", "page_start", "page_end", "tok_start", "tok_end"):
        x, y = getattr(fast.split, k), getattr(slow.split, k)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), k
    assert fast.extend_lens is fast.split.extend_lens and fast.num_pages is fast.split.num_pages  # as __init__
    assert json.dumps(fast.to_dict(), sort_keys=True) == json.dumps(slow.to_dict(), sort_keys=True)
    rf, rs = fast.rank(0, rerange=True), slow.rank(0, rerange=True)
    for k, t in rs.tensors().items():
        assert torch.equal(rf.tensors()[k], t), k
    assert (rf.num_rows, rf.num_valid, rf.compute_padding, rf.static_padding) == \
        (rs.num_rows, rs.num_valid, rs.compute_padding, rs.static_padding)


@pytest.mark.parametrize("page", [1, 2, 16, 64])
@pytest.mark.parametrize("align", [1, 3, 16])
def test_one_request_fast_path_equals_the_general_path(page, align):
    from cpgraph.plan import plan as plan_mod

    for extend in (1, 2, page - 1, page, page + 1, 2 * page, 3 * page + 1, 377):
        if extend < 1:
            continue
        for prefix in (0, page, 5 * page):
            fast = plan_prefill([prefix], [extend], cp_size=1, page_size=page, row_align=align)
            assert plan_mod._one_request_plan([prefix], [extend], 1, page, align) is not None  # it is the fast path
            _assert_same_plan(fast, _general_plan(prefix, extend, page, align))


@given(st.integers(0, 40), st.integers(1, 5000), st.sampled_from([1, 4, 16, 64]), st.integers(1, 100))
@settings(max_examples=200, deadline=None)
def test_one_request_fast_path_equals_the_general_path_random(prefix_pages, extend, page, align):
    _assert_same_plan(plan_prefill((prefix_pages * page,), (extend,), cp_size=1, page_size=page, row_align=align),
                      _general_plan(prefix_pages * page, extend, page, align))


@pytest.mark.parametrize("args", [
    ([0], [0], 1, 16, 1), ([-16], [5], 1, 16, 1), ([8], [5], 1, 16, 1), ([0], [5], 1, 12, 1), ([0], [5], 1, 16, 0),
    ([0], [True], 1, 16, 1), ([0], [5], True, 16, 1), ([0], [5], 2, 16, 1), ([0, 0], [5, 5], 1, 16, 1),
    ([0], [2**31], 1, 16, 1), ([2**31 - 16], [17], 1, 16, 1), ([0], [5.0], 1, 16, 1)])
def test_one_request_fast_path_leaves_the_unusual_to_the_general_path(args):
    from cpgraph.plan import plan as plan_mod

    assert plan_mod._one_request_plan(*args) is None  # the general path checks it (and raises where it is bad)
