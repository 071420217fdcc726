"""Fail compilation if a host-sync op survives in the forward graph.

A host sync (``aten._local_scalar_dense`` from ``.item()``, ``nonzero``,
boolean-mask indexing, ``masked_select``) stalls the GPU every forward and
breaks CUDA-graph capture.  The planner builds all metadata on the host once
per batch precisely so that none is needed; this lint proves it per graph.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .fx_utils import op_name, op_of

HOST_SYNC_OPS = {
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten.item",
    "aten.unique",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.repeat_interleave",  # the one-argument form returns a data-dependent size
}


class HostSyncError(RuntimeError):
    """A forward graph contains an op that synchronises with the host."""


def _bool_index(node: fx.Node) -> bool:
    # aten.index.Tensor / index_put with a boolean index tensor is mask indexing.
    if op_name(op_of(node)) not in ("aten.index", "aten.index_put", "aten._unsafe_index_put"):
        return False
    indices = node.args[1] if len(node.args) > 1 else []
    for idx in indices or []:
        v = idx.meta.get("val") if isinstance(idx, fx.Node) else None
        if isinstance(v, torch.Tensor) and v.dtype == torch.bool:
            return True
    return False


def host_sync_nodes(graph: fx.Graph) -> list[fx.Node]:
    out = []
    for node in graph.nodes:
        op = op_of(node)
        if op is None:
            continue
        name = op_name(op)
        if name in HOST_SYNC_OPS:
            if name == "aten.repeat_interleave" and len(node.args) > 1:
                continue
            out.append(node)
        elif _bool_index(node):
            out.append(node)
    return out


def reject_host_syncs(gm: fx.GraphModule, cfg=None) -> fx.GraphModule:
    """Raise :class:`HostSyncError` naming every host-sync node and where it came from."""
    bad = host_sync_nodes(gm.graph)
    if bad:
        lines = []
        for node in bad:
            where = (node.meta.get("stack_trace") or "").strip().splitlines()
            src = where[-2].strip() if len(where) >= 2 else "(no source location)"
            lines.append(f"  node '{node.name}' runs {op_name(op_of(node))} — from {src}")
        raise HostSyncError(
            "cpgraph: the forward graph synchronises with the host; CP prefill metadata must come from the "
            "plan's device bundle instead:\n" + "\n".join(lines)
        )
    return gm
