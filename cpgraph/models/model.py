"""DeepSeek-V3.2 / GLM-5 causal LM over cpgraph ops (single device, compile-ready).

The forward takes one flat batch of ``M`` compute rows (the planner's row
layout: valid rows of all requests, then dummy rows), a :class:`BatchMeta`
device bundle and the per-layer KV pools, and returns fp32 last-token
logits ``[B, vocab]``.  It contains no host syncs and no data-dependent
shapes: every size follows from ``M``, ``N_kv``, ``V`` and ``B`` (shapes of
the inputs), and every branch is on static config.

Module and parameter names equal transformers' (``model.layers.3.self_attn.
kv_b_proj.weight``, ``model.layers.3.mlp.experts.gate_up_proj``, ...), so
``from_hf`` is a checked state-dict copy.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor, nn

import cpgraph.ops.row_scope  # noqa: F401
import cpgraph.ops.rows  # noqa: F401

from .batch import BatchMeta, KVLayout
from .config import DSAConfig
from .decoder import DecoderLayer
from .layers import RMSNorm, RotaryTable
from .mtp import DraftModel, MTPLayer

_ops = torch.ops.cpgraph


class ForwardOutput(NamedTuple):
    logits: Tensor  # fp32 [B, vocab]
    hidden: Tensor | None  # final-normed hidden states [T, hidden] of every extend token, global order
    topk: list[Tensor] | None  # per layer int32 [M, index_topk], full-view row ids
    # Final-normed hidden state of every compute row [M, hidden], CP-local (this
    # rank's rows, the plan's row layout): what the MTP draft consumes.
    local_hidden: Tensor | None = None


class DSABody(nn.Module):
    def __init__(self, cfg: DSAConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryTable(cfg.rope, cfg.qk_rope_head_dim)


class DSAForCausalLM(nn.Module):
    """Both architectures; ``config.model_type`` only changes the indexer RoPE style and IndexCache."""

    def __init__(self, cfg: DSAConfig, draft: bool = False):
        super().__init__()
        self.config = cfg
        self.model = DSABody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Static cache layout used when forward() gets no ``layout``.  As a module
        # attribute its ints are graph constants even under ``dynamic=True``
        # (ints passed as forward arguments would become symbolic).
        self.kv_layout = KVLayout()
        # The MTP draft layer (checkpoint ``model.layers.{num_hidden_layers}.*``),
        # built only when asked for; see cpgraph/models/mtp.py.
        if draft:
            self.mtp = MTPLayer(cfg)

    @property
    def has_draft(self) -> bool:
        return hasattr(self, "mtp")

    def draft_module(self):
        """The draft forward as its own module (a second compiled graph; docs/mtp.md)."""
        if not self.has_draft:
            raise ValueError("this model has no MTP draft layer: build or load it with draft=True")
        return DraftModel(self)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self,
        input_ids: Tensor,
        meta: BatchMeta,
        mla_pools: Sequence[Tensor],
        index_pools: Sequence[Tensor],
        layout: KVLayout | None = None,
        return_hidden: bool = False,
        return_topk: bool = False,
        return_local_hidden: bool = False,
    ) -> ForwardOutput:
        """Run the batch; ``mla_pools[layer]`` and ``index_pools[j]`` (j-th indexer layer) are written in place.

        ``layout`` defaults to ``self.kv_layout`` (set that attribute instead of
        passing ``layout`` when compiling with ``dynamic=True``).
        ``return_local_hidden``: also return every compute row's final-normed
        hidden state where it was computed (CP-local, no gather), for the draft.
        Every returned tensor states its row scope (``cpgraph::row_scope``).
        """
        cfg = self.config
        layout = self.kv_layout if layout is None else layout
        if len(mla_pools) != cfg.num_hidden_layers:
            raise ValueError(f"mla_pools must hold {cfg.num_hidden_layers} layer pools, got {len(mla_pools)}")
        if len(index_pools) != len(cfg.indexer_layers):
            raise ValueError(
                f"index_pools must hold one pool per indexer layer ({len(cfg.indexer_layers)}), got {len(index_pools)}"
            )
        body = self.model
        x = body.embed_tokens(input_ids)
        cos, sin = body.rotary(meta.positions, x.dtype)
        index_slot = {layer: j for j, layer in enumerate(cfg.indexer_layers)}
        topk = None
        all_topk = []
        for i, layer in enumerate(body.layers):
            j = index_slot.get(i)
            pool = index_pools[j] if j is not None else None
            x, topk = layer(x, cos, sin, meta, layout, mla_pools[i], pool, topk)
            if return_topk:
                all_topk.append(topk)
        last = _ops.take_rows(x, meta.last_token_index)
        logits = _ops.row_scope(self.lm_head(body.norm(last)).float(), "global")
        # All hidden states: valid tokens only, in global order (under CP the
        # output pass turns this row selection into the rerange).
        hidden = _ops.row_scope(_ops.take_rows(body.norm(x), meta.rerange_index), "global") if return_hidden else None
        local = _ops.row_scope(body.norm(x), "local") if return_local_hidden else None
        topk_out = [_ops.row_scope(t, "local") for t in all_topk] if return_topk else None
        return ForwardOutput(logits, hidden, topk_out, local)
