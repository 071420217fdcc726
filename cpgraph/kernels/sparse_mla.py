"""Triton sparse MLA prefill: each query row attends to the key rows its top-k list names.

Work split: one program per (query row, block of ``HB`` heads).  In the
absorbed form every head of a row attends to the *same* key rows, so a
program loads a tile of ``BLOCK_N`` gathered key rows once and uses it for
all its heads, twice: ``S = Q @ K^T`` over the whole 576-wide row (latent
and RoPE parts as two dots) and ``O += P @ V`` with ``V`` = the same tile's
first ``d_v`` columns.  Softmax is online (running max and sum in fp32, base
2 inside the loop, natural-log ``lse`` at the end).  The gathered
``[rows, topk, D]`` block never exists in HBM; a tile lives in registers /
shared memory only.

Program order puts the head blocks of one row next to each other and rows in
ascending order: neighbouring programs read mostly the same key rows (a
causal prefill's top-k lists of adjacent rows overlap), so the second read
comes from L2.

Invalid entries (``-1``, any negative id, ids ``>= N``) are masked *before*
the load: their addresses are computed from row 0 and never dereferenced.
Before the main loop a program scans its row's list once (``topk`` int32
loads, cheap next to the keys) for the position after the last valid entry
and stops there.  So a short row (fewer than ``topk`` keys, every key
selected, ``-1`` tail) costs only the tiles it really has: no separate
"dense" path is needed.  A row with no valid entry runs no tile and writes
``out = 0``, ``lse = +inf``, the op's contract.

Determinism: a row's result depends only on that row's inputs (fixed tile
order, no atomics, no split over keys), so it is bit-identical whatever the
batch around it.  Grid and arguments come from shapes only and nothing is
read back to the host: launches are CUDA-graph capturable.  Offsets are
int64.

Two key formats share the kernel (``KV_FP8``): dense rows in the query's
dtype (``[latent | k_pe]``), and the 656-byte FP8 MLA records of
:mod:`cpgraph.ops.codecs`, dequantised in registers (``e4m3 * 2**e`` is
exact in bf16) before the dots.  Under ``TRITON_INTERPRET=1`` (``INTERPRET``)
the dots run in fp32 (the interpreter has no bf16 matrix product) and the
loops are ``while`` loops (it cannot take a runtime ``range`` bound).

Shapes the kernel does not take (``d_v`` or ``D - d_v`` not a power of two
>= 16, fp32 operands) go to the torch reference; the call is counted under
``reference`` with the reason in the provider report (:mod:`cpgraph.ops.ledger`)
and logged at WARNING once per reason.  See ``docs/ops/sparse_mla.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpgraph.ops import ledger
from cpgraph.ops.providers import REFERENCE

from .provider_name import PROVIDER_NAME
from ._bits import e4m3_to_f32_fast
from ._launch import interpreting

# Tile configuration on CUDA (tuned on the H200, see docs/ops/sparse_mla.md).
HEAD_BLOCK = 64
BLOCK_N = 64
NUM_WARPS = 8
NUM_STAGES = 2
# FP8 records are dequantised in registers; that path has its own tuned tile.
FP8_BLOCK_N = 64
FP8_NUM_WARPS = 8
FP8_NUM_STAGES = 2
# Entries scanned per step when looking for a row's last valid entry.
SCAN = 1024

_LOG2E = 1.4426950408889634  # scores are scaled into base 2 once, inside the dot epilogue

# (kv_fp8, head block, BLOCK_N, warps, stages) -> compiled kernel, for kernel_metadata().
COMPILED: dict = {}


@triton.jit
def _valid_end_step(idx_row, c, topk, n_keys, end, SCAN: tl.constexpr):
    offs = c + tl.arange(0, SCAN)
    t = tl.load(idx_row + offs, mask=offs < topk, other=-1)
    ok = (t >= 0) & (t < n_keys)
    return tl.maximum(end, tl.max(tl.where(ok, offs + 1, 0), axis=0))


@triton.jit
def _valid_end(idx_row, topk, n_keys, SCAN: tl.constexpr, INTERPRET: tl.constexpr):
    """1 + position of the row's last valid entry (0 when there is none)."""
    end = 0
    if INTERPRET:  # the interpreter (numpy >= 2) cannot take a runtime ``range`` bound
        c = 0
        while c < topk:
            end = _valid_end_step(idx_row, c, topk, n_keys, end, SCAN)
            c += SCAN
    else:
        for c in range(0, topk, SCAN):
            end = _valid_end_step(idx_row, c, topk, n_keys, end, SCAN)
    return end


