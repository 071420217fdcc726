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


# The rules of the model contract (docs/model_contract.md, one section per id) that a pass
# checks on the graph.  A broken rule is a ``PassMatchError`` naming the rule and the nodes,
# raised before anything is rewritten, never a silently different graph.
CONTRACT_RULES = {
    "one-row-window": "every indexer op reads the same (ks, ke) row windows",
    "row-window-present": "a graph with KV stores or MoE regions has an indexer op whose (ks, ke) tell real rows "
                          "from dummies",
    "pool-ops-only": "KV pools are graph inputs read and written by cpgraph's ops only, functionalised once per "
                     "write",
    "compose-outputs-unpacked": "the views kv_compose returns are used through getitem only",
    "compose-feeds-attention": "every kv_compose view reaches a sparse_mla call",
    "one-kv-source": "the kv_compose calls serving one sparse_mla share one kv_source",
    "keys-from-compose": "under CP, the keys sparse_mla and the indexer read are composed by kv_compose",
    "materialised-view": "a sparse_mla over a kv_compose view reads prefix rows gathered from the pool its current "
                         "rows are stored into",
    "index-topk-pattern": "CPConfig.index_topk_pattern fits the graph's attention layers and indexers",
    "moe-region-io": "an MoE module region takes one computed row tensor and returns one",
    "moe-experts-in-region": "every moe_experts call lies inside an MoE module region (CPConfig.moe_modules)",
    "expert-shard": "the router scores as many experts as the experts hold times CPConfig.ep",
    "row-scope-stated": "a CP graph with output row selections states the row scope of every output",
    "row-scope-consistent": "outputs stated 'local' hold this rank's rows, outputs stated 'global' are computed "
                            "from a row selection",
    "no-host-syncs": "the forward reads no device value on the host and has no data-dependent shape",
    "invariant-products": "with CPConfig(deterministic=True), every matrix product has a row-invariant form",
}
CONTRACT_DOC = "docs/model_contract.md"


class PassMatchError(RuntimeError):
    """The graph breaks a rule of the model contract; the pass refuses to guess.

    ``rule`` is the rule's id (a key of :data:`CONTRACT_RULES`, a section of
    ``docs/model_contract.md``) and ``nodes`` the names of the nodes that
    break it; the message states both.
    """

    def __init__(self, message: str, *, rule: str | None = None, nodes=()):
        if rule is not None:
            if rule not in CONTRACT_RULES:
                raise ValueError(f"PassMatchError: unknown contract rule {rule!r}")
            message = f"model contract rule '{rule}' ({CONTRACT_RULES[rule]}): {message} [{CONTRACT_DOC}#{rule}]"
        super().__init__(message)
        self.rule = rule
        self.nodes = tuple(n.name if isinstance(n, fx.Node) else str(n) for n in nodes)


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
        users = [n for n in graph.nodes if (op := op_of(n)) is not None and op_name(op) in _WINDOW_ARGS]
        raise PassMatchError(
            f"indexer ops {[n.name for n in users]} read {len(found)} different (ks, ke) window pairs; expected one "
            "per batch", rule="one-row-window", nodes=users)
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


# Ops that hand a tensor's rows on unchanged in meaning (views, copies, casts, the FP8 record unpack).
_PASS_THROUGH = ("aten.view", "aten.reshape", "aten._unsafe_view", "aten.alias", "aten.clone", "aten.slice",
                 "aten.select", "aten.expand", "aten.permute", "aten.unsqueeze", "aten.squeeze", "aten._to_copy",
                 "prims.convert_element_type", "cpgraph.mla_fp8_unpack")
_COMPOSERS = ("cpgraph.kv_compose", "cpgraph.cp_materialize_kv")


def composed_by(node) -> fx.Node | None:
    """The ``kv_compose`` / ``cp_materialize_kv`` whose output ``node`` is (through views and casts), else ``None``."""
    for _ in range(32):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return None
        if node.target is operator.getitem:
            src = node.args[0]
            return src if isinstance(src, fx.Node) and is_op(src, *_COMPOSERS) else None
        if not is_op(node, *_PASS_THROUGH):
            return None
        node = node.args[0]
    return None


