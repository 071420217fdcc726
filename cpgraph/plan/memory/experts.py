"""The routed experts' buffers, per provider: one ``cpgraph::moe_experts`` call replayed on the tape.

Why per provider: the implementations lay the routed rows out differently
(every expert on every row, grouped rows, or DeepGEMM's rows padded to 128
per expert), which at production shapes differs by gigabytes.
"""

from __future__ import annotations

from .formats import FP8_SCALE_BLOCK, _act_bytes
from .tape import _Tape

DEEP_GEMM_ALIGN = 128  # kernels/deep_gemm_experts.ALIGN: every expert's rows start on a 128-row boundary (SM90)
TMA_ALIGN_FP32 = 4  # DeepGEMM's TMA-aligned MN extent of fp32 scales: 16 bytes


def _dispatch_plan(t: _Tape, pairs: int, experts: int) -> None:
    """``dispatch_plan``'s outputs: ``order`` and ``slot_pos`` int64 ``[pairs]``, ``group_ends`` int32 ``[E]``.

    Its sort keys and masks (about 40 bytes a pair) die inside it, before the first row buffer.
    """
    t.alloc("experts.order", 8 * pairs)
    t.alloc("experts.group_ends", 4 * experts)
    t.alloc("experts.slot_pos", 8 * pairs)


