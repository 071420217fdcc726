"""CUDA providers of ``cpgraph::mla_query`` and ``mla_output``: the absorption GEMMs write into the final layouts.

``torch.bmm`` over heads writes into the strided view ``out[:, :, :L].transpose(0, 1)``
(``[H, M, L]`` with row stride ``H * (L + R)``), so the compiled graph no longer holds a pointwise
kernel that re-reads an ``[H, M, L]`` intermediate transposed.  (A Triton GEMM storing the tiles
directly measured 1.1 ms slower at 32K rows x 128 heads on an H200.)  A small Triton kernel
rotates the ``R`` RoPE lanes of ``q`` into ``out[:, :, L:]`` (fp32 math, one rounding).
Graph-safe: static shapes, no host sync, every access masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpgraph.ops.mla_query import rope_interleaved

from .move import interpreting



@triton.jit
def _rope_into(q, cos, sin, out, M, H, q_stride_m, q_stride_h, q_off, o_stride_m, o_stride_h, o_off,
               c_stride, BM: tl.constexpr, BH: tl.constexpr, HALF: tl.constexpr):
    """Interleaved RoPE of ``q[m, h, q_off : q_off + 2 HALF]`` into ``out[m, h, o_off : ...]``: whole
    contiguous lane runs are loaded and stored, the pairs split in registers (coalesced both ways)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    d = tl.arange(0, 2 * HALF)
    i = tl.arange(0, HALF)
    ok = (m < M)[:, None, None] & (h < H)[None, :, None]
    m64 = m.to(tl.int64)[:, None, None]
    h64 = h.to(tl.int64)[None, :, None]
    x = tl.load(q + m64 * q_stride_m + h64 * q_stride_h + q_off + d[None, None, :], mask=ok, other=0.0)
    a, b = tl.split(tl.reshape(x.to(tl.float32), (BM, BH, HALF, 2)))
    cm = (m < M)[:, None]
    c = tl.load(cos + m.to(tl.int64)[:, None] * c_stride + i[None, :], mask=cm, other=0.0).to(tl.float32)[:, None, :]
    s = tl.load(sin + m.to(tl.int64)[:, None] * c_stride + i[None, :], mask=cm, other=0.0).to(tl.float32)[:, None, :]
    y = tl.reshape(tl.join(a * c - b * s, b * c + a * s), (BM, BH, 2 * HALF))
    tl.store(out + m64 * o_stride_m + h64 * o_stride_h + o_off + d[None, None, :], y.to(out.dtype.element_ty),
             mask=ok)


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
    if half & (half - 1):  # the register split needs a power-of-two lane count; other sizes take the reference's RoPE
        from cpgraph.ops import ledger

        ledger.fell_back("mla_query", q.device.type, "triton+reference-rope",
                         f"{R} RoPE lanes (the Triton RoPE takes a power of two pairs)", instead_of="triton")
        out[:, :, L:] = rope_interleaved(q[:, :, nope:], cos, sin)
        return out
    bh = min(triton.next_power_of_2(H), 16)
    bm = 8 if not interpreting() else 16
    grid = (triton.cdiv(M, bm), triton.cdiv(H, bh))
    _rope_into[grid](q, cos, sin, out, M, H, q.stride(0), q.stride(1), nope, out.stride(0), out.stride(1), L,
                     cos.stride(0), BM=bm, BH=bh, HALF=half)
    return out


def mla_output(out_lat, w_uv):
    """Provider of ``cpgraph::mla_output``: the per-head W_UV GEMM writes the ``[M, H * v]`` rows directly.

    ``torch.bmm`` over heads into the strided view ``out.view(M, H, v).transpose(0, 1)`` (``[H, M, v]``
    with row stride ``H * v``): cuBLAS takes that output stride as it is, so no kernel re-reads an
    ``[H, M, v]`` intermediate transposed (cpgraph/ops/mla_output.py says why).
    """
    m, h, _ = out_lat.shape
    v = w_uv.shape[1]
    out = torch.empty((m, h * v), dtype=out_lat.dtype, device=out_lat.device)
    if m == 0:
        return out
    torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out.view(m, h, v).transpose(0, 1))
    return out


__all__ = ["mla_query", "mla_output"]
