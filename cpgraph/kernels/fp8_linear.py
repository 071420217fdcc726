"""CUDA provider of ``cpgraph::fp8_block_linear`` (block-scaled FP8 projections).

Two steps, both without host syncs and with static shapes (CUDA-graph safe):

1. :func:`quantize_activations` -- one Triton kernel quantises ``x`` per token
   per ``block_k`` values exactly as the op's reference does (same e4m3 codes,
   same fp32 or power-of-two scales, divisions IEEE-rounded), so providers
   differ from the reference only in the summation order of the GEMM.
2. the GEMM ``out = sum_kb (xq_kb @ w_kb^T) * xs[:, kb] * ws[n // bn, kb]``:

   * ``scaled_mm``: torch's blockwise-scaled FP8 GEMM
     (``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` activations
     and ``BlockWise128x128`` weights, cuBLASLt on SM90 with CUDA >= 12.9).
     Used when the torch build has it and the shapes fit it (128 x 128
     blocks, ``N`` and ``K`` multiples of 128, bf16 activations);
   * ``triton``: :func:`block_scaled_gemm`, an FP8 tensor-core GEMM that
     multiplies one ``block_k``-wide K slice per step and applies both scales
     to the fp32 partial product before adding it to the fp32 accumulator
     (so no FP8 partial sum spans more than one scale block).  Any ``N``,
     ``K``, ``block_n``; ``block_k`` a power of two in [32, 256].

   * ``deep_gemm``: DeepGEMM's SM90 ``fp8_gemm_nt`` (same operands and scales
     as ``scaled_mm``, same shape rules), where DeepGEMM is installed
     (:mod:`.deep_gemm_lib` loads it).

``CPGRAPH_FP8_LINEAR=auto|scaled_mm|deep_gemm|triton`` picks the GEMM (default
``auto``: ``deep_gemm`` where it is installed and applies, else ``scaled_mm``
where it applies, else ``triton``).  Each call is
counted under the GEMM that ran (``scaled_mm`` or ``triton``, with the
reason scaled_mm did not apply) in the provider report
(:mod:`cpgraph.ops.ledger`).  Where the machine rules ``scaled_mm`` out
(torch without it, not SM90, CUDA < 12.9) that is a fallback, logged at
WARNING once; where the operands do (``kv_a_proj_with_mqa``'s N = 576, block
sizes, activations not bf16) it is the documented split, logged at INFO
once.  Forcing ``scaled_mm`` where it does not apply raises instead of
falling back.  See docs/ops/fp8_linear.md.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cpgraph.ops import ledger
from cpgraph.ops.fp8_linear import (
    QUANTIZED_OP,
    ceil_div,
    check_fp8_block_linear,
    check_fp8_linear_quantized,
    column_major,
)

from . import deep_gemm_lib
from ._bits import KINDS, bits_view, e4m3_bits, exp2_f32, load_f32, pow2_exponent, store_f32_as
from ._launch import interpreting

BACKEND_ENV = "CPGRAPH_FP8_LINEAR"
BACKENDS = ("auto", "scaled_mm", "deep_gemm", "triton")
OP = "fp8_block_linear"


# ------------------------------------------------------ activation quant
@triton.jit
def _quantize_kernel(
    x, q, scales, M, K, stride_xm, stride_sm, stride_sg,
    GROUP: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, POW2: tl.constexpr,
    KIND: tl.constexpr, HW_CAST: tl.constexpr,
):  # fmt: skip
    """One ``[ROWS, GROUP]`` tile: per-row amax, scale, e4m3 codes (the reference's arithmetic)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GP)
    ok_r = rows < M
    ok = ok_r[:, None] & (cols[None, :] < K) & (tl.arange(0, GP)[None, :] < GROUP)
    r64 = rows.to(tl.int64)
    v = load_f32(x + r64[:, None] * stride_xm + cols[None, :], ok, KIND)
    y, s = quantize_group(v, ok, POW2)
    store_e4m3(q + r64[:, None] * K + cols[None, :], y, ok, HW_CAST)
    tl.store(scales + r64 * stride_sm + g * stride_sg, s, mask=ok_r)


@triton.jit
def quantize_group(v, ok, POW2: tl.constexpr, CLAMP: tl.constexpr = True):
    """``[R, G]`` fp32 values (``ok`` masks the group's real columns) -> ``(clamped x / scale, scale [R])``.

    The op reference's arithmetic: amax over the group, ``max(amax, 1e-4) /
    448`` IEEE-rounded (or the power of two above it), NaN scale for a group
    holding a NaN or infinity; shared by every kernel that quantises
    activations so they all produce the reference's codes.

    ``CLAMP=False`` leaves the clamp to ``[-448, 448]`` to the store: the
    GPU's e4m3 conversion saturates finite values (``cvt.rn.satfinite``) and
    keeps NaN, which is the clamp's result, for four instructions a value
    fewer (:func:`store_e4m3` with ``HW_CAST``).
    """
    mag = tl.abs(v)
    mag = tl.where(mag == mag, mag, float("inf"))  # tl.max drops NaN (fmax): count a NaN as an infinity
    amax = tl.max(tl.where(ok, mag, 0.0), axis=1)
    finite = amax <= 3.4028234663852886e38  # NaN / inf in the group -> NaN scale
    if POW2:
        # x / 2**e and x * 2**-e are the same exactly rounded value (2**-e is a normal fp32 for every
        # reachable e): a multiply instead of an IEEE division, same codes.
        e = pow2_exponent(amax)
        s = tl.where(finite, exp2_f32(e), float("nan"))
        y = v * tl.where(finite, exp2_f32(-e), float("nan"))[:, None]
    else:
        s = tl.where(finite, tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0), float("nan"))
        y = tl.math.div_rn(v, s[:, None])
    if CLAMP:
        y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))  # comparisons keep NaN as NaN
    return y, s


