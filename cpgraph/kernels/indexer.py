"""Triton lightning indexer providers: tensor-core scoring and a tie-rule top-k on the GPU.

The kernels live by concern: scoring in :mod:`cpgraph.kernels.indexer_score`, selection in
:mod:`cpgraph.kernels.topk_select`, launch parameters in :mod:`cpgraph.kernels.indexer_tuning`.
This module binds them to the ops ``indexer_topk``, ``indexer_logits``, ``indexer_logits_fp8``,
``topk_ragged`` and ``topk_paged``: the fused ``indexer_topk`` scores a byte-budgeted chunk of
rows, selects its top-k, then the next chunk, so neither the ``[M, H, N]`` products nor the
``[M, N]`` scores ever exist whole.  See docs/ops/indexer.md.
"""

from __future__ import annotations

import torch

from .indexer_score import score_rows
from .indexer_tuning import set_tuning, tuning, tuning_from_env as _tuning_from_env
from .topk_select import scratch_columns, select_rows


def _chunk_rows(n_keys: int, max_logits_bytes: int) -> int:
    from cpgraph.ops.indexer import logits_chunk_rows

    return logits_chunk_rows(n_keys, max_logits_bytes)


def indexer_topk(q, k, weights, ks, ke, topk, max_logits_bytes, k_scale=None):
    """Provider of ``cpgraph::indexer_topk``: score a chunk of rows, select its top-k, next chunk.

    With ``k_scale`` the operands are e4m3 bytes (the FP8 form): the same
    chunking, so the FP8 path holds one fp32 ``[rows, N]`` chunk too.
    """
    M, N = q.shape[0], k.shape[0]
    out = torch.empty((M, topk), dtype=torch.int32, device=q.device)
    if M == 0:
        return out
    if k_scale is not None:
        f8 = torch.float8_e4m3fn
        q, k, k_scale = q.view(f8), k.view(f8), k_scale.contiguous()
    rows = min(M, _chunk_rows(N, max_logits_bytes))
    buf = torch.empty((rows, max(N, 1)), dtype=torch.float32, device=q.device)
    scratch = torch.empty((rows, scratch_columns(N, topk)), dtype=torch.int32, device=q.device)
    for a in range(0, M, rows):
        m = min(rows, M - a)
        score_rows(q, k, weights, ks, ke, buf, a, m, k_scale=k_scale)
        select_rows(buf, ks, ke, out, a, m, topk, scratch=scratch)
    return out


def indexer_logits(q, k, weights, ks, ke):
    """Provider of ``cpgraph::indexer_logits``: fp32 ``[M, N]``, ``-inf`` outside the windows."""
    M, N = q.shape[0], k.shape[0]
    out = torch.full((M, N), float("-inf"), dtype=torch.float32, device=q.device)
    if N:
        score_rows(q, k, weights, ks, ke, out, 0, M)
    return out


def indexer_logits_fp8(q_bytes, k_bytes, k_scale, weights, ks, ke):
    """Provider of ``cpgraph::indexer_logits_fp8`` (e4m3 tensor-core dots, the key scale before the ReLU)."""
    M, N = q_bytes.shape[0], k_bytes.shape[0]
    out = torch.full((M, N), float("-inf"), dtype=torch.float32, device=q_bytes.device)
    if N:
        f8 = torch.float8_e4m3fn
        score_rows(q_bytes.view(f8), k_bytes.view(f8), weights, ks, ke, out, 0, M, k_scale=k_scale.contiguous())
    return out


_SCRATCH_BYTES = 64 << 20  # candidate scratch of the unfused top-k ops: rows are selected in chunks of this


def _select_all(logits, ks, ke, topk, kv_slots):
    """Select every row of full ``[M, N]`` logits, a bounded chunk of rows (and scratch) at a time."""
    M, N = logits.shape
    out = torch.empty((M, topk), dtype=torch.int32, device=logits.device)
    if M == 0:
        return out
    logits = _unit_columns(logits)
    cols = scratch_columns(N, topk)
    rows = min(M, max(1, _SCRATCH_BYTES // (4 * cols)))
    scratch = torch.empty((rows, cols), dtype=torch.int32, device=logits.device)
    for a in range(0, M, rows):
        m = min(rows, M - a)
        select_rows(logits[a:], ks, ke, out, a, m, topk, kv_slots, scratch=scratch)
    return out


def topk_ragged(logits, ks, ke, topk):
    """Provider of ``cpgraph::topk_ragged``."""
    return _select_all(logits, ks, ke, topk, None)


def topk_paged(logits, ks, ke, topk, kv_slots):
    """Provider of ``cpgraph::topk_paged``."""
    return _select_all(logits, ks, ke, topk, kv_slots.contiguous())


def _unit_columns(x: torch.Tensor) -> torch.Tensor:
    return x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous()


def providers() -> dict:
    """Op name -> Triton provider for the indexer ops."""
    return {
        "indexer_topk": indexer_topk,
        "indexer_logits": indexer_logits,
        "indexer_logits_fp8": indexer_logits_fp8,
        "topk_ragged": topk_ragged,
        "topk_paged": topk_paged,
    }



__all__ = ["tuning", "set_tuning", "scratch_columns", "indexer_topk", "indexer_logits", "indexer_logits_fp8", "topk_ragged", "topk_paged", "providers",
           "score_rows", "select_rows"]
