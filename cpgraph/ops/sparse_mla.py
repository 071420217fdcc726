"""Sparse MLA attention over the indexer's top-k keys (absorbed form).

Every query row attends only to the keys its top-k list names.  In the
absorbed MLA form all heads share one key/value row per token,
``kv[t] = [latent (d_v) | k_pe (rope)]``: scores use the whole row, values
are its first ``d_v`` columns.  This is the FlashMLA ``flash_mla_sparse_fwd``
contract, so a provider can bind that kernel (or a Triton kernel) 1:1.

The reference gathers the selected rows, which is ``[rows, topk, D]`` per
chunk; for a long prefill (topk 2048, D 576) that is 4.5 MiB per row in
fp32, so rows are processed in chunks bounded by ``SPARSE_MLA_GATHER_BYTES``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_same_device, check_tensor
from .codecs import MLA_FP8_LATENT, MLA_FP8_RECORD_BYTES, MLA_FP8_ROPE, mla_fp8_unpack_reference
from .providers import select

_INDEX = (torch.int64, torch.int32)
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)

# Upper bound (bytes) on the fp32 gathered keys + scores of one row chunk in the reference.
SPARSE_MLA_GATHER_BYTES = 64 << 20


def sparse_mla_chunk_rows(num_heads: int, topk: int, head_dim: int, budget: int | None = None) -> int:
    """Rows per chunk so that ``[rows, topk, D]`` gathered keys plus ``[rows, H, topk]`` scores fit (>= 1)."""
    budget = SPARSE_MLA_GATHER_BYTES if budget is None else budget
    per_row = 4 * topk * (head_dim + num_heads)
    return max(1, budget // max(per_row, 1))


def _check_sparse_mla(q: Tensor, kv: Tensor, idx: Tensor, sm_scale, d_v) -> None:
    op = "sparse_mla"
    check_tensor(op, "q", q, dtype=_FLOAT, ndim=3)
    m, _, d = q.shape
    check_tensor(op, "kv", kv, dtype=q.dtype, ndim=2, shape=(None, d))
    check_tensor(op, "idx", idx, dtype=_INDEX, ndim=2, shape=(m, None))
    check_same_device(op, q=q, kv=kv, idx=idx)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise ValueError(f"cpgraph.sparse_mla: argument 'sm_scale' must be a float, got {sm_scale!r}")
    if isinstance(d_v, bool) or not isinstance(d_v, int) or d_v < 1 or (isinstance(d, int) and d_v > d):
        raise ValueError(f"cpgraph.sparse_mla: argument 'd_v' must be an int in [1, D={d}], got {d_v!r}")


def _attend_chunk(q: Tensor, kv: Tensor, idx: Tensor, sm_scale: float, d_v: int, gather=None) -> tuple[Tensor, Tensor]:
    """fp32 ``(out [r, H, d_v], lse [r, H])`` for one row chunk; each listed valid entry is one term.

    ``gather(safe_ids)`` returns the fp32 key rows ``[len, D]`` of in-range
    ids (default: rows of ``kv``); the FP8 op passes a dequantising gather.
    """
    n = kv.shape[0]
    r, k = idx.shape
    idx = idx.long()
    valid = (idx >= 0) & (idx < n)  # [r, k]
    safe = torch.where(valid, idx, torch.zeros((), dtype=idx.dtype, device=idx.device))
    rows = (kv.index_select(0, safe.view(-1)).float() if gather is None else gather(safe.view(-1))).view(r, k, -1)
    scores = torch.einsum("rhd,rkd->rhk", q.float(), rows) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is valid
    has_key = valid.any(dim=-1)[:, None]  # [r, 1]
    # Skipped entries score -inf, so exp() gives them exactly 0; rows without keys subtract 0, not -inf.
    probs = torch.exp(scores - torch.where(has_key, lse, torch.zeros_like(lse))[..., None])
    out = torch.einsum("rhk,rkv->rhv", probs, rows[:, :, :d_v])
    lse = torch.where(has_key, lse, torch.full_like(lse, float("inf")))
    return out, lse


def _reference(q, kv, idx, sm_scale, d_v, gather=None):
    m, h, d = q.shape
    out = torch.empty((m, h, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((m, h), dtype=torch.float32, device=q.device)
    topk = idx.shape[1]
    if kv.shape[0] == 0 or topk == 0:  # no key can be valid: shape-only decision
        out.zero_()
        lse.fill_(float("inf"))
        return out, lse
    rows = sparse_mla_chunk_rows(h, topk, d)
    for a in range(0, m, rows):
        b = min(m, a + rows)
        o, l = _attend_chunk(q[a:b], kv, idx[a:b], sm_scale, d_v, gather)
        out[a:b] = o.to(q.dtype)
        lse[a:b] = l
    return out, lse


def sparse_mla_reference(q, kv, idx, sm_scale, d_v):
    return _reference(q, kv, idx, sm_scale, d_v)


@torch.library.custom_op("cpgraph::sparse_mla", mutates_args=())
def sparse_mla(q: Tensor, kv: Tensor, idx: Tensor, sm_scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    """Attention of each query row over the keys listed in ``idx``.

    ``q`` ``[M, H, D]``, ``kv`` ``[N, D]`` (same float dtype), ``idx``
    int32/int64 ``[M, topk]``.  For row ``s``, head ``h``, over the valid
    entries ``t`` of ``idx[s]`` (``0 <= t < N``; ``-1`` and ``t >= N`` are
    skipped; a repeated id counts once per occurrence, as in the kernels)::

        p = softmax_t(sm_scale * q[s,h] . kv[t])
        out[s,h] = sum_t p_t * kv[t, :d_v]          (cast to q.dtype)
        lse[s,h] = log(sum_t exp(sm_scale * q[s,h] . kv[t]))   (natural log, fp32)

    A row without any valid entry (a dummy row, or ``topk == 0``) gets exact
    ``out = 0`` and ``lse = +inf``, never NaN.  Computed in fp32.
    """
    _check_sparse_mla(q, kv, idx, sm_scale, d_v)
    return select("sparse_mla", q.device.type, sparse_mla_reference)(q, kv, idx, float(sm_scale), d_v)


@sparse_mla.register_fake
def _sparse_mla_fake(q, kv, idx, sm_scale, d_v):
    _check_sparse_mla(q, kv, idx, sm_scale, d_v)
    m, h, _ = q.shape
    return q.new_empty((m, h, d_v)), q.new_empty((m, h), dtype=torch.float32)


# --------------------------------------------------------- FP8 record keys
def _check_sparse_mla_fp8(q: Tensor, records: Tensor, idx: Tensor, sm_scale, d_v) -> None:
    op = "sparse_mla_fp8"
    check_tensor(op, "q", q, dtype=_FLOAT, ndim=3, shape=(None, None, MLA_FP8_LATENT + MLA_FP8_ROPE))
    m = q.shape[0]
    check_tensor(op, "records", records, dtype=torch.uint8, shape=(None, MLA_FP8_RECORD_BYTES))
    check_tensor(op, "idx", idx, dtype=_INDEX, ndim=2, shape=(m, None))
    check_same_device(op, q=q, records=records, idx=idx)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise ValueError(f"cpgraph.sparse_mla_fp8: argument 'sm_scale' must be a float, got {sm_scale!r}")
    d = MLA_FP8_LATENT + MLA_FP8_ROPE
    if isinstance(d_v, bool) or not isinstance(d_v, int) or d_v < 1 or d_v > d:
        raise ValueError(f"cpgraph.sparse_mla_fp8: argument 'd_v' must be an int in [1, {d}], got {d_v!r}")


def _dequantize_records(records: Tensor, ids: Tensor) -> Tensor:
    """fp32 ``[len(ids), 576]`` key rows of the records ``ids`` (exact: e4m3 times a power of two)."""
    return mla_fp8_unpack_reference(records.index_select(0, ids), torch.float32)


def sparse_mla_fp8_reference(q, records, idx, sm_scale, d_v):
    return _reference(q, records, idx, sm_scale, d_v, gather=lambda ids: _dequantize_records(records, ids))


@torch.library.custom_op("cpgraph::sparse_mla_fp8", mutates_args=())
def sparse_mla_fp8(q: Tensor, records: Tensor, idx: Tensor, sm_scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    """:func:`sparse_mla` with keys read straight from a pool of 656-byte FP8 MLA records.

    ``records`` ``uint8 [S, 656]`` is the slot-major FP8 MLA pool (or any
    set of records), ``idx`` names record rows (PAGED slot ids when the pool
    is passed as it lives), ``q`` ``[M, H, 576]``.  Key row ``t`` is the
    record's dequantised ``[latent (512) | k_pe (64)]`` in fp32 -- exact,
    since e4m3 times a power-of-two scale is representable -- so the result
    equals ``sparse_mla(q, mla_fp8_unpack(records, float32), idx, ...)``
    computed without materialising the unpacked pool.  Why: a prefill that
    keeps the FP8 cache need not unpack the whole view per layer (576 bf16
    per token written and read again) to use 2048 keys per row.  Same
    validity, empty-row (``out = 0``, ``lse = +inf``) and lse rules as
    :func:`sparse_mla`.
    """
    _check_sparse_mla_fp8(q, records, idx, sm_scale, d_v)
    return select("sparse_mla_fp8", q.device.type, sparse_mla_fp8_reference)(q, records, idx, float(sm_scale), d_v)


@sparse_mla_fp8.register_fake
def _sparse_mla_fp8_fake(q, records, idx, sm_scale, d_v):
    _check_sparse_mla_fp8(q, records, idx, sm_scale, d_v)
    m, h, _ = q.shape
    return q.new_empty((m, h, d_v)), q.new_empty((m, h), dtype=torch.float32)
