"""``reject_host_syncs`` on small FX graphs: every listed sync is flagged, the sized forms pass.

Graphs are built by hand where tracing cannot produce the node (``torch.equal``
and ``bool(t)`` fail under tracing, ``repeat_interleave.self_int`` decomposes),
with fake ``meta["val"]`` on every node as the compiled graphs have; the
tensor-repeats form is also traced, as the compiler would see it.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from cpgraph.passes import HostSyncError
from cpgraph.passes.fx_utils import op_name
from cpgraph.passes.lint import HOST_SYNC_OPS, host_sync_nodes, host_sync_reason, overload_name, reject_host_syncs

aten = torch.ops.aten


def one_call(target, args_of, kwargs=None):
    """A graph ``x (3, 2) float, r (3,) int64 -> target(*args_of(x, r), **kwargs)``; returns it and the call node."""
    g = fx.Graph()
    x, r = g.placeholder("x"), g.placeholder("r")
    with FakeTensorMode():
        x.meta["val"], r.meta["val"] = torch.empty(3, 2), torch.empty(3, dtype=torch.int64)
    node = g.call_function(target, tuple(args_of(x, r)), kwargs or {})
    g.output(node)
    return fx.GraphModule(torch.nn.Module(), g), node


SYNCS = [
    ("item", aten.item.default, lambda x, r: [x]),
    ("_local_scalar_dense", aten._local_scalar_dense.default, lambda x, r: [x]),
    ("equal", aten.equal.default, lambda x, r: [x, x]),
    ("is_nonzero", aten.is_nonzero.default, lambda x, r: [r]),
    ("nonzero", aten.nonzero.default, lambda x, r: [r]),
    ("argwhere", aten.argwhere.default, lambda x, r: [r]),
    ("nonzero_numpy", aten.nonzero_numpy.default, lambda x, r: [r]),
    ("masked_select", aten.masked_select.default, lambda x, r: [x, x]),
    ("bincount", aten.bincount.default, lambda x, r: [r]),
    ("_unique", aten._unique.default, lambda x, r: [r]),
    ("_unique2", aten._unique2.default, lambda x, r: [r]),
    ("unique_consecutive", aten.unique_consecutive.default, lambda x, r: [r]),
    ("unique_dim", aten.unique_dim.default, lambda x, r: [x, 0]),
    ("unique_dim_consecutive", aten.unique_dim_consecutive.default, lambda x, r: [x, 0]),
    ("repeat_interleave.Tensor", aten.repeat_interleave.Tensor, lambda x, r: [r]),
    ("repeat_interleave.self_Tensor", aten.repeat_interleave.self_Tensor, lambda x, r: [x, r, 0]),
    ("repeat_interleave packet, tensor repeats", aten.repeat_interleave, lambda x, r: [x, r]),
]


@pytest.mark.parametrize("target,args_of", [s[1:] for s in SYNCS], ids=[s[0] for s in SYNCS])
def test_each_listed_sync_is_flagged_by_name(target, args_of):
    gm, node = one_call(target, args_of)
    assert host_sync_nodes(gm.graph) == [node]
    with pytest.raises(HostSyncError, match=rf"node '{node.name}' runs {re.escape(overload_name(target))}: "):
        reject_host_syncs(gm)


def test_every_listed_op_is_tested():
    assert {op_name(t) for _, t, _ in SYNCS} == set(HOST_SYNC_OPS) | {"aten.repeat_interleave"}


def test_the_message_says_why():
    gm, _ = one_call(aten.repeat_interleave.self_Tensor, lambda x, r: [x, r, 0])
    with pytest.raises(HostSyncError, match=r"runs aten\.repeat_interleave\.self_Tensor: repeat_interleave with "
                                            r"tensor repeats and no output_size"):
        reject_host_syncs(gm)
    gm, _ = one_call(aten.equal.default, lambda x, r: [x, x])
    with pytest.raises(HostSyncError, match=r"runs aten\.equal\.default: reads a device value on the host: torch.equal"):
        reject_host_syncs(gm)


@pytest.mark.parametrize("target,args_of", [
    (aten.repeat_interleave.Tensor, lambda x, r: [r]),
    (aten.repeat_interleave.self_Tensor, lambda x, r: [x, r, 0]),
    (aten.repeat_interleave, lambda x, r: [x, r]),
], ids=["Tensor", "self_Tensor", "packet"])
def test_repeat_interleave_with_output_size_passes(target, args_of):
    gm, node = one_call(target, args_of, {"output_size": 6})
    assert host_sync_reason(node) is None
    reject_host_syncs(gm)


@pytest.mark.parametrize("target", [aten.repeat_interleave.self_int, aten.repeat_interleave], ids=["self_int", "packet"])
def test_int_repeats_pass(target):
    gm, node = one_call(target, lambda x, r: [x, 2, 0])
    assert host_sync_reason(node) is None
    reject_host_syncs(gm)


def test_symbolic_int_repeats_pass():
    """A SymInt count (a ``sym_size`` node) is still a static repeat count, not a tensor."""
    gm, node = one_call(aten.repeat_interleave, lambda x, r: [x, None, 0])
    with gm.graph.inserting_before(node):
        n = gm.graph.call_function(aten.sym_size.int, (node.args[0], 0))
    n.meta["val"] = 3
    node.args = (node.args[0], n, 0)
    assert host_sync_reason(node) is None


def test_traced_tensor_repeats_flagged_unless_sized():
    """What tracing ``x.repeat_interleave(r, dim=0)`` produces: the ``Tensor`` overload, then ``index_select``."""
    x, r = torch.randn(3, 2), torch.tensor([1, 2, 3])
    unsized = make_fx(lambda x, r: x.repeat_interleave(r, dim=0), tracing_mode="fake")(x, r)
    (node,) = host_sync_nodes(unsized.graph)
    assert node.target is aten.repeat_interleave.Tensor
    sized = make_fx(lambda x, r: x.repeat_interleave(r, dim=0, output_size=6), tracing_mode="fake")(x, r)
    assert host_sync_nodes(sized.graph) == []
