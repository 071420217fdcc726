"""The multi-token-prediction (MTP) draft layer of DeepSeek-V3.2 and GLM-5.

Definition (DeepSeek-V3 technical report, sec. 2.2; the released checkpoints
store it as ``model.layers.{num_hidden_layers}.*``): for every token ``i``
of a prompt, with ``h_i`` the target's final-normed hidden state at ``i``
and ``t_{i+1}`` the *next* token,

    h'_i   = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])
    h''    = DecoderLayer(h')         one DSA layer: its own indexer, MLA and MLP/MoE
    logits = lm_head(shared_head.norm(h''))

``embed`` and ``lm_head`` are the target's (the checkpoints carry copies
under ``embed_tokens`` / ``shared_head.head``; they are the same tensors and
are not loaded twice).  The draft attends over its own KV (one more layer,
layer id ``num_hidden_layers``) at the target's positions, so its cache has
the target's page layout and is owner-sharded by the same plan.

Why a second compiled graph (not one forward): the next token of each
request's last position is the one the target *samples* from its logits,
known only after the target's forward.  The draft therefore runs as its own
module (:class:`DraftModel`) right after the target, taking the sampled ids
as an input tensor (:class:`~cpgraph.models.batch.DraftInputs`), so one graph
serves every batch, a cached-prefix pass (no sampled token needed) included.
The target hands over its hidden rows where they were computed
(``ForwardOutput.local_hidden``, scope "local"): no all-gather, no rerange.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor, nn

import cpgraph.ops.row_scope  # noqa: F401
import cpgraph.ops.rows  # noqa: F401

from .batch import BatchMeta, DraftInputs, KVLayout
from .config import DSAConfig
from .decoder import DecoderLayer
from .layers import RMSNorm

_ops = torch.ops.cpgraph

# Checkpoint names of the draft layer's copies of shared tensors (not loaded: the target's are used).
SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def draft_layer_config(cfg: DSAConfig) -> DSAConfig:
    """``cfg`` with the draft appended as layer ``num_hidden_layers``.

    The draft layer runs its own indexer (it has its own index-K) and the MLP
    kind of the target's last layer (MoE in every released DSA model).
    """
    return replace(
        cfg,
        num_hidden_layers=cfg.num_hidden_layers + 1,
        mlp_layer_types=cfg.mlp_layer_types + (cfg.mlp_layer_types[-1],),
        indexer_types=cfg.indexer_types + ("full",),
    )


class SharedHead(nn.Module):
    """``shared_head.norm`` (the head itself is the target's ``lm_head``)."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)


class MTPLayer(nn.Module):
    """The draft's own parameters, named as the checkpoint names them under ``model.layers.{N}.``."""

    def __init__(self, cfg: DSAConfig):
        super().__init__()
        if cfg.num_hidden_layers < 1:
            raise ValueError("an MTP draft layer needs a target with at least one layer")
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_id = cfg.draft_layer
        self.block = DecoderLayer(draft_layer_config(cfg), cfg.draft_layer)
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = SharedHead(H, eps)

    # The block's modules sit at the layer's top level in checkpoints
    # (``model.layers.61.self_attn...``); :func:`checkpoint_name` maps them.
    def combine(self, embeds: Tensor, hidden: Tensor) -> Tensor:
        return self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))


def checkpoint_name(cfg: DSAConfig, name: str) -> str | None:
    """Module name in :class:`DSAForCausalLM` (``mtp.*``) of a draft checkpoint tensor, else ``None``.

    ``model.layers.{N}.self_attn.x`` -> ``mtp.block.self_attn.x``;
    ``model.layers.{N}.enorm.weight`` -> ``mtp.enorm.weight``; the shared
    copies (:data:`SHARED_COPIES`) map to ``""`` (skip).
    """
    prefix = f"model.layers.{cfg.draft_layer}."
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    if rest in SHARED_COPIES:
        return ""
    if rest.split(".", 1)[0] in ("enorm", "hnorm", "eh_proj", "shared_head"):
        return "mtp." + rest
    return "mtp.block." + rest


class DraftOutput(NamedTuple):
    logits: Tensor  # fp32 [B, vocab], the draft's next-next-token logits at each request's last position


class DraftModel(nn.Module):
    """The draft forward: a module of its own over the target's shared modules (compiled separately).

    Holds the target's ``embed_tokens``, rotary table and ``lm_head`` and its
    ``mtp`` layer as submodules (the same tensors, nothing copied).
    """

    def __init__(self, target):
        super().__init__()
        self.config = target.config
        self.mtp = target.mtp
        self.embed_tokens = target.model.embed_tokens
        self.rotary = target.model.rotary
        self.lm_head = target.lm_head
        # A Python constant of the graph, like the target's (see DSAForCausalLM.kv_layout).
        self.kv_layout = target.kv_layout

    def forward(
        self,
        hidden: Tensor,
        draft: DraftInputs,
        meta: BatchMeta,
        mla_pool: Tensor,
        index_pool: Tensor,
        layout: KVLayout | None = None,
    ) -> DraftOutput:
        """``hidden [M, hidden]``: the target's ``local_hidden`` of the same batch (same ``meta``).

        ``mla_pool`` / ``index_pool``: the pools of layer ``num_hidden_layers``
        (written in place).  Returns the draft's last-token logits.
        """
        layout = self.kv_layout if layout is None else layout
        h = _ops.row_scope(hidden, "local")
        # Row i's next token: from the prompt (host), or the target's sampled
        # token where row i is its request's last (input tensor, no recompile).
        sampled = draft.sampled[draft.last_of.clamp(min=0)]
        next_ids = torch.where(draft.last_of >= 0, sampled, draft.next_ids)
        x = self.mtp.combine(self.embed_tokens(next_ids), h)
        cos, sin = self.rotary(meta.positions, x.dtype)
        x, _ = self.mtp.block(x, cos, sin, meta, layout, mla_pool, index_pool, None)
        last = _ops.take_rows(x, meta.last_token_index)
        logits = self.lm_head(self.mtp.shared_head.norm(last)).float()
        return DraftOutput(_ops.row_scope(logits, "global"))
