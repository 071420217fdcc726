"""Triton lightning indexer: tensor-core scoring and a tie-rule top-k on the GPU.

Two kernels, used by the providers of ``indexer_topk``, ``indexer_logits``,
``indexer_logits_fp8``, ``topk_ragged`` and ``topk_paged``:

* **scoring** computes ``sum_h w[s,h] * relu(q[s,h] . k[t])`` for a block
  of ``ROWS`` query rows against a tile of ``BN`` keys with ONE ``tl.dot``:
  by default the keys are the A operand (the MMA's M axis) and the block's
  ``ROWS x HP`` head vectors the B operand (``q`` is ``[M, H, D]``
  contiguous, so a row block is contiguous too), so each thread holds whole
  runs of one row's heads and the ReLU / head-weight / head-sum epilogue
  stays in registers (``KEYS_M``; heads on M needed cross-warp reductions).
  ``[M, H, N]`` never exists; what is written is the fp32 ``[rows, N]``
  score of a bounded chunk of rows (the op's byte budget).  bf16/fp16
  inputs multiply on tensor cores with fp32 accumulation; FP8 e4m3 operands
  go to the e4m3 MMA as they are, and the key's (positive) scale multiplies
  the head sum once per (row, key); fp32 inputs use IEEE fp32 dots (exact,
  slow: an oracle path).  A program walks only the key tiles that meet its
  rows' windows; when a chunk has few row blocks the key range is also
  split over programs (each writes disjoint score columns, so nothing is
  reduced across them).
* **selection** (one program per row) under the tie rule of
  :func:`cpgraph.ops.indexer.tie_rank_keys`: scores are mapped to
  order-preserving 32-bit keys (``-0.0`` -> ``0.0``, one NaN above
  ``+inf``).  By default the window is split once, by buckets of distance
  below the row's largest key, into winners, candidates (the k-th key's
  bucket, copied in position order to a scratch row) and losers; 8-bit
  radix passes over the candidates find the exact k-th key value ``T`` and
  how many keys equal to ``T`` are needed; one more pass takes every
  candidate above ``T`` plus the first such ties in position order (lower
  positions win).  Without the split, four radix passes and the collection
  read the whole window.  The ``topk`` winners are then sorted by the same
  int64 ``(score, -position)`` key the reference ranks by, so the output
  order is identical too.  Windows of at most ``topk`` keys skip the select
  and are only sorted.

Why per-row selection: a row's result must depend only on its own scores
(tested by re-running rows in other batch compositions), and the window
bounds live on the device, so no shape ever depends on data.  Nothing reads
device memory on the host, every grid depends on static sizes, and all
loads and stores are masked (``ks``/``ke`` are clamped into ``[0, N]``), so
the providers are CUDA-graph capturable.  See docs/ops/indexer.md.
"""

from __future__ import annotations

import functools
import json
import logging
import os

import torch
import triton
import triton.language as tl

from .move import interpreting

