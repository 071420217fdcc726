"""Row scopes (CP-local vs global rows) are stated facts of the graph, checked before any pass runs.

``cpgraph::row_scope`` is the statement; ``graph_facts.read_row_scopes`` (run
by the pass manager first) refuses graphs where a pass would have to guess.
Graphs here are traced with ``make_fx`` (no compile): every ``take_rows`` by
a graph-input index is an output selection, as at a model's top level.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.library import opcheck

import cpgraph.ops  # noqa: F401
import cpgraph.ops.row_scope  # noqa: F401
from cpgraph.passes.graph_facts import ROW_SCOPE, PassMatchError, read_row_scopes, row_scope_of

ops = torch.ops.cpgraph


def _trace(fn):
    x, idx = torch.randn(6, 4), torch.tensor([1, 4])
    return make_fx(fn)(x, idx)


def _markers(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "row_scope" in str(n.target)]


@pytest.mark.parametrize("shape", [(3, 2), (0, 5), (4,)])
def test_row_scope_opcheck(shape):
    for scope in ("local", "global"):
        opcheck(ops.row_scope.default, (torch.randn(shape), scope))
    x = torch.randn(shape)
    assert torch.equal(ops.row_scope(x, "local"), x)


def test_row_scope_rejects_unknown_scope():
    with pytest.raises(ValueError, match="scope must be one of"):
        ops.row_scope(torch.randn(2, 2), "replicated")


def test_stated_graph_is_recorded_and_the_markers_removed():
    def fn(x, idx):
        h = ops.row_scope(x, "local")  # an input stated local (the draft's hidden rows)
        y = (h * 2).relu()
        last = ops.take_rows(y, idx)
        return ops.row_scope(last @ torch.ones(4, 3), "global"), ops.row_scope(y + 1, "local")

    gm = _trace(fn)
    scopes = read_row_scopes(gm, cp_size=2)
    assert not _markers(gm)
    assert sorted(scopes.values()) == ["global", "local", "local"]
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert row_scope_of(placeholder) == "local" and placeholder.meta[ROW_SCOPE] == "local"
    gm.recompile()
    x, idx = torch.randn(6, 4), torch.tensor([1, 4])
    out = gm(x, idx)
    torch.testing.assert_close(out[0], (x * 2).relu()[idx] @ torch.ones(4, 3))


def test_unstated_output_fails():
    def fn(x, idx):
        return ops.row_scope(ops.take_rows(x, idx), "global"), x * 3  # second output states nothing

    with pytest.raises(PassMatchError, match="state no row scope"):
        read_row_scopes(_trace(fn), cp_size=1)


def test_cp_graph_with_selections_but_no_statement_fails():
    def fn(x, idx):
        return ops.take_rows(x, idx)

    with pytest.raises(PassMatchError, match="would have to guess"):
        read_row_scopes(_trace(fn), cp_size=2)
    assert read_row_scopes(_trace(fn), cp_size=1) == {}  # one device: nothing to gather, nothing to guess


def test_global_output_from_local_rows_without_a_selection_fails():
    def fn(x, idx):
        h = ops.row_scope(x, "local")
        return ops.row_scope(h.sum(0, keepdim=True), "global"), ops.row_scope(ops.take_rows(h, idx), "global")

    with pytest.raises(PassMatchError, match="stated 'global' but is computed from local rows"):
        read_row_scopes(_trace(fn), cp_size=2)


def test_selection_feeding_a_local_output_fails():
    def fn(x, idx):
        sel = ops.take_rows(x, idx)
        return ops.row_scope(sel, "local"), ops.row_scope(sel * 2, "global")

    with pytest.raises(PassMatchError, match="stated 'local' but is computed from gathered rows"):
        read_row_scopes(_trace(fn), cp_size=2)


def test_selection_feeding_no_global_output_fails():
    def fn(x, idx):
        sel = ops.take_rows(x, idx)
        return ops.row_scope(x + sel.sum(), "local")

    with pytest.raises(PassMatchError, match="feeds no output stated 'global'"):
        read_row_scopes(_trace(fn), cp_size=2)
