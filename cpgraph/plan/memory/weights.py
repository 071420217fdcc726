"""Weight bytes per rank, by part of the model, from the config alone.

Why by part: CP replicates every part on every rank while expert
parallelism splits only the routed experts (``E / ep`` per rank), and a
reader sizing GPUs wants to see which part dominates.  With the model dtype
this is what ``cpgraph.models.build_model`` allocates (tested against
``estimate_model_bytes``); ``fp8`` adds one fp32 scale per 128x128 block.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .formats import DTYPE_BYTES, FP8_SCALE_BLOCK, _act_bytes, _check_int

if TYPE_CHECKING:  # pragma: no cover
    from cpgraph.models.config import DSAConfig

PARTS = ("attention", "indexer", "dense_mlp", "routed_experts", "shared_experts", "router", "embeddings", "norms")


def _matrix(out_f: int, in_f: int, dtype: str, count: int = 1) -> int:
    """Bytes of ``count`` projection matrices ``[out_f, in_f]``: model dtype, or e4m3 + a 128x128 block scale."""
    if dtype == "fp8":
        blocks = math.ceil(out_f / FP8_SCALE_BLOCK) * math.ceil(in_f / FP8_SCALE_BLOCK)
        return count * (out_f * in_f + 4 * blocks)
    return count * out_f * in_f * DTYPE_BYTES[dtype]


def weight_bytes(cfg: "DSAConfig", dtype: str = "bf16", ep: int = 1) -> dict[str, int]:
    """Bytes per rank of each part of the model (see :data:`PARTS`).

    Tensors transformers keeps in fp32 (router weight and correction bias,
    indexer ``weights_proj``) are 4 bytes whatever ``dtype``; biases, norms
    and embeddings stay in the model dtype (bf16 when ``dtype == "fp8"``).
    The RoPE frequency table (an fp32 buffer) is counted with the norms.
    """
    a = _act_bytes(dtype)
    ep = _check_int("ep", ep)
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    heads, ql, kvl, rope = cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk = cfg.qk_nope_head_dim + rope
    bias = cfg.attention_bias
    attn = (_matrix(ql, H, dtype) + _matrix(heads * qk, ql, dtype) + _matrix(kvl + rope, H, dtype)
            + _matrix(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), kvl, dtype)
            + _matrix(H, heads * cfg.v_head_dim, dtype))
    attn += a * (ql + kvl + rope + H) if bias else 0
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    indexer = _matrix(hi * di, ql, dtype) + _matrix(di, H, dtype) + 4 * hi * H
    n_index = sum(1 for t in cfg.indexer_types if t == "full")
    n_dense = sum(1 for t in cfg.mlp_layer_types if t == "dense")
    n_moe = L - n_dense
    E, im = cfg.n_routed_experts, cfg.moe_intermediate_size
    local_experts = 0
    if n_moe:
        if E % ep:
            raise ValueError(f"plan_memory: argument 'ep' = {ep} does not divide the {E} routed experts")
        local_experts = E // ep
    layer_norms = a * (2 * H + ql + kvl)
    parts = {
        "attention": L * attn,
        "indexer": n_index * indexer,
        "dense_mlp": n_dense * _matrix(cfg.intermediate_size, H, dtype, 3),
        "routed_experts": n_moe * local_experts * (_matrix(2 * im, H, dtype) + _matrix(H, im, dtype)),
        "shared_experts": n_moe * _matrix(im * cfg.n_shared_experts, H, dtype, 3),
        "router": n_moe * 4 * (E * H + E),
        "embeddings": a * cfg.vocab_size * H * (1 if cfg.tie_word_embeddings else 2),
        "norms": L * layer_norms + n_index * a * 2 * di + a * H + 4 * (rope // 2),
    }
    return parts


def param_count(cfg: "DSAConfig") -> int:
    """Parameters of the prefill model (no MTP layers), buffers excluded, tied embeddings counted once."""
    w = weight_bytes(cfg, "fp32")
    n_moe = sum(1 for t in cfg.mlp_layer_types if t == "sparse")
    buffers = 4 * (cfg.qk_rope_head_dim // 2 + n_moe * cfg.n_routed_experts)  # RoPE table, correction biases
    return (sum(w.values()) - buffers) // 4