# Launch tuning (H200, 64 heads x 128): scoring tile = MMA_ROWS rows of query-row heads x KEY_TILE
# keys; selection steps of SELECT_BLOCK window elements.  CPGRAPH_INDEXER_TUNING=file.json overrides
# any of these per machine (see set_tuning); the values never change results, only speed (FP8_ACC_GROUP
# changes FP8 rounding only).
_TUNE = {
    # bf16/fp16 scoring: MMA_ROWS query-row heads x KEY_TILE keys per dot.
    "MMA_ROWS": 128,
    "KEY_TILE": 64,
    "SCORE_WARPS": 4,
    "SCORE_STAGES": 3,
    # Keys on the MMA's M axis and query-row heads on N: the head sum then stays within a thread's
    # registers (plus one quad shuffle) instead of crossing warps through shared memory.
    "KEYS_M": True,
    "SELECT_BLOCK": 4096,
    "SELECT_WARPS": 8,
    # Split the window once into winners / candidates / losers so later passes read only the candidates.
    "SELECT_COMPACT": True,
    # With SELECT_COMPACT: split after this many 8-bit passes (1 or 2), or 0: after one pass bucketed by
    # distance below the row's largest score (2^SELECT_ANCHOR_SHIFT rank steps per bucket, 1/32 of a
    # binade at 18).  The top digit of a row's rank bits is sign + 7 exponent bits, which most scores of
    # a row share; 16 bits, or a bucket near the k-th key, hold a small fraction of the window, so the
    # remaining passes and the collection read little.
    "SELECT_SPLIT_AT": 0,
    "SELECT_ANCHOR_SHIFT": 18,
    # FP8 dots: products accumulated in fp32 every FP8_ACC_GROUP of the head dim (32: every Hopper
    # e4m3 MMA group promoted, as in the DeepGEMM GEMMs; 0: the whole head dim in the MMA accumulator,
    # as DeepGEMM's mqa-logits kernel does for D = 128).
    "FP8_ACC_GROUP": 0,
    # The FP8 scoring tile, tuned apart from the bf16 one (half the operand bytes, twice the MMA rate:
    # the ReLU / weight / head-sum epilogue weighs twice as much against the dot).
    "FP8_MMA_ROWS": 128,
    "FP8_KEY_TILE": 64,
    "FP8_SCORE_WARPS": 4,
    "FP8_SCORE_STAGES": 3,
    "FP8_KEYS_M": True,
    # Register caps (0: the compiler's choice).  Two 8-warp programs per SM need <= 128 registers a
    # thread; the second program's MMA then overlaps the first one's epilogue (or selection latency).
    "SCORE_MAXNREG": 0,
    "FP8_SCORE_MAXNREG": 0,
    "SELECT_MAXNREG": 128,
}
log = logging.getLogger("cpgraph.kernels")


def tuning() -> dict:
    """The launch parameters in use."""
    return dict(_TUNE)


def set_tuning(**values) -> None:
    """Override launch parameters (names of :func:`tuning`); a wrong name or type raises ``ValueError``."""
    for name, value in values.items():
        if name not in _TUNE:
            raise ValueError(f"cpgraph.kernels.indexer: unknown tuning parameter {name!r}; known: {sorted(_TUNE)}")
        if type(value) is not type(_TUNE[name]):
            raise ValueError(f"cpgraph.kernels.indexer: tuning parameter {name!r} must be "
                             f"{type(_TUNE[name]).__name__}, got {value!r}")
    if values.get("SELECT_SPLIT_AT", 1) not in (0, 1, 2):
        raise ValueError(f"cpgraph.kernels.indexer: SELECT_SPLIT_AT must be 0, 1 or 2, got {values['SELECT_SPLIT_AT']!r}")
    if not 0 <= values.get("SELECT_ANCHOR_SHIFT", 0) <= 31:
        raise ValueError(f"cpgraph.kernels.indexer: SELECT_ANCHOR_SHIFT must be in [0, 31], got "
                         f"{values['SELECT_ANCHOR_SHIFT']!r}")
    if values.get("FP8_ACC_GROUP", 0) not in (0, 32, 64, 128):
        raise ValueError(f"cpgraph.kernels.indexer: FP8_ACC_GROUP must be 0, 32, 64 or 128, got {values['FP8_ACC_GROUP']!r}")
    _TUNE.update(values)


def _tuning_from_env() -> None:
    path = os.environ.get("CPGRAPH_INDEXER_TUNING", "")
    if path:
        with open(path) as f:
            set_tuning(**json.load(f))
        log.info("cpgraph.kernels.indexer: tuning from %s: %s", path, _TUNE)


# Kinds of scoring operands.
KIND_HALF = 0  # bf16 / fp16 tensor-core dot, fp32 accumulation
KIND_F32 = 1  # fp32 IEEE dot
KIND_FP8 = 2  # e4m3 x e4m3 tensor-core dot, per-key scale


# ------------------------------------------------------------------ helpers
@triton.jit
def _rank_bits(x):
    """fp32 -> uint32 whose unsigned order is the tie rule's score order.

    ``-0.0`` becomes ``0.0`` and every NaN the positive quiet NaN (above
    ``+inf``); then the sign bit is set for positives and all bits are
    flipped for negatives.
    """
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.uint32, bitcast=True)
    b = tl.where(x != x, tl.full(b.shape, 0x7FC00000, tl.uint32), b)
    neg = (b >> 31) != 0
    return tl.where(neg, b ^ 0xFFFFFFFF, b | 0x80000000)


