"""CUDA providers of the row-invariant ops (``cpgraph/ops/invariant.py``): Triton GEMMs with one config per weight.

What makes a GEMM row-invariant: every output row is computed by the same
instructions in the same order, whatever ``M`` is and whichever other rows
share its tile.  cuBLAS does not promise that (it picks kernels, tile shapes
and split-K by ``M``); these kernels do, by construction:

* the tile configuration (:func:`tiles`) is a function of ``(N, K, dtype)``
  only -- the weight's shape -- never of ``M``;
* no split-K: one program owns an output tile and runs the whole K loop,
  ``k0 = 0, BK, 2 BK, ..`` in order, accumulating in fp32 (``tl.dot`` with
  the accumulator passed in); the partial last K block is masked to exact
  zeros;
* ``M`` is not specialised (``do_not_specialize``), so one compiled binary
  serves every row count; rows past ``M`` are masked loads of zeros, which
  cannot change another row's dot products (a tensor-core MMA computes each
  output element from its own row and column);
* the epilogue (``alpha``, ``beta * bias``, the one rounding) is per element.

Kernels here:

* :func:`matmul` -- ``alpha * a @ b + beta * bias`` for 2-D and batched 3-D
  operands with any strides (``invariant_mm``; also the absorbed-query GEMM
  of ``invariant_mla_query``, which writes straight into the strided
  ``[M, H, L + R]`` layout);
* :func:`grouped_matmul` -- the routed experts' bf16 grouped GEMM
  (``invariant_moe_experts``): each program finds its ``(expert, row tile)``
  from the device-side group ends (:func:`cpgraph.kernels.fp8_grouped._tile_of`),
  so the tiles follow the routing but no row's arithmetic does;
* the FP8 linear and FP8 experts reuse :mod:`.fp8_linear` /
  :mod:`.fp8_grouped` with their tiles fixed explicitly (:data:`FP8_TILES`),
  and the combine of :mod:`.moe`, which sums each row's top-k slots in order.

Static shapes, no host syncs: CUDA-graph capturable.  Under
``TRITON_INTERPRET=1`` (CPU tests) bf16 operands are read as their bit
patterns and multiplied in fp32 (the interpreter has no bf16), with
interpreter-sized tiles: invariant there too, not bitwise equal to the GPU.
``CPGRAPH_INVARIANT_GEMM_TILES=BM,BN,BK,warps,stages`` overrides the bf16 /
fp16 config, ``CPGRAPH_INVARIANT_GEMM_TILES_F32`` the fp32 one (for tuning on a
GPU with ``benchmarks/invariant_gemm_bench.py``; it changes bits, not invariance).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from cpgraph.ops import ledger
from cpgraph.ops.invariant import check_invariant_mm, invariant_fp8_linear_reference, out_shape

from ._bits import KINDS, bits_view, load_f32, store_f32_as
from ._launch import interpreting
from .fp8_grouped import GROUP_T, _tile_of, grouped_gemm, swiglu_quantize
from .fp8_linear import block_scaled_gemm, quantize_activations

TILES_ENV = "CPGRAPH_INVARIANT_GEMM_TILES"
TILES_F32_ENV = "CPGRAPH_INVARIANT_GEMM_TILES_F32"
# (BM, BN, warps, stages) of the FP8 GEMMs: the measured defaults of .fp8_linear / .fp8_grouped, stated here so
# that a later per-M tuning there cannot silently make deterministic mode depend on M.
FP8_TILES = (64, 128, 4, 4)
FP8_TILES_INTERPRET = (32, 32, 4, 1)


def fp8_tiles() -> tuple[int, int, int, int]:
    return FP8_TILES_INTERPRET if interpreting() else FP8_TILES


def tiles(n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """``(BM, BN, BK, num_warps, num_stages)`` for a ``[K, N]`` weight of ``dtype``: never a function of ``M``.

    bf16 / fp16: 256 x 128 x 64 tiles, 8 warps, 3 stages (two warpgroups of
    tensor-core MMAs, 144 KiB of operand stages); narrow weights (N <= 64)
    take 128 x 64 tiles, 4 stages.  fp32 is multiplied exactly
    (``input_precision="ieee"``, no TF32) on 64 x 128 x 32 tiles (64 x 64
    for narrow weights).  Picked by ``benchmarks/invariant_gemm_bench.py``
    on an H200 at DeepSeek-V3.2's products (docs/deterministic.md, "Cost"):
    the bf16 tile took the dense layer's products from 1.47x to 1.27x
    cuBLAS's time, the fp32 one the router's from 3.7x to 2.4x.  The
    interpreter takes 64 x 64 x 64 tiles (its cost is per program).
    """
    if interpreting():
        return 64, 64, 64, 4, 1
    env = TILES_F32_ENV if dtype == torch.float32 else TILES_ENV
    override = os.environ.get(env, "").strip()
    if override:
        parts = [int(p) for p in override.split(",")]
        if len(parts) != 5:
            raise ValueError(f"{env} must be BM,BN,BK,warps,stages, got {override!r}")
        return tuple(parts)  # type: ignore[return-value]
    if dtype == torch.float32:
        return (64, 64, 32, 4, 3) if n <= 64 else (64, 128, 32, 4, 3)
    return (128, 64, 64, 8, 4) if n <= 64 else (256, 128, 64, 8, 3)


@triton.jit
def _load_tile(ptrs, mask, KIND: tl.constexpr, BITS: tl.constexpr):
    """A tile for ``tl.dot``: the dtype itself on the GPU, bf16 bits widened to fp32 under the interpreter."""
    if BITS:
        return load_f32(ptrs, mask, KIND)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _dot_by_sum(av, bv):
    """``av @ bv`` as a broadcast multiply and a sum over K (interpreter only).

    The interpreter's ``tl.dot`` is numpy's BLAS matmul of the tile, whose
    bits for a row depend on the row's position in the tile (measured with
    OpenBLAS); a sum over one axis treats every element alike, so the CPU
    tests can check the kernels' row invariance bit for bit.  On the GPU the
    tensor-core ``tl.dot`` computes each element from its own row and column.
    """
    return tl.sum(av[:, :, None] * bv[None, :, :], axis=1)


@triton.jit(do_not_specialize=["M"])
def _mm_kernel(
    a, b, bias, out, M, N, K,
    sa_b, sa_m, sa_k, sb_b, sb_k, sb_n, sc_b, sc_m, sc_n, so_b, so_m, so_n,
    alpha, beta,
    HAS_BIAS: tl.constexpr, HAS_ALPHA: tl.constexpr, HAS_BETA: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    KIND: tl.constexpr, OUT_KIND: tl.constexpr, BITS: tl.constexpr, IEEE: tl.constexpr, LOOP_WHILE: tl.constexpr,
):  # fmt: skip
    """``out[batch, BM rows, BN cols] = alpha * a @ b + beta * bias`` with the whole K loop in order."""
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n  # grouped launch order: GROUP_M row tiles share a weight tile in L2
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK).to(tl.int64)
    ok_m = rm < M
    ok_n = rn < N
    a_ptrs = a + batch * sa_b + rm[:, None] * sa_m + rk[None, :] * sa_k
    b_ptrs = b + batch * sb_b + rk[:, None] * sb_k + rn[None, :] * sb_n
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if LOOP_WHILE:  # the interpreter: no runtime bound in range(), and a dot that treats every row alike
        k0 = 0
        while k0 < K:
            ok_k = (k0 + rk) < K
            av = _load_tile(a_ptrs, ok_m[:, None] & ok_k[None, :], KIND, BITS)
            bv = _load_tile(b_ptrs, ok_k[:, None] & ok_n[None, :], KIND, BITS)
            acc += _dot_by_sum(av, bv)
            a_ptrs += BK * sa_k
            b_ptrs += BK * sb_k
            k0 += BK
    else:
        for k0 in range(0, K, BK):
            ok_k = (k0 + rk) < K
            av = _load_tile(a_ptrs, ok_m[:, None] & ok_k[None, :], KIND, BITS)
            bv = _load_tile(b_ptrs, ok_k[:, None] & ok_n[None, :], KIND, BITS)
            if IEEE:
                acc = tl.dot(av, bv, acc, input_precision="ieee")
            else:
                acc = tl.dot(av, bv, acc)
            a_ptrs += BK * sa_k
            b_ptrs += BK * sb_k
    ok = ok_m[:, None] & ok_n[None, :]
    if HAS_ALPHA:
        acc = acc * alpha
    if HAS_BIAS:
        c = load_f32(bias + batch * sc_b + rm[:, None] * sc_m + rn[None, :] * sc_n, ok, KIND)
        if HAS_BETA:
            c = c * beta
        acc = acc + c
    store_f32_as(out + batch * so_b + rm[:, None] * so_m + rn[None, :] * so_n, acc, ok, OUT_KIND)


def matmul(a: Tensor, b: Tensor, bias: Tensor | None = None, beta: float = 1.0, alpha: float = 1.0, *,
           out: Tensor | None = None) -> Tensor:
    """``alpha * a @ b + beta * bias`` (2-D or batched 3-D, any strides) into ``out`` (any strides) or a new tensor.

    ``beta == 0`` ignores ``bias`` (as ``addmm`` does).  Row-invariant: the
    config comes from :func:`tiles` of ``b``'s ``(N, K)`` and dtype.
    """
    check_invariant_mm(a, b, bias)
    if a.dtype not in KINDS:
        raise ValueError(f"invariant matmul: the Triton kernel takes {sorted(map(str, KINDS))}, got {a.dtype}")
    shape = out_shape(a, b)
    if out is None:
        out = torch.empty(shape, dtype=a.dtype, device=a.device)
    elif tuple(out.shape) != shape or out.dtype != a.dtype:
        raise ValueError(f"invariant matmul: out must be {shape} {a.dtype}, got {tuple(out.shape)} {out.dtype}")
    three = a.dim() == 3
    a3 = a if three else a.unsqueeze(0)
    b3 = b if three else b.unsqueeze(0)
    o3 = out if three else out.unsqueeze(0)
    batch, m, k = a3.shape
    n = b3.shape[2]
    if batch == 0 or m == 0 or n == 0:
        return out
    use_bias = bias is not None and beta != 0
    if use_bias:
        c3 = bias.expand(shape)
        c3 = c3 if three else c3.unsqueeze(0)
    else:
        c3 = o3  # never read
    bm, bn, bk, warps, stages = tiles(n, k, a.dtype)
    bits = interpreting() and a.dtype == torch.bfloat16
    av, bv = (bits_view(a3), bits_view(b3)) if bits else (a3, b3)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), batch)
    _mm_kernel[grid](
        av, bv, bits_view(c3), bits_view(o3), m, n, k,
        a3.stride(0), a3.stride(1), a3.stride(2), b3.stride(0), b3.stride(1), b3.stride(2),
        c3.stride(0), c3.stride(1), c3.stride(2), o3.stride(0), o3.stride(1), o3.stride(2),
        float(alpha), float(beta),
        HAS_BIAS=use_bias, HAS_ALPHA=alpha != 1, HAS_BETA=use_bias and beta != 1,
        BM=bm, BN=bn, BK=bk, GROUP_M=8, KIND=KINDS[a.dtype], OUT_KIND=KINDS[a.dtype], BITS=bits,
        IEEE=a.dtype == torch.float32, LOOP_WHILE=interpreting(),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


# ------------------------------------------------------------ grouped (bf16 experts)
@triton.jit
def _grouped_kernel(
    a, a_rows, b, group_ends, out, N, K, E, C, sa_m, sb_e, sb_n, sb_k,
    EP: tl.constexpr, GATHER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    KIND: tl.constexpr, BITS: tl.constexpr, IEEE: tl.constexpr, LOOP_WHILE: tl.constexpr,
):  # fmt: skip
    """``out[rows of one expert's tile, BN cols] = a[rows] @ b[e]^T`` (``b [E, N, K]``), whole K loop in order."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, first, end, live = _tile_of(group_ends, t, E, C, EP, BM)
    if live:
        rm = (first + tl.arange(0, BM)).to(tl.int64)
        ok_m = rm < end
        if GATHER:  # row of the input feeding each sorted position
            src = tl.load(a_rows + rm, mask=ok_m, other=0).to(tl.int64)
        else:
            src = rm
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        ok_n = rn < N
        rk = tl.arange(0, BK).to(tl.int64)
        a_ptrs = a + src[:, None] * sa_m + rk[None, :]
        b_ptrs = b + e.to(tl.int64) * sb_e + rk[:, None] * sb_k + rn[None, :] * sb_n
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if LOOP_WHILE:
            k0 = 0
            while k0 < K:
                ok_k = (k0 + rk) < K
                av = _load_tile(a_ptrs, ok_m[:, None] & ok_k[None, :], KIND, BITS)
                bv = _load_tile(b_ptrs, ok_k[:, None] & ok_n[None, :], KIND, BITS)
                acc += _dot_by_sum(av, bv)
                a_ptrs += BK
                b_ptrs += BK * sb_k
                k0 += BK
        else:
            for k0 in range(0, K, BK):
                ok_k = (k0 + rk) < K
                av = _load_tile(a_ptrs, ok_m[:, None] & ok_k[None, :], KIND, BITS)
                bv = _load_tile(b_ptrs, ok_k[:, None] & ok_n[None, :], KIND, BITS)
                if IEEE:
                    acc = tl.dot(av, bv, acc, input_precision="ieee")
                else:
                    acc = tl.dot(av, bv, acc)
                a_ptrs += BK
                b_ptrs += BK * sb_k
        store_f32_as(out + rm[:, None] * N + rn[None, :], acc, ok_m[:, None] & ok_n[None, :], KIND)


def grouped_matmul(a: Tensor, a_rows: Tensor | None, b: Tensor, group_ends: Tensor, rows: int) -> Tensor:
    """``out [rows, N]``: sorted row ``r`` of expert ``e`` = ``a[a_rows[r]] @ b[e]^T`` (``b [E, N, K]``).

    ``a_rows`` int64 maps sorted rows to rows of ``a`` (``None``: identity);
    ``group_ends`` int32 ``[E]`` cumulative rows per expert.  Rows past
    ``group_ends[-1]`` are left unwritten (never read).  Tiles from
    :func:`tiles` of ``(N, K)``.
    """
    e, n, k = b.shape
    out = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    if rows == 0 or n == 0 or e == 0:
        return out
    a = a.contiguous()
    bm, bn, bk, warps, stages = tiles(n, k, a.dtype)
    bits = interpreting() and a.dtype == torch.bfloat16
    grid = (triton.cdiv(rows, bm) + e, triton.cdiv(n, bn))
    _grouped_kernel[grid](
        bits_view(a) if bits else a, a_rows if a_rows is not None else group_ends, bits_view(b) if bits else b,
        group_ends, bits_view(out), n, k, e, rows, a.stride(0), b.stride(0), b.stride(1), b.stride(2),
        EP=max(16, triton.next_power_of_2(e)), GATHER=a_rows is not None, BM=bm, BN=bn, BK=bk,
        KIND=KINDS[a.dtype], BITS=bits, IEEE=a.dtype == torch.float32, LOOP_WHILE=interpreting(),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------- providers
def invariant_mm(a, b, bias=None, beta=1.0, alpha=1.0):
    """Provider of ``cpgraph::invariant_mm``; fp64 (no tensor-core kernel here) runs the fixed-order reference."""
    if a.dtype not in KINDS:
        from cpgraph.ops.invariant import invariant_mm_reference

        ledger.fell_back("invariant_mm", a.device.type, "reference", f"{a.dtype} operands", instead_of="triton")
        return invariant_mm_reference(a, b, bias, beta, alpha)
    return matmul(a, b, bias, beta, alpha)


def invariant_fp8_linear(x, weight, weight_scale_inv, block_n, block_k, act_scale_pow2):
    """Provider of ``cpgraph::invariant_fp8_linear``: Triton quantisation + the Triton FP8 GEMM at :data:`FP8_TILES`.

    torch's blockwise ``scaled_mm`` (cuBLASLt, heuristics by shape) is never
    used here.  A ``block_k`` the Triton GEMM does not take (not a power of
    two in [32, 256]) runs the fixed-order reference, counted and logged.
    """
    if block_k & (block_k - 1) or not 32 <= block_k <= 256:
        ledger.fell_back("invariant_fp8_linear", x.device.type, "reference",
                         f"block_k={block_k} is not a power of two in [32, 256]", instead_of="triton")
        return invariant_fp8_linear_reference(x, weight, weight_scale_inv, block_n, block_k, act_scale_pow2)
    xq, xs = quantize_activations(x, block_k, act_scale_pow2)
    return block_scaled_gemm(xq, xs, weight, weight_scale_inv, block_n, block_k, x.dtype, tiles=fp8_tiles())


def invariant_moe_experts(x, topk_ids, topk_w, gate_up, down, num_valid=None, gate_up_scale=None, down_scale=None,
                          block_n=128, block_k=128, act_scale_pow2=False):
    """Provider of ``cpgraph::invariant_moe_experts``: dispatch, grouped GEMMs at fixed tiles, combine in slot order."""
    from cpgraph.ops.invariant import invariant_moe_experts_reference
    from cpgraph.ops.invariant_core import silu
    from cpgraph.ops.moe import dispatch_plan

    from .moe_combine import combine

    m, k = topk_ids.shape
    e = gate_up.shape[0]
    fp8 = gate_up_scale is not None
    if fp8 and (block_k & (block_k - 1) or not 32 <= block_k <= 256):
        ledger.fell_back("invariant_moe_experts", x.device.type, "reference",
                         f"FP8 block_k={block_k} is not a power of two in [32, 256]", instead_of="triton")
        return invariant_moe_experts_reference(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale,
                                               down_scale, block_n, block_k, act_scale_pow2)
    plan = dispatch_plan(topk_ids, num_valid, e)
    src = plan.order // k
    if fp8:
        t = fp8_tiles() + (1 if interpreting() else GROUP_T,)  # the raster order (group_t) never changes bits
        xq, xs = quantize_activations(x, block_k, act_scale_pow2)
        h = grouped_gemm(xq, xs, src, gate_up, gate_up_scale, plan.group_ends, block_n, block_k, x.dtype, m * k,
                         tiles=t)
        aq, a_s = swiglu_quantize(h, plan.group_ends, block_k, act_scale_pow2)
        y = grouped_gemm(aq, a_s, None, down, down_scale, plan.group_ends, block_n, block_k, x.dtype, m * k, tiles=t)
    else:
        h = grouped_matmul(x, src, gate_up, plan.group_ends, m * k)
        gate, up = h.chunk(2, dim=-1)
        y = grouped_matmul(silu(gate) * up, None, down, plan.group_ends, m * k)
    return combine(y, plan.slot_pos, topk_w, x.dtype)


def invariant_mla_query(q, w_uk, cos, sin):
    """Provider of ``cpgraph::invariant_mla_query``: the absorption GEMM writes into ``out[:, :, :L]`` directly."""
    from cpgraph.ops.mla_query import rope_interleaved

    m, h, d = q.shape
    nope, lat = w_uk.shape[1], w_uk.shape[2]
    out = torch.empty((m, h, lat + d - nope), dtype=q.dtype, device=q.device)
    if m == 0:
        return out
    matmul(q[:, :, :nope].transpose(0, 1), w_uk, out=out[:, :, :lat].transpose(0, 1))
    half = (d - nope) // 2
    if interpreting() or half & (half - 1):  # the Triton RoPE takes a power of two pairs
        out[:, :, lat:] = rope_interleaved(q[:, :, nope:].float(), cos.float(), sin.float()).to(q.dtype)
        return out
    from .mla_query import _rope_into

    q = q if q.stride(2) == 1 else q.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    bh = min(triton.next_power_of_2(h), 16)
    grid = (triton.cdiv(m, 8), triton.cdiv(h, bh))
    _rope_into[grid](q, cos, sin, out, m, h, q.stride(0), q.stride(1), nope, out.stride(0), out.stride(1), lat,
                     cos.stride(0), BM=8, BH=bh, HALF=half)
    return out


def invariant_mla_output(out_lat, w_uv):
    """Provider of ``cpgraph::invariant_mla_output``: the W_UV GEMM writes the ``[M, H * v]`` rows directly."""
    m, h, _ = out_lat.shape
    v = w_uv.shape[1]
    out = torch.empty((m, h * v), dtype=out_lat.dtype, device=out_lat.device)
    if m == 0:
        return out
    if out_lat.dtype not in KINDS:
        from cpgraph.ops.invariant import invariant_mla_output_reference

        ledger.fell_back("invariant_mla_output", out_lat.device.type, "reference", f"{out_lat.dtype} operands",
                         instead_of="triton")
        return invariant_mla_output_reference(out_lat, w_uv)
    matmul(out_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out.view(m, h, v).transpose(0, 1))
    return out


def providers() -> dict:
    """Op name -> launcher, for :func:`cpgraph.kernels.providers`."""
    return {
        "invariant_mm": invariant_mm,
        "invariant_fp8_linear": invariant_fp8_linear,
        "invariant_moe_experts": invariant_moe_experts,
        "invariant_mla_query": invariant_mla_query,
        "invariant_mla_output": invariant_mla_output,
    }


__all__ = ["FP8_TILES", "TILES_ENV", "grouped_matmul", "matmul", "providers", "tiles"]