@triton.jit
def store_e4m3(dst, y, ok, HW_CAST: tl.constexpr):
    """Store ``y`` (already in [-448, 448] or NaN) as e4m3 codes, rounded to nearest even."""
    if HW_CAST:  # the GPU's conversion: the same codes as the bit-level one for |y| <= 448
        tl.store(dst, y.to(tl.float8e4nv), mask=ok)
    else:
        tl.store(dst, e4m3_bits(y).to(tl.uint8), mask=ok)


def quantize_activations(x: torch.Tensor, group: int, pow2: bool, *, scales_column_major: bool = False):
    """``(e4m3 [M, K], fp32 scales [M, ceil(K / group)])``, equal to the reference's quantisation.

    ``scales_column_major`` lays the scales out with stride ``(1, M)``, the
    layout torch's blockwise-scaled GEMM takes for ``BlockWise1x128``.
    """
    x = x.contiguous()
    m, k = x.shape
    groups = ceil_div(k, group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if scales_column_major:
        scales = torch.empty((groups, m), dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scales
    hw = not interpreting()
    rows = 4 if interpreting() else max(1, min(16, 4096 // triton.next_power_of_2(group)))
    src = bits_view(x)
    _quantize_kernel[(triton.cdiv(m, rows), groups)](
        src, q if hw else q.view(torch.uint8), scales, m, k, x.stride(0), scales.stride(0), scales.stride(1),
        GROUP=group, GP=triton.next_power_of_2(group), ROWS=rows, POW2=bool(pow2), KIND=KINDS[x.dtype],
        HW_CAST=hw, num_warps=4,
    )  # fmt: skip
    return q, scales


# ------------------------------------------------------------ Triton GEMM
@triton.jit
def _k_step(acc, a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, stride_sak, k0, K, ok_m, ok_n, rk, BK: tl.constexpr,
            SB_SCALAR: tl.constexpr, EVEN_K: tl.constexpr = False):
    """One ``BK``-wide K block: e4m3 dot (fp32 result), times both block scales, added to ``acc``.

    ``SB_SCALAR``: the tile's ``BN`` columns lie in one weight-scale block
    (``BN`` divides ``block_n``), so ``sb_ptrs`` is one pointer and the two
    scales fold into one per-row factor: one FMA per accumulator element
    instead of two multiplies and an add (the scaling runs on the CUDA cores
    between tensor-core dots, so it is on the critical path).

    ``EVEN_K``: ``BK`` divides ``K``, so no K mask: the loads' predicates are
    per row only, which keeps the copies wide (V3.2's K of 7168 and 2048 are
    multiples of 128).
    """
    kb = k0 // BK
    if EVEN_K:
        av = tl.load(a_ptrs, mask=ok_m[:, None], other=0.0)
        bv = tl.load(b_ptrs, mask=ok_n[:, None], other=0.0)
    else:
        ok_k = (k0 + rk) < K
        av = tl.load(a_ptrs, mask=ok_m[:, None] & ok_k[None, :], other=0.0)
        bv = tl.load(b_ptrs, mask=ok_n[:, None] & ok_k[None, :], other=0.0)
    part = tl.dot(av, tl.trans(bv))
    sa = tl.load(sa_ptrs + kb * stride_sak, mask=ok_m, other=0.0)
    if SB_SCALAR:
        acc = acc + part * (sa * tl.load(sb_ptrs + kb))[:, None]
    else:
        sb = tl.load(sb_ptrs + kb, mask=ok_n, other=0.0)
        acc = acc + part * sa[:, None] * sb[None, :]
    return acc


@triton.jit
def _gemm_kernel(
    a, a_scale, b, b_scale, out, M, N, K, stride_sam, stride_sak, n_kb,
    BLOCK_N_Q: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    OUT_KIND: tl.constexpr, LOOP_WHILE: tl.constexpr, SB_SCALAR: tl.constexpr,
    EVEN_K: tl.constexpr = False,
):  # fmt: skip
    """``out[BM, BN]`` tile: per K block, an e4m3 tensor-core dot scaled in fp32 and accumulated."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    # Grouped launch order: GROUP_M row tiles share each weight tile while it is in L2.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    ok_m = rm < M
    ok_n = rn < N
    a_ptrs = a + rm.to(tl.int64)[:, None] * K + rk[None, :]
    b_ptrs = b + rn.to(tl.int64)[:, None] * K + rk[None, :]
    sa_ptrs = a_scale + rm.to(tl.int64) * stride_sam
    if SB_SCALAR:
        sb_ptrs = b_scale + ((pid_n * BN) // BLOCK_N_Q).to(tl.int64) * n_kb
    else:
        sb_ptrs = b_scale + (rn // BLOCK_N_Q).to(tl.int64) * n_kb
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if LOOP_WHILE:  # the interpreter cannot take a runtime bound in range()
        k0 = 0
        while k0 < K:
            acc = _k_step(acc, a_ptrs + k0, b_ptrs + k0, sa_ptrs, sb_ptrs, stride_sak, k0, K, ok_m, ok_n, rk, BK,
                          SB_SCALAR, EVEN_K)
            k0 += BK
    else:
        for k0 in range(0, K, BK):
            acc = _k_step(acc, a_ptrs + k0, b_ptrs + k0, sa_ptrs, sb_ptrs, stride_sak, k0, K, ok_m, ok_n, rk, BK,
                          SB_SCALAR, EVEN_K)
    dst = out + rm.to(tl.int64)[:, None] * N + rn[None, :]
    store_f32_as(dst, acc, ok_m[:, None] & ok_n[None, :], OUT_KIND)


def _tiles(m: int) -> tuple[int, int, int, int]:
    """``(BM, BN, num_warps, num_stages)``: 64 x 128 tiles, one warpgroup, a 4-deep pipeline.

    The fastest of nine variants in 12 of 14 V3.2 cases on H200 (``fp8_linear_bench.py --sweep``,
    M 4096 and 32768), 5-15 % ahead of 128 x 128 / 8 warps: several one-warpgroup CTAs per SM
    overlap one CTA's per-block fp32 scaling with another's tensor-core dots.
    """
    if interpreting():
        return 32, 32, 4, 1
    return 64, 128, 4, 4


def block_scaled_gemm(xq, xs, w, ws, block_n: int, block_k: int, out_dtype, *, tiles=None, group_m: int = 8):
    """Triton GEMM on quantised operands (``xs`` any strides); ``tiles`` overrides ``(BM, BN, warps, stages)``."""
    if block_k & (block_k - 1) or not 32 <= block_k <= 256:
        raise ValueError(
            f"cpgraph.fp8_block_linear: the Triton GEMM needs block_k a power of two in [32, 256], got {block_k}"
        )
    m, k = xq.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    bm, bn, warps, stages = tiles or _tiles(m)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    dst = bits_view(out)
    _gemm_kernel[grid](
        xq, xs, w.contiguous(), ws.contiguous(), dst, m, n, k, xs.stride(0), xs.stride(1), ws.shape[1],
        BLOCK_N_Q=block_n, BM=bm, BN=bn, BK=block_k, GROUP_M=group_m, OUT_KIND=KINDS[out_dtype],
        LOOP_WHILE=interpreting(), SB_SCALAR=block_n % bn == 0, EVEN_K=k % block_k == 0,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


# ------------------------------------------------------ torch scaled_mm
def scaled_mm_available() -> bool:
    """Whether this torch build exposes the blockwise-scaled FP8 GEMM API (not whether the GPU runs it)."""
    F = torch.nn.functional
    kinds = getattr(F, "ScalingType", None)
    return hasattr(F, "scaled_mm") and kinds is not None and hasattr(kinds, "BlockWise128x128")


def _machine_reason(x) -> str | None:
    """Why this machine cannot run :func:`scaled_mm_gemm` at all (``None`` if it can)."""
    if not scaled_mm_available():
        return "torch has no torch.nn.functional.scaled_mm with BlockWise128x128"
    if x.device.type != "cuda":
        return "not a CUDA tensor"
    if torch.cuda.get_device_capability(x.device)[0] != 9:
        return "blockwise scaling runs on SM90 only"
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    if cuda < (12, 9):
        return f"blockwise scaling needs CUDA >= 12.9, torch is built with {torch.version.cuda}"
    return None


def _operand_reason(act_dtype, w, block_n: int, block_k: int, n_multiple: int = 128) -> str | None:
    """Why these operands do not fit :func:`scaled_mm_gemm` (``None`` if they do); ``n_multiple``: the N rule."""
    if (block_n, block_k) != (128, 128):
        return f"block {block_n}x{block_k} is not 128x128"
    n, k = w.shape
    if n % n_multiple or k % 128:
        return (f"N={n} and K={k} must be multiples of 128" if n_multiple == 128 else
                f"N={n} must be a multiple of {n_multiple} and K={k} of 128")
    if act_dtype != torch.bfloat16:
        return f"activations are {act_dtype}, not bfloat16"
    return None


def scaled_mm_reason(x, w, block_n: int, block_k: int) -> str | None:
    """``None`` when :func:`scaled_mm_gemm` applies to these operands, else why not (static facts only)."""
    return _machine_reason(x) or _operand_reason(x.dtype, w, block_n, block_k)


def scaled_mm_gemm(xq, xs, w, ws, out_dtype):
    """torch's blockwise GEMM: ``xs`` ``[M, K/128]`` with strides ``(1, M)``; ``ws`` padded to ``K/128`` rounded up to 4."""
    F = torch.nn.functional
    kb = ws.shape[1]
    padded = ceil_div(kb, 4) * 4
    # [L4, N/128], strides (1, L4); V3.2's K/128 (56, 16, 12, 128) need no padding, so no copy either.
    ws_t = (ws.contiguous() if padded == kb else torch.nn.functional.pad(ws, (0, padded - kb))).t()
    return F.scaled_mm(
        xq, w.t(), xs, F.ScalingType.BlockWise1x128, ws_t, F.ScalingType.BlockWise128x128,
        swizzle_a=F.SwizzleType.NO_SWIZZLE, swizzle_b=F.SwizzleType.NO_SWIZZLE, output_dtype=out_dtype,
    )  # fmt: skip


# ------------------------------------------------------------ DeepGEMM
def _deep_gemm_reason(x) -> str | None:
    """Why DeepGEMM's dense FP8 GEMM cannot run here (``None`` if it can)."""
    if x.device.type != "cuda" or interpreting():
        return "not a CUDA tensor"
    return deep_gemm_lib.machine_reason(x)


def _deep_gemm_applies(choice: str, x, w, block_n: int, block_k: int, act_dtype) -> bool:
    """Whether this call runs DeepGEMM: ``auto`` and ``deep_gemm`` where the machine and the operands take it.

    ``auto`` prefers it over ``scaled_mm`` (H200, V3.2's projections at 32K rows: 1.12-1.19x
    cuBLASLt's blockwise kernel on the same codes and scales, same bits; docs/ops/fp8_linear.md).
    ``deep_gemm`` on a machine without it raises; operands it does not take (:func:`deep_gemm_operand_reason`)
    go as ``auto``.
    """
    if choice not in ("auto", "deep_gemm"):
        return False
    machine = _deep_gemm_reason(x)
    if machine is not None:
        if choice == "deep_gemm":
            raise ValueError(f"cpgraph.fp8_block_linear: {BACKEND_ENV}=deep_gemm but {machine}")
        return False
    return deep_gemm_operand_reason(act_dtype, w, block_n, block_k) is None


def deep_gemm_operand_reason(act_dtype, w, block_n: int, block_k: int) -> str | None:
    """Why DeepGEMM's ``fp8_gemm_nt`` does not take these operands (``None`` if it does).

    Unlike cuBLASLt's blockwise kernel it takes an ``N`` that ends inside a
    128-row weight block: V3.2's ``kv_a`` (N = 576) and a fused ``q_a`` +
    ``kv_a`` (2112) matched the reference on the H200 (relative error 2.1e-3,
    as at N = 1536), ``kv_a`` 1.7-1.8x the Triton GEMM (a probe, 2026-12-05;
    ``benchmarks/fp8_linear_bench.py --shapes kv_a,q_a_kv_a --check`` repeats
    it).  Only multiples of 64 were checked, so only those are offered.
    """
    return _operand_reason(act_dtype, w, block_n, block_k, n_multiple=64)


def deep_gemm_linear(xq, xs, w, ws, out_dtype):
    """DeepGEMM's ``fp8_gemm_nt``: ``xs`` ``[M, K/128]`` column-major (its SM90 layout: no transpose copy)."""
    out = torch.empty((xq.shape[0], w.shape[0]), dtype=out_dtype, device=xq.device)
    if out.numel():
        deep_gemm_lib.load().fp8_gemm_nt((xq, xs), (w, ws.contiguous()), out)
    return out


# ---------------------------------------------------------------- provider
def backend() -> str:
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {', '.join(BACKENDS)}, got {choice!r}")
    return choice


def choose_gemm(op: str, x, w, block_n: int, block_k: int, act_dtype) -> str:
    """Which GEMM computes this call (``deep_gemm``, ``scaled_mm`` or ``triton``), counted for ``op`` (module doc).

    ``x``: any tensor on the call's device; ``act_dtype``: the activations' (= the output's) dtype.
    """
    choice = backend()
    device = x.device.type
    if choice == "triton":
        ledger.ran_as(op, device, "triton", f"{BACKEND_ENV}=triton")
        return "triton"
    if _deep_gemm_applies(choice, x, w, block_n, block_k, act_dtype):
        ledger.ran_as(op, device, "deep_gemm")
        return "deep_gemm"
    # auto, scaled_mm, or deep_gemm where the operands rule DeepGEMM out: as auto
    machine = _machine_reason(x)
    why_not = machine or _operand_reason(act_dtype, w, block_n, block_k)
    if choice == "scaled_mm" and why_not is not None:
        raise ValueError(f"cpgraph.{op}: {BACKEND_ENV}=scaled_mm but {why_not}")
    if why_not is None:
        ledger.ran_as(op, device, "scaled_mm")
        return "scaled_mm"
    if machine is not None and device == "cuda":
        ledger.fell_back(op, device, "triton", why_not, instead_of="scaled_mm")
    else:
        ledger.ran_as(op, device, "triton", why_not)
    return "triton"


def _gemm(kind: str, xq, xs, w, ws, block_n: int, block_k: int, out_dtype):
    if kind == "deep_gemm":
        return deep_gemm_linear(xq, column_major(xs), w, ws, out_dtype)
    if kind == "scaled_mm":
        return scaled_mm_gemm(xq, column_major(xs), w, ws, out_dtype)
    return block_scaled_gemm(xq, xs, w, ws, block_n, block_k, out_dtype)


def fp8_block_linear(x, weight, weight_scale_inv, block_n: int, block_k: int, act_scale_pow2: bool):
    """Provider: quantise activations (Triton), then the GEMM ``CPGRAPH_FP8_LINEAR`` selects (counted per call)."""
    check_fp8_block_linear(x, weight, weight_scale_inv, block_n, block_k)
    kind = choose_gemm(OP, x, weight, block_n, block_k, x.dtype)
    xq, xs = quantize_activations(x, block_k, act_scale_pow2, scales_column_major=kind != "triton")
    return _gemm(kind, xq, xs, weight, weight_scale_inv, block_n, block_k, x.dtype)


def fp8_quantize_activations(x, group: int, pow2: bool):
    """Provider of ``cpgraph::fp8_quantize_activations``: the Triton quantiser, scales column-major."""
    return quantize_activations(x, group, pow2, scales_column_major=True)


def fp8_linear_quantized(xq, x_scales, weight, weight_scale_inv, block_n: int, block_k: int, out_dtype):
    """Provider of ``cpgraph::fp8_linear_quantized``: the GEMM ``fp8_block_linear`` would run on these operands."""
    check_fp8_linear_quantized(xq, x_scales, weight, weight_scale_inv, block_n, block_k, out_dtype)
    kind = choose_gemm(QUANTIZED_OP, xq, weight, block_n, block_k, out_dtype)
    return _gemm(kind, xq, x_scales, weight, weight_scale_inv, block_n, block_k, out_dtype)


__all__ = [
    "BACKEND_ENV",
    "quantize_group",
    "store_e4m3",
    "block_scaled_gemm",
    "choose_gemm",
    "fp8_block_linear",
    "fp8_linear_quantized",
    "fp8_quantize_activations",
    "quantize_activations",
    "scaled_mm_available",
    "scaled_mm_gemm",
    "scaled_mm_reason",
]