@triton.jit
def _sort_key(u, pos):
    """int64 key ``signed(u) * 2^32 + (2^32 - 1 - pos)``: exactly the reference's ``tie_rank_keys``."""
    o = (u ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64)
    return (o << 32) | (0xFFFFFFFF - pos.to(tl.int64))


@triton.jit
def _window(ks, ke, row, n_keys):
    """Row ``row``'s window clamped into ``[0, n_keys]`` (bad ids can never address memory)."""
    lo = tl.load(ks + row).to(tl.int32)
    hi = tl.load(ke + row).to(tl.int32)
    lo = tl.minimum(tl.maximum(lo, 0), n_keys)
    hi = tl.minimum(tl.maximum(hi, lo), n_keys)
    return lo, hi


# ------------------------------------------------------------------ scoring
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


# ---------------------------------------------------------------- selection
@triton.jit
def _keys_at(srow, crow, i0, end, FROM_CAND: tl.constexpr, BLOCK: tl.constexpr):
    """One block of keys: (positions, rank bits, valid) of window slots ``[i0, i0 + BLOCK)``.

    Either the window itself (``i`` is the position, ``end`` = ``hi``) or the
    compacted candidate list ``crow`` (positions in increasing order,
    ``end`` = candidate count), whose scores are gathered.
    """
    i = i0 + tl.arange(0, BLOCK)
    valid = i < end
    if FROM_CAND:
        pos = tl.load(crow + i, mask=valid, other=0)
    else:
        pos = i
    u = _rank_bits(tl.load(srow + pos, mask=valid, other=0.0))
    return pos, u, valid


