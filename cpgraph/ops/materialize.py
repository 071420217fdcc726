"""``cpgraph::cp_materialize_kv``: the dense full KV view from owner-sharded storage.

With owner-sharded KV each rank stores only the pages it owns, but the
attention and indexer kernels want one dense full view per layer.  This op
builds it with ONE collective per call, whatever the number of payload kinds
(MLA records, index-key bytes, index-key scales, ...):

1. pack: every payload (cached-prefix rows this rank owns, then this
   forward's fresh compute rows) is viewed as bytes and laid side by side
   into one ``uint8 [P + M, S]`` buffer (each kind at an 8-byte aligned
   column, ``S`` = the kinds' row bytes rounded up to 8 each; zero padding);
2. one functional ``all_gather_into_tensor`` -> ``[world * (P + M), S]``;
3. place: each kind's byte columns are gathered into ``[kv_rows, bytes_k]``
   with ``cpgraph::take_rows`` through the planner's ``kv_source`` (the
   gathered row of every full-view row, built on the host once per batch)
   and viewed back as the kind's dtype.

The eager op body takes pack and placement from the device's providers
(``cp_materialize_kv_pack`` / ``cp_materialize_kv_place``: on CUDA the
Triton pack and the one-launch multi-kind placement of
:mod:`cpgraph.kernels.materialize`); ``cp_materialize_kv_decomposed`` keeps
the torch/``take_rows`` form for the lowering pass.  Both give the same bytes.

Why one collective: collective launch latency and synchronisation dominate
for the small per-layer payloads of short batches, and every rank must issue
the same collectives in the same order, which is easiest to guarantee when
there is exactly one.  Why current rows travel from the fresh tensors: the
cache might not have been written yet (or hold stale bytes); the full view
must use this forward's values.  Why a source index per full-view row: two
requests sharing a physical prefix page still get separate full-view rows,
and since every destination names exactly one source, nothing depends on
which write lands last.  The descriptors come from
:func:`cpgraph.plan.materialize.materialize_descriptors`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_index_range, check_same_device, check_tensor
from .collectives import all_gather_dim0, check_group_args, resolve_group
from .providers import select

_OP = "cp_materialize_kv"


def _check_payloads(op: str, name: str, payloads) -> None:
    if not isinstance(payloads, (list, tuple)):
        raise ValueError(f"cpgraph.{op}: argument '{name}' must be a list of tensors, got {type(payloads).__name__}")
    for k, t in enumerate(payloads):
        check_tensor(op, f"{name}[{k}]", t, ndim=2)


def _check_compose(op: str, prefix_rows, current_rows, kv_source) -> None:
    _check_payloads(op, "prefix_rows", prefix_rows)
    _check_payloads(op, "current_rows", current_rows)
    if len(prefix_rows) != len(current_rows):
        raise ValueError(
            f"cpgraph.{op}: 'prefix_rows' has {len(prefix_rows)} payloads but 'current_rows' has "
            f"{len(current_rows)}; pass one prefix and one current tensor per payload kind"
        )
    if not current_rows:
        raise ValueError(f"cpgraph.{op}: 'current_rows' must hold at least one payload")
    num_prefix = prefix_rows[0].shape[0]
    num_current = current_rows[0].shape[0]
    for k, (p, c) in enumerate(zip(prefix_rows, current_rows)):
        if p.dtype != c.dtype:
            raise ValueError(
                f"cpgraph.{op}: payload {k}: 'prefix_rows[{k}]' is {p.dtype} but 'current_rows[{k}]' is {c.dtype}"
            )
        check_tensor(op, f"prefix_rows[{k}]", p, shape=(num_prefix, c.shape[1]))
        check_tensor(op, f"current_rows[{k}]", c, shape=(num_current, None))
    check_tensor(op, "kv_source", kv_source, dtype=torch.int64, ndim=1)
    named = {f"prefix_rows[{k}]": t for k, t in enumerate(prefix_rows)}
    named.update({f"current_rows[{k}]": t for k, t in enumerate(current_rows)})
    check_same_device(op, **named, kv_source=kv_source)


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


# ------------------------------------------------------------------ kv_compose
def kv_compose_reference(prefix_rows: list[Tensor], current_rows: list[Tensor], kv_source: Tensor) -> list[Tensor]:
    return [torch.ops.cpgraph.take_rows(torch.cat([p, c], dim=0), kv_source) for p, c in zip(prefix_rows, current_rows)]


@torch.library.custom_op("cpgraph::kv_compose", mutates_args=())
def kv_compose(prefix_rows: list[Tensor], current_rows: list[Tensor], kv_source: Tensor) -> list[Tensor]:
    """Single-device full KV view: cached-prefix rows plus this forward's rows, placed per request.

    The single-device form of ``cp_materialize_kv`` (a group of one): for
    each payload kind ``k``, ``out[k][v] = cat(prefix_rows[k], current_rows[k])[kv_source[v]]``,
    zero where ``kv_source[v] == -1`` (page-tail slack).  ``prefix_rows[k]``
    are the cached-prefix rows read from the pool (``paged_gather`` at the
    descriptors' ``send_slots``); ``current_rows[k]`` are the fresh rows of
    this forward, never re-read through the cache.  The CP attention pass
    swaps this op for ``cp_materialize_kv`` with the same arguments plus the
    group, which is why the model is written against it.
    """
    _check_compose("kv_compose", prefix_rows, current_rows, kv_source)
    check_index_range("kv_compose", "kv_source", kv_source, -1, prefix_rows[0].shape[0] + current_rows[0].shape[0])
    return kv_compose_reference(prefix_rows, current_rows, kv_source)


@kv_compose.register_fake
def _kv_compose_fake(prefix_rows, current_rows, kv_source):
    _check_compose("kv_compose", prefix_rows, current_rows, kv_source)
    return [c.new_empty((kv_source.shape[0], c.shape[1])) for c in current_rows]


# ----------------------------------------------------------- cp_materialize_kv
PACK_ALIGN = 8


def packed_columns(current_rows: list[Tensor]) -> tuple[list[int], int]:
    """Byte column of every kind in a packed row, and the packed row's bytes.

    Each kind starts at a multiple of ``PACK_ALIGN`` bytes and the row is
    padded to one (656 + 128 + 4 -> columns 0, 656, 784, row 792 instead of
    788): 0.5% more bytes on the wire buys 8-byte aligned rows, so the
    placement kernel moves the large kinds as 8-byte words instead of 4.
    The padding is zeros (deterministic bytes on the wire).  Shape
    arithmetic only: both ranks compute the same layout without talking.
    """
    columns = []
    col = 0
    for c in current_rows:
        columns.append(col)
        col += -(-(c.shape[1] * c.element_size()) // PACK_ALIGN) * PACK_ALIGN
    return columns, col


def pack_reference(prefix_rows: list[Tensor], current_rows: list[Tensor], columns: list[int], row_bytes: int) -> Tensor:
    """``uint8 [P + M, row_bytes]``: this rank's block, prefix rows then current rows, kinds side by side."""
    ends = list(columns[1:]) + [row_bytes]
    parts = []
    for p, c, col, end in zip(prefix_rows, current_rows, columns, ends):
        kind = torch.cat([_as_bytes(p), _as_bytes(c)], dim=0)
        parts.append(kind)
        pad = end - col - kind.shape[1]
        if pad:
            parts.append(kind.new_zeros((kind.shape[0], pad)))
    return torch.cat(parts, dim=1)


def place_reference(gathered: Tensor, kv_source: Tensor, columns: list[int], current_rows: list[Tensor]) -> list[Tensor]:
    """Every kind's full view: ``take_rows`` on its byte columns of the gathered rows, viewed as its dtype."""
    views = []
    for c, col in zip(current_rows, columns):
        width = c.shape[1] * c.element_size()
        if width == 0:  # an empty kind: no bytes to place (and no byte view to reinterpret)
            views.append(c.new_empty((kv_source.shape[0], 0)))
            continue
        placed = torch.ops.cpgraph.take_rows(gathered[:, col : col + width], kv_source)
        views.append(placed.contiguous().view(c.dtype))
    return views


def _materialize(prefix_rows, current_rows, kv_source, group_name, world_size, pack, place) -> list[Tensor]:
    """pack -> ONE functional all-gather -> place (``pack``/``place`` bit-identical across providers)."""
    _check_compose(_OP, prefix_rows, current_rows, kv_source)
    check_group_args(_OP, group_name, world_size)
    block = prefix_rows[0].shape[0] + current_rows[0].shape[0]
    # Checked (under CPGRAPH_DEBUG) before communicating, so a bad descriptor
    # raises on every rank instead of leaving peers inside a collective.
    check_index_range(_OP, "kv_source", kv_source, -1, world_size * block)
    columns, row_bytes = packed_columns(current_rows)
    send = pack(prefix_rows, current_rows, columns, row_bytes)  # [P + M, row_bytes]
    gathered = all_gather_dim0(send, group_name, world_size)  # [world * (P + M), row_bytes]
    return place(gathered, kv_source, columns, current_rows)


def cp_materialize_kv_decomposed(
    prefix_rows: list[Tensor],
    current_rows: list[Tensor],
    kv_source: Tensor,
    group_name: str,
    world_size: int,
) -> list[Tensor]:
    """Same result as ``cpgraph::cp_materialize_kv`` from one functional all-gather + ``take_rows``.

    Torch ops, the functional collective and ``cpgraph::take_rows`` only, so
    a lowering pass can hand it to Inductor (which then sees the collective).
    """
    return _materialize(prefix_rows, current_rows, kv_source, group_name, world_size, pack_reference, place_reference)


@torch.library.custom_op("cpgraph::cp_materialize_kv", mutates_args=())
def cp_materialize_kv(
    prefix_rows: list[Tensor],
    current_rows: list[Tensor],
    kv_source: Tensor,
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
    ``kv_source`` int64 ``[kv_rows]``: for every full-view row, its row in
    the rank-major gathered ``[world_size * (P + M)]`` buffer, ``-1`` for
    page-tail slack (a zero row).  Dummy rows and padding are never named,
    so they never land.  Exactly one collective per call.
    """
    _check_compose(_OP, prefix_rows, current_rows, kv_source)
    check_group_args(_OP, group_name, world_size)
    resolve_group(_OP, group_name, world_size)
    # Eager body: pack and placement come from the device's providers (the
    # Triton pack / multi-kind placement on CUDA), logged once; the torch
    # references otherwise.  Same packed layout and bytes either way.
    device = current_rows[0].device.type
    pack = select("cp_materialize_kv_pack", device, pack_reference)
    place = select("cp_materialize_kv_place", device, place_reference)
    return _materialize(prefix_rows, current_rows, kv_source, group_name, world_size, pack, place)


@cp_materialize_kv.register_fake
def _cp_materialize_kv_fake(prefix_rows, current_rows, kv_source, group_name, world_size):
    _check_compose(_OP, prefix_rows, current_rows, kv_source)
    check_group_args(_OP, group_name, world_size)
    return [c.new_empty((kv_source.shape[0], c.shape[1])) for c in current_rows]
