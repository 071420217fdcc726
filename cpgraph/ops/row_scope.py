"""``cpgraph::row_scope``: declares whether a tensor's rows are CP-local or global.

Why an op: under CP a ``[rows, ...]`` tensor either holds this rank's compute
rows (the planner's row layout, ``M`` rows, different on every rank) or rows
that every rank holds alike (last-token logits, the rerange of all hidden
states).  Both can have any length, so the length says nothing: with static
padding and several requests, ``M`` can equal ``B`` or ``T`` by accident.
The model therefore *states* the scope at every forward boundary (inputs it
takes as rows and outputs it returns) with this identity op, and the pass
manager reads the statement (``cpgraph.passes.graph_facts.row_scopes``),
checks it against the graph, records it in node metadata and removes the op
before any pass runs.  See docs/mtp.md.

``scope`` is ``"local"`` (this rank's compute rows) or ``"global"``
(identical on every rank).  Eager execution returns a copy (a custom op may
not alias its input); compiled graphs never execute it.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCOPES = ("local", "global")


def _check(x: Tensor, scope: str) -> None:
    if scope not in SCOPES:
        raise ValueError(f"cpgraph.row_scope: scope must be one of {SCOPES}, got {scope!r}")
    if x.dim() < 1:
        raise ValueError("cpgraph.row_scope: argument 'x' must have at least 1 dimension (rows)")


@torch.library.custom_op("cpgraph::row_scope", mutates_args=())
def row_scope(x: Tensor, scope: str) -> Tensor:
    """Identity on values; ``scope`` ("local" / "global") is a fact for the compiler."""
    _check(x, scope)
    return x.clone()


@row_scope.register_fake
def _row_scope_fake(x, scope):
    _check(x, scope)
    return torch.empty_like(x)
