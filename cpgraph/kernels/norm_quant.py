"""CUDA provider of ``cpgraph::fp8_rms_norm_quantize``: residual add, RMSNorm and FP8 codes in one pass.

One program per row.  A row of up to 8192 values (every DSA width) is read
once and kept in registers; a longer one takes two sweeps in tiles of ``TG``
quantisation groups (``TG * group`` values):

1. add the residual (rounded to the activation dtype, written out as
   ``summed``) and accumulate the fp32 squares;
2. re-read the row (from L2 while it stays there: ``summed`` as step 1
   wrote it when there is a residual, else ``x``), scale by
   ``rsqrt(mean + eps)`` and the weight, round to the activation dtype
   (written out as ``normed`` when asked), and quantise each group with
   :func:`~cpgraph.kernels.fp8_linear.quantize_group`, the quantiser every
   FP8 kernel here shares, so the codes are exactly those of the rounded
   row (the op's contract).

On the GPU the bf16 roundings take the hardware conversion and the e4m3
store's saturation does the clamp: the bit-level forms (which the
interpreter needs) made the kernel issue-bound, slower than Inductor's norm
followed by the quantiser (docs/performance.md, "Third round").  The values
are the same; only a NaN's payload differs (the GPU's canonical NaN).

Why two paths: one sweep reads the row once, but holds all of it in
registers, which bounds the width; two sweeps work for any width (a user's
model) with the same registers, the second reading from L2 while the rows
in flight fit there.  Only a row's own values enter its sum (in a fixed tile
order), so a row's result does not depend on the batch: CP ranks and a
single device compute identical rows.  No host sync; static shapes (CUDA
graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpgraph.ops.fp8_linear import ceil_div
from cpgraph.ops.norm_quant import check_rms_norm_quantize

from ._bits import KINDS, bits_view, load_f32, round_to_kind, store_f32_as
from ._launch import interpreting
from .fp8_linear import quantize_group, store_e4m3


@triton.jit
def _round(v, KIND: tl.constexpr, HW_CAST: tl.constexpr):
    """fp32 -> the activation dtype -> fp32, round to nearest even.  On the GPU a bf16 value takes the hardware
    conversion (``cvt.rn.bf16``, one instruction for two values) instead of the bit-level one (about eight a
    value, which left this kernel issue-bound); both round alike and differ only in a NaN's payload."""
    if HW_CAST and KIND == 1:
        return v.to(tl.bfloat16).to(tl.float32)
    else:
        return round_to_kind(v, KIND)


@triton.jit
def _store_as(ptrs, v, ok, KIND: tl.constexpr, HW_CAST: tl.constexpr):
    """Store fp32 values already rounded to the activation dtype (exact), bf16 as its int16 bits."""
    if HW_CAST and KIND == 1:
        tl.store(ptrs, v.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=ok)
    else:
        store_f32_as(ptrs, v, ok, KIND)


@triton.jit
def _row_tile(x, res, row_x, row_r, cols, ok, KIND: tl.constexpr, HAS_RES: tl.constexpr, HW_CAST: tl.constexpr):
    """``s`` of one tile: ``x`` (+ the residual, rounded to the activation dtype)."""
    s = load_f32(x + row_x + cols, ok, KIND)
    if HAS_RES:
        s = _round(s + load_f32(res + row_r + cols, ok, KIND), KIND, HW_CAST)
    return s


@triton.jit
def _squares_tile(acc, x, res, summed, row_x, row_r, row_o, g0, gi, ci, K,
                  GROUP: tl.constexpr, KIND: tl.constexpr, HAS_RES: tl.constexpr, HW_CAST: tl.constexpr):  # fmt: skip
    """Sweep 1 on one tile: ``s`` (written out as ``summed`` with a residual), its squares added to ``acc``."""
    cols = (g0 + gi)[:, None] * GROUP + ci[None, :]
    ok = (ci[None, :] < GROUP) & (cols < K)  # a group past the last starts at >= K: masked too
    s = _row_tile(x, res, row_x, row_r, cols, ok, KIND, HAS_RES, HW_CAST)
    if HAS_RES:
        _store_as(summed + row_o + cols, s, ok, KIND, HW_CAST)
    return acc + s * s


