"""Cleanup passes: a stable topological sort and a DCE that keeps side effects.

Rewrite passes insert nodes where convenient and may leave producers that no
longer have users; these two passes restore order and remove the leftovers.
Both are plain ``fn(gm, cfg) -> gm`` units (see ``docs/passes.md``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .fx_utils import _AUTO_FUNC, op_of


def _inputs(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def sort_topologically(gm: fx.GraphModule, cfg=None) -> fx.GraphModule:
    """Reorder nodes so every node follows its inputs, moving as little as possible.

    Nodes keep their current relative order unless an input appears later; a
    node then waits for exactly its last missing input.  Already-sorted graphs
    are unchanged, which keeps snapshots and Inductor's scheduling stable.
    """
    graph = gm.graph
    order = list(graph.nodes)
    placed: set[fx.Node] = set()
    waiting: dict[fx.Node, list[fx.Node]] = {}
    result: list[fx.Node] = []
    stack = list(reversed(order))
    while stack:
        node = stack.pop()
        if node in placed:
            continue
        missing = [a for a in _inputs(node) if a not in placed]
        if missing:
            waiting.setdefault(missing[-1], []).append(node)
            continue
        placed.add(node)
        result.append(node)
        stack.extend(reversed(waiting.pop(node, [])))
    if waiting or len(result) != len(order):
        raise RuntimeError("cpgraph.sort_topologically: the graph has a cycle")
    if result != order:
        cursor = None
        for node in result:
            if cursor is not None and cursor.next is not node:
                cursor.append(node)
            cursor = node
    return gm


def has_side_effect(node: fx.Node) -> bool:
    """Mutating ops, auto_functionalized wrappers, collectives and in-place copies stay."""
    if node.op in ("placeholder", "output"):
        return True
    if node.op != "call_function":
        return False
    if node.target in _AUTO_FUNC:
        return True
    target = op_of(node)
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    if isinstance(target, torch._ops.OpOverload) and target.namespace in ("_c10d_functional", "c10d"):
        return True
    return node.is_impure()


def eliminate_dead_code(gm: fx.GraphModule, cfg=None) -> fx.GraphModule:
    """Remove nodes without users unless they have a side effect (cache writes, collectives)."""
    graph = gm.graph
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if not node.users and not has_side_effect(node):
                graph.erase_node(node)
                changed = True
    return gm
