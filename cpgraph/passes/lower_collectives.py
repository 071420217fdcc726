"""Lowering pass: expose the collectives inside cpgraph's CP ops to Inductor.

The CP rewrite passes insert semantic ops (``cp_materialize_kv``,
``cp_rerange``, ``cp_last_tokens``) so that graphs stay readable and
snapshots say what moves and why.  Inductor cannot see inside a custom op,
so this last rewrite replaces each with its ``*_decomposed`` twin: PyTorch
functional collectives (``all_gather_into_tensor`` + ``wait_tensor``) plus
cpgraph placement ops, which Inductor schedules and can overlap with
compute.  The decompositions contain no rank constant, so every rank still
compiles the same graph.

Before::                                       After::

    kv, kf = cp_materialize_kv(P, C, src, g, 2)    b = cat(bytes(P)); c = cat(bytes(C))
                                                   w = wait_tensor(all_gather_into_tensor(cat(b, c), 2, g))
                                                   kv = view(take_rows(w[:, :W0], src)); kf = ...

The rerange is the exception where the all-gather form loses: on CUDA over
NCCL (a static fact of the graph and its group, see
``cpgraph.ops.collectives.rerange_form``) ``cp_rerange`` becomes the opaque
``cp_rerange_p2p`` op instead, whose transfer overlaps the local placement
(measured faster than gather + placement; docs/ops/collectives.md)::

    hid = cp_rerange(x, rr_idx, g, 2)      hid = cp_rerange_p2p(x, rr_idx, g, 2, min_bytes)

CPU / gloo graphs keep the decomposition.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from cpgraph.ops.collectives import (
    RERANGE_P2P_MIN_BYTES,
    cp_last_tokens_decomposed,
    cp_rerange_decomposed,
    group_backend,
    rerange_form,
)
from cpgraph.ops.materialize import cp_materialize_kv_decomposed

from .config import CPConfig
from .fx_utils import fake_mode_of, find_nodes, insert_call

_DECOMPOSITIONS = {
    "cpgraph.cp_materialize_kv": cp_materialize_kv_decomposed,
    "cpgraph.cp_rerange": cp_rerange_decomposed,
    "cpgraph.cp_last_tokens": cp_last_tokens_decomposed,
}


def _inline(graph: fx.Graph, node: fx.Node, fn) -> None:
    flat, spec = tree_flatten((node.args, node.kwargs))
    is_node = [isinstance(a, fx.Node) for a in flat]
    example = [a.meta["val"] if isinstance(a, fx.Node) else a for a in flat]

    def traced(*tensors):
        it = iter(tensors)
        full = [next(it) if n else a for a, n in zip(flat, is_node)]
        args, kwargs = tree_unflatten(full, spec)
        return fn(*args, **kwargs)

    inputs = [e for e, n in zip(example, is_node) if n]
    mode = fake_mode_of(graph)
    # Trace with Inductor's decompositions: the post-grad graph may only hold
    # ops Inductor lowers directly (e.g. no raw aten.index_select).
    from torch._inductor.decomposition import select_decomp_table

    with mode:
        sub = make_fx(traced, decomposition_table=select_decomp_table(), tracing_mode="real")(*inputs)
    env = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    arg_nodes = [a for a, n in zip(flat, is_node) if n]
    for ph, a in zip(placeholders, arg_nodes):
        env[ph] = a
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            if n.op == "get_attr":
                raise RuntimeError(f"cpgraph lowering: decomposition of {node.name} captured a constant ({n.target})")
            new = graph.node_copy(n, lambda x: env[x])
            new.meta = {"val": n.meta["val"]} if "val" in n.meta else {}
            env[n] = new
    out = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    result = fx.map_arg(out, lambda x: env[x])
    if isinstance(result, (list, tuple)):
        import operator

        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(result[user.args[1]])
                graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)


def _lower_rerange(graph: fx.Graph, node: fx.Node, cfg: CPConfig) -> bool:
    """Swap ``cp_rerange`` for ``cp_rerange_p2p`` where :func:`rerange_form` says so; ``True`` if swapped."""
    rows, index, group_name, world_size = node.args
    device_type = rows.meta["val"].device.type
    if rerange_form(device_type, group_backend(group_name, device_type)) != "p2p":
        return False
    with graph.inserting_before(node):
        new = insert_call(graph, torch.ops.cpgraph.cp_rerange_p2p.default,
                          (rows, index, group_name, world_size, RERANGE_P2P_MIN_BYTES))
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return True


def lower_cp_collectives(gm: fx.GraphModule, cfg: CPConfig) -> fx.GraphModule:
    """Replace CP ops by functional collectives + placement ops (the rerange by its P2P op on CUDA + NCCL)."""
    graph = gm.graph
    for name, fn in _DECOMPOSITIONS.items():
        for node in find_nodes(graph, name):
            if name == "cpgraph.cp_rerange" and _lower_rerange(graph, node, cfg):
                continue
            _inline(graph, node, fn)
    return gm
