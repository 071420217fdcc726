"""Facts the rewrite passes read off a post-grad graph.

Each helper answers one question from the graph alone (never from
rank-local state), so every rank reaches the same decisions.
"""

from __future__ import annotations

import operator
from collections import deque

import torch
import torch.fx as fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

from .fx_utils import is_op, op_name, op_of

# Indexer ops and where their (ks, ke) window arguments sit.
_WINDOW_ARGS = {
    "cpgraph.indexer_topk": (3, 4),
    "cpgraph.indexer_logits": (3, 4),
    "cpgraph.indexer_logits_fp8": (4, 5),
    "cpgraph.topk_ragged": (1, 2),
    "cpgraph.topk_paged": (1, 2),
}


class PassMatchError(RuntimeError):
    """The graph does not have the structure a pass relies on; the pass refuses to guess."""


def order_of(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def row_windows(graph: fx.Graph) -> tuple[fx.Node, fx.Node] | None:
    """The ``(ks, ke)`` row-window inputs every indexer op reads, or ``None`` without an indexer.

    By the planner's contract (docs/contracts.md) a row is real exactly when
    its window is non-empty (``ke > ks``); dummy rows have ``ks == ke``.
    """
    found = set()
    for node in graph.nodes:
        op = op_of(node)
        if op is None:
            continue
        pos = _WINDOW_ARGS.get(op_name(op))
        if pos is not None:
            found.add((node.args[pos[0]], node.args[pos[1]]))
    if not found:
        return None
    if len(found) > 1:
        raise PassMatchError(f"indexer ops read {len(found)} different (ks, ke) window pairs; expected one per batch")
    return found.pop()


def first_user_of_kind(node: fx.Node, names: tuple[str, ...], order: dict[fx.Node, int]) -> fx.Node | None:
    """The earliest (graph order) node among ``node``'s transitive users that runs one of ``names``."""
    best = None
    seen = {node}
    queue = deque(node.users)
    while queue:
        n = queue.popleft()
        if n in seen:
            continue
        seen.add(n)
        if is_op(n, *names):
            if best is None or order[n] < order[best]:
                best = n
            continue  # do not look past a match
        queue.extend(n.users)
    return best


def list_outputs(node: fx.Node) -> dict[int, fx.Node]:
    """``getitem(node, k)`` users of a node that returns a list/tuple, by ``k``."""
    out = {}
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem:
            out[user.args[1]] = user
        else:
            raise PassMatchError(f"node {node.name}'s list output is used by {user.name} without getitem")
    return out


def module_regions(graph: fx.Graph, class_names: tuple[str, ...]) -> dict[str, list[fx.Node]]:
    """Nodes grouped by the innermost enclosing module whose class is in ``class_names``.

    Uses the ``nn_module_stack`` that Dynamo records and AOT keeps, so the
    region is "everything the model's MoE module computed", whatever ops
    that module is made of.
    """
    regions: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        key = None
        for path, cls in stack.values():
            cls_name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
            if cls_name.rsplit(".", 1)[-1] in class_names:
                key = path  # keep the innermost match
        if key is not None and node.op == "call_function":
            regions.setdefault(key, []).append(node)
    # Nodes made by decompositions and pattern rewrites may carry no module stack
    # (constants, dtype casts of weights, rewritten index math).  A node without
    # one whose every user is inside the region exists only for the region, so it
    # belongs to it; walking backwards catches chains of such nodes.
    order = list(graph.nodes)
    for key, nodes in regions.items():
        inside = set(nodes)
        changed = True
        while changed:
            changed = False
            for node in reversed(order):
                if node in inside or node.op != "call_function" or node.meta.get("nn_module_stack"):
                    continue
                if node.users and all(u in inside for u in node.users):
                    inside.add(node)
                    changed = True
        regions[key] = [n for n in order if n in inside]
    return regions


def tensor_val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None



# ------------------------------------------------------------ buffer versions
# After functionalisation a mutated buffer (a KV pool) is a chain of values:
# the graph input, then one new value per mutating op, each produced as
# ``getitem(auto_functionalized_v2(op, ..., _all_bases=[base, ...]), j)``.
# A pass that reads a pool must read the value current at its reader, or
# Inductor cannot write the pool in place (it would copy the whole pool).
def _returns_before_bases(mutation: fx.Node) -> int:
    """How many op outputs precede the new bases in an ``auto_functionalized_v2`` result."""
    returns = getattr(mutation.args[0], "_schema", None)
    n = len(returns.returns) if returns is not None else 0
    return n if n > 1 else 1  # a single output, or None, still takes one slot


def _is_mutation_of(node: fx.Node, base: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is auto_functionalized_v2
        and base in (node.kwargs.get("_all_bases") or ())
    )


def previous_version(value: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(mutation, base)`` when ``value`` is a buffer value a mutating op produced from ``base``; else None."""
    if value.op != "call_function" or value.target is not operator.getitem:
        return None
    mutation, j = value.args
    if not isinstance(mutation, fx.Node) or mutation.target is not auto_functionalized_v2:
        return None
    bases = mutation.kwargs.get("_all_bases") or []
    k = j - _returns_before_bases(mutation)
    if not 0 <= k < len(bases):
        return None
    return mutation, bases[k]


def version_history(value: fx.Node) -> list[fx.Node]:
    """The mutating ops that produced ``value``, oldest first (empty for an untouched input)."""
    chain = []
    step = previous_version(value)
    while step is not None:
        chain.append(step[0])
        step = previous_version(step[1])
    return chain[::-1]


def version_at(value: fx.Node, reader: fx.Node, order: dict[fx.Node, int]) -> fx.Node:
    """The value of ``value``'s buffer current at ``reader``: follow the mutations placed before it.

    Creates the ``getitem`` of a mutation's new base when the graph has none.
    Raises :class:`PassMatchError` when one value is mutated twice (the graph
    is not a functionalised chain).
    """
    graph = reader.graph
    while True:
        mutations = [u for u in value.users if _is_mutation_of(u, value) and order[u] < order[reader]]
        if not mutations:
            return value
        if len(mutations) > 1:
            raise PassMatchError(f"buffer value {value.name} is mutated by {len(mutations)} ops: {mutations}")
        mutation = mutations[0]
        j = _returns_before_bases(mutation) + list(mutation.kwargs["_all_bases"]).index(value)
        nxt = [u for u in mutation.users if u.target is operator.getitem and u.args[1] == j]
        if nxt:
            value = nxt[0]
        else:
            with graph.inserting_after(mutation):
                value = graph.call_function(operator.getitem, (mutation, j))
            value.meta["val"] = mutation.meta["val"][j]
            order[value] = order[mutation]  # placed right after it; only compared against readers


# ------------------------------------------------------------ row scopes
# Whether a tensor's rows are this rank's compute rows ("local") or rows every
# rank holds alike ("global") is stated by the model with ``cpgraph::row_scope``
# (cpgraph/ops/row_scope.py) at its boundaries, never inferred from a shape:
# with static padding and several requests a local ``[M, ...]`` can have the
# length of a global ``[B, ...]`` or ``[T, ...]``.  The pass manager checks the
# statements (:func:`read_row_scopes`) before any pass runs, records each in
# ``node.meta[ROW_SCOPE]`` of the tensor it describes, and removes the ops.
ROW_SCOPE = "cpgraph_row_scope"
_ROW_SCOPE_OP = "cpgraph.row_scope"


def _top_level(node: fx.Node) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return len(stack) <= 1  # Dynamo records the root module itself as the outermost entry (or nothing)


def output_row_selections(graph: fx.Graph) -> list[fx.Node]:
    """Top-level ``take_rows`` by a graph-input index: the selections the output pass turns into CP gathers."""
    return [
        n
        for n in graph.nodes
        if is_op(n, "cpgraph.take_rows") and _top_level(n) and isinstance(n.args[1], fx.Node)
        and n.args[1].op == "placeholder"
    ]


def _graph_outputs(graph: fx.Graph) -> list[fx.Node]:
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    found: list[fx.Node] = []
    fx.node.map_arg(out.args, lambda n: found.append(n))
    # Mutated buffers (KV pools) come back as new versions of graph inputs: state, not rows.
    return [n for n in found if tensor_val(n) is not None and n.op != "placeholder" and previous_version(n) is None]


def _reaches(starts, stop: set, targets: set) -> fx.Node | None:
    """A node of ``targets`` reachable from ``starts`` along users without passing a node of ``stop``."""
    seen, queue = set(), deque(starts)
    while queue:
        n = queue.popleft()
        if n in seen:
            continue
        seen.add(n)
        if n in targets:
            return n
        if n in stop:
            continue
        queue.extend(n.users)
    return None


def read_row_scopes(gm: fx.GraphModule, cp_size: int) -> dict[str, str]:
    """Check the model's row-scope statements, record them in node metadata, drop the marker ops.

    Returns ``{node name: scope}`` of the described tensors.  Raises
    :class:`PassMatchError` where a pass would otherwise have to guess:

    * a CP graph with output row selections but no statement at all;
    * a graph with statements whose outputs are not all stated;
    * an output row selection (which the output pass turns into a CP gather)
      that feeds no output stated "global";
    * a "global" output computed from "local" rows without passing such a selection;
    * a "local" output computed from a selection's (gathered) rows.
    """
    graph = gm.graph
    markers = [n for n in graph.nodes if is_op(n, _ROW_SCOPE_OP)]
    selections = output_row_selections(graph)
    if not markers:
        if cp_size > 1 and selections:
            raise PassMatchError(
                f"CP graph selects output rows ({', '.join(n.name for n in selections)}) but states no row "
                "scope (cpgraph::row_scope): the output pass would have to guess which outputs are CP-local"
            )
        return {}
    scopes: dict[fx.Node, str] = {}
    for m in markers:
        scope = m.args[1] if len(m.args) > 1 else m.kwargs.get("scope")
        if scope not in ("local", "global"):
            raise PassMatchError(f"row_scope {m.name} states scope {scope!r}; expected 'local' or 'global'")
        scopes[m] = scope
    unstated = [n.name for n in _graph_outputs(graph) if n not in scopes]
    if unstated:
        raise PassMatchError(
            f"graph outputs {unstated} state no row scope (cpgraph::row_scope); a pass cannot tell CP-local rows "
            "from global ones"
        )
    local = {m for m, s in scopes.items() if s == "local"}
    glob = {m for m, s in scopes.items() if s == "global"}
    sel = set(selections)
    for s in selections:
        if _reaches([s], set(), glob) is None:
            raise PassMatchError(
                f"output row selection {s.name} feeds no output stated 'global': cannot tell whether it is a CP gather"
            )
        bad = _reaches([s], set(), local)
        if bad is not None:
            raise PassMatchError(f"output {bad.name} is stated 'local' but is computed from gathered rows ({s.name})")
    for m in local:
        bad = _reaches(list(m.users), sel, glob)
        if bad is not None:
            raise PassMatchError(
                f"output {bad.name} is stated 'global' but is computed from local rows ({m.name}) without a row selection"
            )
    described = {}
    for m, scope in scopes.items():
        src = m.args[0]
        src.meta[ROW_SCOPE] = scope
        described[src.name] = scope
        m.replace_all_uses_with(src)
        graph.erase_node(m)
    return described


def row_scope_of(node: fx.Node) -> str | None:
    """The row scope the model stated for ``node`` ("local" / "global"), or ``None`` if it stated none."""
    return node.meta.get(ROW_SCOPE)
