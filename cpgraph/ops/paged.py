"""Paged KV store and gather.

A KV pool is slot-major: slot ``loc`` of a record pool is row ``loc``; of an
fp8 index-K page pool it is token ``loc % page_size`` of page
``loc // page_size`` (layout in :mod:`cpgraph.ops.codecs`).  Slot ``-1``
means "no slot": CP compute padding and static padding rows carry it, so a
store skips them (dummy rows never write KV) and a gather returns zero rows
(shapes stay static, no boolean-mask indexing).  Any slot outside
``[0, S)`` (``S`` = the pool's slots: rows, or pages * page_size) is treated
exactly like ``-1``, by the references and the kernels alike: no provider
ever reads or writes outside the pool.  With ``CPGRAPH_DEBUG`` on, slots
outside ``[-1, S)`` raise instead (:mod:`cpgraph.ops.rows` states the rule).

The stores are the only mutating cpgraph ops.  They declare exactly what they
write (``mutates_args``) and return nothing, so functionalisation turns them
into ``auto_functionalized`` nodes and writes back; nothing can be dead-code
eliminated.  The gathers are functional and always return new tensors.

Skipping ``-1`` without a host sync: every skipped row is redirected to the
slot *and value* of the first valid row, so the extra writes repeat an
identical value (deterministic even with duplicate indices).  When no row is
valid, the writes go to slot 0 with slot 0's current value (a no-op).  Two
*valid* rows naming one slot is a caller bug and the result is unspecified.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_index_range, check_same_device, check_tensor
from .codecs import FLOATS, check_index_pages, num_scale_blocks, quantize_blocks
from .providers import select
from .rows import index_in_range

_INDEX = (torch.int64, torch.int32)


def _write_plan(slots: Tensor, num_slots: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(target slot, source row, any_valid)`` for a sync-free masked scatter.

    A row is valid iff its slot lies in ``[0, num_slots)``.  Valid rows
    write themselves; skipped rows repeat the first valid row's write.  With
    no valid row at all every target is slot 0 and the caller substitutes
    the slot's current value (``any_valid`` is a 0-d bool).
    """
    valid, safe = index_in_range(slots, num_slots)
    first = torch.argmax(valid.to(torch.uint8))  # first valid row, or 0 if none (0-d, on device)
    rows = torch.arange(slots.shape[0], device=slots.device)
    src = torch.where(valid, rows, first)
    return safe.index_select(0, src), src, valid.any()


# ------------------------------------------------------------ paged_store
def _check_paged_store(pool: Tensor, rows: Tensor, slots: Tensor) -> None:
    check_tensor("paged_store", "pool", pool, ndim=2)
    check_tensor("paged_store", "rows", rows, dtype=pool.dtype, shape=(None, pool.shape[1]))
    check_tensor("paged_store", "slots", slots, dtype=_INDEX, shape=(rows.shape[0],))
    check_same_device("paged_store", pool=pool, rows=rows, slots=slots)


def paged_store_reference(pool: Tensor, rows: Tensor, slots: Tensor) -> None:
    if slots.shape[0] == 0 or pool.shape[0] == 0:
        return
    target, src, any_valid = _write_plan(slots, pool.shape[0])
    values = torch.where(any_valid, rows.index_select(0, src), pool[0])
    pool.index_put_((target,), values)


@torch.library.custom_op("cpgraph::paged_store", mutates_args=("pool",))
def paged_store(pool: Tensor, rows: Tensor, slots: Tensor) -> None:
    """``pool[slots[i]] = rows[i]`` for every ``slots[i] != -1``.

    ``pool``: ``[S, W]`` of any dtype (a dense MLA/index-K pool, or the
    ``uint8 [S, 656]`` FP8 MLA pool); ``rows``: ``[N, W]`` of the pool's dtype
    (already packed: ``mla_dense_pack`` / ``mla_fp8_pack``); ``slots``:
    int32/int64 ``[N]`` in ``[-1, S)``.  Rows with slot ``-1`` are skipped,
    and so are rows whose slot lies outside ``[0, S)`` (they raise under
    ``CPGRAPH_DEBUG``).
    """
    _check_paged_store(pool, rows, slots)
    check_index_range("paged_store", "slots", slots, -1, pool.shape[0])
    select("paged_store", pool.device.type, paged_store_reference)(pool, rows, slots)