def list_outputs(node: fx.Node) -> dict[int, fx.Node]:
    """``getitem(node, k)`` users of a node that returns a list/tuple, by ``k``."""
    out = {}
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem:
            out[user.args[1]] = user
        else:
            raise PassMatchError(f"node {node.name}'s list output is used by {user.name} without getitem",
                                 rule="compose-outputs-unpacked", nodes=[node, user])
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
            raise PassMatchError(f"buffer value {value.name} is mutated by {len(mutations)} ops: {mutations}",
                                 rule="pool-ops-only", nodes=[value, *mutations])
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


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen, queue = set(), deque(node.all_input_nodes)
    while queue:
        n = queue.popleft()
        if n not in seen:
            seen.add(n)
            queue.extend(n.all_input_nodes)
    return list(seen)


def read_row_scopes(gm: fx.GraphModule, cp_size: int) -> dict[str, str]:
    """Check the model's row-scope statements, record them in node metadata, drop the marker ops.

    Returns ``{node name: scope}`` of the described tensors.  Raises
    :class:`PassMatchError` where a pass would otherwise have to guess:

    * a CP graph with output row selections but no statement at all;
    * a graph with statements whose outputs are not all stated;
    * an output row selection (which the output pass turns into a CP gather)
      that feeds no output stated "global";
    * a "global" output computed from "local" rows without passing such a selection;
    * under CP, a "global" output computed from no such selection at all
      (for example rows selected inside a submodule, or by aten indexing,
      which the output pass does not rewrite: the output would be this
      rank's rows, stated global);
    * a "local" output computed from a selection's (gathered) rows.
    """
    graph = gm.graph
    markers = [n for n in graph.nodes if is_op(n, _ROW_SCOPE_OP)]
    selections = output_row_selections(graph)
    if not markers:
        if cp_size > 1 and selections:
            raise PassMatchError(
                f"CP graph selects output rows ({', '.join(n.name for n in selections)}) but states no row "
                "scope (cpgraph::row_scope): the output pass would have to guess which outputs are CP-local",
                rule="row-scope-stated", nodes=selections)
        return {}
    scopes: dict[fx.Node, str] = {}
    for m in markers:
        scope = m.args[1] if len(m.args) > 1 else m.kwargs.get("scope")
        if scope not in ("local", "global"):
            raise PassMatchError(f"row_scope {m.name} states scope {scope!r}; expected 'local' or 'global'",
                                 rule="row-scope-stated", nodes=[m])
        scopes[m] = scope
    unstated = [n for n in _graph_outputs(graph) if n not in scopes]
    if unstated:
        raise PassMatchError(
            f"graph outputs {[n.name for n in unstated]} state no row scope (cpgraph::row_scope); a pass cannot tell "
            "CP-local rows from global ones", rule="row-scope-stated", nodes=unstated)
    local = {m for m, s in scopes.items() if s == "local"}
    glob = {m for m, s in scopes.items() if s == "global"}
    sel = set(selections)
    for s in selections:
        if _reaches([s], set(), glob) is None:
            raise PassMatchError(
                f"output row selection {s.name} feeds no output stated 'global': cannot tell whether it is a CP gather",
                rule="row-scope-consistent", nodes=[s])
        bad = _reaches([s], set(), local)
        if bad is not None:
            raise PassMatchError(f"output {bad.name} is stated 'local' but is computed from gathered rows ({s.name})",
                                 rule="row-scope-consistent", nodes=[bad, s])
    for m in local:
        bad = _reaches(list(m.users), sel, glob)
        if bad is not None:
            raise PassMatchError(
                f"output {bad.name} is stated 'global' but is computed from local rows ({m.name}) without a row "
                "selection",
                rule="row-scope-consistent", nodes=[bad, m])
    if cp_size > 1:
        for m in glob:
            if m.args[0].op == "placeholder" or _reaches(selections, set(), {m}) is not None:
                continue
            inner = [n.name for n in _ancestors(m) if is_op(n, "cpgraph.take_rows")]
            hint = f"; the row selections {inner} are not at the model's top level" if inner else ""
            raise PassMatchError(
                f"output {m.name} is stated 'global' but no output row selection (cpgraph.take_rows by a graph-input "
                f"index, at the top level of the compiled module) computes it: under CP it would hold this rank's "
                f"rows{hint}", rule="row-scope-consistent", nodes=[m])
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
