"""Attention pass: owner-sharded KV store and one materialisation per layer.

The single-device forward writes this forward's KV rows into the paged cache
and builds each layer's full view with ``kv_compose`` (cached prefix rows
from the pool + fresh rows).  Under CP each rank holds only the pages it
owns, so the full view must be assembled across ranks.  This pass:

1. guards every KV store so only real rows write: the slots become
   ``where(ke > ks, slots, -1)`` (dummy rows have empty windows by the
   planner's contract, and a ``-1`` slot is skipped by every store op);
2. replaces the ``kv_compose`` calls that feed one attention call (the MLA
   records, and the index keys of a full indexer layer) with ONE
   ``cp_materialize_kv`` carrying all their payloads, so each layer issues
   exactly one collective.

Before (one layer, dense cache)::

    rec  = mla_dense_pack(c, k_pe)
    paged_store(mla_pool, rec, row_slots)
    kv,  = kv_compose([paged_gather(mla_pool, prefix_slots)], [rec], kv_source)
    paged_store(index_pool, k, row_slots)
    kf,  = kv_compose([paged_gather(index_pool, prefix_slots)], [k], kv_source)
    idx  = indexer_topk(q, kf, w, ks, ke, ...)
    out  = sparse_mla(q576, kv, idx, ...)

After::

    valid_slots = where(ke > ks, row_slots, -1)
    paged_store(mla_pool, rec, valid_slots)
    paged_store(index_pool, k, valid_slots)
    kv, kf = cp_materialize_kv([paged_gather(mla_pool, prefix_slots),
                                paged_gather(index_pool, prefix_slots)],
                               [rec, k], kv_source, group_name, cp)
    ...

With ``cp_size == 1`` only the store guard applies (there is nothing to
gather).  See ``docs/contracts.md`` for the ownership contract.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .cleanup import sort_topologically
from .config import CPConfig
from .fx_utils import _AUTO_FUNC, find_nodes, insert_call
from .graph_facts import PassMatchError, first_user_of_kind, list_outputs, order_of, row_windows

_STORES = {"cpgraph.paged_store": "slots", "cpgraph.index_k_store": "slots"}
_ATTENTION = ("cpgraph.sparse_mla",)


def _guard_stores(gm: fx.GraphModule) -> int:
    graph = gm.graph
    windows = row_windows(graph)
    stores = find_nodes(graph, *_STORES)
    if not stores:
        return 0
    if windows is None:
        raise PassMatchError("KV stores found but no indexer row windows (ks, ke) to tell real rows from dummies")
    ks, ke = windows
    guarded: dict[fx.Node, fx.Node] = {}
    order = order_of(graph)
    for store in stores:
        if store.target not in _AUTO_FUNC:
            raise PassMatchError(f"store {store.name} is not functionalised; run the pass on a post-grad graph")
        slots = store.kwargs["slots"]
        if slots not in guarded:
            anchor = max((ks, ke, slots), key=lambda n: order.get(n, -1))
            with graph.inserting_after(anchor):
                real = insert_call(graph, torch.ops.aten.gt.Tensor, (ke, ks))
            with graph.inserting_after(real):
                guarded[slots] = insert_call(graph, torch.ops.aten.where.ScalarOther, (real, slots, -1))
        store.update_kwarg("slots", guarded[slots])
    return len(stores)


def _merge_composes(gm: fx.GraphModule, cfg: CPConfig) -> int:
    graph = gm.graph
    composes = find_nodes(graph, "cpgraph.kv_compose")
    if not composes:
        return 0
    order = order_of(graph)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in composes:
        attn = first_user_of_kind(node, _ATTENTION, order)
        if attn is None:
            raise PassMatchError(f"kv_compose {node.name} feeds no sparse_mla; cannot tell which layer it serves")
        groups.setdefault(attn, []).append(node)
    for attn in sorted(groups, key=order.get):
        members = sorted(groups[attn], key=order.get)
        sources = {m.args[2] for m in members}
        if len(sources) != 1:
            raise PassMatchError(f"the KV payloads of {attn.name} use different kv_source descriptors")
        prefix, current, slices = [], [], []
        for m in members:
            slices.append((m, len(current)))
            prefix += list(m.args[0])
            current += list(m.args[1])
        last = members[-1]
        with graph.inserting_before(last):
            merged = insert_call(
                graph,
                torch.ops.cpgraph.cp_materialize_kv.default,
                (prefix, current, members[0].args[2], cfg.group_name, cfg.cp_size),
            )
        for m, offset in slices:
            for k, user in list_outputs(m).items():
                with graph.inserting_after(merged):
                    item = graph.call_function(user.target, (merged, offset + k))
                    item.meta["val"] = merged.meta["val"][offset + k]
                user.replace_all_uses_with(item)
                graph.erase_node(user)
            graph.erase_node(m)
    return len(groups)


def materialize_kv_by_owner(gm: fx.GraphModule, cfg: CPConfig) -> fx.GraphModule:
    """Guard KV stores to real rows; under CP, one ``cp_materialize_kv`` per attention call."""
    _guard_stores(gm)
    if cfg.cp_size > 1:
        _merge_composes(gm, cfg)
    # Inserted nodes may precede users that the merge moved; restore a valid order.
    return sort_topologically(gm)

