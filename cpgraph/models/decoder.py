"""One DSA decoder layer: MLA attention with its indexer, then the dense MLP or the MoE.

A module of its own because two models stack it: the target
(:class:`~cpgraph.models.model.DSAForCausalLM`, one per hidden layer) and
the MTP draft (:class:`~cpgraph.models.mtp.MTPLayer`, one more layer), and
the target holds the draft; with the layer here neither imports the other.
"""

from __future__ import annotations

from torch import nn

from .attention import MLAttention
from .config import DSAConfig
from .layers import MLP, RMSNorm
from .moe import MoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSAConfig, idx: int):
        super().__init__()
        self.is_moe = cfg.mlp_layer_types[idx] == "sparse"
        self.self_attn = MLAttention(cfg, idx)
        self.mlp = MoE(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, meta, layout, mla_pool, index_pool, prev_topk):
        attn, topk = self.self_attn(self.input_layernorm(x), cos, sin, meta, layout, mla_pool, index_pool, prev_topk)
        x = x + attn
        h = self.post_attention_layernorm(x)
        # MoE is row-local; the compiler's MoE pass compacts valid rows around
        # it so that padding rows never reach the router (docs/contracts.md).
        # The row windows tell the experts how many leading rows are real.
        mlp = self.mlp(h, (meta.ks, meta.ke)) if self.is_moe else self.mlp(h)
        return x + mlp, topk


__all__ = ["DecoderLayer"]
