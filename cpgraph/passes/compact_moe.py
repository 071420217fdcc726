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
providers that bound their work.  Rows are row-local through the region, so
valid rows' outputs are unchanged and dummies come back as exact zeros.

With expert parallelism (``CPConfig.ep > 1``) the pass then wraps the routed
experts in the dispatch/combine round trip (:mod:`.expert_parallel`): the
rows sent are the compacted real rows only.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .cleanup import sort_topologically
from .config import CPConfig
from .expert_parallel import dispatch_moe_experts
from .fx_utils import insert_call
from .graph_facts import PassMatchError, module_regions, order_of, row_windows, tensor_val


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


def compact_moe_rows(gm: fx.GraphModule, cfg: CPConfig) -> fx.GraphModule:
    """Compact valid rows before every MoE region and restore the compute layout after it."""
    graph = gm.graph
    regions = module_regions(graph, cfg.moe_modules)
    if not regions:
        return dispatch_moe_experts(gm, cfg)
    windows = row_windows(graph)
    if windows is None:
        raise PassMatchError("MoE regions found but no indexer row windows (ks, ke) to tell real rows from dummies")
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
                f"{[n.name for n in inputs]} -> {[n.name for n in outputs]}"
            )
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
        outside_users = [u for u in y.users if u not in inside]
        with graph.inserting_after(y):
            restored = insert_call(graph, torch.ops.cpgraph.restore_compute_static.default, (y, row_kind))
        for u in outside_users:
            u.replace_input_with(y, restored)
    return dispatch_moe_experts(sort_topologically(gm), cfg)
