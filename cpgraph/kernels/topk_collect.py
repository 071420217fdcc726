"""Stage 4 of the top-k selection: write the winners, in position order, from the list or the window.

Why a module: once ``T`` and the number of its ties to take are known, the collection is a
self-contained compaction -- every key above ``T`` and the first ties of ``T`` by position, placed
by packed prefix sums, stopping once ``topk`` keys are out -- that needs only the list's layout and
the encodings of :mod:`.topk_bits`.  The output is in position order by construction (no sort).
The design: :mod:`.topk_select_kernel`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .topk_bits import _byte, _list_load, _rank_bits, _scan4


@triton.jit
def _collect_step(srow, crow, prow, orow, kv_slots, i0, hi, threshold, need, taken, ties, topk,
                  FROM_LIST: tl.constexpr, PAGED: tl.constexpr, BLOCK: tl.constexpr):
    """Write one block's winners (above ``threshold``, or equal and among the first ``need`` ties) in position order.

    A block is window keys ``[i0, i0 + BLOCK)`` or, ``FROM_LIST``, list entries (position order
    too).  The selected ties of a block are a prefix of its ties, so the winners before a key
    number ``above_before + min(ties_before, room)`` with ``room = need - ties``: one packed scan
    of both flags (a block holds fewer than 2^15 keys).
    """
    idx = i0 + tl.arange(0, BLOCK)
    valid = idx < hi
    if FROM_LIST:
        u = _list_load(crow, idx, hi, 0)
        pos = tl.load(prow + idx, mask=valid, other=0)
    else:
        u = _rank_bits(tl.load(srow + idx, mask=valid, other=0.0))
        pos = idx
    return _collect_entries(u, pos, valid, orow, kv_slots, threshold, need, taken, ties, topk, PAGED)


@triton.jit
def _collect_entries(u, pos, valid, orow, kv_slots, threshold, need, taken, ties, topk, PAGED: tl.constexpr):
    """:func:`_collect_step` on keys already loaded (rank bits ``u`` at positions ``pos``)."""
    above = (valid & (u > threshold)).to(tl.int32)
    eq = (valid & (u == threshold)).to(tl.int32)
    both = above | (eq << 16)
    run = tl.cumsum(both, axis=0) - both  # exclusive
    total = tl.sum(both, axis=0)
    return _collect_write(above, eq, run & 0xFFFF, run >> 16, total & 0xFFFF, total >> 16, pos, orow, kv_slots, need,
                          taken, ties, topk, PAGED)


@triton.jit
def _collect_write(above, eq, above_before, eq_before, n_above, n_eq, pos, orow, kv_slots, need, taken, ties, topk,
                   PAGED: tl.constexpr):
    """Write a step's winners given each key's flags and the flags before it in the step; the new ``taken, ties``.

    ``n_above``/``n_eq``: the step's totals.  The selected ties of a step are a prefix of its ties.
    """
    room = tl.maximum(need - ties, 0)
    sel = (above != 0) | ((eq != 0) & (eq_before < room))
    slot = taken + above_before + tl.minimum(eq_before, room)
    keep = sel & (slot < topk)
    if PAGED:
        val = tl.load(kv_slots + pos, mask=keep, other=-1).to(tl.int32)
    else:
        val = pos
    tl.store(orow + slot, val, mask=keep)
    return taken + n_above + tl.minimum(n_eq, room), ties + n_eq


@triton.jit
def _collect_round(u0, u1, u2, u3, p0, p1, p2, p3, i, total, orow, kv_slots, threshold, need, taken, ties, topk,
                   PAGED: tl.constexpr, STEP: tl.constexpr):
    """:func:`_collect_entries` over a round of four one-entry-a-thread steps (list entries ``i + b STEP``).

    Two packed scans a round (one of the flags above ``threshold``, one of its ties) instead of four.
    """
    v0 = i < total
    v1 = i + STEP < total
    v2 = i + 2 * STEP < total
    v3 = i + 3 * STEP < total
    a0 = (v0 & (u0 > threshold)).to(tl.int32)
    a1 = (v1 & (u1 > threshold)).to(tl.int32)
    a2 = (v2 & (u2 > threshold)).to(tl.int32)
    a3 = (v3 & (u3 > threshold)).to(tl.int32)
    e0 = (v0 & (u0 == threshold)).to(tl.int32)
    e1 = (v1 & (u1 == threshold)).to(tl.int32)
    e2 = (v2 & (u2 == threshold)).to(tl.int32)
    e3 = (v3 & (u3 == threshold)).to(tl.int32)
    ra, ta = _scan4(a0, a1, a2, a3)
    re, te = _scan4(e0, e1, e2, e3)
    taken, ties = _collect_write(a0, e0, _byte(ra, 0), _byte(re, 0), _byte(ta, 0), _byte(te, 0), p0, orow, kv_slots,
                                 need, taken, ties, topk, PAGED)
    taken, ties = _collect_write(a1, e1, _byte(ra, 1), _byte(re, 1), _byte(ta, 1), _byte(te, 1), p1, orow, kv_slots,
                                 need, taken, ties, topk, PAGED)
    taken, ties = _collect_write(a2, e2, _byte(ra, 2), _byte(re, 2), _byte(ta, 2), _byte(te, 2), p2, orow, kv_slots,
                                 need, taken, ties, topk, PAGED)
    return _collect_write(a3, e3, _byte(ra, 3), _byte(re, 3), _byte(ta, 3), _byte(te, 3), p3, orow, kv_slots, need,
                          taken, ties, topk, PAGED)


@triton.jit
def _collect_list(crow, prow, orow, kv_slots, total, threshold, need, topk, PAGED: tl.constexpr,
                  STEP: tl.constexpr):
    """The collection over the list's ``total`` entries in one-entry-a-thread steps (``LIST_STEP``).

    :func:`_collect_step` from the list with ``STEP`` = 32 x warps, as :func:`_float_pass`: the loads,
    the scans and the scattered stores share one layout.  Four steps a round, their eight loads issued
    together at its top; it stops after the round in which ``topk`` keys are out (that round's later
    steps write nothing: their slots are past ``topk``).
    """
    ar = tl.arange(0, STEP)
    taken = tl.full((), 0, tl.int32)
    ties = tl.full((), 0, tl.int32)
    i0 = 0
    while (i0 < total) & (taken < topk):
        i = i0 + ar
        u0 = _list_load(crow, i, total, 0)
        u1 = _list_load(crow, i, total, STEP)
        u2 = _list_load(crow, i, total, 2 * STEP)
        u3 = _list_load(crow, i, total, 3 * STEP)
        p0 = tl.load(prow + i, mask=i < total, other=0)
        p1 = tl.load(prow + i + STEP, mask=i + STEP < total, other=0)
        p2 = tl.load(prow + i + 2 * STEP, mask=i + 2 * STEP < total, other=0)
        p3 = tl.load(prow + i + 3 * STEP, mask=i + 3 * STEP < total, other=0)
        taken, ties = _collect_round(u0, u1, u2, u3, p0, p1, p2, p3, i, total, orow, kv_slots, threshold, need, taken,
                                     ties, topk, PAGED, STEP)
        i0 += 4 * STEP
