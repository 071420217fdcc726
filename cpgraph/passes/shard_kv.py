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
gather).  Under CP the pass first checks that every key view the attention
and the indexer read is a ``kv_compose`` output (rule ``keys-from-compose``
of docs/model_contract.md): keys read from the pool any other way would
hold only this rank's pages.  At every CP size it first checks that the
pools are graph inputs read and written by cpgraph's ops only (rule
``pool-ops-only``): an aten write cannot be guarded.  See ``docs/contracts.md`` for the ownership contract.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.fx as fx

from .cleanup import sort_topologically
from .config import CPConfig
from .fx_utils import _AUTO_FUNC, find_nodes, insert_call, is_op, op_name, op_of
from .graph_facts import (
    PassMatchError,
    composed_by,
    first_user_of_kind,
    list_outputs,
    order_of,
    previous_version,
    row_windows,
)

_STORES = {"cpgraph.paged_store": "slots", "cpgraph.index_k_store": "slots"}
_ATTENTION = ("cpgraph.sparse_mla",)
# Ops that read a layer's full key view (their argument 1): the attention and the indexer scorers.
_KEY_READERS = ("cpgraph.sparse_mla", "cpgraph.indexer_topk", "cpgraph.indexer_logits", "cpgraph.indexer_logits_fp8")


def _guard_stores(gm: fx.GraphModule) -> int:
    graph = gm.graph
    windows = row_windows(graph)
    stores = find_nodes(graph, *_STORES)
    if not stores:
        return 0
    if windows is None:
        raise PassMatchError(f"KV stores {[s.name for s in stores]} found but no indexer op whose row windows (ks, ke) "
                             "tell real rows from dummies", rule="row-window-present", nodes=stores)
    ks, ke = windows
    guarded: dict[fx.Node, fx.Node] = {}
    order = order_of(graph)
    for store in stores:
        if store.target not in _AUTO_FUNC:
            raise PassMatchError(f"store {store.name} is not functionalised; run the pass on a post-grad graph",
                                 rule="pool-ops-only", nodes=[store])
        slots = store.kwargs["slots"]
        if slots not in guarded:
            anchor = max((ks, ke, slots), key=lambda n: order.get(n, -1))
            with graph.inserting_after(anchor):
                real = insert_call(graph, torch.ops.aten.gt.Tensor, (ke, ks))
            with graph.inserting_after(real):
                guarded[slots] = insert_call(graph, torch.ops.aten.where.ScalarOther, (real, slots, -1))
        store.update_kwarg("slots", guarded[slots])
    return len(stores)


def _root(value):
    """The graph input a buffer value is a version of (through cpgraph's functionalised mutations)."""
    step = previous_version(value) if isinstance(value, fx.Node) else None
    while step is not None:
        value = step[1]
        step = previous_version(value)
    return value


def _is_cpgraph(op) -> bool:
    return op_name(op).startswith("cpgraph.")


def _check_pool_access(graph: fx.Graph) -> None:
    """KV pools are graph inputs that only cpgraph's ops read and write (functionalised: one version per write).

    The store guard turns dummy rows' slots into ``-1``, which only the store
    ops skip: a pool written another way (``pool[slots] = rows``) would let
    dummy rows write slot ``-1``, the pool's last row, and the attention
    passes could not tell what the pool holds.  Checked from the pools the
    cpgraph ops name: each must be a graph input, and every use of every
    version of it a cpgraph op, a size query, or the write-back of a version.
    """
    roots = set()
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _AUTO_FUNC and _is_cpgraph(node.args[0]):
            roots.update(_root(b) for b in node.kwargs.get("_all_bases") or ())
        elif is_op(node, "cpgraph.paged_gather", "cpgraph.index_k_gather"):
            roots.add(_root(node.args[0]))
    for root in sorted(roots, key=lambda n: n.name):
        if root.op != "placeholder":
            raise PassMatchError(
                f"the KV pool value {root.name} that cpgraph ops read is computed by {op_name(op_of(root))}, not "
                "a graph input written only by cpgraph's store ops", rule="pool-ops-only", nodes=[root])
        values, seen = deque([root]), set()
        while values:
            value = values.popleft()
            if value in seen:
                continue
            seen.add(value)
            for user in value.users:
                if user.op == "output" or is_op(user, "aten.sym_size", "aten.copy_"):
                    continue  # a size query, or the write-back of a version into the input
                if user.target in _AUTO_FUNC and _is_cpgraph(user.args[0]):
                    values.extend(g for g in user.users if previous_version(g) == (user, value))
                    continue
                if op_of(user) is not None and _is_cpgraph(op_of(user)):
                    continue
                raise PassMatchError(
                    f"KV pool {root.name} is used by {user.name} ({op_name(op_of(user))}), not by a cpgraph op: "
                    "only paged_store / index_k_store may write a pool (dummy rows' writes are masked there)",
                    rule="pool-ops-only", nodes=[user])


def _check_composed_keys(graph: fx.Graph) -> None:
    """Under CP every key view the attention and the indexer read must come from a ``kv_compose``.

    A rank's pool holds only the pages it owns: keys read from it any other
    way (a ``paged_gather`` of every slot, the pool itself) miss the other
    ranks' rows, and nothing in the graph would show it.
    """
    for node in find_nodes(graph, *_KEY_READERS):
        keys = node.args[1]
        if composed_by(keys) is None:
            name = keys.name if isinstance(keys, fx.Node) else repr(keys)
            raise PassMatchError(
                f"{node.name} reads keys {name} that no kv_compose built: under CP this rank's pool holds only "
                "the pages it owns, so the keys of other ranks' rows would be missing",
                rule="keys-from-compose", nodes=[node])


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
            raise PassMatchError(f"kv_compose {node.name} feeds no sparse_mla; cannot tell which layer it serves",
                                 rule="compose-feeds-attention", nodes=[node])
        groups.setdefault(attn, []).append(node)
    for attn in sorted(groups, key=order.get):
        members = sorted(groups[attn], key=order.get)
        sources = {m.args[2] for m in members}
        if len(sources) != 1:
            raise PassMatchError(f"the KV payloads of {attn.name} use different kv_source descriptors "
                                 f"({[m.name for m in members]})", rule="one-kv-source", nodes=[attn, *members])
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
    _check_pool_access(gm.graph)
    _guard_stores(gm)
    if cfg.cp_size > 1:
        _check_composed_keys(gm.graph)
        _merge_composes(gm, cfg)
    # Inserted nodes may precede users that the merge moved; restore a valid order.
    return sort_topologically(gm)