@paged_store.register_fake
def _paged_store_fake(pool, rows, slots):
    _check_paged_store(pool, rows, slots)
    return None


# ----------------------------------------------------------- paged_gather
def _check_paged_gather(pool: Tensor, slots: Tensor) -> None:
    check_tensor("paged_gather", "pool", pool, ndim=2)
    check_tensor("paged_gather", "slots", slots, dtype=_INDEX, ndim=1)
    check_same_device("paged_gather", pool=pool, slots=slots)


def paged_gather_reference(pool: Tensor, slots: Tensor) -> Tensor:
    if pool.shape[0] == 0:  # only -1 slots can be valid input here
        return pool.new_zeros((slots.shape[0], pool.shape[1]))
    valid, safe = index_in_range(slots, pool.shape[0])
    picked = pool.index_select(0, safe)
    return torch.where(valid.unsqueeze(1), picked, torch.zeros((), dtype=pool.dtype, device=pool.device))


@torch.library.custom_op("cpgraph::paged_gather", mutates_args=())
def paged_gather(pool: Tensor, slots: Tensor) -> Tensor:
    """``out[i] = pool[slots[i]]``, a zero row where ``slots[i] == -1``.

    Returns a new ``[N, W]`` tensor of the pool's dtype (for the FP8 MLA pool
    the zero record decodes to zeros, since its scales are 0).  A slot
    outside ``[0, S)`` gives a zero row like ``-1`` (raises under
    ``CPGRAPH_DEBUG``).
    """
    _check_paged_gather(pool, slots)
    check_index_range("paged_gather", "slots", slots, -1, pool.shape[0])
    return select("paged_gather", pool.device.type, paged_gather_reference)(pool, slots)


@paged_gather.register_fake
def _paged_gather_fake(pool, slots):
    _check_paged_gather(pool, slots)
    return pool.new_empty((slots.shape[0], pool.shape[1]))