@triton.jit
def _fp8_key_tile(rec8, rec16, rec32, t, ok, BLOCK_N: tl.constexpr, DPE: tl.constexpr, DTYPE: tl.constexpr,
                  EXACT_BITS: tl.constexpr):  # fmt: skip
    """Dequantised ``(latent [BLOCK_N, 512], k_pe [BLOCK_N, DPE])`` from 656-byte records, in ``DTYPE``.

    The latent is read as ``[BLOCK_N, 4, 128]`` so each 128-value block meets
    its own scale by broadcasting; merging the last two axes is free.  Every
    step is exact for bf16 (e4m3 values and power-of-two scales fit): on the
    GPU the hardware fp8 conversion; with ``EXACT_BITS`` (the interpreter,
    which has no fp8 numbers) the integer decode of ``_bits`` and fp32.
    """
    blk = tl.arange(0, 4)
    col = tl.arange(0, 128)
    codes = tl.load(
        rec8 + t[:, None, None] * 656 + blk[None, :, None] * 128 + col[None, None, :], mask=ok[:, None, None], other=0
    )
    scale = tl.load(rec32 + t[:, None] * 164 + 128 + blk[None, :], mask=ok[:, None], other=0)
    scale = scale.to(tl.float32, bitcast=True)[:, :, None]
    pc = tl.arange(0, DPE)
    pe_bits = tl.load(rec16 + t[:, None] * 328 + 264 + pc[None, :], mask=ok[:, None], other=0)
    if EXACT_BITS:
        lat = e4m3_to_f32_fast(codes.to(tl.int32)) * scale
        pe = (pe_bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        lat = (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale).to(DTYPE)
        pe = pe_bits.to(tl.bfloat16, bitcast=True).to(DTYPE)
    return tl.reshape(lat, (BLOCK_N, 512)), pe


@triton.jit
def _attend_tile(
    q_lat, q_pe, kv, rec16, rec32, idx_row, start, end, n_keys, kv_row_stride, scale_log2, m_i, l_i, acc,
    DV: tl.constexpr, DPE: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """One tile of ``BLOCK_N`` listed ids: gather, scores, online-softmax update of ``(m_i, l_i, acc)``."""
    dv = tl.arange(0, DV)
    dpe = tl.arange(0, DPE)
    offs = start + tl.arange(0, BLOCK_N)
    t = tl.load(idx_row + offs, mask=offs < end, other=-1).to(tl.int64)
    ok = (t >= 0) & (t < n_keys)
    t = tl.where(ok, t, 0)
    if KV_FP8:
        k_lat, k_pe = _fp8_key_tile(kv, rec16, rec32, t, ok, BLOCK_N, DPE, q_lat.dtype, DOT_F32)
    else:
        k_ptrs = kv + t[:, None] * kv_row_stride
        k_lat = tl.load(k_ptrs + dv[None, :], mask=ok[:, None], other=0)
        k_pe = tl.load(k_ptrs + DV + dpe[None, :], mask=ok[:, None], other=0)
        if DOT_F32:
            k_lat = k_lat.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
    if DOT_F32:
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision="ieee")
    else:
        s = tl.dot(q_lat, tl.trans(k_lat))
        s = tl.dot(q_pe, tl.trans(k_pe), s)
    s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp2 finite
    alpha = tl.exp2(m_i - base)
    p = tl.exp2(s - base[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if DOT_F32:
        acc = tl.dot(p, k_lat, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(k_lat.dtype), k_lat, acc)
    return m_new, l_i, acc


@triton.jit
def _sparse_mla_kernel(
    q, kv, rec16, rec32, idx, out, lse,
    n_keys, topk, num_heads, head_blocks, scale_log2,
    q_row_stride, q_head_stride, kv_row_stride, idx_row_stride, out_row_stride, out_head_stride, lse_row_stride,
    HB: tl.constexpr, DV: tl.constexpr, DPE: tl.constexpr,
    BLOCK_N: tl.constexpr, SCAN: tl.constexpr, KV_FP8: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    row = (pid // head_blocks).to(tl.int64)
    heads = (pid % head_blocks) * HB + tl.arange(0, HB)
    head_ok = heads < num_heads
    dv = tl.arange(0, DV)
    dpe = tl.arange(0, DPE)

    q_ptrs = q + row * q_row_stride + heads.to(tl.int64)[:, None] * q_head_stride
    q_lat = tl.load(q_ptrs + dv[None, :], mask=head_ok[:, None], other=0)
    q_pe = tl.load(q_ptrs + DV + dpe[None, :], mask=head_ok[:, None], other=0)
    if INTERPRET:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    idx_row = idx + row * idx_row_stride
    end = _valid_end(idx_row, topk, n_keys, SCAN, INTERPRET)

    m_i = tl.full([HB], float("-inf"), tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, DV], tl.float32)
    if INTERPRET:  # see _valid_end
        start = 0
        while start < end:
            m_i, l_i, acc = _attend_tile(
                q_lat, q_pe, kv, rec16, rec32, idx_row, start, end, n_keys, kv_row_stride, scale_log2, m_i, l_i, acc,
                DV, DPE, BLOCK_N, KV_FP8, INTERPRET,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(0, end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q_lat, q_pe, kv, rec16, rec32, idx_row, start, end, n_keys, kv_row_stride, scale_log2, m_i, l_i, acc,
                DV, DPE, BLOCK_N, KV_FP8, INTERPRET,
            )  # fmt: skip

    has_key = l_i > 0.0
    l_safe = tl.where(has_key, l_i, 1.0)
    o = tl.where(has_key[:, None], acc / l_safe[:, None], 0.0)
    # Natural-log lse: (running max + log2 of the sum) in base 2, times ln 2.
    row_lse = tl.where(has_key, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("inf"))
    o_ptrs = out + row * out_row_stride + heads.to(tl.int64)[:, None] * out_head_stride + dv[None, :]
    tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=head_ok[:, None])
    tl.store(lse + row * lse_row_stride + heads, row_lse, mask=head_ok)


def _is_pow2_at_least_16(x: int) -> bool:
    return x >= 16 and not x & (x - 1)


def supports(q: torch.Tensor, head_dim: int, d_v: int) -> str | None:
    """``None`` if the kernel takes these shapes/dtypes, else the reason it does not."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"{q.dtype} operands (the kernel takes bf16/fp16)"
    if not _is_pow2_at_least_16(d_v) or not _is_pow2_at_least_16(head_dim - d_v):
        return f"D={head_dim}, d_v={d_v} (the kernel needs d_v and D - d_v powers of two >= 16)"
    if d_v > 512:
        return f"d_v={d_v} > 512 (the accumulator would not fit one program)"
    return None


def _head_block(num_heads: int) -> int:
    return HEAD_BLOCK if num_heads >= HEAD_BLOCK else max(16, triton.next_power_of_2(num_heads))


def _default_tile(kv_fp8: bool) -> tuple[int, int, int, int]:
    """(head block, BLOCK_N, warps, stages) used on CUDA unless a config overrides it."""
    if kv_fp8:
        return HEAD_BLOCK, FP8_BLOCK_N, FP8_NUM_WARPS, FP8_NUM_STAGES
    return HEAD_BLOCK, BLOCK_N, NUM_WARPS, NUM_STAGES


def _rows_last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _launch(q, keys, rec16, rec32, idx, sm_scale: float, d_v: int, dpe: int, kv_fp8: bool, n_keys: int,
            kv_row_stride: int, config: dict | None):  # fmt: skip
    m, h, _ = q.shape
    out = torch.empty((m, h, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((m, h), dtype=torch.float32, device=q.device)
    if m == 0 or h == 0:
        return out, lse
    interp = interpreting()
    hb, block_n, warps, stages = _default_tile(kv_fp8)
    cfg = {"head_block": min(hb, _head_block(h)), "block_n": block_n, "num_warps": warps, "num_stages": stages}
    if interp:
        cfg.update(block_n=32, num_warps=4, num_stages=1)
    if config:
        cfg.update(config)
    hb = cfg["head_block"]
    head_blocks = triton.cdiv(h, hb)
    topk = idx.shape[1]
    compiled = _sparse_mla_kernel[(m * head_blocks,)](
        q, keys, rec16, rec32, idx, out, lse,
        n_keys, topk, h, head_blocks, float(sm_scale) * _LOG2E,
        q.stride(0), q.stride(1), kv_row_stride, idx.stride(0) if m > 1 else topk, out.stride(0), out.stride(1),
        lse.stride(0),
        hb, d_v, dpe, cfg["block_n"], SCAN, kv_fp8, interp,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if not interp:
        COMPILED[(kv_fp8, hb, cfg["block_n"], cfg["num_warps"], cfg["num_stages"])] = compiled
    return out, lse


def sparse_mla(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sm_scale: float, d_v: int,
               config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Provider of ``cpgraph::sparse_mla`` (``config`` overrides the tile, for the benchmark)."""
    head_dim = kv.shape[1]
    reason = supports(q, head_dim, d_v)
    if reason is not None:
        from cpgraph.ops.sparse_mla import sparse_mla_reference

        ledger.fell_back("sparse_mla", q.device.type, REFERENCE, reason, instead_of=PROVIDER_NAME)
        return sparse_mla_reference(q, kv, idx, sm_scale, d_v)
    q = _rows_last_contiguous(q)
    kv = _rows_last_contiguous(kv)
    idx = _rows_last_contiguous(idx)
    kv_row_stride = kv.stride(0) if kv.shape[0] > 1 else head_dim
    return _launch(q, kv, kv, kv, idx, sm_scale, d_v, head_dim - d_v, False, kv.shape[0], kv_row_stride, config)


def sparse_mla_fp8(q: torch.Tensor, records: torch.Tensor, idx: torch.Tensor, sm_scale: float, d_v: int,
                   config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Provider of ``cpgraph::sparse_mla_fp8``: keys read from 656-byte FP8 records, dequantised in the kernel."""
    if q.dtype != torch.bfloat16:
        from cpgraph.ops.sparse_mla import sparse_mla_fp8_reference

        ledger.fell_back("sparse_mla_fp8", q.device.type, REFERENCE, f"{q.dtype} queries (the kernel takes bf16)",
                         instead_of=PROVIDER_NAME)
        return sparse_mla_fp8_reference(q, records, idx, sm_scale, d_v)
    q = _rows_last_contiguous(q)
    idx = _rows_last_contiguous(idx)
    rec = records.contiguous()
    return _launch(q, rec, rec.view(torch.int16), rec.view(torch.int32), idx, sm_scale, d_v, 64, True,
                   rec.shape[0], 656, config)  # fmt: skip


def kernel_metadata() -> list[dict]:
    """Registers, spills and shared memory of each compiled tile variant used so far (benchmark report)."""
    rows = []
    for (kv_fp8, hb, block_n, warps, stages), k in COMPILED.items():
        meta = getattr(k, "metadata", None)
        rows.append({
            "kv_fp8": kv_fp8, "head_block": hb, "block_n": block_n, "num_warps": warps, "num_stages": stages,
            "n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
            "shared_bytes": getattr(meta, "shared", None),
        })  # fmt: skip
    return rows


__all__ = ["sparse_mla", "sparse_mla_fp8", "supports", "kernel_metadata"]
