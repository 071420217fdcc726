"""CUDA provider of ``cpgraph::mla_query``: the absorption GEMM writes into the final query layout.

``torch.bmm`` over heads takes the output as a strided view ``out[:, :, :L].transpose(0, 1)``
(``[H, M, L]`` with row stride ``H * (L + R)``): cuBLAS's strided batched GEMM writes each head's
``[M, L]`` block in place, so no ``[H, M, L]`` intermediate is read back transposed.  A small
Triton kernel rotates the ``R`` RoPE lanes of ``q`` into ``out[:, :, L:]`` (fp32 math, one
rounding).  Graph-safe: static shapes, no host sync, every access masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .move import interpreting


@triton.jit
def _rope_into(q, cos, sin, out, M, H, q_stride_m, q_stride_h, q_off, o_stride_m, o_stride_h, o_off,
               c_stride, half, HP: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr):
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    i = tl.arange(0, HP)
    ok = (m < M)[:, None, None] & (h < H)[None, :, None] & (i < half)[None, None, :]
    m64 = m.to(tl.int64)[:, None, None]
    h64 = h.to(tl.int64)[None, :, None]
    src = q + m64 * q_stride_m + h64 * q_stride_h + q_off + 2 * i[None, None, :]
    a = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(src + 1, mask=ok, other=0.0).to(tl.float32)
    cm = (m < M)[:, None] & (i < half)[None, :]
    c = tl.load(cos + m.to(tl.int64)[:, None] * c_stride + i[None, :], mask=cm, other=0.0).to(tl.float32)[:, None, :]
    s = tl.load(sin + m.to(tl.int64)[:, None] * c_stride + i[None, :], mask=cm, other=0.0).to(tl.float32)[:, None, :]
    dst = out + m64 * o_stride_m + h64 * o_stride_h + o_off + 2 * i[None, None, :]
    tl.store(dst, (a * c - b * s).to(out.dtype.element_ty), mask=ok)
    tl.store(dst + 1, (b * c + a * s).to(out.dtype.element_ty), mask=ok)


def mla_query(q, w_uk, cos, sin):
    """Provider of ``cpgraph::mla_query`` (see the module docstring)."""
    M, H, D = q.shape
    nope, L = w_uk.shape[1], w_uk.shape[2]
    R = D - nope
    out = torch.empty((M, H, L + R), dtype=q.dtype, device=q.device)
    if M == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    torch.bmm(q[:, :, :nope].transpose(0, 1), w_uk, out=out[:, :, :L].transpose(0, 1))
    cos, sin = cos.contiguous(), sin.contiguous()
    half = R // 2
    bh = min(triton.next_power_of_2(H), 16)
    bm = 4 if not interpreting() else 16
    grid = (triton.cdiv(M, bm), triton.cdiv(H, bh))
    _rope_into[grid](q, cos, sin, out, M, H, q.stride(0), q.stride(1), nope, out.stride(0), out.stride(1), L,
                     cos.stride(0), half, HP=triton.next_power_of_2(half), BM=bm, BH=bh)
    return out


__all__ = ["mla_query"]
