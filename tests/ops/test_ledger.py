"""The provider report counts what computed each op call (cpgraph/ops/ledger.py), not what was registered."""

from __future__ import annotations

import pytest
import torch

import cpgraph.ops  # noqa: F401  (registers the ops)
from cpgraph.ops import ledger
from cpgraph.ops.providers import calls, register_provider, reset_calls, selected, unregister_provider
from cpgraph.ops.rows import take_rows_reference

ops = torch.ops.cpgraph


@pytest.fixture
def handing_on():
    """A ``take_rows`` provider on cpu that hands rows with a negative index on to the reference, like a kernel
    refusing a shape: each call is counted under what computed it."""

    def provider(x, index):
        if bool((index < 0).any()):  # test-only data check; a real provider decides from shapes and dtypes
            ledger.fell_back("take_rows", "cpu", "reference", "a -1 index (test rule)", instead_of="handing_on")
            return take_rows_reference(x, index)
        return x[index] * 1

    register_provider("take_rows", "cpu", "handing_on", provider)
    yield
    unregister_provider("take_rows", "cpu")


def test_calls_are_counted_under_the_implementation_that_ran(handing_on, caplog):
    x = torch.randn(5, 3)
    with caplog.at_level("WARNING", logger="cpgraph.ops"):
        for _ in range(3):
            ops.take_rows(x, torch.tensor([0, 4]))
        for _ in range(2):
            ops.take_rows(x, torch.tensor([-1, 2]))
    assert calls("cpu")["take_rows"] == [
        {"implementation": "handing_on", "calls": 3, "reason": None},
        {"implementation": "reference", "calls": 2, "reason": "a -1 index (test rule)"},
    ]
    assert selected("cpu")["take_rows"] == "handing_on+reference"
    assert ledger.describe(calls("cpu")["take_rows"]) == "handing_on 3 calls, reference 2 calls (a -1 index (test rule))"
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "take_rows" in r.getMessage()]
    assert len(warned) == 1  # once per (op, reason), not per call
    assert "reference runs instead of handing_on: a -1 index (test rule)" in warned[0].getMessage()


def test_registration_and_reset_forget_the_counts(handing_on):
    ops.take_rows(torch.randn(3, 2), torch.tensor([1]))
    assert calls("cpu")["take_rows"][0]["implementation"] == "handing_on"
    unregister_provider("take_rows", "cpu")  # the old counts named other code
    assert "take_rows" not in calls("cpu")
    ops.take_rows(torch.randn(3, 2), torch.tensor([1]))
    assert calls("cpu")["take_rows"] == [{"implementation": "reference", "calls": 1, "reason": None}]
    reset_calls()
    assert calls("cpu") == {}


def test_a_call_that_raises_is_not_counted():
    def broken(x, index):
        raise RuntimeError("provider failed")

    register_provider("take_rows", "cpu", "broken", broken)
    try:
        with pytest.raises(RuntimeError, match="provider failed"):
            ops.take_rows(torch.randn(3, 2), torch.tensor([1]))
        assert "take_rows" not in calls("cpu")
    finally:
        unregister_provider("take_rows", "cpu")


def test_a_kernel_called_directly_records_its_own_call():
    """Outside an op call (a benchmark calling a kernel function) a fallback is still one counted call."""
    reset_calls()
    ledger.fell_back("sparse_mla", "cpu", "reference", "direct call (test)", instead_of="triton")
    assert calls("cpu") == {"sparse_mla": [{"implementation": "reference", "calls": 1, "reason": "direct call (test)"}]}


def test_nested_ops_keep_their_own_counts():
    """A provider of one op that calls another op: the inner op's fallback does not relabel the outer call."""

    def outer(x, index):
        ledger.ran_as("take_rows", "cpu", "outer_variant", "test variant")
        return ops.paged_gather(x, index)  # an op of its own, counted under its own name

    reset_calls()
    register_provider("take_rows", "cpu", "outer", outer)
    try:
        ops.take_rows(torch.randn(4, 2), torch.tensor([3, 0]))
        got = calls("cpu")
    finally:
        unregister_provider("take_rows", "cpu")
    assert got["take_rows"] == [{"implementation": "outer_variant", "calls": 1, "reason": "test variant"}]
    assert got["paged_gather"] == [{"implementation": "reference", "calls": 1, "reason": None}]


def test_compiled_graphs_count_every_call():
    """A compiled graph calls the op body like eager code: each call of the compiled function is counted."""

    def f(x, index):
        return ops.take_rows(x, index) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x, index = torch.randn(6, 3), torch.tensor([5, -1, 0])
    reset_calls()
    for _ in range(3):
        out = compiled(x, index)
    assert torch.equal(out, f(x, index))
    assert calls("cpu")["take_rows"] == [{"implementation": "reference", "calls": 4, "reason": None}]  # 3 + eager
    torch._dynamo.reset()


def test_recording_keeps_the_first_calls_arguments_and_still_counts(handing_on):
    from cpgraph.ops.providers import recording_calls, select

    reset_calls()
    x = torch.randn(6, 4)
    idx = [torch.tensor([0, 5]), torch.tensor([2]), torch.tensor([1, 1, 3])]
    with recording_calls("take_rows", "cpu", limit=2) as rec:
        outs = [ops.take_rows(x, i) for i in idx]
        with pytest.raises(RuntimeError, match="already being recorded"):
            with recording_calls("take_rows", "cpu"):
                pass
    assert [a[1].tolist() for a, _ in rec.calls] == [[0, 5], [2]]  # the limit, in call order
    assert rec.calls[0][0][0] is x  # the tensors themselves, not copies
    assert rec.name == "handing_on"
    assert torch.equal(rec.fn(*rec.calls[1][0]), outs[1])  # the implementation, replayable
    assert calls("cpu")["take_rows"] == [{"implementation": "handing_on", "calls": 3, "reason": None}]
    rec.fn(x, idx[0])  # a replay is not a call of the op: not counted
    assert calls("cpu")["take_rows"][0]["calls"] == 3
    assert isinstance(select("take_rows", "cpu", take_rows_reference), ledger.Counted)  # the block left nothing behind
    ops.take_rows(x, idx[0])
    assert len(rec.calls) == 2
