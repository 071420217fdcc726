"""FP8 routed experts on the GPU: a Triton grouped GEMM with 128 x 128 block scales.

Why: routed experts are about 97 % of DeepSeek-V3.2's weight bytes, so an
FP8 checkpoint only halves the model if they stay in e4m3.  ``torch``'s
grouped FP8 GEMM (``torch._scaled_grouped_mm``) takes one scale per row of
each operand (rowwise), which cannot express the checkpoints' per-block
weight scales nor the recipe's per-token-per-128 activation scales; this
module computes ``cpgraph::moe_experts``' FP8 contract exactly (up to the
order of fp32 sums) with three kernels and no host sync:

1. :func:`~cpgraph.kernels.fp8_linear.quantize_activations` quantises the
   ``M`` expert inputs once (not the ``M * top_k`` dispatched copies);
2. :func:`grouped_gemm` -- ``gate_up``: each program finds its
   ``(expert, row tile)`` from the device-side ``group_ends`` (a prefix sum
   over the experts' tile counts, in registers), gathers its quantised input
   rows through the dispatch order (no gathered copy), and runs one e4m3
   tensor-core dot per ``block_k`` slice, scaled by both block scales in
   fp32 before it joins the fp32 accumulator (as
   ``cpgraph::fp8_block_linear``'s Triton GEMM);
3. :func:`swiglu_quantize` -- ``silu(gate) * up`` in fp32 and its
   per-row-per-``block_k`` quantisation in one pass, only for the routed rows;
4. :func:`grouped_gemm` again for ``down``, then the weighted combine of
   :mod:`.moe_combine`.

Static shapes: the grid covers the worst case (``ceil(C / BM) + E`` row
tiles for ``C = M * top_k`` dispatched rows) and programs past the routed
tiles exit at once, so the work follows the device-side ``num_valid`` and
the whole op is CUDA-graph capturable.  A row's result depends only on its
own inputs.  See docs/ops/fp8_linear.md.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from cpgraph.ops import ledger
from cpgraph.ops.fp8_linear import ceil_div
from cpgraph.ops.moe import dispatch_plan, moe_experts_fp8_reference
from cpgraph.ops.providers import REFERENCE

from .provider_name import PROVIDER_NAME
from ._bits import KINDS, bits_view, load_f32, store_f32_as
from ._launch import interpreting
from .fp8_linear import _k_step, quantize_activations, quantize_group, store_e4m3
from .moe_combine import combine


@triton.jit
def _tile_of(group_ends, t, E, C, EP: tl.constexpr, BM: tl.constexpr):
    """Row tile ``t`` of the grouped problem -> ``(expert, first row, row end, live)``, all from the device.

    Expert ``e`` owns sorted rows ``[group_ends[e-1], group_ends[e])`` and
    ``ceil(count / BM)`` tiles; tiles are numbered expert after expert.
    """
    ei = tl.arange(0, EP)
    in_e = ei < E
    ends = tl.minimum(tl.load(group_ends + ei, mask=in_e, other=0).to(tl.int32), C)
    starts = tl.load(group_ends + ei - 1, mask=in_e & (ei > 0), other=0).to(tl.int32)
    counts = tl.where(in_e, tl.maximum(ends - starts, 0), 0)
    tiles = (counts + BM - 1) // BM
    cum = tl.cumsum(tiles, 0)
    live = t < tl.sum(tiles, 0)
    e = tl.sum((cum <= t).to(tl.int32), 0)
    sel = ei == e
    first = tl.sum(tl.where(sel, starts, 0), 0) + (t - tl.sum(tl.where(sel, cum - tiles, 0), 0)) * BM
    end = tl.sum(tl.where(sel, ends, 0), 0)
    return e, first, end, live


@triton.jit
def _k_pair(acc, a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, stride_sak, k0, ok_m, ok_n, BK: tl.constexpr):
    """Two ``BK`` blocks (``K`` a multiple of ``2 BK``, one weight-scale block per tile): both dots first.

    The two tensor-core dots do not depend on each other, so the second can issue while the first
    one's result is scaled on the CUDA cores; the sums reach ``acc`` in the same order as two
    :func:`~.fp8_linear._k_step` calls.
    """
    kb = k0 // BK
    a0 = tl.load(a_ptrs, mask=ok_m[:, None], other=0.0)
    b0 = tl.load(b_ptrs, mask=ok_n[:, None], other=0.0)
    a1 = tl.load(a_ptrs + BK, mask=ok_m[:, None], other=0.0)
    b1 = tl.load(b_ptrs + BK, mask=ok_n[:, None], other=0.0)
    p0 = tl.dot(a0, tl.trans(b0))
    p1 = tl.dot(a1, tl.trans(b1))
    f0 = tl.load(sa_ptrs + kb * stride_sak, mask=ok_m, other=0.0) * tl.load(sb_ptrs + kb)
    f1 = tl.load(sa_ptrs + (kb + 1) * stride_sak, mask=ok_m, other=0.0) * tl.load(sb_ptrs + kb + 1)
    acc = acc + p0 * f0[:, None]
    return acc + p1 * f1[:, None]


@triton.jit
def _grouped_gemm_kernel(
    a, a_scale, a_rows, b, b_scale, group_ends, out,
    N, K, E, C, stride_sam, stride_sak, stride_be, stride_bse, n_kb, T, NT,
    EP: tl.constexpr, GATHER: tl.constexpr, BLOCK_N_Q: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, OUT_KIND: tl.constexpr, LOOP_WHILE: tl.constexpr, SB_SCALAR: tl.constexpr,
    EVEN_K: tl.constexpr = False, GROUP_T: tl.constexpr = 1, PAIR_K: tl.constexpr = False,
):  # fmt: skip
    """``out[rows of one expert's tile, BN columns]`` = that expert's block-scaled FP8 product.

    ``GROUP_T > 1``: a 1-D grid in grouped raster order, ``GROUP_T`` row tiles by every column tile
    (row tile fastest), so a group's input rows stay in L2 while every weight column tile passes
    over them; with ``GROUP_T == 1`` the grid is 2-D (row tiles x column tiles), and each input row
    tile is read from HBM once per column tile (see :func:`_gemm_tiles`).
    """
    if GROUP_T > 1:
        pid = tl.program_id(0)
        per_group = GROUP_T * NT
        first_t = (pid // per_group) * GROUP_T
        size = tl.minimum(T - first_t, GROUP_T)
        t = first_t + (pid % per_group) % size
        pid_n = (pid % per_group) // size
    else:
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
    e, first, end, live = _tile_of(group_ends, t, E, C, EP, BM)
    if live:
        rm = first + tl.arange(0, BM)
        ok_m = rm < end
        rm64 = rm.to(tl.int64)
        if GATHER:  # row of the quantised input feeding each sorted position
            src = tl.load(a_rows + rm64, mask=ok_m, other=0).to(tl.int64)
        else:
            src = rm64
        rn = pid_n * BN + tl.arange(0, BN)
        ok_n = rn < N
        rk = tl.arange(0, BK)
        e64 = e.to(tl.int64)
        a_ptrs = a + src[:, None] * K + rk[None, :]
        b_ptrs = b + e64 * stride_be + rn.to(tl.int64)[:, None] * K + rk[None, :]
        sa_ptrs = a_scale + src * stride_sam
        if SB_SCALAR:
            sb_ptrs = b_scale + e64 * stride_bse + ((pid_n * BN) // BLOCK_N_Q).to(tl.int64) * n_kb
        else:
            sb_ptrs = b_scale + e64 * stride_bse + (rn // BLOCK_N_Q).to(tl.int64) * n_kb
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        STEP: tl.constexpr = 2 * BK if PAIR_K else BK
        if LOOP_WHILE:  # the interpreter cannot take a runtime bound in range()
            k0 = 0
            while k0 < K:
                if PAIR_K:
                    acc = _k_pair(acc, a_ptrs + k0, b_ptrs + k0, sa_ptrs, sb_ptrs, stride_sak, k0, ok_m, ok_n, BK)
                else:
                    acc = _k_step(acc, a_ptrs + k0, b_ptrs + k0, sa_ptrs, sb_ptrs, stride_sak, k0, K, ok_m, ok_n, rk,
                                  BK, SB_SCALAR, EVEN_K)
                k0 += STEP
        elif PAIR_K:
            for k0 in range(0, K, STEP):
                acc = _k_pair(acc, a_ptrs + k0, b_ptrs + k0, sa_ptrs, sb_ptrs, stride_sak, k0, ok_m, ok_n, BK)
        else:
            for k0 in range(0, K, BK):
                acc = _k_step(acc, a_ptrs + k0, b_ptrs + k0, sa_ptrs, sb_ptrs, stride_sak, k0, K, ok_m, ok_n, rk,
                              BK, SB_SCALAR, EVEN_K)
        store_f32_as(out + rm64[:, None] * N + rn[None, :], acc, ok_m[:, None] & ok_n[None, :], OUT_KIND)


TILES_ENV = "CPGRAPH_FP8_GROUPED_TILES"
GROUP_T = 16  # row tiles per group of the default raster order (see _gemm_tiles); never changes bits


def _gemm_tiles(rows: int, experts: int) -> tuple[int, ...]:
    """``(BM, BN, num_warps, num_stages, group_t)``: 64 x 128, one warpgroup, 4 stages, groups of 16 row tiles.

    Measured on H200 at V3.2's shapes (256 experts, 32K x 8 routed rows):

    * raster order: the 2-D grid (``group_t = 1``) reads each input row tile from HBM once per
      column tile (32 times for gate/up, 56 for down); in groups of 16 row tiles (1-D grid, row
      tile fastest) it stays in L2 while every column tile passes over it.  In the compiled
      two-layer V3.2 forward (``benchmarks/production_shape.py``, FP8 weights + KV, one run): both
      grouped GEMMs 36.4 -> 32.6 ms.  Alone (``benchmarks/moe_bench.py --fp8 --tiles``): gate/up
      25.3 -> 22.0 ms (1.00x -> 1.15x ``torch._grouped_mm`` bf16), down 14.5 -> 12.9 ms.
    * paired K blocks (``pair_k``, :func:`_k_pair`: two independent dots per step) with 128 x 128
      / 8 warps were 1 ms faster alone (gate/up 1.20x, down 1.11x) but 1.5 ms slower in the
      forward (34.1 ms), so they stay an option; with one warpgroup they are slower (registers).
    * 64 x 128 keeps the bits of the earlier default and of deterministic mode's fixed tile.

    ``CPGRAPH_FP8_GROUPED_TILES=BM,BN,warps,stages[,group_t[,pair_k]]`` overrides it (tuning; the
    bits change only with the tile, never with ``group_t`` or ``pair_k``).
    """
    if interpreting():
        return 32, 32, 4, 1, 1
    env = os.environ.get(TILES_ENV, "")
    return _tiles_from_env(env) if env else (64, 128, 4, 4, GROUP_T)


@functools.lru_cache(maxsize=8)
def _tiles_from_env(env: str) -> tuple[int, ...]:
    """``CPGRAPH_FP8_GROUPED_TILES`` parsed once per value (the tiles are read on every call)."""
    try:
        vals = tuple(int(v) for v in env.split(","))
    except ValueError:
        vals = ()
    if len(vals) not in (4, 5, 6) or min(vals[:5]) < 1:
        raise ValueError(f"{TILES_ENV} must be BM,BN,warps,stages[,group_t[,pair_k]] (positive ints, pair_k 0 "
                         f"or 1), got {env!r}")
    return vals


def grouped_gemm(a, a_scale, a_rows, b, b_scale, group_ends, block_n: int, block_k: int, out_dtype, rows: int,
                 *, tiles=None) -> Tensor:
    """``out [rows, N]``: sorted row ``r`` of expert ``e`` = ``deq(a[a_rows[r]]) @ deq(b[e])^T``.

    ``a`` e4m3 ``[R, K]`` with fp32 scales ``a_scale [R, ceil(K / block_k)]``
    (any strides); ``a_rows`` int64 ``[rows]`` maps sorted rows to rows of
    ``a`` (``None``: the identity); ``b`` e4m3 ``[E, N, K]`` with
    ``b_scale [E, ceil(N / block_n), ceil(K / block_k)]``; ``group_ends``
    int32 ``[E]`` cumulative rows per expert.  Rows past ``group_ends[-1]``
    are left unwritten.  ``tiles`` overrides ``(BM, BN, warps, stages[, group_t[, pair_k]])``.
    """
    if block_k & (block_k - 1) or not 32 <= block_k <= 256:
        raise ValueError(f"cpgraph.moe_experts: the FP8 grouped GEMM needs block_k a power of two in [32, 256], got {block_k}")
    e, n, k = b.shape
    out = torch.empty((rows, n), dtype=out_dtype, device=a.device)
    if rows == 0 or n == 0 or e == 0:
        return out
    bm, bn, warps, stages, *rest = tiles or _gemm_tiles(rows, e)
    group_t = rest[0] if rest else 1
    # Paired K blocks need whole pairs of K blocks and one weight-scale block per column tile.
    pair_k = bool(rest[1]) if len(rest) > 1 else False
    pair_k = pair_k and k % (2 * block_k) == 0 and block_n % bn == 0
    b = b.contiguous()
    b_scale = b_scale.contiguous()
    row_tiles, col_tiles = triton.cdiv(rows, bm) + e, triton.cdiv(n, bn)
    grid = (row_tiles * col_tiles,) if group_t > 1 else (row_tiles, col_tiles)
    dst = bits_view(out)
    _grouped_gemm_kernel[grid](
        a.contiguous(), a_scale, a_rows if a_rows is not None else group_ends, b, b_scale, group_ends, dst,
        n, k, e, rows, a_scale.stride(0), a_scale.stride(1), b.stride(0), b_scale.stride(0), b_scale.shape[2],
        row_tiles, col_tiles,
        EP=max(16, triton.next_power_of_2(e)), GATHER=a_rows is not None, BLOCK_N_Q=block_n, BM=bm, BN=bn,
        BK=block_k, OUT_KIND=KINDS[out_dtype], LOOP_WHILE=interpreting(), SB_SCALAR=block_n % bn == 0,
        EVEN_K=k % block_k == 0, GROUP_T=group_t, PAIR_K=pair_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


# ------------------------------------------------------------ SwiGLU + quant
@triton.jit
def _swiglu_quant_kernel(
    h, group_ends, q, scales, C, I, E, stride_h,
    GROUP: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, POW2: tl.constexpr, KIND: tl.constexpr,
    HW_CAST: tl.constexpr,
):  # fmt: skip
    """``silu(gate) * up`` of ``ROWS`` routed rows x one group, quantised like the op's reference."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    routed = tl.minimum(tl.load(group_ends + E - 1).to(tl.int32), C)
    ok_r = rows < routed
    cols = g * GROUP + tl.arange(0, GP)
    ok = ok_r[:, None] & (cols[None, :] < I) & (tl.arange(0, GP)[None, :] < GROUP)
    r64 = rows.to(tl.int64)
    gate = load_f32(h + r64[:, None] * stride_h + cols[None, :], ok, KIND)
    up = load_f32(h + r64[:, None] * stride_h + I + cols[None, :], ok, KIND)
    act = gate / (1.0 + tl.exp(-gate)) * up
    y, s = quantize_group(act, ok, POW2)
    store_e4m3(q + r64[:, None] * I + cols[None, :], y, ok, HW_CAST)
    tl.store(scales + r64 * tl.cdiv(I, GROUP) + g, s, mask=ok_r)


def swiglu_quantize(h: Tensor, group_ends: Tensor, group: int, pow2: bool) -> tuple[Tensor, Tensor]:
    """``h [C, 2I]`` (gate | up) -> ``(e4m3 [C, I], fp32 scales [C, ceil(I / group)])`` for the routed rows.

    Rows past ``group_ends[-1]`` are left unwritten (they are never read).
    """
    c, two_i = h.shape
    i = two_i // 2
    groups = ceil_div(i, group)
    q = torch.empty((c, i), dtype=torch.float8_e4m3fn, device=h.device)
    scales = torch.empty((c, groups), dtype=torch.float32, device=h.device)
    if c == 0 or i == 0 or group_ends.numel() == 0:
        return q, scales
    hw = not interpreting()
    rows = 4 if interpreting() else max(1, min(16, 4096 // triton.next_power_of_2(group)))
    src = bits_view(h)
    _swiglu_quant_kernel[(triton.cdiv(c, rows), groups)](
        src, group_ends, q if hw else q.view(torch.uint8), scales, c, i, group_ends.numel(), h.stride(0),
        GROUP=group, GP=triton.next_power_of_2(group), ROWS=rows, POW2=bool(pow2), KIND=KINDS[h.dtype],
        HW_CAST=hw, num_warps=4,
    )  # fmt: skip
    return q, scales


# ---------------------------------------------------------------- provider
def moe_experts_fp8(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale, down_scale, block_n: int,
                    block_k: int, act_scale_pow2: bool) -> Tensor:
    """FP8 routed experts: quantise, grouped gate/up GEMM, SwiGLU + quant, grouped down GEMM, combine."""
    if block_k & (block_k - 1) or not 32 <= block_k <= 256:
        ledger.fell_back("moe_experts", x.device.type, REFERENCE,
                         f"FP8 block_k={block_k} is not a power of two in [32, 256]", instead_of=PROVIDER_NAME)
        return moe_experts_fp8_reference(x, topk_ids, topk_w, gate_up, down, num_valid, gate_up_scale, down_scale,
                                         block_n, block_k, act_scale_pow2)
    m, k = topk_ids.shape
    e = gate_up.shape[0]
    plan = dispatch_plan(topk_ids, num_valid, e)
    xq, xs = quantize_activations(x, block_k, act_scale_pow2)
    src = plan.order // k
    h = grouped_gemm(xq, xs, src, gate_up, gate_up_scale, plan.group_ends, block_n, block_k, x.dtype, m * k)
    aq, a_s = swiglu_quantize(h, plan.group_ends, block_k, act_scale_pow2)
    y = grouped_gemm(aq, a_s, None, down, down_scale, plan.group_ends, block_n, block_k, x.dtype, m * k)
    return combine(y, plan.slot_pos, topk_w, x.dtype)


__all__ = ["grouped_gemm", "moe_experts_fp8", "swiglu_quantize"]