def _routed_experts(t: _Tape, provider: str, rows: int, k: int, experts: int, H: int, im: int, a: int, fp8: bool,
                    deterministic: bool) -> None:
    """One ``cpgraph::moe_experts`` call of ``rows`` rows, ``k`` routes, ``experts`` local experts; leaves ``experts``.

    Each branch follows its implementation's body line by line (its locals
    live until it returns; ``C = rows * k`` is the static dispatch capacity,
    whatever the routing).  Its buffers are booked as ``experts.*``, apart
    from the layer's own names (the MLP's normed input ``h`` stays live).
    ``a``: bytes of an activation value (``x``'s dtype).
    """
    C = rows * k
    s_h, s_i = -(-H // FP8_SCALE_BLOCK), -(-im // FP8_SCALE_BLOCK)  # fp32 activation scales per row (block_k 128)
    if provider == "reference":  # ops/moe.py moe_experts_reference: every expert on every row
        t.alloc("experts.routed", C)  # bool [rows, k]
        t.alloc("experts.safe_ids", 8 * C)
        t.alloc("experts.w", 4 * C)
        t.alloc("experts.combine.zeros", 4 * rows * experts)
        t.alloc("experts.combine", 4 * rows * experts)  # .scatter_add (out of place)
        t.free("experts.combine.zeros")
        t.alloc("experts.h", experts * rows * 2 * im * a)  # einsum -> [E, rows, 2I]
        t.alloc("experts.silu", experts * rows * im * a)
        t.alloc("experts.act", experts * rows * im * a)
        t.free("experts.silu")
        t.alloc("experts.y", experts * rows * H * a)  # einsum -> [E, rows, H]
        t.free("experts.act")  # a temporary argument of the einsum
        if a != 4:
            t.alloc("experts.combine.cast", a * rows * experts)  # combine.to(y.dtype)
        t.alloc("experts", rows * H * a)
    elif provider == "deep_gemm":  # kernels/deep_gemm_experts.py: rows padded per expert to DEEP_GEMM_ALIGN
        P = C + DEEP_GEMM_ALIGN * experts  # padded_layout's size: covers every routing
        _dispatch_plan(t, C, experts)  # _padded_dispatch, line by line; its plan and positions die when it returns
        t.alloc("experts.psum", 4 * experts)  # padded_layout (its per-expert sums and per-row lookups die inside it)
        t.alloc("experts.pos", 8 * C)
        t.alloc("experts.token.src", 8 * C)  # plan.order // k, _inverse's argument
        t.alloc("experts.token", 8 * (P + 1))  # _inverse: torch.full((P + 1,), -1), viewed as [P]
        t.free("experts.token.src")
        t.alloc("experts.slot.used", C)  # torch.where(slot >= 0, pos[slot.clamp(min=0)], slot)
        t.alloc("experts.slot.clamp", 8 * C)
        t.alloc("experts.slot.pos", 8 * C)
        t.alloc("experts.slot_rows", 8 * C)
        t.free("experts.slot.used", "experts.slot.clamp", "experts.slot.pos")
        t.free("experts.order", "experts.group_ends", "experts.slot_pos", "experts.pos")  # _padded_dispatch returns
        if fp8:
            t.alloc("experts.xq", rows * H)  # quantize_activations: e4m3 + fp32 scales per 128
            t.alloc("experts.xs", 4 * rows * s_h)
            t.alloc("experts.a", P * H)  # take_rows into the padded layout (DeepGEMM's TMA reads rows in place)
            t.alloc("experts.a_s", 4 * P * s_h)
            t.alloc("experts.h", P * 2 * im * a)
            # DeepGEMM (SM90) copies the K-major activation scales into an MN-major, TMA-aligned tensor for
            # the call (transform_sf_into_required_layout); the 128 x 128 weight scales are used as they are.
            t.alloc("experts.sfa", 4 * s_h * -(-P // TMA_ALIGN_FP32) * TMA_ALIGN_FP32)
            t.free("experts.sfa")
            t.alloc("experts.aq", P * im)  # swiglu_quantize
            t.alloc("experts.aq_s", 4 * P * s_i)
            t.alloc("experts.y", P * H * a)
            t.alloc("experts.sfa", 4 * s_i * -(-P // TMA_ALIGN_FP32) * TMA_ALIGN_FP32)
            t.free("experts.sfa")
        else:
            t.alloc("experts.xs", P * H * a)  # take_rows
            t.alloc("experts.h", P * 2 * im * a)
            t.alloc("experts.act", P * im * a)  # Triton swiglu
            t.alloc("experts.y", P * H * a)
        t.alloc("experts", rows * H * a)  # Triton combine
    elif fp8:  # kernels/fp8_grouped.py (and invariant_gemm.py's FP8 form): the GEMM gathers rows itself
        _dispatch_plan(t, C, experts)
        if deterministic:
            t.alloc("experts.src", 8 * C)  # invariant_moe_experts takes order // k before it quantises
        t.alloc("experts.xq", rows * H)  # quantize_activations: e4m3 + fp32 scales per 128
        t.alloc("experts.xs", 4 * rows * s_h)
        if not deterministic:
            t.alloc("experts.src", 8 * C)  # order // k
        t.alloc("experts.h", C * 2 * im * a)
        t.alloc("experts.aq", C * im)  # swiglu_quantize: e4m3 + fp32 scales, one pass (no bf16 SwiGLU output)
        t.alloc("experts.aq_s", 4 * C * s_i)
        t.alloc("experts.y", C * H * a)
        t.alloc("experts", rows * H * a)
    elif deterministic:  # kernels/invariant_gemm.py invariant_moe_experts, bf16: eager silu(gate) * up
        _dispatch_plan(t, C, experts)
        t.alloc("experts.src", 8 * C)
        t.alloc("experts.h", C * 2 * im * a)  # grouped_matmul gathers x's rows itself
        t.alloc("experts.silu", C * im * a)
        t.alloc("experts.act", C * im * a)
        t.free("experts.silu")
        t.alloc("experts.y", C * H * a)
        t.free("experts.act")  # a temporary argument of grouped_matmul
        t.alloc("experts", rows * H * a)
    else:  # ops/moe.py moe_experts_grouped as kernels/moe.py calls it on CUDA
        _dispatch_plan(t, C, experts)
        t.alloc("experts.src", 8 * C)
        t.alloc("experts.xs", C * H * a)  # take_rows (Triton row mover)
        t.alloc("experts.h", C * 2 * im * a)  # torch._grouped_mm
        t.alloc("experts.act", C * im * a)  # Triton swiglu: one output, no silu copy
        t.alloc("experts.y", C * H * a)
        t.alloc("experts", rows * H * a)  # Triton combine
    t.free(*[name for name in t._live if name.startswith("experts.")])  # the call's locals die when it returns


def experts_bytes(provider: str, rows: int, top_k: int, experts: int, hidden: int, inner: int, *, dtype: str = "bf16",
                  deterministic: bool = False) -> int:
    """Most bytes one ``cpgraph::moe_experts`` call has live at once (its output included), as the plan books them.

    ``experts``: the experts the call holds (``E / ep``); ``inner``: ``moe_intermediate_size``.
    """
    t = _Tape()
    _routed_experts(t, provider, rows, top_k, experts, hidden, inner, _act_bytes(dtype), dtype == "fp8",
                    deterministic)
    return t.peak
