"""``cpgraph::cp_materialize_kv``: the dense full KV view from owner-sharded storage.

With owner-sharded KV each rank stores only the pages it owns, but the
attention and indexer kernels want one dense full view per layer.  This op
builds it with ONE collective per call, whatever the number of payload kinds
(MLA records, index-key bytes, index-key scales, ...):

1. pack: every payload (cached-prefix rows this rank owns, then this
   forward's fresh compute rows) is viewed as bytes and laid side by side
   into one ``uint8 [P + M, S]`` buffer (``S`` = sum of the kinds' row bytes);
2. one functional ``all_gather_into_tensor`` -> ``[world * (P + M), S]``;
3. place: each kind's byte columns are gathered into ``[kv_rows, bytes_k]``
   with ``cpgraph::take_rows`` through a source index derived on device from
   the planner's ``prefix_dest`` / ``current_dest`` and viewed back as the
   kind's dtype.

Why one collective: collective launch latency and synchronisation dominate
for the small per-layer payloads of short batches, and every rank must issue
the same collectives in the same order, which is easiest to guarantee when
there is exactly one.  Why current rows travel from the fresh tensors: the
cache might not have been written yet (or hold stale bytes); the full view
must use this forward's values.  Why destinations are per request: two
requests sharing a physical prefix page still get separate full-view rows,
so nothing depends on which write lands last.  The descriptors come from
:func:`cpgraph.plan.materialize.materialize_descriptors`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_index_range, check_same_device, check_tensor, debug_enabled
from .collectives import all_gather_dim0, check_group_args, check_size_arg, resolve_group

_OP = "cp_materialize_kv"


def _check_payloads(name: str, payloads) -> None:
    if not isinstance(payloads, (list, tuple)):
        raise ValueError(f"cpgraph.{_OP}: argument '{name}' must be a list of tensors, got {type(payloads).__name__}")
    for k, t in enumerate(payloads):
        check_tensor(_OP, f"{name}[{k}]", t, ndim=2)


def _check_materialize(prefix_rows, current_rows, prefix_dest, current_dest, kv_rows, group_name, world_size) -> None:
    check_group_args(_OP, group_name, world_size)
    _check_payloads("prefix_rows", prefix_rows)
    _check_payloads("current_rows", current_rows)
    if len(prefix_rows) != len(current_rows):
        raise ValueError(
            f"cpgraph.{_OP}: 'prefix_rows' has {len(prefix_rows)} payloads but 'current_rows' has "
            f"{len(current_rows)}; pass one prefix and one current tensor per payload kind"
        )
    if not current_rows:
        raise ValueError(f"cpgraph.{_OP}: 'current_rows' must hold at least one payload")
    num_prefix = prefix_rows[0].shape[0]
    num_current = current_rows[0].shape[0]
    for k, (p, c) in enumerate(zip(prefix_rows, current_rows)):
        if p.dtype != c.dtype:
            raise ValueError(
                f"cpgraph.{_OP}: payload {k}: 'prefix_rows[{k}]' is {p.dtype} but 'current_rows[{k}]' is {c.dtype}"
            )
        check_tensor(_OP, f"prefix_rows[{k}]", p, shape=(num_prefix, c.shape[1]))
        check_tensor(_OP, f"current_rows[{k}]", c, shape=(num_current, None))
    check_tensor(_OP, "prefix_dest", prefix_dest, dtype=torch.int64, shape=(world_size * num_prefix,))
    check_tensor(_OP, "current_dest", current_dest, dtype=torch.int64, shape=(world_size * num_current,))
    check_size_arg(_OP, "kv_rows", kv_rows, 0)
    named = {f"prefix_rows[{k}]": t for k, t in enumerate(prefix_rows)}
    named.update({f"current_rows[{k}]": t for k, t in enumerate(current_rows)})
    check_same_device(_OP, **named, prefix_dest=prefix_dest, current_dest=current_dest)


def _row_major(t: Tensor) -> Tensor:
    """``t`` itself if it has plain row-major strides, else a row-major copy.

    ``Tensor.view(dtype)`` between element sizes needs ``stride(-1) == 1``;
    ``is_contiguous()`` alone does not promise that when a dim has size 0 or 1.
    """
    if t.is_contiguous() and t.stride(-1) == 1:
        return t
    return t.new_empty(t.shape).copy_(t)


def _as_bytes(t: Tensor) -> Tensor:
    """``[N, W]`` of any dtype -> ``uint8 [N, W * itemsize]`` (a view when row-major)."""
    return _row_major(t).view(torch.uint8)


def _check_dest_values(dest: Tensor, kv_rows: int) -> None:
    """Debug only: destinations in ``[-1, kv_rows)`` and no full-view row written twice."""
    check_index_range(_OP, "prefix_dest/current_dest", dest, -1, kv_rows)
    if debug_enabled():
        landed = dest[dest >= 0]  # sync-ok: debug flag only
        if landed.unique().numel() != landed.numel():  # sync-ok: debug flag only
            raise ValueError(f"cpgraph.{_OP}: two gathered rows target the same full-view row")


def cp_materialize_kv_decomposed(
    prefix_rows: list[Tensor],
    current_rows: list[Tensor],
    prefix_dest: Tensor,
    current_dest: Tensor,
    kv_rows: int,
    group_name: str,
    world_size: int,
) -> list[Tensor]:
    """Same result as ``cpgraph::cp_materialize_kv`` from one functional all-gather + ``take_rows``."""
    _check_materialize(prefix_rows, current_rows, prefix_dest, current_dest, kv_rows, group_name, world_size)
    num_prefix = prefix_rows[0].shape[0]
    num_current = current_rows[0].shape[0]
    # Destination of every gathered row, in the gathered (rank-major) order.
    # Built (and, under CPGRAPH_DEBUG, checked) before communicating, so a bad
    # descriptor raises on every rank instead of leaving peers in a collective.
    dest = torch.cat(
        [prefix_dest.view(world_size, num_prefix), current_dest.view(world_size, num_current)], dim=1
    ).reshape(-1)
    _check_dest_values(dest, kv_rows)
    # Invert it on device: source row of every full-view row, -1 where no one
    # writes (page-tail slack -> zero rows).  Dropped rows (-1: dummies,
    # padding) go to a sink row that is cut off.
    sink = torch.where(dest >= 0, dest, kv_rows)
    rows_id = torch.arange(dest.shape[0], dtype=torch.int64, device=dest.device)
    source = torch.full((kv_rows + 1,), -1, dtype=torch.int64, device=dest.device)
    source = source.index_copy(0, sink, rows_id)[:kv_rows]

    # Pack: this rank's block is [P prefix rows ; M current rows], all kinds side by side.
    prefix_bytes = torch.cat([_as_bytes(t) for t in prefix_rows], dim=1)
    current_bytes = torch.cat([_as_bytes(t) for t in current_rows], dim=1)
    send = torch.cat([prefix_bytes, current_bytes], dim=0)
    gathered = all_gather_dim0(send, group_name, world_size)  # [world * (P + M), S]

    views = []
    col = 0
    for c in current_rows:
        width = c.shape[1] * c.element_size()
        placed = torch.ops.cpgraph.take_rows(gathered[:, col : col + width], source)
        views.append(_row_major(placed).view(c.dtype))
        col += width
    return views


@torch.library.custom_op("cpgraph::cp_materialize_kv", mutates_args=())
def cp_materialize_kv(
    prefix_rows: list[Tensor],
    current_rows: list[Tensor],
    prefix_dest: Tensor,
    current_dest: Tensor,
    kv_rows: int,
    group_name: str,
    world_size: int,
) -> list[Tensor]:
    """Dense full KV views ``[kv_rows, W_k]`` of the whole batch, one per payload kind.

    ``prefix_rows[k]``: this rank's ``[P, W_k]`` rows of the cached-prefix
    pages it owns (gathered from its local pool with
    ``MaterializeDescriptors.send_slots``; ``-1`` slots give zero padding
    rows).  ``current_rows[k]``: this rank's ``[M, W_k]`` compute rows of
    this forward (dummies included).  Kind ``k`` has the same dtype and
    width in both; kinds may differ in dtype and width (fp32/bf16 dense
    records, uint8 fp8 records, uint8 key bytes plus their fp32 scales).
    ``prefix_dest`` int64 ``[world_size * P]`` / ``current_dest`` int64
    ``[world_size * M]``: full-view row of every rank-major gathered row,
    ``-1`` = drop (padding, dummy rows).  Full-view rows nobody writes
    (page-tail slack) are zero.  Exactly one collective per call.
    """
    _check_materialize(prefix_rows, current_rows, prefix_dest, current_dest, kv_rows, group_name, world_size)
    resolve_group(_OP, group_name, world_size)
    return cp_materialize_kv_decomposed(
        prefix_rows, current_rows, prefix_dest, current_dest, kv_rows, group_name, world_size
    )


@cp_materialize_kv.register_fake
def _cp_materialize_kv_fake(prefix_rows, current_rows, prefix_dest, current_dest, kv_rows, group_name, world_size):
    _check_materialize(prefix_rows, current_rows, prefix_dest, current_dest, kv_rows, group_name, world_size)
    return [c.new_empty((kv_rows, c.shape[1])) for c in current_rows]
