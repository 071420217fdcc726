"""Expert-parallel pass: send every MoE row to the ranks that hold its routed experts.

With ``CPConfig(ep=cp_size)`` rank ``r`` holds only experts
``[r*E/ep, (r+1)*E/ep)`` (the model was built or loaded as that shard), but
the model's forward is still the single-device one: its
``cpgraph::moe_experts`` call sees global expert ids and local weights.
This pass wraps every such call in the expert-parallel round trip
(``cpgraph/ops/expert_parallel.py``, ``docs/expert_parallel.md``):

Before::

    y = moe_experts(x, ids, w, gate_up_local, down_local, num_valid)

After::

    rx, rids, nrecv, order, slot = moe_dispatch(x, ids, num_valid, E, slots, group, ep)
    ry = moe_experts(rx, rids, full([n, 1], 1.0), gate_up_local, down_local, nrecv)
    y  = moe_combine(ry, order, slot, w, group, ep)

It runs right after the MoE compaction (:func:`compact_moe.compact_moe_rows`
calls it), so ``x`` holds real rows first and ``num_valid`` -- the count the
MoE derives from the row windows -- bounds what is sent: padding rows never
take an expert's capacity.  ``E`` is the local expert count times ``ep``;
where the graph shows the router's top-k the pass checks that it scores
exactly ``E`` experts, and with ``ep == 1`` that the weights are not a shard
(a shard without dispatch would silently drop the routes to other ranks).
``slots`` is ``CPConfig.ep_capacity_slots`` or the worst case
``min(top_k, E / ep)``, with which no route can overflow.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import cpgraph.ops.expert_parallel  # noqa: F401  (registers moe_dispatch / moe_combine)

from .config import CPConfig
from .fx_utils import find_nodes, insert_call, is_op
from .graph_facts import PassMatchError, tensor_val

_ARGS = ("x", "topk_ids", "topk_w", "gate_up", "down", "num_valid",
         "gate_up_scale", "down_scale", "block_n", "block_k", "act_scale_pow2")
# The FP8 routed experts' block scales and recipe (``FP8Experts``) travel with the re-inserted call.
_FP8_ARGS = _ARGS[6:]
# Ops that carry expert ids through unchanged (dtype casts, views) between the router's top-k and the experts.
_PASS_THROUGH = ("prims.convert_element_type", "aten._to_copy", "aten.view", "aten.reshape", "aten.clone",
                 "aten.alias")


def router_width(ids: fx.Node) -> int | None:
    """How many experts the router scored for these ids (the selection input's last dim), or ``None`` if unseen."""
    node = ids
    for _ in range(16):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return None
        if node.target is operator.getitem:
            src = node.args[0]
            # aten.topk's indices (a model's own router), or cpgraph::moe_route's ids (the DSA models')
            if isinstance(src, fx.Node) and ((is_op(src, "aten.topk") and node.args[1] == 1)
                                             or (is_op(src, "cpgraph.moe_route") and node.args[1] == 0)):
                scores = tensor_val(src.args[0])
                width = scores.shape[-1] if scores is not None else None
                return width if isinstance(width, int) else None
            return None
        if not is_op(node, *_PASS_THROUGH):
            return None
        node = node.args[0]
    return None


def _experts_args(node: fx.Node) -> dict:
    args = dict(zip(_ARGS, node.args))
    args.update(node.kwargs)
    args.setdefault("num_valid", None)
    return args


def _getitem(graph: fx.Graph, node: fx.Node, i: int) -> fx.Node:
    item = graph.call_function(operator.getitem, (node, i))
    item.meta["val"] = node.meta["val"][i]
    return item


def _size(graph: fx.Graph, node: fx.Node, dim: int):
    """``node``'s size along ``dim``: an int, or a ``sym_size`` node under dynamic shapes."""
    size = tensor_val(node).shape[dim]
    if isinstance(size, int):
        return size
    sym = graph.call_function(torch.ops.aten.sym_size.int, (node, dim))
    sym.meta["val"] = size
    return sym


def dispatch_moe_experts(gm: fx.GraphModule, cfg: CPConfig) -> fx.GraphModule:
    """Wrap every ``moe_experts`` call in ``moe_dispatch`` / ``moe_combine`` when ``cfg.ep > 1``."""
    graph = gm.graph
    for node in find_nodes(graph, "cpgraph.moe_experts"):
        a = _experts_args(node)
        local = tensor_val(a["gate_up"]).shape[0]
        width = router_width(a["topk_ids"])
        if cfg.ep == 1:
            if width is not None and width != local:
                raise PassMatchError(
                    f"{node.name}: the router scores {width} experts but the experts hold {local}; "
                    f"a model holding an expert shard needs CPConfig(ep=cp_size)", rule="expert-shard", nodes=[node])
            continue
        num_experts = local * cfg.ep
        if width is not None and width != num_experts:
            raise PassMatchError(
                f"{node.name}: the router scores {width} experts but {local} local experts x ep {cfg.ep} = "
                f"{num_experts}; load each rank's shard with ep_size={cfg.ep}", rule="expert-shard", nodes=[node])
        top_k = tensor_val(a["topk_ids"]).shape[1]
        slots = cfg.ep_capacity_slots or min(top_k, local)
        x_val = tensor_val(a["x"])
        with graph.inserting_before(node):
            sent = insert_call(graph, torch.ops.cpgraph.moe_dispatch.default,
                               (a["x"], a["topk_ids"], a["num_valid"], num_experts, slots, cfg.group_name, cfg.ep))
            rx, rids, nrecv, order, slot = (_getitem(graph, sent, i) for i in range(5))
            ones = insert_call(graph, torch.ops.aten.full.default, ([_size(graph, rids, 0), 1], 1.0),
                               {"dtype": torch.float32, "device": x_val.device, "pin_memory": False})
            fp8 = {k: a[k] for k in _FP8_ARGS if k in a}
            ry = insert_call(graph, torch.ops.cpgraph.moe_experts.default,
                             (rx, rids, ones, a["gate_up"], a["down"], nrecv), fp8)
            y = insert_call(graph, torch.ops.cpgraph.moe_combine.default,
                            (ry, order, slot, a["topk_w"], cfg.group_name, cfg.ep))
        node.replace_all_uses_with(y)
        graph.erase_node(node)
    return gm
