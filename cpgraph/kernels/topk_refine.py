"""Stage 3 of the top-k selection: the 32-bin histogram passes that make the k-th key exact.

Why a module: the refinement reads only the candidates (the list's entries inside the bracket, or
the window filtered to the bracket when there is no list) and returns just two numbers, the k-th
key's rank bits ``T`` and how many keys equal to ``T`` to take; everything it needs to know of the
other stages is the list's layout and the encodings of :mod:`.topk_bits`.  The design:
:mod:`.topk_select_kernel`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .topk_bits import _byte, _list_load, _rank_bits, _scan4


@triton.jit
def _digit_hist(srow, crow, lo, hi, base, count, direct, tlo, thi, prefix, shift, low, dst, BLOCK: tl.constexpr,
                LIST_STEP: tl.constexpr, STEP: tl.constexpr):
    """32-bin histogram of bits ``[low, shift)`` of ``u - tlo`` over candidates whose bits from ``shift`` equal ``prefix``.

    Candidates are the ``count`` entries of ``crow[base:]`` in ``[tlo, thi]`` (the list also holds the
    keys above ``thi``), or with ``direct`` the window's keys in ``[tlo, thi]``.  With ``dst >= 0`` the
    counted entries are also copied, in order, to ``crow[dst:]``: the next passes read only those.
    ``(x >> (shift - 1)) >> 1`` keeps every shift below 32.  ``LIST_STEP``: the list in
    one-entry-a-thread steps of ``STEP`` (:func:`_list_hist`).
    """
    hist = tl.zeros((32,), tl.int32)
    width = shift - low
    mask_bits = (tl.full((), 1, tl.uint32) << width.to(tl.uint32)) - 1
    if direct:
        i0 = lo
        while i0 < hi:
            pos = i0 + tl.arange(0, BLOCK)
            valid = pos < hi
            u = _rank_bits(tl.load(srow + pos, mask=valid, other=0.0))
            rel = u - tlo
            m = valid & (u >= tlo) & (u <= thi) & (((rel >> (shift - 1).to(tl.uint32)) >> 1) == prefix)
            hist += tl.histogram(((rel >> low.to(tl.uint32)) & mask_bits).to(tl.int32), 32, mask=m)
            i0 += BLOCK
    elif LIST_STEP:
        hist = _list_hist(crow + base, count, tlo, thi, prefix, shift, low, mask_bits, crow + dst, dst >= 0, STEP)
    else:
        i0 = 0
        written = tl.full((), 0, tl.int32)
        while i0 < count:
            i = i0 + tl.arange(0, BLOCK)
            valid = i < count
            hist, written = _hist_entries(_list_load(crow + base, i, count, 0), valid, tlo, thi, prefix, shift, low,
                                          mask_bits, crow + dst, dst >= 0, written, hist)
            i0 += BLOCK
    return hist


@triton.jit
def _hist_entries(u, valid, tlo, thi, prefix, shift, low, mask_bits, out, copy, written, hist):
    """:func:`_digit_hist` on list entries already loaded (rank bits ``u``): add their digits to ``hist``.

    With ``copy`` the counted entries are also written, in order, to ``out[written:]``.
    """
    digit, m = _digits(u, valid, tlo, thi, prefix, shift, low, mask_bits)
    hist += tl.histogram(digit, 32, mask=m)
    if copy:
        mi = m.to(tl.int32)
        run = tl.cumsum(mi, axis=0) - mi  # exclusive
        tl.store(out + written + run, u.to(tl.int32, bitcast=True), mask=m)
        written += tl.sum(mi, axis=0)
    return hist, written


@triton.jit
def _digits(u, valid, tlo, thi, prefix, shift, low, mask_bits):
    """The digits (bits ``[low, shift)`` of ``u - tlo``) of list entries ``u`` and which of them count."""
    rel = u - tlo
    m = valid & (u <= thi) & (((rel >> (shift - 1).to(tl.uint32)) >> 1) == prefix)
    return ((rel >> low.to(tl.uint32)) & mask_bits).to(tl.int32), m


@triton.jit
def _list_hist(src, count, tlo, thi, prefix, shift, low, mask_bits, out, copy, STEP: tl.constexpr):
    """:func:`_digit_hist` over list entries ``src[0:count]`` in one-entry-a-thread steps (``LIST_STEP``).

    As :func:`_float_pass`: ``STEP`` is 32 x warps, so the loads, the scan and the scattered copy share
    one layout (no shared-memory moves between them).  Four steps a round, their loads issued together
    at its top (loading a round ahead cost 7 more instructions a round in sm_90 SASS, the collection's
    13); the copy is one packed scan a round (:func:`_scan4`).  One histogram a round, over the four
    steps' digits joined in registers (the join and the reshape move nothing: each thread holds its
    four): Triton's histogram adds its counts through shared memory with three barriers a call, so
    one call a step cost more than the layout conversions it saved (a first form with one call a
    step, and loads a round ahead, counted 313 instructions a round against the ``BLOCK`` form's 282).
    """
    hist = tl.zeros((32,), tl.int32)
    written = tl.full((), 0, tl.int32)
    ar = tl.arange(0, STEP)
    i0 = 0
    while i0 < count:
        i = i0 + ar
        u0 = _list_load(src, i, count, 0)
        u1 = _list_load(src, i, count, STEP)
        u2 = _list_load(src, i, count, 2 * STEP)
        u3 = _list_load(src, i, count, 3 * STEP)
        d0, m0 = _digits(u0, i < count, tlo, thi, prefix, shift, low, mask_bits)
        d1, m1 = _digits(u1, i + STEP < count, tlo, thi, prefix, shift, low, mask_bits)
        d2, m2 = _digits(u2, i + 2 * STEP < count, tlo, thi, prefix, shift, low, mask_bits)
        d3, m3 = _digits(u3, i + 3 * STEP < count, tlo, thi, prefix, shift, low, mask_bits)
        d = tl.reshape(tl.join(tl.join(d0, d1), tl.join(d2, d3)), (4 * STEP,))
        m = tl.reshape(tl.join(tl.join(m0, m1), tl.join(m2, m3)), (4 * STEP,))
        hist += tl.histogram(d, 32, mask=m)
        if copy:
            run, n = _scan4(m0, m1, m2, m3)
            tl.store(out + written + _byte(run, 0), u0.to(tl.int32, bitcast=True), mask=m0)
            written += _byte(n, 0)
            tl.store(out + written + _byte(run, 1), u1.to(tl.int32, bitcast=True), mask=m1)
            written += _byte(n, 1)
            tl.store(out + written + _byte(run, 2), u2.to(tl.int32, bitcast=True), mask=m2)
            written += _byte(n, 2)
            tl.store(out + written + _byte(run, 3), u3.to(tl.int32, bitcast=True), mask=m3)
            written += _byte(n, 3)
        i0 += 4 * STEP
    return hist


@triton.jit
def _refine(srow, crow, lo, hi, count, direct, tlo, thi, need, cap, COMPACT: tl.constexpr, BLOCK: tl.constexpr,
            LIST_STEP: tl.constexpr, STEP: tl.constexpr):
    """The exact k-th rank bits ``T`` in ``[tlo, thi]`` and how many keys equal to ``T`` to take.

    ``need`` is the k-th key's rank among the candidates (1 = the largest).  Each pass fixes up to
    5 more bits of ``T - tlo``, from the top bit of ``thi - tlo`` down.  ``COMPACT``: the second
    pass also copies the candidates it counts (those of the first pass's digit, ~1/32 of them) to
    the free tail of the list's rank-bit column, when they fit there, and the later passes read only
    that copy instead of the whole list again.
    """
    span = thi - tlo
    bits = tl.full((), 0, tl.int32)
    while (span >> bits.to(tl.uint32)) > 1:  # bits = number of significant bits of span (span < 2^32)
        bits += 1
    bits = tl.where(span > 0, bits + 1, 0)
    bins = tl.arange(0, 32)
    prefix = tl.full((), 0, tl.uint32)
    shift = bits
    base = tl.full((), 0, tl.int32)
    cnt = count
    bucket = count
    n_pass = tl.full((), 0, tl.int32)
    while shift > 0:
        low = tl.maximum(shift - 5, 0)
        dst = tl.full((), -1, tl.int32)
        if COMPACT:
            dst = tl.where((n_pass == 1) & (~direct) & (bucket <= cap - count), count, dst)
        hist = _digit_hist(srow, crow, lo, hi, base, cnt, direct, tlo, thi, prefix, shift, low, dst, BLOCK, LIST_STEP,
                           STEP)
        if COMPACT:
            tl.debug_barrier()  # the copy was written by other threads of this program
            moved = dst >= 0
            base = tl.where(moved, dst, base)
            cnt = tl.where(moved, tl.sum(hist, axis=0), cnt)
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        digit = tl.max(tl.where(at_or_above >= need, bins, -1), axis=0)
        bucket = tl.sum(tl.where(bins == digit, hist, 0), axis=0)
        need -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        prefix = (prefix << (shift - low).to(tl.uint32)) | digit.to(tl.uint32)
        shift = low
        n_pass += 1
    return tlo + prefix, need
