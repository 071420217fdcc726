"""Triton lightning-indexer scoring: ``sum_h w[s,h] * relu(q[s,h] . k[t])`` on the tensor cores.

One kernel computes the scores of a block of ``ROWS`` query rows against a tile of ``BN`` keys
with ONE ``tl.dot``: by default the keys are the A operand (the MMA's M axis) and the block's
``ROWS x HP`` head vectors the B operand (``q`` is ``[M, H, D]`` contiguous, so a row block is
contiguous too), so each thread holds whole runs of one row's heads and the ReLU / head-weight /
head-sum epilogue stays in registers (``KEYS_M``; heads on M needed cross-warp reductions).
``[M, H, N]`` never exists; what is written is the fp32 ``[rows, N]`` score of a bounded chunk of
rows (the op's byte budget).  bf16/fp16 inputs multiply on tensor cores with fp32 accumulation;
FP8 e4m3 operands go to the e4m3 MMA as they are, and the key's (positive) scale multiplies the
head sum once per (row, key); fp32 inputs use IEEE fp32 dots (exact, slow: an oracle path).  A
program walks only the key tiles that meet its rows' windows; when a chunk has few row blocks the
key range is also split over programs (each writes disjoint score columns, so nothing is reduced
across them).  A row's scores depend only on that row (tiles are aligned to ``BN`` whatever the
batch), every grid is static and every access masked: CUDA-graph safe.  See docs/ops/indexer.md.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .indexer_tuning import _TUNE
from .move import interpreting

# Kinds of scoring operands.
KIND_HALF = 0  # bf16 / fp16 tensor-core dot, fp32 accumulation
KIND_F32 = 1  # fp32 IEEE dot
KIND_FP8 = 2  # e4m3 x e4m3 tensor-core dot, per-key scale


@triton.jit
def _score_kernel(
    q, k, w, k_scale, ks, ke, out,
    row0, m_rows, n_keys, out_stride,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    ROWS: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr,
    KIND: tl.constexpr, UPCAST: tl.constexpr, KEYS_M: tl.constexpr, LOOP_WHILE: tl.constexpr,
    FP8_GROUP: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    split = tl.program_id(1)
    first = blk * ROWS  # local row of the block's first row

    # A operand: row i of the tile is head (i % HP) of local row first + i // HP.
    i = tl.arange(0, ROWS * HP)
    r_i = first + i // HP
    h_i = i % HP
    ok_i = (r_i < m_rows) & (h_i < H)
    g_i = (row0 + r_i).to(tl.int64)
    d = tl.arange(0, DP)
    a = tl.load(q + (g_i * H + h_i)[:, None] * D + d[None, :], mask=ok_i[:, None] & (d[None, :] < D), other=0.0)
    wt = tl.load(w + g_i * H + h_i, mask=ok_i, other=0.0)
    if UPCAST:
        a = a.to(tl.float32)

    # The block's rows and windows (empty for rows past the chunk).
    rr = tl.arange(0, ROWS)
    lr = first + rr
    ok_r = lr < m_rows
    gr = (row0 + tl.where(ok_r, lr, 0)).to(tl.int64)
    lo_r = tl.load(ks + gr, mask=ok_r, other=0).to(tl.int32)
    hi_r = tl.load(ke + gr, mask=ok_r, other=0).to(tl.int32)
    lo_r = tl.minimum(tl.maximum(lo_r, 0), n_keys)
    hi_r = tl.where(ok_r, tl.minimum(tl.maximum(hi_r, lo_r), n_keys), lo_r)
    busy = hi_r > lo_r
    lo = tl.min(tl.where(busy, lo_r, n_keys), axis=0)
    hi = tl.max(tl.where(busy, hi_r, 0), axis=0)
    lo = (lo // BN) * BN  # tiles aligned to BN whatever the batch: a key's tile depends on t only
    n_tiles = tl.cdiv(tl.maximum(hi - lo, 0), BN)
    per_split = tl.cdiv(n_tiles, SPLITS)
    t_begin = lo + split * per_split * BN
    t_end = tl.minimum(hi, t_begin + per_split * BN)

    out_rows = out + lr.to(tl.int64) * out_stride
    if LOOP_WHILE:
        t0 = t_begin
        while t0 < t_end:
            _score_tile(a, wt, k, k_scale, out_rows, lo_r, hi_r, t0, n_keys, D, DP, ROWS, HP, BN, KIND, UPCAST, KEYS_M,
                        FP8_GROUP)
            t0 += BN
    else:
        for t0 in range(t_begin, t_end, BN):
            _score_tile(a, wt, k, k_scale, out_rows, lo_r, hi_r, t0, n_keys, D, DP, ROWS, HP, BN, KIND, UPCAST, KEYS_M,
                        FP8_GROUP)


@triton.jit
def _score_tile(
    a, wt, k, k_scale, out_rows, lo_r, hi_r, t0, n_keys,
    D: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr,
    KIND: tl.constexpr, UPCAST: tl.constexpr, KEYS_M: tl.constexpr, FP8_GROUP: tl.constexpr,
):  # fmt: skip
    """One key tile: dot, ReLU, head weights, sum over heads, store the in-window scores.

    FP8: the e4m3 operands go to the tensor cores as they are; the key's
    scale (positive: a ue8m0 power of two) is applied once per (row, key)
    after the head sum, ``sum_h w relu(d s) = s sum_h w relu(d)`` for
    ``s > 0``, instead of once per (head, key) product.
    """
    t = t0 + tl.arange(0, BN)
    d = tl.arange(0, DP)
    ok_t = t < n_keys
    kt = tl.load(k + t.to(tl.int64)[:, None] * D + d[None, :], mask=ok_t[:, None] & (d[None, :] < D), other=0.0)
    if UPCAST:
        kt = kt.to(tl.float32)
    if KEYS_M:  # keys on the M axis, query-row heads on N: the head sum stays inside a thread's registers
        if KIND == 1:
            dots = tl.dot(kt, tl.trans(a), input_precision="ieee")
        elif KIND == 2 and FP8_GROUP > 0:
            dots = tl.dot(kt, tl.trans(a), max_num_imprecise_acc=FP8_GROUP)
        else:
            dots = tl.dot(kt, tl.trans(a))
        part = tl.maximum(dots, 0.0) * wt[None, :]
        if ROWS == 1:
            score = tl.reshape(tl.sum(part, axis=1), (BN, 1))
        else:
            score = tl.sum(tl.reshape(part, (BN, ROWS, HP)), axis=2)
        if KIND == 2:
            score = score * tl.load(k_scale + t, mask=ok_t, other=0.0)[:, None]
        inside = (t[:, None] >= lo_r[None, :]) & (t[:, None] < hi_r[None, :])
        tl.store(out_rows[None, :] + t[:, None], score, mask=inside)
    else:
        if KIND == 1:
            dots = tl.dot(a, tl.trans(kt), input_precision="ieee")
        elif KIND == 2 and FP8_GROUP > 0:
            dots = tl.dot(a, tl.trans(kt), max_num_imprecise_acc=FP8_GROUP)
        else:
            dots = tl.dot(a, tl.trans(kt))
        part = tl.maximum(dots, 0.0) * wt[:, None]
        if ROWS == 1:
            score = tl.reshape(tl.sum(part, axis=0), (1, BN))
        else:
            score = tl.sum(tl.reshape(part, (ROWS, HP, BN)), axis=1)
        if KIND == 2:
            score = score * tl.load(k_scale + t, mask=ok_t, other=0.0)[None, :]
        inside = (t[None, :] >= lo_r[:, None]) & (t[None, :] < hi_r[:, None])
        tl.store(out_rows[:, None] + t[None, :], score, mask=inside)


def _pow2(x: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(max(int(x), 1)))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _operands(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """Contiguous q/k in a dtype the dot takes, their kind, and whether the dot runs in fp32."""
    q, k = q.contiguous(), k.contiguous()
    if q.dtype == torch.float8_e4m3fn:
        return q, k, KIND_FP8, False
    if q.dtype != k.dtype or q.dtype == torch.float32:
        return q.float(), k.float(), KIND_F32, False
    # The interpreter's bf16/fp16 dot is wrong (numpy has no bf16): compute it in fp32 there.
    return q, k, KIND_HALF, interpreting()


def score_rows(q, k, weights, ks, ke, out, row0: int, m_rows: int, k_scale=None, *, rows_per_block=None,
               key_tile=None, splits=None, num_warps=None, num_stages=None, keys_m=None, fp8_group=None,
               maxnreg=None) -> None:
    """Write scores of rows ``[row0, row0 + m_rows)`` into ``out[0:m_rows]`` (in-window columns only).

    ``q`` ``[M, H, D]`` / ``k`` ``[N, D]`` bf16, fp16, fp32 or (with
    ``k_scale``, positive) float8_e4m3fn; ``out`` fp32 with unit column stride.
    Columns outside a row's window are left untouched.  The keyword
    arguments override the tile choice (benchmark sweeps).
    """
    if m_rows <= 0:
        return
    _, H, D = q.shape
    N = k.shape[0]
    q, k, kind, upcast = _operands(q, k)
    HP, DP = _pow2(H), _pow2(D, 32 if kind == KIND_FP8 else 16)  # fp8 dots need K >= 32
    pre = "FP8_" if kind == KIND_FP8 else ""
    if interpreting():
        rows = rows_per_block or max(1, min(_pow2(m_rows), 64 // HP if HP <= 64 else 1))
        bn = key_tile or min(_pow2(N, 16), 64)
    else:
        rows = rows_per_block or max(1, _TUNE[pre + "MMA_ROWS"] // HP)
        bn = key_tile or _TUNE[pre + "KEY_TILE"]
    if rows * HP < 16:  # the dot needs >= 16 rows of A: pad the head axis
        HP = 16 // rows
    blocks = triton.cdiv(m_rows, rows)
    tiles = triton.cdiv(max(N, 1), bn)
    if splits is None:
        splits = 1 if interpreting() else max(1, min(tiles, triton.cdiv(2 * _sm_count(q.device.index or 0), blocks)))
    scale = k_scale if k_scale is not None else weights  # placeholder pointer when unused
    weights, ks, ke = weights.contiguous(), ks.contiguous(), ke.contiguous()
    _score_kernel[(blocks, splits)](
        q, k, weights, scale, ks, ke, out, row0, m_rows, N, out.stride(0),
        H=H, HP=HP, D=D, DP=DP, ROWS=rows, BN=bn, SPLITS=splits, KIND=kind, UPCAST=upcast,
        KEYS_M=_TUNE[pre + "KEYS_M"] if keys_m is None else keys_m, LOOP_WHILE=interpreting(),
        FP8_GROUP=(_TUNE["FP8_ACC_GROUP"] if fp8_group is None else fp8_group),
        num_warps=num_warps or (4 if interpreting() else _TUNE[pre + "SCORE_WARPS"]),
        num_stages=num_stages or (1 if interpreting() else _TUNE[pre + "SCORE_STAGES"]),
        **_maxnreg(_TUNE[pre + "SCORE_MAXNREG"] if maxnreg is None else maxnreg),
    )  # fmt: skip


def _maxnreg(cap: int) -> dict:
    """The ``maxnreg`` launch option when a cap is set (compiled code only: the interpreter has registers to spare)."""
    return {"maxnreg": cap} if cap and not interpreting() else {}

__all__ = ["score_rows"]
