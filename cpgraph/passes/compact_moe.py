"""MoE pass: padding rows never reach the router.

A rank's compute rows include dummies (CP compute padding, static padding).
MoE routing must see only real rows: a dummy row routed to an expert would
consume that expert's capacity in a token-dispatch implementation and can
push real rows out, which corrupts tiny-extend batches (docs/contracts.md).  The model's
MoE is written for one device and knows nothing of padding; this pass wraps
every MoE module's region (found by module class through
``nn_module_stack``, ``CPConfig.moe_modules``) with the static-shape
compaction ops:

Before::

    y = <MoE region>(h)               # router, experts, shared experts, combine

After::

    row_kind = ke <= ks               # 1 = dummy row (empty key window), once per graph
    hc, num_valid = compact_valid_static(h, row_kind)   # real rows first, dummies zeroed
    yc = <MoE region>(hc)
    y  = restore_compute_static(yc, row_kind)            # compute layout, dummies exact 0

The static form keeps every shape independent of data (CUDA-graph capture
across batches of one bucket); ``num_valid`` stays on the device for
providers that bound their work: a ``moe_experts`` call of the region that
the model gave no real-row count (a model written without padding in mind)
gets it.  A ``moe_experts`` call outside every region is an error (rule
``moe-experts-in-region`` of docs/model_contract.md): its padding rows would
reach the router unnoticed.  Rows are row-local through the region, so
valid rows' outputs are unchanged and dummies come back as exact zeros.

With expert parallelism (``CPConfig.ep > 1``) the pass then wraps the routed
experts in the dispatch/combine round trip (:mod:`.expert_parallel`): the
rows sent are the compacted real rows only.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .cleanup import sort_topologically
from .config import CPConfig
from .expert_parallel import dispatch_moe_experts
from .fx_utils import VIEW_OPS, find_nodes, insert_call, is_op
from .graph_facts import PassMatchError, module_regions, order_of, row_windows, tensor_val


# Position of ``num_valid`` in ``cpgraph::moe_experts(x, topk_ids, topk_w, gate_up, down, num_valid, ...)``.
_NUM_VALID = 5


def _region_io(nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    inside = set(nodes)
    inputs = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a in inside or a in inputs:
                continue
            v = tensor_val(a)
            # The activation is the one tensor computed in the graph that flows in;
            # weights and buffers are graph inputs (lifted parameters).  Sizes are not
            # compared: under dynamic shapes the row counts of different inputs are
            # distinct symbols.
            if v is not None and v.dim() >= 1 and a.op == "call_function":
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    return inputs, outputs


def _rows_of(node, xc: fx.Node) -> bool:
    """Whether ``node`` is ``xc`` or a reshape of it that keeps its rows (``[M, 1, H] -> [M, H]``)."""
    for _ in range(8):
        if node is xc:
            return True
        if not (isinstance(node, fx.Node) and is_op(node, *VIEW_OPS)):
            return False
        v, src = tensor_val(node), tensor_val(node.args[0])
        if v is None or src is None or v.dim() < 1 or src.dim() < 1:
            return False
        if not statically_known_true(v.shape[0] == src.shape[0]):
            return False
        node = node.args[0]
    return False


def _count_real_rows(graph: fx.Graph, nodes: list[fx.Node], xc: fx.Node, count: fx.Node) -> dict[fx.Node, fx.Node]:
    """Hand the compaction's real-row count to the region's ``moe_experts`` calls that were given none.

    A model's MoE knows nothing of padding and may call the experts without
    ``num_valid``; after compaction the real rows lead, so their count bounds
    the experts' work (and the expert-parallel dispatch) to real rows.  Only
    calls whose rows are the compacted input's rows get it.  Each such call
    is re-inserted (not edited: Inductor checks a traced call's arguments
    against the ones it was traced with).  Returns ``{old call: new call}``.
    """
    replaced = {}
    for node in nodes:
        if not is_op(node, "cpgraph.moe_experts") or not _rows_of(node.args[0], xc):
            continue
        args, kwargs = list(node.args), dict(node.kwargs)
        given = args[_NUM_VALID] if len(args) > _NUM_VALID else kwargs.get("num_valid")
        if given is not None:
            continue
        if len(args) > _NUM_VALID:
            args[_NUM_VALID] = count
        elif len(args) == _NUM_VALID and not kwargs:
            args.append(count)
        else:
            kwargs["num_valid"] = count
        with graph.inserting_before(node):
            new = insert_call(graph, torch.ops.cpgraph.moe_experts.default, tuple(args), kwargs)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        replaced[node] = new
    return replaced


def compact_moe_rows(gm: fx.GraphModule, cfg: CPConfig) -> fx.GraphModule:
    """Compact valid rows before every MoE region and restore the compute layout after it."""
    graph = gm.graph
    regions = module_regions(graph, cfg.moe_modules)
    if cfg.moe_modules:
        inside = {n for nodes in regions.values() for n in nodes}
        stray = [n for n in find_nodes(graph, "cpgraph.moe_experts") if n not in inside]
        if stray:
            raise PassMatchError(
                f"moe_experts calls {[n.name for n in stray]} lie outside every MoE region (modules of classes "
                f"{list(cfg.moe_modules)}): their padding rows would reach the router; name the module class that "
                "holds the router and the experts in CPConfig(moe_modules=...)", rule="moe-experts-in-region",
                nodes=stray)
    if not regions:
        return dispatch_moe_experts(gm, cfg)
    windows = row_windows(graph)
    if windows is None:
        raise PassMatchError(f"MoE regions {sorted(regions)} found but no indexer op whose row windows (ks, ke) tell "
                             "real rows from dummies", rule="row-window-present")
    ks, ke = windows
    order = order_of(graph)
    first = min((n for nodes in regions.values() for n in nodes), key=order.get)
    with graph.inserting_before(first):
        dummy = insert_call(graph, torch.ops.aten.le.Tensor, (ke, ks))
        row_kind = insert_call(graph, torch.ops.prims.convert_element_type.default, (dummy, torch.int64))
    for path, nodes in regions.items():
        inputs, outputs = _region_io(nodes)
        if len(inputs) != 1 or len(outputs) != 1:
            raise PassMatchError(
                f"MoE region {path}: expected one computed input and one output, found "
                f"{[n.name for n in inputs]} -> {[n.name for n in outputs]}", rule="moe-region-io",
                nodes=inputs + outputs)
        (x,), (y,) = inputs, outputs
        inside = set(nodes)
        start = min(nodes, key=order.get)
        with graph.inserting_before(start):
            packed = insert_call(graph, torch.ops.cpgraph.compact_valid_static.default, (x, row_kind))
            xc = graph.call_function(operator.getitem, (packed, 0))
            xc.meta["val"] = packed.meta["val"][0]
        for n in nodes:
            if x in n.all_input_nodes:
                n.replace_input_with(x, xc)
        with graph.inserting_after(xc):
            count = graph.call_function(operator.getitem, (packed, 1))
            count.meta["val"] = packed.meta["val"][1]
        replaced = _count_real_rows(graph, nodes, xc, count)
        if not count.users:
            graph.erase_node(count)
        inside = {replaced.get(n, n) for n in nodes}
        y = replaced.get(y, y)
        outside_users = [u for u in y.users if u not in inside]
        with graph.inserting_after(y):
            restored = insert_call(graph, torch.ops.cpgraph.restore_compute_static.default, (y, row_kind))
        for u in outside_users:
            u.replace_input_with(y, restored)
    return dispatch_moe_experts(sort_topologically(gm), cfg)
