"""Grouped-GEMM provider of ``cpgraph::moe_experts`` with a Triton weighted combine.

The expert GEMMs are ``torch._grouped_mm`` (CUTLASS grouped GEMM on SM90,
bf16 in, fp32 accumulation); the dispatch is the op module's
:func:`~cpgraph.ops.moe.dispatch_plan`.  What Triton adds is the combine:
each output row reads its ``top_k`` expert rows from the sorted buffer,
weights them in fp32 and writes one rounded row.  The torch form of that
step materialises ``[M, top_k, H]`` in fp32 (an upcast copy of every routed
activation); the kernel keeps it in registers, reads only routed positions
(sorted positions past the last group hold uninitialised memory and are
never addressed) and sums the slots in a fixed order, so a row's result is
deterministic and depends only on that row.

FP8 experts (e4m3 stacks with block scales) take the Triton grouped FP8
GEMM of :mod:`.fp8_grouped` instead.

Operands the grouped GEMM does not take (fp32 or fp16 on CUDA, row strides
not 16-byte aligned) run the dense reference; the call is counted under
``reference`` with the reason in the provider report
(:mod:`cpgraph.ops.ledger`) and logged at WARNING once per reason.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from cpgraph.ops import ledger
from cpgraph.ops.moe import grouped_mm_supported, moe_experts_grouped, moe_experts_reference
from cpgraph.ops.providers import REFERENCE

from .provider_name import PROVIDER_NAME
from ._launch import Launcher, interpreting


@triton.jit
def _combine_kernel(
    y,  # [C, H] sorted expert outputs
    slot_pos,  # int64 [M, K], -1 = slot routes nowhere
    w,  # fp32 [M, K]
    out,  # [M, H]
    num_rows,
    capacity,
    width,
    y_stride,
    out_stride,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < width
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((ROWS, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(K):
        pos = tl.load(slot_pos + rows64 * K + j, mask=row_ok, other=-1).to(tl.int64)
        used = row_ok & (pos >= 0) & (pos < capacity)
        pos = tl.where(used, pos, 0)
        wj = tl.load(w + rows64 * K + j, mask=used, other=0.0)
        vals = tl.load(y + pos[:, None] * y_stride + cols[None, :], mask=used[:, None] & col_ok[None, :], other=0.0)
        acc += wj[:, None] * vals.to(tl.float32)
    tl.store(
        out + rows64[:, None] * out_stride + cols[None, :],
        acc.to(out.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


_COMBINE = Launcher(_combine_kernel)


def combine(y_sorted: Tensor, slot_pos: Tensor, topk_w: Tensor, out_dtype: torch.dtype) -> Tensor:
    """Triton form of :func:`cpgraph.ops.moe.combine_reference` (same signature, same result up to fp32 order)."""
    m, k = slot_pos.shape
    h = y_sorted.shape[1]
    out = torch.empty((m, h), dtype=out_dtype, device=y_sorted.device)
    if m == 0 or h == 0:
        return out
    if y_sorted.stride(1) != 1:
        y_sorted = y_sorted.contiguous()
    slot_pos = slot_pos.contiguous()
    topk_w = topk_w.contiguous()
    block_h = min(triton.next_power_of_2(h), 4096 if interpreting() else 512)
    rows = 64 if interpreting() else 4
    grid = (triton.cdiv(m, rows), triton.cdiv(h, block_h))
    _COMBINE(
        grid,
        [y_sorted, slot_pos, topk_w, out, m, y_sorted.shape[0], h, y_sorted.stride(0), out.stride(0), k, rows, block_h],
        4,
    )
    return out


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

    FP8 experts (block scales given) run :func:`cpgraph.kernels.fp8_grouped.moe_experts_fp8`.
    """
    if gate_up_scale is not None:
        from .fp8_grouped import moe_experts_fp8

        return moe_experts_fp8(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale, down_scale,
                               block_n, block_k, act_scale_pow2)
    if not grouped_mm_supported(x, gate_up):
        ledger.fell_back("moe_experts", x.device.type, REFERENCE, grouped_mm_refusal(x, gate_up),
                         instead_of=PROVIDER_NAME)
        return moe_experts_reference(x, topk_ids, topk_w, gate_up, down, num_valid)
    return moe_experts_grouped(x, topk_ids, topk_w, gate_up, down, num_valid, combine=combine)


__all__ = ["combine", "grouped_mm_refusal", "moe_experts"]
