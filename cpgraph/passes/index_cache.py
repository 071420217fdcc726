"""IndexCache pass: shared layers reuse the previous full layer's top-k.

GLM-5 ships IndexCache in its checkpoints (shared layers have no indexer at
all); the same trick applies to any DSA model at serving time.  Given
``CPConfig.index_topk_pattern`` (one ``F``/``S`` per layer), this pass makes
every ``S`` layer's attention read the top-k of the nearest earlier ``F``
layer, then removes that layer's indexer: its index-K stores are erased
explicitly (they are side effects, DCE would keep them) and everything that
only fed its top-k dies in DCE.

Before (layers 0 F, 1 S)::                After::

    t0 = indexer_topk(..layer 0..)           t0 = indexer_topk(..layer 0..)
    sparse_mla(q0, kv0, t0)                  sparse_mla(q0, kv0, t0)
    paged_store(index_pool1, k1, slots)      (gone)
    k1f, = kv_compose([...], [k1], src)      (gone)
    t1 = indexer_topk(q1, k1f, ...)          (gone)
    sparse_mla(q1, kv1, t1)                  sparse_mla(q1, kv1, t0)

Layers are identified by the order of ``sparse_mla`` calls (one per layer).
A model whose shared layers already have no indexer (GLM-5) has nothing to
rewrite for them; a pattern whose ``F`` layers have no indexer is an error.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from .cleanup import eliminate_dead_code
from .config import CPConfig
from .fx_utils import _AUTO_FUNC, find_nodes, is_op
from .graph_facts import PassMatchError

_TOPK = ("cpgraph.indexer_topk", "cpgraph.topk_ragged", "cpgraph.topk_paged")
_INDEX_STORES = ("cpgraph.paged_store", "cpgraph.index_k_store")


def _index_compose(topk: fx.Node) -> fx.Node:
    """The ``kv_compose`` that built the keys this top-k ranked (through the logits op if separate)."""
    scorer = topk.args[0] if is_op(topk, "cpgraph.topk_ragged", "cpgraph.topk_paged") else topk
    if not is_op(scorer, "cpgraph.indexer_topk", "cpgraph.indexer_logits", "cpgraph.indexer_logits_fp8"):
        raise PassMatchError(f"top-k {topk.name} is not fed by an indexer scoring op", rule="index-topk-pattern",
                             nodes=[topk])
    keys = scorer.args[1]
    if keys.target is operator.getitem and is_op(keys.args[0], "cpgraph.kv_compose", "cpgraph.cp_materialize_kv"):
        return keys.args[0]
    raise PassMatchError(f"the keys of {scorer.name} do not come from a kv_compose", rule="index-topk-pattern",
                         nodes=[scorer])


def _key_sources(topk: fx.Node) -> set:
    """The fresh index keys behind a top-k: current rows of its index ``kv_compose``, unwrapped."""
    keys = set()
    for cur in _index_compose(topk).args[1]:
        keys.add(cur)
        if cur.target is operator.getitem and is_op(cur.args[0], "cpgraph.index_k_quant"):
            keys.add(cur.args[0].args[0])
    return keys


def _drop_store(graph: fx.Graph, store: fx.Node) -> None:
    """Erase a functionalised store: its 'mutated' outputs become the untouched bases again."""
    bases = store.kwargs.get("_all_bases") or []
    for user in list(store.users):
        if user.target is operator.getitem and user.args[1] >= 1 and user.args[1] - 1 < len(bases):
            base = bases[user.args[1] - 1]
            for w in list(user.users):  # the write-back copy_(base, new) becomes a no-op: drop it
                if w.target is not None and "copy_" in str(w.target) and w.args[0] is base:
                    w.replace_all_uses_with(base)
                    graph.erase_node(w)
            user.replace_all_uses_with(base)
            graph.erase_node(user)
    if store.users:
        raise PassMatchError(f"cannot drop store {store.name}: unexpected users {list(store.users)}",
                             rule="pool-ops-only", nodes=[store, *store.users])
    graph.erase_node(store)


def reuse_shared_topk(gm: fx.GraphModule, cfg: CPConfig) -> fx.GraphModule:
    """Rewire ``S`` layers to the previous ``F`` layer's top-k and delete their indexers."""
    pattern = cfg.index_topk_pattern
    if pattern is None:
        return gm
    graph = gm.graph
    attention = find_nodes(graph, "cpgraph.sparse_mla")
    if len(attention) != len(pattern):
        raise PassMatchError(f"index_topk_pattern has {len(pattern)} layers but the graph has {len(attention)} "
                             f"sparse_mla calls", rule="index-topk-pattern", nodes=attention)
    current = None
    stores = [n for n in find_nodes(graph, *_INDEX_STORES) if n.target in _AUTO_FUNC]
    for layer, (attn, kind) in enumerate(zip(attention, pattern)):
        topk = attn.args[2]
        own = isinstance(topk, fx.Node) and is_op(topk, *_TOPK) and topk is not current
        if kind == "F":
            if not own:
                raise PassMatchError(f"layer {layer} is 'F' in index_topk_pattern but runs no indexer of its own "
                                     f"({attn.name})", rule="index-topk-pattern", nodes=[attn])
            current = topk
            continue
        if not own:
            continue  # already shared (e.g. GLM-5 checkpoints): nothing to remove
        keys = _key_sources(topk)
        attn.replace_input_with(topk, current)
        for store in [s for s in stores if s.kwargs.get("rows", s.kwargs.get("keys")) in keys]:
            _drop_store(graph, store)
            stores.remove(store)
    return eliminate_dead_code(gm)
