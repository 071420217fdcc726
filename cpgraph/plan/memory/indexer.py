"""The indexer's bookings: its queries and keys, their FP8 quantisation, and the chunked scores and top-k select.

Why apart from the attention layer: only the layers that run their own
indexer (IndexCache) book it, and the select kernel's scratch width is
restated here rather than imported (the plan imports no kernels;
``tests/kernels`` checks ``_select_scratch_columns`` against the kernel's).
"""

from __future__ import annotations

from .op_bookings import _compose, _fp32_product, _rope
from .tape import _Tape


def _hadamard(t: _Tape, name: str, n_values: int, a: int) -> None:
    """``hadamard_reference`` (the CUDA default): fp32 butterflies; after the loop the last two fp32
    buffers (``y`` and the one ``a``/``b`` still view), the scaled copy and the output are live at once."""
    f32 = 4 * n_values
    t.alloc(name + ".y_prev", f32)
    t.alloc(name + ".y", f32)
    t.alloc(name + ".scaled", f32)
    t.alloc(name, n_values * a)
    t.free(name + ".y_prev", name + ".y", name + ".scaled")


def _indexer(t: _Tape, cfg, R: int, N: int, a: int, index_format: str, max_logits_bytes: int, split: bool) -> None:
    """``Indexer.forward``; leaves only its output ``topk`` int32 ``[R, topk]`` live."""
    H, hi, di, rope, topk = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim, cfg.index_topk
    iq = R * hi * di * a
    t.alloc("iq.proj", iq)  # wq_b(q_lat)
    _rope(t, "iq.rot", R * hi * rope * a)
    t.alloc("iq", iq)  # cat((rope(rot), rest))
    t.free("iq.proj", "iq.rot")
    t.alloc("ik.proj", R * di * a)
    t.alloc("ik.norm", R * di * a)
    t.free("ik.proj")
    _rope(t, "ik.rot", R * rope * a)
    t.alloc("ik", R * di * a)
    t.free("ik.norm", "ik.rot")
    _fp32_product(t, "w.proj", R, H, hi, a, split)  # fp32_linear(x, weights_proj.weight)
    t.alloc("w", 4 * R * hi)  # * weight_scale
    t.free("w.proj")
    if index_format == "fp8":
        _hadamard(t, "ik.h", R * di, a)
        t.free("ik")
        t.alloc("ik.quant_tmp", 2 * 4 * R * di)  # index_k_quant (reference): fp32 copies
        t.alloc("ik.bytes", R * di + 4 * R)
        t.free("ik.quant_tmp")
        _compose(t, "k_view", R, N, di + 4)  # e4m3 keys + fp32 scales
        # indexer_q_prepare (its reference: hadamard, then indexer_q_quant; the rotated queries live only inside)
        _hadamard(t, "iq.h", R * hi * di, a)
        t.alloc("qq.f32", 2 * 4 * R * hi * di)  # indexer_q_quant (reference): q.float(), .abs()
        t.free("qq.f32")
        t.alloc("qq.amax", 4 * R * hi)
        t.alloc("qq.f32", 2 * 4 * R * hi * di)  # e4m3_bytes: x.float() / scale
        t.alloc("q_bytes", R * hi * di)
        t.free("qq.f32")
        t.alloc("w_q", 4 * R * hi)
        t.free("qq.amax", "iq.h", "iq")  # the op returns; the model drops q
        t.alloc("k_scale", 4 * N)  # k_scale[:, 0].contiguous()
        _chunked_topk(t, R, N, topk, max_logits_bytes)  # indexer_topk's FP8 form: e4m3 operands, same chunks
        t.free("ik.h", "ik.bytes", "k_view", "q_bytes", "w_q", "k_scale", "w")
        return
    _compose(t, "k_view", R, N, di * a)
    _chunked_topk(t, R, N, topk, max_logits_bytes)
    t.free("iq", "ik", "w", "k_view")


def _select_scratch_columns(n_keys: int, topk: int) -> int:
    """Scratch columns per row of the Triton select kernel (``cpgraph.kernels.topk_select.scratch_columns``):
    its list's rank bits and positions."""
    return 2 * max(1, min(n_keys, topk + max(topk, n_keys // 8)))


def _chunked_topk(t: _Tape, R: int, N: int, topk: int, max_logits_bytes: int) -> None:
    """``indexer_topk``'s provider: its output, and one fp32 score chunk (scored, selected, next chunk).

    The select kernel's candidate scratch (int32, ``scratch_columns`` per row of the chunk) lives
    beside the chunk's scores.
    """
    t.alloc("topk", 4 * R * topk)
    chunk = min(R, max(1, max_logits_bytes // (4 * max(N, 1))))
    t.alloc("scores", 4 * chunk * N)
    t.alloc("select scratch", 4 * chunk * _select_scratch_columns(N, topk))
    t.free("scores", "select scratch")