@triton.jit
def _emit_tile(s, w, normed, q, scales, row, row_o, cols, ok, g, rstd, M, G,
               POW2: tl.constexpr, KIND: tl.constexpr, W_KIND: tl.constexpr, EMIT_NORMED: tl.constexpr,
               HW_CAST: tl.constexpr):  # fmt: skip
    """The normed values of one tile rounded to the activation dtype (written when asked), then their codes and
    scales."""
    h = _round((s * rstd) * load_f32(w + cols, ok, W_KIND), KIND, HW_CAST)
    if EMIT_NORMED:
        _store_as(normed + row_o + cols, h, ok, KIND, HW_CAST)
    y, sc = quantize_group(h, ok, POW2, not HW_CAST)  # on the GPU the saturating e4m3 store clamps
    store_e4m3(q + row_o + cols, y, ok, HW_CAST)
    tl.store(scales + row + g.to(tl.int64) * M, sc, mask=g < G)  # column-major [M, G]


@triton.jit
def _quantize_tile(x, summed, w, normed, q, scales, row, row_x, row_o, g0, gi, ci, rstd, M, K, G,
                   GROUP: tl.constexpr, POW2: tl.constexpr, KIND: tl.constexpr, W_KIND: tl.constexpr,
                   HAS_RES: tl.constexpr, EMIT_NORMED: tl.constexpr, HW_CAST: tl.constexpr):  # fmt: skip
    """Sweep 2 on one tile: the row's values again (from L2), then :func:`_emit_tile`.  With a residual that is
    ``summed`` as sweep 1 wrote it (already rounded: one read and no add instead of two reads, an add and a
    rounding), else ``x``."""
    g = g0 + gi
    cols = g[:, None] * GROUP + ci[None, :]
    ok = (ci[None, :] < GROUP) & (cols < K)
    if HAS_RES:
        s = load_f32(summed + row_o + cols, ok, KIND)
    else:
        s = load_f32(x + row_x + cols, ok, KIND)
    _emit_tile(s, w, normed, q, scales, row, row_o, cols, ok, g, rstd, M, G, POW2, KIND, W_KIND, EMIT_NORMED,
               HW_CAST)