# ----------------------------------------------------------- index pages
def _page_views(pages: Tensor, page_size: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """Views ``[P, page, D]`` (key bytes) and ``[P, page, 4 nb]`` (scale bytes) of the pages."""
    p = pages.shape[0]
    split = page_size * head_dim
    keys = pages[:, :split].view(p, page_size, head_dim)
    scales = pages[:, split:].view(p, page_size, 4 * num_scale_blocks(head_dim))
    return keys, scales


def _check_pages_strides(op: str, pages: Tensor) -> None:
    if pages.dim() == 2 and pages.shape[1] > 1 and pages.stride(1) != 1:
        raise ValueError(f"cpgraph.{op}: argument 'pages' must have unit stride along its last dim")


def _check_index_k_store(pages: Tensor, keys: Tensor, slots: Tensor, page_size: int) -> None:
    check_tensor("index_k_store", "keys", keys, dtype=FLOATS, ndim=2)
    check_index_pages("index_k_store", "pages", pages, page_size, keys.shape[1])
    check_tensor("index_k_store", "slots", slots, dtype=_INDEX, shape=(keys.shape[0],))
    check_same_device("index_k_store", pages=pages, keys=keys, slots=slots)


def index_k_store_reference(pages: Tensor, keys: Tensor, slots: Tensor, page_size: int) -> None:
    if slots.shape[0] == 0 or pages.shape[0] == 0:
        return
    key_view, scale_view = _page_views(pages, page_size, keys.shape[1])
    q, scales = quantize_blocks(keys)
    target, src, any_valid = _write_plan(slots, pages.shape[0] * page_size)
    page, offset = target // page_size, target % page_size
    q_rows = torch.where(any_valid, q.index_select(0, src), key_view[0, 0])
    s_rows = torch.where(any_valid, scales.view(torch.uint8).index_select(0, src), scale_view[0, 0])
    key_view.index_put_((page, offset), q_rows)
    scale_view.index_put_((page, offset), s_rows)


@torch.library.custom_op("cpgraph::index_k_store", mutates_args=("pages",))
def index_k_store(pages: Tensor, keys: Tensor, slots: Tensor, page_size: int) -> None:
    """Quantise ``keys [N, D]`` and write them into fp8 index pages at ``slots``.

    ``pages``: ``uint8 [P, page_size * (D + 4 nb)]`` (layout in
    :mod:`cpgraph.ops.codecs`); slot ``loc`` is token ``loc % page_size`` of
    page ``loc // page_size``.  Quantisation is per token, so storing a
    token here gives the same bytes as ``index_k_page_pack`` of its page.
    Rows with slot ``-1`` are skipped, and so are rows whose slot lies
    outside ``[0, P * page_size)`` (they raise under ``CPGRAPH_DEBUG``).
    """
    _check_index_k_store(pages, keys, slots, page_size)
    _check_pages_strides("index_k_store", pages)
    check_index_range("index_k_store", "slots", slots, -1, pages.shape[0] * page_size)
    select("index_k_store", pages.device.type, index_k_store_reference)(pages, keys, slots, page_size)


@index_k_store.register_fake
def _index_k_store_fake(pages, keys, slots, page_size):
    _check_index_k_store(pages, keys, slots, page_size)
    return None


def _check_index_k_gather(pages: Tensor, slots: Tensor, page_size: int, head_dim: int) -> None:
    check_index_pages("index_k_gather", "pages", pages, page_size, head_dim)
    check_tensor("index_k_gather", "slots", slots, dtype=_INDEX, ndim=1)
    check_same_device("index_k_gather", pages=pages, slots=slots)


def index_k_gather_reference(pages: Tensor, slots: Tensor, page_size: int, head_dim: int) -> tuple[Tensor, Tensor]:
    n = slots.shape[0]
    nb = num_scale_blocks(head_dim)
    if pages.shape[0] == 0:
        return pages.new_zeros((n, head_dim)), pages.new_zeros((n, nb), dtype=torch.float32)
    key_view, scale_view = _page_views(pages, page_size, head_dim)
    valid, loc = index_in_range(slots, pages.shape[0] * page_size)
    valid = valid.unsqueeze(1)
    page, offset = loc // page_size, loc % page_size
    zero = torch.zeros((), dtype=torch.uint8, device=pages.device)
    key_bytes = torch.where(valid, key_view[page, offset], zero)
    scale_bytes = torch.where(valid, scale_view[page, offset], zero)
    return key_bytes, scale_bytes.view(torch.float32)


@torch.library.custom_op("cpgraph::index_k_gather", mutates_args=())
def index_k_gather(pages: Tensor, slots: Tensor, page_size: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """Read index keys at ``slots``: ``(e4m3 bytes uint8 [N, D], scales f32 [N, nb])``.

    Zero bytes and zero scale where ``slots[i] == -1`` or lies outside
    ``[0, P * page_size)`` (a zero scale makes the key decode to exact
    zeros; out-of-range slots raise under ``CPGRAPH_DEBUG``).  The bytes and scales are what
    ``indexer_logits_fp8`` takes (with ``nb == 1``, squeeze the scales).
    """
    _check_index_k_gather(pages, slots, page_size, head_dim)
    _check_pages_strides("index_k_gather", pages)
    check_index_range("index_k_gather", "slots", slots, -1, pages.shape[0] * page_size)
    return select("index_k_gather", pages.device.type, index_k_gather_reference)(pages, slots, page_size, head_dim)


@index_k_gather.register_fake
def _index_k_gather_fake(pages, slots, page_size, head_dim):
    _check_index_k_gather(pages, slots, page_size, head_dim)
    n = slots.shape[0]
    return (
        pages.new_empty((n, head_dim), dtype=torch.uint8),
        pages.new_empty((n, num_scale_blocks(head_dim)), dtype=torch.float32),
    )
