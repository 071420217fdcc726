"""MLA attention in absorbed form, restricted to the indexer's top-k keys.

Per layer (the model math is in docs/models.md):

* queries: ``q = q_b(rmsnorm(q_a(x)))`` -> per head ``[q_nope | q_pe]``; RoPE on
  ``q_pe``; ``q_nope`` is absorbed into the latent space with ``W_UK`` so a
  query is ``[q_nope @ W_UK | q_pe]`` (width ``kv_lora + rope``);
* keys/values: one shared record per token ``[rmsnorm(c) | rope(k_pe)]``
  written to the paged MLA cache at ``row_slots``; the full view (prefix and
  current tokens of every request, in the plan's full-view coordinates) is
  composed by ``cpgraph::kv_compose`` from the cached prefix rows (read at
  ``prefix_slots``) and this forward's fresh records.  Under CP a compiler
  pass swaps that op for the owner-sharded ``cp_materialize_kv``;
* ``cpgraph::sparse_mla`` attends over the selected full-view rows with
  softmax scale ``qk_head_dim^-0.5`` (x yarn mscale^2), values = latents;
  the latent output goes through ``W_UV`` and ``o_proj``.

The forward is written once, in the materialised form above, and that is
what runs eagerly (the reference).  Where the keys are read from in a
compiled forward is the compiler's choice: on one device the
``read_kv_in_place`` pass points sparse MLA at the pool itself with PAGED
slot ids (``sparse_mla_fp8`` for FP8 records) and drops the per-layer view;
under CP the view stays (docs/passes.md, "Where sparse MLA reads its keys").

Dense records are ``[latent | k_pe]`` in the model dtype; FP8 records are the
656-byte format (``mla_fp8_pack`` / ``mla_fp8_unpack``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import cpgraph.ops.codecs  # noqa: F401  (registers mla_fp8_pack / mla_dense_pack)
import cpgraph.ops.layer_events  # noqa: F401
import cpgraph.ops.materialize  # noqa: F401
import cpgraph.ops.mla_output  # noqa: F401  (registers mla_output)
import cpgraph.ops.mla_query  # noqa: F401  (registers mla_query)
import cpgraph.ops.rows  # noqa: F401

from .batch import BatchMeta, KVLayout
from .config import DSAConfig
from .indexer import Indexer
from .layers import RMSNorm, rope_interleaved, softmax_scale

_ops = torch.ops.cpgraph


def _paged_ops():
    # Imported lazily: these modules are written by other people in parallel and
    # registering them at import time of cpgraph.models would make a missing
    # file break ``import cpgraph.models`` for the loaders and the CLI.
    import cpgraph.ops.paged  # noqa: F401
    import cpgraph.ops.sparse_mla  # noqa: F401


class MLAttention(nn.Module):
    def __init__(self, cfg: DSAConfig, layer_idx: int):
        super().__init__()
        _paged_ops()
        self.layer_idx = layer_idx
        self.num_heads = H = cfg.num_attention_heads
        self.nope = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.v_dim = cfg.v_head_dim
        self.sm_scale = softmax_scale(cfg.rope, cfg.qk_head_dim)
        bias = cfg.attention_bias
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)  # eps 1e-6 as in transformers (not rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, cfg.hidden_size, bias=bias)
        # IndexCache: a "shared" layer owns no indexer at all (no weights, no compute, no index-K pages).
        self.indexer = Indexer(cfg) if cfg.indexer_types[layer_idx] == "full" else None

    def _absorbed(self) -> tuple[Tensor, Tensor]:
        """``W_UK [H, nope, L]`` and ``W_UV [H, v, L]`` as views of ``kv_b_proj``."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, : self.nope], w[:, self.nope :]

    def query(self, q_lat: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Sparse-MLA queries ``[M, H, kv_lora + rope]`` = ``[q_nope @ W_UK | rope(q_pe)]`` from ``q_lat``.

        Its own method so that benchmarks/mla_query_bench.py times exactly
        this code.  ``cpgraph::mla_query`` is one op so that the GPU provider's
        absorption GEMM writes straight into the ``[M, H, L + R]`` layout
        (cpgraph/ops/mla_query.py says why).
        """
        M = q_lat.shape[0]
        w_uk, _ = self._absorbed()
        q = self.q_b_proj(q_lat).view(M, self.num_heads, self.nope + self.rope_dim)
        return _ops.mla_query(q, w_uk, cos, sin)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: BatchMeta,
        layout: KVLayout,
        mla_pool: Tensor,
        index_pool: Tensor | None,
        prev_topk: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """``x`` ``[M, hidden]`` (normed) -> (``[M, hidden]``, top-k ``int32 [M, k]`` ragged ids)."""
        _, w_uv = self._absorbed()

        q_lat = self.q_a_layernorm(self.q_a_proj(x))
        q_full = self.query(q_lat, cos, sin)

        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        k_pe = rope_interleaved(k_pe, cos, sin)

        # Write this forward's rows to the cache; build the full view from the
        # cached prefix (read from the pool) and the fresh rows (never re-read).
        fp8 = layout.kv_format == "fp8"
        # Per-layer event points for the runtime (HiCache load-back waits, transfer hooks).
        _ops.kv_layer_ready(mla_pool, self.layer_idx)
        record = _ops.mla_fp8_pack(c, k_pe) if fp8 else _ops.mla_dense_pack(c, k_pe)
        _ops.paged_store(mla_pool, record, meta.row_slots)
        (kv,) = _ops.kv_compose([_ops.paged_gather(mla_pool, meta.prefix_slots)], [record], meta.kv_source)
        if fp8:
            kv = _ops.mla_fp8_unpack(kv, x.dtype)

        if self.indexer is not None:
            topk = self.indexer(x, q_lat, cos, sin, meta, layout, index_pool)
        else:
            if prev_topk is None:
                raise ValueError(f"layer {self.layer_idx} is a shared-indexer layer but no earlier layer ran one")
            topk = prev_topk

        _ops.kv_layer_written(mla_pool, self.layer_idx)
        out_lat, _lse = _ops.sparse_mla(q_full, kv, topk, self.sm_scale, self.kv_lora)
        # W_UV absorbed, written as the [M, H * v] rows o_proj reads (cpgraph/ops/mla_output.py says why)
        return self.o_proj(_ops.mla_output(out_lat, w_uv)), topk