@triton.jit
def _rms_norm_quantize_kernel(
    x, res, w, summed, normed, q, scales, M, K, K_F, G, stride_x, stride_r, eps,
    GROUP: tl.constexpr, GP: tl.constexpr, TG: tl.constexpr, POW2: tl.constexpr, KIND: tl.constexpr,
    W_KIND: tl.constexpr, HAS_RES: tl.constexpr, EMIT_NORMED: tl.constexpr, HW_CAST: tl.constexpr,
    LOOP_WHILE: tl.constexpr, ONE_SWEEP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    gi = tl.arange(0, TG)
    ci = tl.arange(0, GP)
    row_x = row * stride_x
    row_r = row * stride_r
    row_o = row * K
    if ONE_SWEEP:  # the whole row is one tile (TG >= G): read once, kept in registers
        cols = gi[:, None] * GROUP + ci[None, :]
        ok = (ci[None, :] < GROUP) & (cols < K)
        s = _row_tile(x, res, row_x, row_r, cols, ok, KIND, HAS_RES, HW_CAST)
        if HAS_RES:
            _store_as(summed + row_o + cols, s, ok, KIND, HW_CAST)
        mean = tl.math.div_rn(tl.sum(tl.sum(s * s, axis=1), axis=0), K_F)
        rstd = tl.math.div_rn(1.0, tl.sqrt_rn(mean + eps))
        _emit_tile(s, w, normed, q, scales, row, row_o, cols, ok, gi, rstd, M, G, POW2, KIND, W_KIND, EMIT_NORMED,
                   HW_CAST)
    else:
        acc = tl.zeros([TG, GP], dtype=tl.float32)
        if LOOP_WHILE:  # the interpreter cannot take a runtime bound in range()
            g0 = 0
            while g0 < G:
                acc = _squares_tile(acc, x, res, summed, row_x, row_r, row_o, g0, gi, ci, K, GROUP, KIND, HAS_RES,
                                     HW_CAST)
                g0 += TG
        else:
            for g0 in range(0, G, TG):
                acc = _squares_tile(acc, x, res, summed, row_x, row_r, row_o, g0, gi, ci, K, GROUP, KIND, HAS_RES,
                                     HW_CAST)
        mean = tl.math.div_rn(tl.sum(tl.sum(acc, axis=1), axis=0), K_F)
        rstd = tl.math.div_rn(1.0, tl.sqrt_rn(mean + eps))
        if HAS_RES:
            tl.debug_barrier()  # sweep 1's ``summed`` stores visible to every thread of the program before sweep 2
        if LOOP_WHILE:
            g0 = 0
            while g0 < G:
                _quantize_tile(x, summed, w, normed, q, scales, row, row_x, row_o, g0, gi, ci, rstd, M, K, G,
                               GROUP, POW2, KIND, W_KIND, HAS_RES, EMIT_NORMED, HW_CAST)
                g0 += TG
        else:
            for g0 in range(0, G, TG):
                _quantize_tile(x, summed, w, normed, q, scales, row, row_x, row_o, g0, gi, ci, rstd, M, K, G,
                               GROUP, POW2, KIND, W_KIND, HAS_RES, EMIT_NORMED, HW_CAST)


ROW_VALUES = 8192  # rows up to this many values (in whole groups, a power of two of them) take one sweep
TILE_VALUES = 2048  # the tile of the two sweeps past that (16 groups of 128)


def rms_norm_quantize(x, residual, weight, eps: float, group: int, pow2: bool, emit_normed: bool, *,
                      row_values: int = ROW_VALUES, tile_values: int = TILE_VALUES, num_warps: int | None = None):
    """Provider: the op's ``(summed, normed, q, scales)`` from one kernel launch (module docstring).

    A row of at most ``row_values`` values (V3.2's 7168 and 1536, GLM-5's 6144) is read once and kept in
    registers; a longer one takes two sweeps of ``tile_values``.  ``num_warps`` defaults to 8 for one sweep of
    more than 4096 values, else 4.  The knobs are for ``benchmarks/norm_quant_bench.py --sweep``; the op uses
    the defaults, and a given ``K`` always takes the same path (a row's bits do not depend on ``M``).
    """
    check_rms_norm_quantize(x, residual, weight, eps, group)
    shape, k = x.shape, x.shape[-1]
    x = x.reshape(-1, k)  # a view for the rows the model hands over; a copy only for odd strides
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None:
        residual = residual.reshape(-1, k)
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    weight = weight.contiguous()
    m = x.shape[0]
    groups = ceil_div(k, group)
    summed = torch.empty(shape if residual is not None else (0, k), dtype=x.dtype, device=x.device)
    normed = torch.empty(shape if emit_normed else (0, k), dtype=x.dtype, device=x.device)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((groups, m), dtype=torch.float32, device=x.device).t()
    if m == 0:
        return summed, normed, q, scales
    hw = not interpreting()
    gp = triton.next_power_of_2(group)
    row_groups = triton.next_power_of_2(groups)
    one_sweep = row_groups * gp <= row_values
    tile_groups = row_groups if one_sweep else max(1, min(row_groups, tile_values // gp))
    if num_warps is None:
        num_warps = 8 if one_sweep and row_groups * gp > 4096 else 4
    res = residual if residual is not None else x
    _rms_norm_quantize_kernel[(m,)](
        bits_view(x), bits_view(res), bits_view(weight), bits_view(summed if residual is not None else x),
        bits_view(normed if emit_normed else x), q if hw else q.view(torch.uint8), scales,
        m, k, float(k), groups, x.stride(0), res.stride(0), float(eps),
        GROUP=group, GP=gp, TG=tile_groups, POW2=bool(pow2), KIND=KINDS[x.dtype], W_KIND=KINDS[weight.dtype],
        HAS_RES=residual is not None, EMIT_NORMED=bool(emit_normed), HW_CAST=hw, LOOP_WHILE=not hw,
        ONE_SWEEP=one_sweep, num_warps=num_warps,
    )  # fmt: skip
    return summed, normed, q, scales


__all__ = ["rms_norm_quantize"]
