"""One ``MLAttention`` call as the tape books it: the queries, the KV view, the layer's indexer, then sparse MLA.

Why two peaks from one replay: the plan reports the attention up to the
top-k and the sparse MLA from there on as two phases, and the second
starts from what the first left live.
"""

from __future__ import annotations

from .formats import MLA_FP8_RECORD_BYTES
from .indexer import _indexer
from .op_bookings import _compose, _rope
from .tape import _Tape


def _attention_layer(cfg, R: int, N: int, a: int, kv_format: str, index_format: str, max_logits_bytes: int,
                     has_prev: bool, own_indexer: bool, split: bool) -> tuple[int, int]:
    """``(peak up to the top-k, peak from sparse MLA on)`` of one ``MLAttention`` call, above the base."""
    H, heads, ql, kvl, rope = (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                               cfg.qk_rope_head_dim)
    qk = cfg.qk_nope_head_dim + rope
    t = _Tape()
    t.alloc("x_normed", R * H * a)  # input_layernorm(x), the layer's argument
    if has_prev:
        t.alloc("topk_prev", 4 * R * cfg.index_topk)  # the previous layer's top-k, held by the model's loop
    t.alloc("q_a", R * ql * a)
    t.alloc("q_lat", R * ql * a)
    t.free("q_a")
    t.alloc("q", R * heads * qk * a)
    # cpgraph::mla_query's GPU provider: the W_UK GEMM and the RoPE lanes write straight into q_full (no
    # transients); q_b_proj's output dies when MLAttention.query returns.
    t.alloc("q_full", R * heads * (kvl + rope) * a)
    t.free("q")
    t.alloc("kv_a", R * (kvl + rope) * a)
    t.alloc("c.contiguous", R * kvl * a)  # rms_norm copies the strided latent first
    t.alloc("c", R * kvl * a)
    t.free("c.contiguous")
    _rope(t, "k_pe", R * rope * a)
    t.free("kv_a")
    fp8 = kv_format == "fp8"
    record = MLA_FP8_RECORD_BYTES if fp8 else (kvl + rope) * a
    t.alloc("record", R * record)
    _compose(t, "kv", R, N, record)
    if fp8:
        t.alloc("kv.bf16", N * (kvl + rope) * a)  # mla_fp8_unpack
        t.free("kv")
    if own_indexer:
        _indexer(t, cfg, R, N, a, index_format, max_logits_bytes, split)
    attention = t.peak
    t.new_phase()
    t.alloc("out_lat", R * heads * kvl * a)
    t.alloc("lse", 4 * R * heads)
    # cpgraph::mla_output's GPU provider: the W_UV GEMM writes the [R, heads * v] rows o_proj reads (no transient)
    t.alloc("out", R * heads * cfg.v_head_dim * a)
    t.alloc("o_proj", R * H * a)
    return attention, t.peak
