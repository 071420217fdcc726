"""Output pass: row selections at the model's output become CP gathers.

The single-device model selects output rows with ``take_rows`` on indices in
gathered coordinates (``rank * M + row``; with one device simply the row):
the last token of every request for the logits, and, when all hidden states
are requested, every valid token in global order.  Under CP the rows live
on different ranks, so:

* a selection that feeds the logits projection (a matmul) becomes the narrow
  ``cp_last_tokens`` (``B`` rows travel, not ``cp * M``);
* a selection returned as hidden states becomes the full ``cp_rerange``.

Before::                               After (cp = 2)::

    last = take_rows(x, last_idx)          last = cp_last_tokens(x, last_idx, group, 2)
    logits = mm(norm(last), W)             logits = mm(norm(last), W)
    hid = take_rows(norm(x), rr_idx)       hid = cp_rerange(norm(x), rr_idx, group, 2)

Only selections at the top level of the model are touched (not inside any
submodule), and only those whose index is a graph input (plan metadata):
``graph_facts.output_row_selections``, the same set the row-scope check
reads, which refuses a CP graph whose "global" output no such selection
computes (docs/model_contract.md, rule ``row-scope-consistent``).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.fx as fx

from .config import CPConfig
from .fx_utils import insert_call, is_op
from .graph_facts import output_row_selections

_MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.matmul", "aten.linear")


def _feeds_matmul(node: fx.Node) -> bool:
    seen, queue = set(), deque(node.users)
    while queue:
        n = queue.popleft()
        if n in seen:
            continue
        seen.add(n)
        if is_op(n, *_MATMULS):
            return True
        queue.extend(n.users)
    return False


def gather_output_rows(gm: fx.GraphModule, cfg: CPConfig) -> fx.GraphModule:
    """Turn top-level output row selections into ``cp_last_tokens`` / ``cp_rerange``."""
    if cfg.cp_size == 1:
        return gm
    graph = gm.graph
    for node in output_row_selections(graph):
        rows, index = node.args
        op = torch.ops.cpgraph.cp_last_tokens.default if _feeds_matmul(node) else torch.ops.cpgraph.cp_rerange.default
        with graph.inserting_before(node):
            new = insert_call(graph, op, (rows, index, cfg.group_name, cfg.cp_size))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    return gm
