"""The lightning indexer: picks each query row's top-k keys for sparse MLA.

``iq = wq_b(q_lat)`` viewed ``[H_idx, D]``, ``ik = LayerNorm(wk(x))`` ``[D]``,
RoPE on the first ``qk_rope_head_dim`` dims of both (half-split for
DeepSeek-V3.2, interleaved for GLM-5: ``config.indexer_rope``),
``w = weights_proj(x)`` in fp32.  The score of key ``t`` for row ``s`` is
``sum_h w[s,h] * H^-0.5 * D^-0.5 * relu(iq[s,h] . ik[t])`` over the causal
window ``[ks, ke)``; all scale factors are folded into ``w`` before the op.

Keys are stored per layer in the index-K cache; the full view is composed
from the cached prefix keys (read at ``prefix_slots``) and this forward's
keys by ``cpgraph::kv_compose``, the op the CP pass swaps for the
owner-sharded materialisation:

* ``dense``: slot-major ``[slots, D]`` pool in the model dtype; scoring with
  ``cpgraph::indexer_topk`` (fused logits + top-k, chunked by a byte budget);
* ``fp8``: production form -- an orthonormal Hadamard on ``iq`` and ``ik``
  (dot products unchanged, outliers spread before quantisation), keys stored
  as e4m3 + one power-of-two scale per token (``index_k_store``), queries
  quantised with the scale folded into ``w`` (``indexer_q_quant``), scores and
  selection by ``cpgraph::indexer_topk`` given the key scales (the FP8 form of
  the same fused op, chunked by the same byte budget, so the ``[M, N]`` fp32
  scores of ``indexer_logits_fp8`` never exist in the model).

Output: ``int32 [M, topk]`` row ids in the full view (ragged coordinates,
already offset by the request start), in position order, ``-1`` padding.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .batch import BatchMeta, KVLayout
from .config import DSAConfig
from .fp32_linear import fp32_linear
from .layers import ROPE_STYLES

_ops = torch.ops.cpgraph


def _indexer_ops():
    import cpgraph.ops.indexer  # noqa: F401
    import cpgraph.ops.materialize  # noqa: F401
    import cpgraph.ops.paged  # noqa: F401


class Indexer(nn.Module):
    def __init__(self, cfg: DSAConfig):
        super().__init__()
        _indexer_ops()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.rope = ROPE_STYLES[cfg.indexer_rope]
        self.weight_scale = self.n_heads**-0.5 * self.head_dim**-0.5
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        # fp32 whatever the model dtype, as in transformers (_keep_in_fp32_modules).
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False, dtype=torch.float32)

    def _rope_first(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((self.rope(rot, cos, sin), rest), dim=-1)

    def forward(
        self,
        x: Tensor,
        q_lat: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: BatchMeta,
        layout: KVLayout,
        index_pool: Tensor,
    ) -> Tensor:
        M = x.shape[0]
        q = self.wq_b(q_lat).view(M, self.n_heads, self.head_dim)
        q = self._rope_first(q, cos, sin)
        k = self._rope_first(self.k_norm(self.wk(x)), cos, sin)
        w = fp32_linear(x, self.weights_proj.weight) * self.weight_scale  # fp32 by definition (models/fp32_linear.py)

        if layout.kv_format == "fp8":
            k = _ops.hadamard(k)
            _ops.index_k_store(index_pool, k, meta.row_slots, layout.page_size)
            cur_bytes, cur_scale = _ops.index_k_quant(k)
            pre_bytes, pre_scale = _ops.index_k_gather(index_pool, meta.prefix_slots, layout.page_size, self.head_dim)
            k_bytes, k_scale = _ops.kv_compose([pre_bytes, pre_scale], [cur_bytes, cur_scale], meta.kv_source)
            q_bytes, w_q = _ops.indexer_q_prepare(q, w)  # hadamard + indexer_q_quant in one pass over q
            del q  # read by nothing else: an eager forward frees it before the scores (the memory plan's order)
            # head_dim <= 128 -> one scale block per token (checked when the layout is built).  Scored and
            # selected a byte-budgeted chunk of rows at a time, like the dense path: never [M, N] at once.
            key_scale = k_scale[:, 0].contiguous()
            return _ops.indexer_topk(q_bytes, k_bytes, w_q, meta.ks, meta.ke, self.topk, layout.max_logits_bytes,
                                     key_scale)

        k = k.to(index_pool.dtype)
        _ops.paged_store(index_pool, k, meta.row_slots)
        (k_full,) = _ops.kv_compose([_ops.paged_gather(index_pool, meta.prefix_slots)], [k], meta.kv_source)
        return _ops.indexer_topk(q, k_full, w, meta.ks, meta.ke, self.topk, layout.max_logits_bytes)