@triton.jit
def _histogram_step(srow, crow, i0, end, prefix, known, SHIFT: tl.constexpr, FROM_CAND: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Histogram of 8-bit digit ``SHIFT`` over one block's keys that match ``prefix`` on ``known`` bits."""
    _, u, valid = _keys_at(srow, crow, i0, end, FROM_CAND, BLOCK)
    match = valid & ((u & known) == prefix)
    return tl.histogram(((u >> SHIFT) & 0xFF).to(tl.int32), 256, mask=match)


@triton.jit
def _window_histogram(srow, crow, lo, hi, prefix, known, SHIFT: tl.constexpr, FROM_CAND: tl.constexpr,
                      LOOP_WHILE: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram of digit ``SHIFT`` over keys ``[lo, hi)`` (one radix pass), in either loop form."""
    hist = tl.zeros((256,), tl.int32)
    if LOOP_WHILE:
        i0 = lo
        while i0 < hi:
            hist += _histogram_step(srow, crow, i0, hi, prefix, known, SHIFT, FROM_CAND, BLOCK)
            i0 += BLOCK
    else:
        for i0 in range(lo, hi, BLOCK):
            hist += _histogram_step(srow, crow, i0, hi, prefix, known, SHIFT, FROM_CAND, BLOCK)
    return hist


@triton.jit
def _split_step(srow, orow, crow, i0, hi, prefix, taken, count, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """Keys whose bits above ``SHIFT`` exceed ``prefix``'s are winners (to ``orow``); equal ones are candidates.

    One scan serves both lists: the two flags are packed into the low and
    high 16 bits of an int32 (a block holds fewer than 2^15 keys).
    """
    pos, u, valid = _keys_at(srow, crow, i0, hi, False, BLOCK)
    top = u >> SHIFT
    bucket = prefix >> SHIFT
    above = (valid & (top > bucket)).to(tl.int32)
    inbin = (valid & (top == bucket)).to(tl.int32)
    both = above | (inbin << 16)
    run = tl.cumsum(both, axis=0) - both  # exclusive
    tl.store(orow + taken + (run & 0xFFFF), pos, mask=above != 0)
    tl.store(crow + count + (run >> 16), pos, mask=inbin != 0)
    total = tl.sum(both, axis=0)
    return taken + (total & 0xFFFF), count + (total >> 16)


@triton.jit
def _collect_step(srow, orow, crow, i0, end, threshold, need, taken, ties, topk, FROM_CAND: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Write one block's winners (above ``threshold``, or equal and among the first ``need`` ties) to ``orow``.

    The selected ties of a block are a prefix of its ties (position order),
    so the winners before a key number ``above_before + min(ties_before, room)``
    with ``room = need - ties``: one packed scan of both flags.
    """
    pos, u, valid = _keys_at(srow, crow, i0, end, FROM_CAND, BLOCK)
    above = (valid & (u > threshold)).to(tl.int32)
    eq = (valid & (u == threshold)).to(tl.int32)
    both = above | (eq << 16)
    run = tl.cumsum(both, axis=0) - both  # exclusive
    room = tl.maximum(need - ties, 0)
    eq_before = run >> 16
    sel = (above != 0) | ((eq != 0) & (eq_before < room))
    slot = taken + (run & 0xFFFF) + tl.minimum(eq_before, room)
    tl.store(orow + slot, pos, mask=sel & (slot < topk))
    total = tl.sum(both, axis=0)
    n_eq = total >> 16
    return taken + (total & 0xFFFF) + tl.minimum(n_eq, room), ties + n_eq


@triton.jit
def _pick_digit(hist, need, prefix, known, SHIFT: tl.constexpr):
    """Digit of the ``need``-th largest key in ``hist``; returns (need within that digit, prefix, known)."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    digit = tl.max(tl.where(at_or_above >= need, bins, -1), axis=0)
    need -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
    prefix = prefix | (digit.to(tl.uint32) << SHIFT)
    known = known | tl.full((), 0xFF << SHIFT, tl.uint32)
    return digit, need, prefix, known


@triton.jit
def _anchor_bucket(u, umax, SHIFT: tl.constexpr):
    """Bucket of rank bits ``u`` by distance below the row's largest ``umax`` (0 = nearest; 255 = far or beyond)."""
    return tl.minimum((umax - u) >> SHIFT, 255).to(tl.int32)


@triton.jit
def _anchor_split_step(srow, orow, crow, i0, hi, umax, bucket, taken, count, SHIFT: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Keys in nearer buckets than ``bucket`` are winners (to ``orow``); keys in it are candidates (to ``crow``)."""
    pos, u, valid = _keys_at(srow, crow, i0, hi, False, BLOCK)
    b = _anchor_bucket(u, umax, SHIFT)
    above = (valid & (b < bucket)).to(tl.int32)
    inbin = (valid & (b == bucket)).to(tl.int32)
    both = above | (inbin << 16)
    run = tl.cumsum(both, axis=0) - both  # exclusive
    tl.store(orow + taken + (run & 0xFFFF), pos, mask=above != 0)
    tl.store(crow + count + (run >> 16), pos, mask=inbin != 0)
    total = tl.sum(both, axis=0)
    return taken + (total & 0xFFFF), count + (total >> 16)


@triton.jit
def _select_kernel(
    scores, ks, ke, kv_slots, out, cand,
    row0, n_keys, score_stride, cand_stride, topk,
    KP: tl.constexpr, BLOCK: tl.constexpr, PAGED: tl.constexpr, COMPACT: tl.constexpr, SORT: tl.constexpr,
    LOOP_WHILE: tl.constexpr, SPLIT_AT: tl.constexpr, ANCHOR_SHIFT: tl.constexpr,
):  # fmt: skip
    """Row ``row0 + program`` of ``out`` <- its top-k under the tie rule (scores row = program).

    Radix select on the 32-bit rank bits, 8 bits per pass.  With ``COMPACT``
    the window is split once into winners (written at once), candidates
    (positions, in order, copied to ``cand``) and losers, and the remaining
    passes read only the candidates:

    * ``SPLIT_AT`` 1 or 2: after that many radix passes over the window,
      candidates share the k-th key's leading 8 or 16 bits;
    * ``SPLIT_AT`` 0 (anchored): one cheap pass finds the row's largest
      rank bits ``umax``, one histogram pass counts keys by
      ``(umax - u) >> ANCHOR_SHIFT`` (255 = everything farther), and the
      candidates are the bucket holding the k-th key.  Buckets are ranges
      of the order, so the split is exact for any data; only its size
      depends on the scores (a k-th key far below the maximum makes the
      last bucket, possibly the whole window, the candidates: slower,
      still exact).

    ``SORT=False`` leaves the winners in collection order (benchmarks time
    the sort with it; the ops always sort).
    """
    local = tl.program_id(0)
    row = row0 + local
    lo, hi = _window(ks, ke, row, n_keys)
    n = hi - lo
    srow = scores + local.to(tl.int64) * score_stride
    crow = cand + local.to(tl.int64) * cand_stride
    orow = out + row.to(tl.int64) * topk
    j = tl.arange(0, KP)
    if n <= topk:
        winners = tl.where(j < n, lo + j, -1)
    else:
        prefix = tl.full((), 0, tl.uint32)
        known = tl.full((), 0, tl.uint32)
        need = topk  # keys still to take among those matching the prefix
        taken = tl.full((), 0, tl.int32)
        start = lo
        end = hi
        if COMPACT and SPLIT_AT == 0:
            umax = tl.full((), 0, tl.uint32)
            if LOOP_WHILE:
                i0 = lo
                while i0 < hi:
                    _, u, valid = _keys_at(srow, crow, i0, hi, False, BLOCK)
                    umax = tl.maximum(umax, tl.max(tl.where(valid, u, 0), axis=0))
                    i0 += BLOCK
            else:
                for i0 in range(lo, hi, BLOCK):
                    _, u, valid = _keys_at(srow, crow, i0, hi, False, BLOCK)
                    umax = tl.maximum(umax, tl.max(tl.where(valid, u, 0), axis=0))
            hist = tl.zeros((256,), tl.int32)
            if LOOP_WHILE:
                i0 = lo
                while i0 < hi:
                    _, u, valid = _keys_at(srow, crow, i0, hi, False, BLOCK)
                    hist += tl.histogram(_anchor_bucket(u, umax, ANCHOR_SHIFT), 256, mask=valid)
                    i0 += BLOCK
            else:
                for i0 in range(lo, hi, BLOCK):
                    _, u, valid = _keys_at(srow, crow, i0, hi, False, BLOCK)
                    hist += tl.histogram(_anchor_bucket(u, umax, ANCHOR_SHIFT), 256, mask=valid)
            bins = tl.arange(0, 256)
            bucket = tl.min(tl.where(tl.cumsum(hist, axis=0) >= need, bins, 255), axis=0)
            need -= tl.sum(tl.where(bins < bucket, hist, 0), axis=0)
            count = tl.full((), 0, tl.int32)
            if LOOP_WHILE:
                i0 = lo
                while i0 < hi:
                    taken, count = _anchor_split_step(srow, orow, crow, i0, hi, umax, bucket, taken, count,
                                                      ANCHOR_SHIFT, BLOCK)
                    i0 += BLOCK
            else:
                for i0 in range(lo, hi, BLOCK):
                    taken, count = _anchor_split_step(srow, orow, crow, i0, hi, umax, bucket, taken, count,
                                                      ANCHOR_SHIFT, BLOCK)
            tl.debug_barrier()  # candidates written by other threads of this program
            start = 0
            end = count
        else:
            hist = _window_histogram(srow, crow, lo, hi, prefix, known, 24, False, LOOP_WHILE, BLOCK)
            digit, need, prefix, known = _pick_digit(hist, need, prefix, known, 24)
            if COMPACT:
                if SPLIT_AT == 2:  # the second digit over the whole window too, then split on 16 bits
                    hist = _window_histogram(srow, crow, lo, hi, prefix, known, 16, False, LOOP_WHILE, BLOCK)
                    digit, need, prefix, known = _pick_digit(hist, need, prefix, known, 16)
                count = tl.full((), 0, tl.int32)
                if LOOP_WHILE:
                    i0 = lo
                    while i0 < hi:
                        taken, count = _split_step(srow, orow, crow, i0, hi, prefix, taken, count, 32 - 8 * SPLIT_AT,
                                                   BLOCK)
                        i0 += BLOCK
                else:
                    for i0 in range(lo, hi, BLOCK):
                        taken, count = _split_step(srow, orow, crow, i0, hi, prefix, taken, count, 32 - 8 * SPLIT_AT,
                                                   BLOCK)
                tl.debug_barrier()  # candidates written by other threads of this program
                start = 0
                end = count
        # Radix passes still to do (over the candidates when split): digit shifts 24 - 8 p.
        for p in tl.static_range(SPLIT_AT if COMPACT else 1, 4):
            hist = _window_histogram(srow, crow, start, end, prefix, known, 24 - 8 * p, COMPACT, LOOP_WHILE, BLOCK)
            digit, need, prefix, known = _pick_digit(hist, need, prefix, known, 24 - 8 * p)
        # Collect: every key above T, then the first `need` keys equal to T in position order.
        ties = tl.full((), 0, tl.int32)
        if LOOP_WHILE:
            i0 = start
            while i0 < end:
                taken, ties = _collect_step(srow, orow, crow, i0, end, prefix, need, taken, ties, topk, COMPACT, BLOCK)
                i0 += BLOCK
        else:
            for i0 in range(start, end, BLOCK):
                taken, ties = _collect_step(srow, orow, crow, i0, end, prefix, need, taken, ties, topk, COMPACT, BLOCK)
        tl.debug_barrier()  # the winners were written by other threads of this program
        winners = tl.load(orow + j, mask=j < topk, other=-1)
    # Order the winners best first with the reference's int64 key.
    have = winners >= 0
    pos = tl.where(have, winners, lo)
    u = _rank_bits(tl.load(srow + pos, mask=have, other=0.0))
    key = tl.where(have, _sort_key(u, pos), tl.full((KP,), -9223372036854775808, tl.int64))
    if SORT:
        key = tl.sort(key, descending=True)
    picked = (0xFFFFFFFF - (key & 0xFFFFFFFF)).to(tl.int32)
    live = key != -9223372036854775808
    if PAGED:
        picked = tl.load(kv_slots + tl.where(live, picked, 0).to(tl.int64), mask=live, other=-1).to(tl.int32)
    tl.debug_barrier()  # every thread has read the scratch winners before they are overwritten
    tl.store(orow + j, tl.where(live, picked, -1), mask=j < topk)


def select_rows(scores, ks, ke, out, row0: int, m_rows: int, topk: int, kv_slots=None, *, scratch=None,
                block=None, num_warps=None, compact=None, sort=True, split_at=None, anchor_shift=None,
                maxnreg=None) -> None:
    """Top-k of rows ``[row0, row0 + m_rows)`` (scores in ``scores[0:m_rows]``) into ``out`` (int32 ``[M, topk]``).

    RAGGED ids, or PAGED slots ``kv_slots[t]`` when ``kv_slots`` is given.
    ``scratch`` (int32, at least ``[m_rows, N]``) holds the compacted
    candidates; allocated here when not given.  The keyword arguments after
    it are tuning knobs for benchmarks.
    """
    if m_rows <= 0:
        return
    N = scores.shape[1]
    compact = _TUNE["SELECT_COMPACT"] if compact is None else compact
    if compact and scratch is None:
        scratch = torch.empty((m_rows, max(N, 1)), dtype=torch.int32, device=scores.device)
    if not compact:
        scratch = out  # never read or written
    kp = _pow2(topk, 16)
    block = block or ((1 << 14) if interpreting() else _TUNE["SELECT_BLOCK"])
    if block > (1 << 15) or block & (block - 1):
        raise ValueError(f"cpgraph.kernels.indexer: select block must be a power of two <= 32768 (packed 16-bit "
                         f"counts), got {block}")
    paged = kv_slots is not None
    ks, ke = ks.contiguous(), ke.contiguous()
    _select_kernel[(m_rows,)](
        scores, ks, ke, kv_slots if paged else ks, out, scratch, row0, N, scores.stride(0), scratch.stride(0), topk,
        KP=kp, BLOCK=block, PAGED=paged, COMPACT=compact, SORT=sort, LOOP_WHILE=interpreting(),
        SPLIT_AT=_TUNE["SELECT_SPLIT_AT"] if split_at is None else split_at,
        ANCHOR_SHIFT=_TUNE["SELECT_ANCHOR_SHIFT"] if anchor_shift is None else anchor_shift,
        num_warps=num_warps or (4 if interpreting() else _TUNE["SELECT_WARPS"]),
        **_maxnreg(_TUNE["SELECT_MAXNREG"] if maxnreg is None else maxnreg),
    )  # fmt: skip


# ---------------------------------------------------------------- providers
def _chunk_rows(n_keys: int, max_logits_bytes: int) -> int:
    from cpgraph.ops.indexer import logits_chunk_rows

    return logits_chunk_rows(n_keys, max_logits_bytes)


def indexer_topk(q, k, weights, ks, ke, topk, max_logits_bytes, k_scale=None):
    """Provider of ``cpgraph::indexer_topk``: score a chunk of rows, select its top-k, next chunk.

    With ``k_scale`` the operands are e4m3 bytes (the FP8 form): the same
    chunking, so the FP8 path holds one fp32 ``[rows, N]`` chunk too.
    """
    M, N = q.shape[0], k.shape[0]
    out = torch.empty((M, topk), dtype=torch.int32, device=q.device)
    if M == 0:
        return out
    if k_scale is not None:
        f8 = torch.float8_e4m3fn
        q, k, k_scale = q.view(f8), k.view(f8), k_scale.contiguous()
    rows = min(M, _chunk_rows(N, max_logits_bytes))
    buf = torch.empty((rows, max(N, 1)), dtype=torch.float32, device=q.device)
    scratch = torch.empty((rows, max(N, 1)), dtype=torch.int32, device=q.device) if _TUNE["SELECT_COMPACT"] else None
    for a in range(0, M, rows):
        m = min(rows, M - a)
        score_rows(q, k, weights, ks, ke, buf, a, m, k_scale=k_scale)
        select_rows(buf, ks, ke, out, a, m, topk, scratch=scratch)
    return out


def indexer_logits(q, k, weights, ks, ke):
    """Provider of ``cpgraph::indexer_logits``: fp32 ``[M, N]``, ``-inf`` outside the windows."""
    M, N = q.shape[0], k.shape[0]
    out = torch.full((M, N), float("-inf"), dtype=torch.float32, device=q.device)
    if N:
        score_rows(q, k, weights, ks, ke, out, 0, M)
    return out


def indexer_logits_fp8(q_bytes, k_bytes, k_scale, weights, ks, ke):
    """Provider of ``cpgraph::indexer_logits_fp8`` (e4m3 tensor-core dots, the key scale before the ReLU)."""
    M, N = q_bytes.shape[0], k_bytes.shape[0]
    out = torch.full((M, N), float("-inf"), dtype=torch.float32, device=q_bytes.device)
    if N:
        f8 = torch.float8_e4m3fn
        score_rows(q_bytes.view(f8), k_bytes.view(f8), weights, ks, ke, out, 0, M, k_scale=k_scale.contiguous())
    return out


_SCRATCH_BYTES = 64 << 20  # candidate scratch of the unfused top-k ops: rows are selected in chunks of this


def _select_all(logits, ks, ke, topk, kv_slots):
    """Select every row of full ``[M, N]`` logits, a bounded chunk of rows (and scratch) at a time."""
    M, N = logits.shape
    out = torch.empty((M, topk), dtype=torch.int32, device=logits.device)
    if M == 0:
        return out
    logits = _unit_columns(logits)
    rows = min(M, max(1, _SCRATCH_BYTES // (4 * max(N, 1))))
    scratch = torch.empty((rows, max(N, 1)), dtype=torch.int32, device=logits.device) if _TUNE["SELECT_COMPACT"] else None
    for a in range(0, M, rows):
        m = min(rows, M - a)
        select_rows(logits[a:], ks, ke, out, a, m, topk, kv_slots, scratch=scratch)
    return out


def topk_ragged(logits, ks, ke, topk):
    """Provider of ``cpgraph::topk_ragged``."""
    return _select_all(logits, ks, ke, topk, None)


def topk_paged(logits, ks, ke, topk, kv_slots):
    """Provider of ``cpgraph::topk_paged``."""
    return _select_all(logits, ks, ke, topk, kv_slots.contiguous())


def _unit_columns(x: torch.Tensor) -> torch.Tensor:
    return x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous()


def providers() -> dict:
    """Op name -> Triton provider for the indexer ops."""
    return {
        "indexer_topk": indexer_topk,
        "indexer_logits": indexer_logits,
        "indexer_logits_fp8": indexer_logits_fp8,
        "topk_ragged": topk_ragged,
        "topk_paged": topk_paged,
    }


_tuning_from_env()

__all__ = ["tuning", "set_tuning", "indexer_topk", "indexer_logits", "indexer_logits_fp8", "topk_ragged", "topk_paged", "providers",
           "score_rows", "select_rows"]
