"""CUDA provider of ``cpgraph::mla_query``: the absorption GEMM writes into the final query layout.

A Triton GEMM per (row block, head, column block) multiplies ``q[:, h, :nope]`` by
``W_UK[h]`` with fp32 accumulation and stores the tile straight into ``out[:, h, :L]`` (row
stride ``H * (L + R)``), so no ``[H, M, L]`` intermediate is written and read back transposed.
(``torch.bmm`` with that strided view as ``out=`` measured 4.3 ms above a plain bmm at 32K rows
and 128 heads on an H200: it goes through a temporary.)  The whole ``nope`` reduction runs in one
fixed order inside one program, so a row's result depends only on that row.  A small Triton
kernel rotates the ``R`` RoPE lanes of ``q`` into ``out[:, :, L:]`` (fp32 math, one rounding).
Graph-safe: static shapes, no host sync, every access masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .move import interpreting


@triton.jit
def _absorb(q, w, out, M, q_sm, q_sh, w_sh, w_sk, o_sm, o_sh, L, NOPE: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    h = tl.program_id(1).to(tl.int64)
    n = tl.program_id(2) * BN + tl.arange(0, BN)
    ok_m = m < M
    ok_n = n < L
    m64 = m.to(tl.int64)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, NOPE, BK):
        k = k0 + tl.arange(0, BK)
        ok_k = k < NOPE
        a = tl.load(q + m64[:, None] * q_sm + h * q_sh + k[None, :], mask=ok_m[:, None] & ok_k[None, :], other=0.0)
        b = tl.load(w + h * w_sh + k.to(tl.int64)[:, None] * w_sk + n[None, :], mask=ok_k[:, None] & ok_n[None, :],
                    other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    tl.store(out + m64[:, None] * o_sm + h * o_sh + n[None, :], acc.to(out.dtype.element_ty),
             mask=ok_m[:, None] & ok_n[None, :])


# (BM, BN, BK, warps, stages) of the absorption GEMM; benchmarks/mla_query_bench.py --sweep times others.
ABSORB_TILE = [128, 128, 64, 8, 3]


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
    if w_uk.stride(2) != 1:
        w_uk = w_uk.contiguous()
    if interpreting():
        bm, bn, bk, warps, stages = 16, 16, 16, 4, 1
    else:
        bm, bn, bk, warps, stages = ABSORB_TILE
    grid = (triton.cdiv(M, bm), H, triton.cdiv(L, bn))
    _absorb[grid](q, w_uk, out, M, q.stride(0), q.stride(1), w_uk.stride(0), w_uk.stride(1), out.stride(0),
                  out.stride(1), L, NOPE=nope, BM=bm, BN=bn, BK=bk, IEEE=q.dtype == torch.float32,
                  num_warps=warps, num_stages=stages)
    cos, sin = cos.contiguous(), sin.contiguous()
    half = R // 2
    bh = min(triton.next_power_of_2(H), 16)
    bm = 4 if not interpreting() else 16
    grid = (triton.cdiv(M, bm), triton.cdiv(H, bh))
    _rope_into[grid](q, cos, sin, out, M, H, q.stride(0), q.stride(1), nope, out.stride(0), out.stride(1), L,
                     cos.stride(0), half, HP=triton.next_power_of_2(half), BM=bm, BH=bh)
    return out


__all__ = ["mla_query"]
