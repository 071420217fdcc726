"""Grouped-GEMM provider of ``cpgraph::moe_experts`` with a Triton weighted combine.

The expert GEMMs are ``torch._grouped_mm`` (CUTLASS grouped GEMM on SM90,
bf16 in, fp32 accumulation); the dispatch is the op module's
:func:`~cpgraph.ops.moe.dispatch_plan`.  What Triton adds is the weighted
combine (:mod:`.moe_combine`: fp32 in registers, a fixed slot order, so a
row's result depends only on that row) and, on CUDA, the SwiGLU between the
GEMMs (:mod:`.swiglu`: one pass over the routed rows).

FP8 experts (e4m3 stacks with block scales) take DeepGEMM's grouped GEMM
where it is installed and applies (:mod:`.deep_gemm_experts`), else the
Triton grouped FP8 GEMM of :mod:`.fp8_grouped`.

Operands the grouped GEMM does not take (fp32 or fp16 on CUDA, row strides
not 16-byte aligned) run the dense reference; the call is counted under
``reference`` with the reason in the provider report
(:mod:`cpgraph.ops.ledger`) and logged at WARNING once per reason.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cpgraph.ops import ledger
from cpgraph.ops.moe import grouped_mm_supported, moe_experts_grouped, moe_experts_reference
from cpgraph.ops.providers import REFERENCE

from . import deep_gemm_experts
from .fp8_grouped import moe_experts_fp8
from .moe_combine import combine
from .move import take_rows
from .provider_name import PROVIDER_NAME
from .swiglu import swiglu


def grouped_mm_refusal(x: Tensor, gate_up: Tensor) -> str:
    """Why :func:`~cpgraph.ops.moe.grouped_mm_supported` is false for these operands (for the report)."""
    if x.device.type == "cuda" and not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return f"{x.dtype} operands (torch._grouped_mm takes bf16 on CUDA)"
    if x.device.type not in ("cuda", "cpu") or x.dtype not in (torch.float32, torch.bfloat16):
        return f"{x.dtype} operands on {x.device.type} (torch._grouped_mm takes bf16, or fp32 on CPU)"
    return (f"H={x.shape[1]}, 2I={gate_up.shape[1]} {x.dtype} rows are not 16-byte aligned "
            "(torch._grouped_mm needs aligned row strides)")


def moe_experts(x, topk_ids, topk_w, gate_up, down, num_valid=None, gate_up_scale=None, down_scale=None,
                block_n=128, block_k=128, act_scale_pow2=False) -> Tensor:
    """Provider: grouped GEMMs + Triton combine where ``torch._grouped_mm`` takes the operands.

    FP8 experts (block scales given) run DeepGEMM's grouped GEMM where it applies
    (:mod:`.deep_gemm_experts`), else :func:`cpgraph.kernels.fp8_grouped.moe_experts_fp8`.
    """
    if gate_up_scale is not None:
        if deep_gemm_experts.choose(x, gate_up, down, block_n, block_k):
            return deep_gemm_experts.moe_experts_fp8(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale,
                                                     down_scale, block_n, block_k, act_scale_pow2)
        return moe_experts_fp8(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale, down_scale,
                               block_n, block_k, act_scale_pow2)
    if not grouped_mm_supported(x, gate_up):
        ledger.fell_back("moe_experts", x.device.type, REFERENCE, grouped_mm_refusal(x, gate_up),
                         instead_of=PROVIDER_NAME)
        return moe_experts_reference(x, topk_ids, topk_w, gate_up, down, num_valid)
    # On CUDA the SwiGLU between the GEMMs is one Triton kernel (.swiglu) and the routed rows are gathered by the
    # Triton row mover (H200, V3.2 sizes, 256K rows of 7168: about 1.6 ms against index_select's 2.0); on CPU the
    # eager forms stay, so the CPU numerics and interpreter time of this path are unchanged (the kernels' own
    # tests run them under the interpreter).
    cuda = x.is_cuda
    if cuda and deep_gemm_experts.choose_bf16(x, gate_up):
        return deep_gemm_experts.moe_experts_bf16(x, topk_ids, topk_w, gate_up, down, num_valid)
    return moe_experts_grouped(x, topk_ids, topk_w, gate_up, down, num_valid, combine=combine,
                               swiglu=swiglu if cuda else None, take_rows=take_rows if cuda else None)


__all__ = ["combine", "grouped_mm_refusal", "moe_experts"]
