"""Row ops against plain-Python brute force, opcheck on several input sets, and bad input."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import cpgraph.ops  # noqa: F401  (registers the ops)
from cpgraph.plan import plan_prefill

ops = torch.ops.cpgraph


def brute_take(x, index):
    """Rows by index; an index outside ``[0, N)`` (``-1`` or any other) is a zero row."""
    n = x.shape[0]
    width = x[0].numel() if n else 0
    flat = x.reshape(n, width).tolist()
    out = [flat[i] if 0 <= i < n else [0.0] * width for i in index.tolist()]
    return torch.tensor(out, dtype=x.dtype).reshape(len(out), *x.shape[1:])


def row_kinds():
    """row_kind vectors from real plans: tiny extends, row_align padding, a full rank."""
    out = []
    for prefix, extend, cp, page, align in [([0], [1], 4, 4, 1), ([0, 8], [13, 6], 2, 4, 4), ([0] * 3, [9, 1, 30], 3, 2, 8)]:
        plan = plan_prefill(prefix, extend, cp_size=cp, page_size=page, row_align=align)
        out += [plan.rank(r).row_kind for r in range(cp)]
    return out


@pytest.mark.parametrize("shape,index", [((7, 3), [2, -1, 0, 6]), ((5,), [4, 4, -1]), ((6, 2, 3), [-1, -1]), ((4, 8), [])])
def test_take_rows_matches_brute_force(shape, index):
    x = torch.randn(shape)
    idx = torch.tensor(index, dtype=torch.int64)
    got = ops.take_rows(x, idx)
    assert torch.equal(got, brute_take(x, idx))
    assert torch.equal(ops.take_rows(x, idx.to(torch.int32)), got)


@pytest.mark.parametrize(
    "args",
    [
        (torch.randn(7, 3), torch.tensor([2, -1, 0, 6])),
        (torch.randn(9, 2, 4, dtype=torch.bfloat16), torch.tensor([8, 0, 0], dtype=torch.int32)),
        (torch.randint(0, 255, (5, 16), dtype=torch.uint8), torch.tensor([-1, 1, 2, 3, 4])),
    ],
)
def test_take_rows_opcheck(args):
    opcheck(ops.take_rows.default, args)


@pytest.mark.parametrize("num_rows,valid", [(6, [0, 2, 5]), (4, [0, 1, 2, 3]), (5, [3]), (3, [])])
def test_compact_restore_round_trip(num_rows, valid):
    x = torch.randn(num_rows, 4)
    vr = torch.tensor(valid, dtype=torch.int64)
    y = ops.compact_valid(x, vr)
    assert y.tolist() == [x[i].tolist() for i in valid]
    back = ops.restore_compute(y, vr, num_rows)
    for r in range(num_rows):
        expect = x[r] if r in valid else torch.zeros(4)
        assert torch.equal(back[r], expect)
    opcheck(ops.compact_valid.default, (x, vr))
    opcheck(ops.restore_compute.default, (y, vr, num_rows))


@pytest.mark.parametrize("row_kind", row_kinds())
def test_static_forms_match_brute_force(row_kind):
    M = row_kind.shape[0]
    x = torch.randn(M, 3)
    y, num_valid = ops.compact_valid_static(x, row_kind)
    valid = [r for r in range(M) if int(row_kind[r]) == 0]
    assert num_valid.tolist() == [len(valid)]
    assert y.shape == x.shape
    for j in range(M):
        expect = x[valid[j]] if j < len(valid) else torch.zeros(3)
        assert torch.equal(y[j], expect)
    back = ops.restore_compute_static(y, row_kind)
    for r in range(M):
        assert torch.equal(back[r], x[r] if r in valid else torch.zeros(3))
    # Same result as the dynamic form over the planner's valid rows.
    vr = torch.tensor(valid, dtype=torch.int64)
    assert torch.equal(back, ops.restore_compute(ops.compact_valid(x, vr), vr, M))


@pytest.mark.parametrize("row_kind", row_kinds()[:4])
def test_static_forms_opcheck(row_kind):
    x = torch.randn(row_kind.shape[0], 2, 3)
    opcheck(ops.compact_valid_static.default, (x, row_kind))
    y, _ = ops.compact_valid_static(x, row_kind)
    opcheck(ops.restore_compute_static.default, (y, row_kind))


def test_static_forms_trace_without_data_dependent_shapes():
    def f(x, row_kind):
        y, n = ops.compact_valid_static(x, row_kind)
        return ops.restore_compute_static(y * 2, row_kind), n

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    for rk in row_kinds()[:3]:
        x = torch.randn(rk.shape[0], 5)
        out, n = compiled(x, rk)
        ref, nref = f(x, rk)
        assert torch.equal(out, ref) and torch.equal(n, nref)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: ops.take_rows(torch.randn(3, 2), torch.tensor([0.0])), "argument 'index' must have dtype"),
        (lambda: ops.take_rows(torch.randn(3, 2), torch.tensor([[0]])), "argument 'index' must be 1-D"),
        (lambda: ops.take_rows(torch.tensor(1.0), torch.tensor([0])), "argument 'x' must have at least 1 dimension"),
        (lambda: ops.take_rows(torch.randn(3, 2, device="meta"), torch.tensor([0])), "must be on one device"),
        (lambda: ops.restore_compute(torch.randn(3, 2), torch.tensor([0, 1]), 4), "argument 'valid_rows' must have shape"),
        (lambda: ops.compact_valid_static(torch.randn(3, 2), torch.zeros(4, dtype=torch.int64)), "argument 'row_kind'"),
    ],
)
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_debug_flag_checks_index_range(monkeypatch):
    x = torch.randn(3, 2)
    bad = torch.tensor([5, 1, -3])
    monkeypatch.setenv("CPGRAPH_DEBUG", "1")
    with pytest.raises(ValueError, match="outside"):
        ops.take_rows(x, bad)
    with pytest.raises(ValueError, match="'valid_rows'"):
        ops.compact_valid(x, torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="'valid_rows'"):
        ops.restore_compute(x, torch.tensor([0, 1, 9]), 4)
    monkeypatch.setenv("CPGRAPH_DEBUG", "0")
    # Without the flag an out-of-range id means "no row", like -1 (no error, no foreign bytes).
    assert torch.equal(ops.take_rows(x, bad), torch.stack([torch.zeros(2), x[1], torch.zeros(2)]))


# Ids the index rule must treat as "no row" (N = 5 source rows below).
OUT_OF_RANGE = [-1, -2, -7, 5, 6, 1000, 2**31 - 1, -(2**31), 2**40, -(2**40)]


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_out_of_range_ids_are_no_row(monkeypatch, idx_dtype):
    monkeypatch.delenv("CPGRAPH_DEBUG", raising=False)
    x = torch.randn(5, 3)
    ids = [i for i in OUT_OF_RANGE if idx_dtype == torch.int64 or -(2**31) <= i < 2**31]
    index = torch.tensor([0, *ids, 4, 2], dtype=idx_dtype)
    want = brute_take(x, index.to(torch.int64))
    assert torch.equal(ops.take_rows(x, index), want)
    assert torch.equal(ops.compact_valid(x, index), want)
    # into an empty tensor, every id is "no row"
    assert torch.equal(ops.take_rows(x[:0], index), torch.zeros(index.shape[0], 3))
    # restore_compute drops y rows whose target is out of range; the others land
    y = torch.randn(index.shape[0], 3)
    back = ops.restore_compute(y, index, 5)
    expect = torch.zeros(5, 3)
    for k, t in enumerate(index.tolist()):
        if 0 <= t < 5:
            expect[t] = y[k]
    assert torch.equal(back, expect)


def test_provider_is_selected_and_logged_once(caplog):
    from cpgraph.ops import providers

    calls = []

    def fake_provider(x, index):
        calls.append(1)
        return torch.full((index.shape[0], *x.shape[1:]), 7.0)

    providers.register_provider("take_rows", "cpu", "test-provider", fake_provider)
    try:
        with caplog.at_level("INFO", logger="cpgraph.ops"):
            ops.take_rows(torch.randn(3, 2), torch.tensor([0]))
            out = ops.take_rows(torch.randn(3, 2), torch.tensor([1, 2]))
        assert torch.equal(out, torch.full((2, 2), 7.0)) and len(calls) == 2
        logged = [r for r in caplog.records if "take_rows" in r.getMessage()]
        assert len(logged) == 1 and "test-provider" in logged[0].getMessage()
        assert providers.active_provider("take_rows", "cpu") == "test-provider"
    finally:
        providers.unregister_provider("take_rows", "cpu")
    assert providers.active_provider("take_rows", "cpu") == "reference"
