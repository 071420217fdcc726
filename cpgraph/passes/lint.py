"""Fail compilation if a host-sync op survives in the forward graph.

A host sync stalls the GPU every forward and breaks CUDA-graph capture.  Two
kinds exist: an op that returns a Python value read from the device
(``.item()``, ``torch.equal``, ``bool(t)``), and an op whose output size is
data (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing,
``repeat_interleave`` with tensor repeats and no ``output_size``).  The
planner builds all metadata on the host once per batch precisely so that
none is needed; this lint proves it per graph.

Rules are per overload, not per op name: ``repeat_interleave.self_int``
(a fixed repeat count) has a static size while ``repeat_interleave.self_Tensor``
does not, and the same name covers both.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .fx_utils import op_name, op_of
from .graph_facts import PassMatchError


class HostSyncError(PassMatchError):
    """A forward graph contains an op that synchronises with the host (model contract rule ``no-host-syncs``)."""


_SCALAR = "reads a device value on the host"
_COUNT = "its output size is the number of selected elements"
_DISTINCT = "its output size is the number of distinct values"

# Ops every overload of which synchronises, and why.
HOST_SYNC_OPS = {
    "aten._local_scalar_dense": _SCALAR + ": .item(), int(t), float(t)",
    "aten.item": _SCALAR + ": .item()",
    "aten.equal": _SCALAR + ": torch.equal returns a Python bool",
    "aten.is_nonzero": _SCALAR + ": bool(t), `if t:`",
    "aten.nonzero": _COUNT,
    "aten.nonzero_numpy": _COUNT,
    "aten.argwhere": _COUNT,
    "aten.masked_select": _COUNT,
    "aten.bincount": "its output size is the largest value + 1",
    "aten._unique": _DISTINCT,
    "aten._unique2": _DISTINCT,
    "aten.unique_dim": _DISTINCT,
    "aten.unique_consecutive": _DISTINCT,
    "aten.unique_dim_consecutive": _DISTINCT,
}

# Overloads that synchronise unless the caller passes ``output_size`` (then the size is static).
SIZED_BY_OUTPUT_SIZE = {
    "aten.repeat_interleave.Tensor",
    "aten.repeat_interleave.Tensor_out",
    "aten.repeat_interleave.self_Tensor",
}
_REPEATS = "repeat_interleave with tensor repeats and no output_size: its output size is sum(repeats)"


def overload_name(target) -> str:
    """``aten.repeat_interleave.self_Tensor``; a packet or a non-op target keeps :func:`op_name`."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{op_name(target)}.{target._overloadname}"
    return op_name(target)


def _tensor_repeats(node: fx.Node, op) -> bool:
    """Whether a ``repeat_interleave`` node's repeats are a tensor (decided from the arguments for a packet)."""
    if isinstance(op, torch._ops.OpOverload):
        return overload_name(op) in SIZED_BY_OUTPUT_SIZE
    # A bare packet (hand-built graphs): the one-argument form takes repeats first, the others second.
    repeats = node.args[1] if len(node.args) > 1 else (node.args[0] if node.args else node.kwargs.get("repeats"))
    val = repeats.meta.get("val") if isinstance(repeats, fx.Node) else repeats
    return isinstance(val, torch.Tensor)


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


def host_sync_reason(node: fx.Node) -> str | None:
    """Why ``node`` synchronises with the host, or ``None`` when it does not."""
    op = op_of(node)
    if op is None:
        return None
    name = op_name(op)
    if name in HOST_SYNC_OPS:
        return HOST_SYNC_OPS[name]
    if name == "aten.repeat_interleave":
        if node.kwargs.get("output_size") is None and _tensor_repeats(node, op):
            return _REPEATS
        return None
    if _bool_index(node):
        return "boolean-mask indexing: its output size is the number of true mask elements"
    return None


def host_sync_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [node for node in graph.nodes if host_sync_reason(node) is not None]


def reject_host_syncs(gm: fx.GraphModule, cfg=None) -> fx.GraphModule:
    """Raise :class:`HostSyncError` naming every host-sync node, why it syncs, and where it came from."""
    bad = host_sync_nodes(gm.graph)
    if bad:
        lines = []
        for node in bad:
            where = (node.meta.get("stack_trace") or "").strip().splitlines()
            src = where[-2].strip() if len(where) >= 2 else "(no source location)"
            lines.append(f"  node '{node.name}' runs {overload_name(op_of(node))}: {host_sync_reason(node)} — from {src}")
        raise HostSyncError(
            "cpgraph: the forward graph synchronises with the host; CP prefill metadata must come from the "
            "plan's device bundle instead:\n" + "\n".join(lines), rule="no-host-syncs", nodes=bad
        )
    return gm
