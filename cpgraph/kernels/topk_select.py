"""Triton top-k selection under the tie rule: one program per row, a sampled bracket, 32-bin passes.

The job: from a row's fp32 scores in its window ``[lo, hi)`` pick the ``topk`` best keys under
the tie rule of :func:`cpgraph.ops.indexer.tie_rank_keys` (higher score first, the lower position
among equal scores) and write their positions **in position order** (docs/ops/indexer.md).  The
scores do no FLOPs, so the cost is instructions per key; the design keeps full passes over the
window to two and makes everything else work on a small candidate set:

1. **Bracket from a sample.**  ``SAMPLE`` keys at evenly spaced positions are sorted (in
   registers); the sample's order statistics around the k-th key's expected rank, widened by four
   standard deviations of a sample count, give ``tlo <= T <= thi`` for the k-th key ``T`` with
   overwhelming probability.  Any bracket is correct: only the speed depends on it.
2. **One pass over the window** counts keys above ``thi`` and copies every key ranked at least
   ``tlo`` -- the keys above ``thi`` and the candidates in ``[tlo, thi]``, together about
   ``topk`` plus a few percent of the window -- to a list in the scratch row (rank bits and
   position, in position order).  If the counts show that ``T`` is not in the bracket, the
   bracket becomes everything (a slow but exact path).  ``FLOAT_PASS`` (opt-in) makes the same
   pass with fp32 compares against the bounds and one key a thread (see :func:`_float_pass`).
3. **Refine over the list's candidates** with 32-bin histograms (5 bits of ``u - tlo`` a pass, ~12
   instructions a key, where a 256-bin ``tl.histogram`` costs ~90) until ``T`` and the number of
   keys equal to ``T`` still to take are exact.  If the list did not fit the scratch, the
   passes read the window itself, filtered to the bracket (correct, slower); a bracket of one
   value (a massive tie) needs no pass at all.
4. **Collect in position order** from the list (every winner ranks at least ``T >= tlo``, so
   every winner is on it): every entry above ``T`` and the first ties of ``T`` by position,
   compacted with one packed prefix sum; it stops as soon as ``topk`` keys are out.  So the
   window is read once, where an earlier form read it a second time here (a 32K-key window is
   about 8x its list).  Without a list (missed bracket, overflow) the collection walks the
   window.  No sort: the output is in position order by construction.

``LIST_STEP`` (opt-in) walks the list in 3 and 4 one entry a thread, 32 x warps entries a step
and four steps a round (:func:`_list_hist`, :func:`_collect_list`), as :func:`_float_pass` walks
the window: the loads, the scans and the scattered stores then share one layout, and one packed
scan serves a round (a byte per step).  Same list, same copy, same ids.

Scores map to order-preserving 32-bit rank bits (``-0.0`` -> ``0.0``, one NaN above ``+inf``).
Why per row: a row's result must depend only on its own scores (CP = single device; tested by
re-running rows in other batch compositions), and the window bounds live on the device, so no
shape ever depends on data.  Nothing reads device memory on the host, the grid depends on static
sizes, ``ks``/``ke`` are clamped into ``[0, N]`` and every load and store is masked: CUDA-graph
capturable and never out of bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .indexer_tuning import _TUNE
from .move import interpreting

_U32_MAX = 0xFFFFFFFF


@triton.jit
def _rank_bits(x):
    """fp32 -> uint32 whose unsigned order is the tie rule's score order.

    ``-0.0`` becomes ``0.0`` and every NaN the positive quiet NaN (above ``+inf``); then the sign
    bit is set for positives and all bits are flipped for negatives.
    """
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.uint32, bitcast=True)
    b = tl.where(x != x, tl.full(b.shape, 0x7FC00000, tl.uint32), b)
    neg = (b >> 31) != 0
    return tl.where(neg, b ^ 0xFFFFFFFF, b | 0x80000000)


@triton.jit
def _rank_float(r):
    """The fp32 whose rank bits are ``r`` (scalar; the inverse of :func:`_rank_bits` on canonical values)."""
    b = tl.where((r >> 31) != 0, r & 0x7FFFFFFF, r ^ 0xFFFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _ranks_in_place(crow, count, BLOCK: tl.constexpr):
    """List entries ``[0, count)`` of ``crow``: raw fp32 bits -> rank bits (the float pass stores raw scores)."""
    i0 = 0
    while i0 < count:
        i = i0 + tl.arange(0, BLOCK)
        m = i < count
        x = tl.load(crow + i, mask=m, other=0).to(tl.float32, bitcast=True)
        tl.store(crow + i, _rank_bits(x).to(tl.int32, bitcast=True), mask=m)
        i0 += BLOCK


@triton.jit
def _float_step(x, pos, lo, hi, crow, prow, tlo_f, thi_f, has_hi, n_above, total, cap):
    """One step of :func:`_float_pass` over keys ``pos >= lo`` (values ``x``)."""
    valid = pos < hi
    return _list_append(crow, prow, x.to(tl.int32, bitcast=True), pos, valid & ~(x <= thi_f) & has_hi,
                        valid & ~(x < tlo_f), n_above, total, cap)


@triton.jit
def _float_pass(srow, crow, prow, lo, hi, tlo, thi, cap, STEP: tl.constexpr):
    """The window pass on fp32 compares: count keys above ``thi``, list every key ranked ``>= tlo``.

    Equal to :func:`_bracket_step` over the window, with two compares a key instead of the rank
    bits: for a canonical non-NaN bound ``rank(x) > thi`` is ``not (x <= f(thi))`` (unordered, so a
    NaN is above, as the tie rule ranks it) and ``rank(x) >= tlo`` is ``not (x < f(tlo))`` (``-0.0``
    and ``0.0`` compare equal, as they rank equal).  Bounds at or past the NaN rank are the special
    cases: ``thi`` there has nothing above it, and ``tlo`` is lowered to ``+inf``'s rank first (any
    lower bound that stays below the k-th key is a valid bracket).  ``tlo == 0`` maps to a NaN, which
    keeps every key.  The list gets raw fp32 bits (rank bits only after :func:`_ranks_in_place`).

    ``STEP`` is one key a thread (32 x warps): every tensor of the pass then has the one layout a
    scattered store allows, so no step moves values between layouts through shared memory, and the
    scan is one warp scan.  Four steps a round, each round's loads issued a round ahead, keep enough
    bytes in flight for the memory system.
    """
    has_hi = thi < 0xFFC00000
    thi_f = _rank_float(thi)
    tlo_f = _rank_float(tlo)
    ar = tl.arange(0, STEP)
    n_above = tl.full((), 0, tl.int32)
    total = tl.full((), 0, tl.int32)
    i0 = lo
    p0 = i0 + ar
    x0 = tl.load(srow + p0, mask=p0 < hi, other=0.0)
    x1 = tl.load(srow + p0 + STEP, mask=p0 + STEP < hi, other=0.0)
    x2 = tl.load(srow + p0 + 2 * STEP, mask=p0 + 2 * STEP < hi, other=0.0)
    x3 = tl.load(srow + p0 + 3 * STEP, mask=p0 + 3 * STEP < hi, other=0.0)
    while i0 < hi:
        p0 = i0 + ar
        q0 = p0 + 4 * STEP
        y0 = tl.load(srow + q0, mask=q0 < hi, other=0.0)
        y1 = tl.load(srow + q0 + STEP, mask=q0 + STEP < hi, other=0.0)
        y2 = tl.load(srow + q0 + 2 * STEP, mask=q0 + 2 * STEP < hi, other=0.0)
        y3 = tl.load(srow + q0 + 3 * STEP, mask=q0 + 3 * STEP < hi, other=0.0)
        n_above, total = _float_step(x0, p0, lo, hi, crow, prow, tlo_f, thi_f, has_hi, n_above, total, cap)
        n_above, total = _float_step(x1, p0 + STEP, lo, hi, crow, prow, tlo_f, thi_f, has_hi, n_above, total, cap)
        n_above, total = _float_step(x2, p0 + 2 * STEP, lo, hi, crow, prow, tlo_f, thi_f, has_hi, n_above, total,
                                     cap)
        n_above, total = _float_step(x3, p0 + 3 * STEP, lo, hi, crow, prow, tlo_f, thi_f, has_hi, n_above, total,
                                     cap)
        x0 = y0
        x1 = y1
        x2 = y2
        x3 = y3
        i0 += 4 * STEP
    return n_above, total


@triton.jit
def _window(ks, ke, row, n_keys):
    """Row ``row``'s window clamped into ``[0, n_keys]`` (bad ids can never address memory)."""
    lo = tl.load(ks + row).to(tl.int32)
    hi = tl.load(ke + row).to(tl.int32)
    lo = tl.minimum(tl.maximum(lo, 0), n_keys)
    hi = tl.minimum(tl.maximum(hi, lo), n_keys)
    return lo, hi


@triton.jit
def _at(x, idx, iota):
    """Element ``idx`` of the 1-D tensor ``x`` (a scalar)."""
    return tl.sum(tl.where(iota == idx, x, 0), axis=0)


@triton.jit
def _sample_bracket(srow, lo, n, topk, SAMPLE: tl.constexpr):
    """``(tlo, thi)`` rank bits that bracket the row's k-th key with high probability (``n > topk``)."""
    s = tl.arange(0, SAMPLE)
    off = (s.to(tl.int64) * n) // SAMPLE  # evenly spaced, all inside the window
    u = _rank_bits(tl.load(srow + lo + off))
    o = tl.sort((u ^ 0x80000000).to(tl.int32, bitcast=True), descending=True)  # signed, same order
    p = topk.to(tl.float32) / n.to(tl.float32)
    r = (topk.to(tl.int64) * SAMPLE // n).to(tl.int32)  # the k-th key's expected sample index
    margin = (4.0 * tl.sqrt(SAMPLE * p * (1.0 - p)) + 2.0).to(tl.int32)
    i_hi = r - margin
    i_lo = r + margin
    thi = (_at(o, i_hi, s).to(tl.uint32, bitcast=True)) ^ 0x80000000
    tlo = (_at(o, i_lo, s).to(tl.uint32, bitcast=True)) ^ 0x80000000
    thi = tl.where(i_hi < 0, tl.full((), 0xFFFFFFFF, tl.uint32), thi)
    tlo = tl.where(i_lo >= SAMPLE, tl.full((), 0, tl.uint32), tlo)
    return tlo, thi


@triton.jit
def _bracket_step(srow, crow, prow, i0, hi, tlo, thi, n_above, total, cap, BLOCK: tl.constexpr):
    """One block: count keys above ``thi``; append every key ``>= tlo`` (rank bits, position) to the row's list.

    The list holds, in position order, every key that can win when the bracket holds (all of them
    rank at least ``tlo``): the keys above ``thi`` and the candidates in ``[tlo, thi]``.  So the
    refinement reads only the list, and the collection walks the list instead of the window.
    """
    pos = i0 + tl.arange(0, BLOCK)
    valid = pos < hi
    x = tl.load(srow + pos, mask=valid, other=0.0)
    return _bracket_block(x, crow, prow, pos, valid, tlo, thi, n_above, total, cap)


@triton.jit
def _bracket_block(x, crow, prow, pos, valid, tlo, thi, n_above, total, cap):
    """:func:`_bracket_step` on a block already loaded (``x`` at positions ``pos``)."""
    u = _rank_bits(x)
    return _list_append(crow, prow, u.to(tl.int32, bitcast=True), pos, valid & (u > thi), valid & (u >= tlo),
                        n_above, total, cap)


@triton.jit
def _list_append(crow, prow, bits, pos, above, keep, n_above, total, cap):
    """Append the ``keep`` keys (``bits``, ``pos``) to the row's list, in order; count the ``above`` and ``keep`` keys.

    Slots past ``cap`` are not written (the count still grows: the caller sees the overflow).  One
    packed sum counts both flags (a step holds fewer than 2^16 keys).
    """
    keep = keep.to(tl.int32)
    run = tl.cumsum(keep, axis=0) - keep  # exclusive
    slot = total + run
    ok = (keep != 0) & (slot < cap)
    tl.store(crow + slot, bits, mask=ok)
    tl.store(prow + slot, pos, mask=ok)
    both = tl.sum(above.to(tl.int32) | (keep << 16), axis=0)
    return n_above + (both & 0xFFFF), total + (both >> 16)


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
def _list_load(ptr, i, n, off):
    """List entries ``ptr[i + off]`` (masked to ``i + off < n``) as rank bits.

    ``(ptr + i) + off``: loads of one round share an address and differ by an immediate offset.
    """
    return tl.load(ptr + i + off, mask=i + off < n, other=0).to(tl.uint32, bitcast=True)


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
def _byte(x, b: tl.constexpr):
    """Byte ``b`` of the int32 ``x`` (8-bit packed counts)."""
    return (x >> (8 * b)) & 0xFF


@triton.jit
def _pack4(f0, f1, f2, f3):
    """Four 0/1 flags a lane (one per step of a round) packed into bytes of one int32."""
    return f0.to(tl.int32) | (f1.to(tl.int32) << 8) | (f2.to(tl.int32) << 16) | (f3.to(tl.int32) << 24)


@triton.jit
def _scan4(f0, f1, f2, f3):
    """The exclusive scan and the total of a round's four flags, in one packed scan (byte ``b``: step ``b``).

    Each step holds ``STEP < 256`` lanes, so no byte carries into the next (``_select_kernel`` checks it).
    """
    both = _pack4(f0, f1, f2, f3)
    return tl.cumsum(both, axis=0) - both, tl.sum(both, axis=0)


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


@triton.jit
def _select_kernel(
    scores, ks, ke, kv_slots, out, cand,
    row0, m_rows, n_keys, score_stride, cand_stride, cand_cap, topk,
    BLOCK: tl.constexpr, SAMPLE: tl.constexpr, PAGED: tl.constexpr, LOOP_WHILE: tl.constexpr,
    LAST_ROW_FIRST: tl.constexpr = False, COMPACT: tl.constexpr = False, PREFETCH: tl.constexpr = False,
    FLOAT_PASS: tl.constexpr = False, PASS_STEP: tl.constexpr = 32, STOP_AFTER: tl.constexpr = 0,
    LIST_STEP: tl.constexpr = False,
):  # fmt: skip
    """Row ``row0 + local`` of ``out`` <- its top-k under the tie rule, in position order (scores row = local).

    ``LAST_ROW_FIRST``: program ``p`` takes row ``m_rows - 1 - p``.  Causal windows grow with the
    row, and the GPU starts programs in order, so the longest rows start first and the launch does
    not end on a wave of its longest rows (longest-processing-time-first).

    ``STOP_AFTER`` (benchmarks only: the output is then wrong) ends each row after stage 1 (the
    sample's bracket), 2 (the window pass) or 3 (the refinement), so timing differences place the
    time inside the kernel where no hardware counters can.

    ``LIST_STEP`` walks the list (the refinement's histogram passes and the collection) in steps of
    ``PASS_STEP`` = 32 x warps entries, one a thread, instead of ``BLOCK``; a round's four step counts
    share one int32, a byte each, so ``PASS_STEP`` must stay below 256.
    """
    tl.static_assert(PASS_STEP < 256 or not LIST_STEP, "LIST_STEP: 32 x warps must stay below 256 (byte counts)")
    local = tl.program_id(0)
    if LAST_ROW_FIRST:
        local = m_rows - 1 - local
    row = row0 + local
    topk = topk + tl.zeros((), tl.int32)  # a tensor even when Triton specialises topk == 1
    lo, hi = _window(ks, ke, row, n_keys)
    n = hi - lo
    srow = scores + local.to(tl.int64) * score_stride
    crow = cand + local.to(tl.int64) * cand_stride  # list: rank bits in [0, cap), positions in [cap, 2 cap)
    prow = crow + cand_cap
    orow = out + row.to(tl.int64) * topk
    if n <= topk:  # the whole window, in order, then -1
        # In BLOCK steps, not one topk-wide tensor: the widest tensor sets every path's registers,
        # and registers bound how many row programs an SM holds.
        j0 = 0
        while j0 < topk:
            j = j0 + tl.arange(0, BLOCK)
            live = j < n
            pos = lo + j
            if PAGED:
                val = tl.load(kv_slots + pos, mask=live, other=-1).to(tl.int32)
            else:
                val = pos
            tl.store(orow + j, tl.where(live, val, -1), mask=j < topk)
            j0 += BLOCK
    else:
        tlo, thi = _sample_bracket(srow, lo, n, topk, SAMPLE)
        if STOP_AFTER == 1:
            tl.store(orow, (tlo ^ thi).to(tl.int32, bitcast=True))
            return
        n_above = tl.full((), 0, tl.int32)
        total = tl.full((), 0, tl.int32)
        if FLOAT_PASS:
            tlo = tl.where(tlo >= 0xFFC00000, tl.full((), 0xFF800000, tl.uint32), tlo)  # NaN rank -> +inf's
            n_above, total = _float_pass(srow, crow, prow, lo, hi, tlo, thi, cand_cap, PASS_STEP)
            tl.debug_barrier()  # list entries written by other threads of this program
            _ranks_in_place(crow, tl.minimum(total, cand_cap), BLOCK)
        elif PREFETCH:
            # The next block's load is issued before this block's scan, so its latency overlaps the
            # scan's dependent chain (each block's list slots wait on the previous block's count).
            ar = tl.arange(0, BLOCK)
            x = tl.load(srow + lo + ar, mask=lo + ar < hi, other=0.0)
            i0 = lo
            while i0 < hi:
                pos = i0 + ar
                nxt = pos + BLOCK
                x_next = tl.load(srow + nxt, mask=nxt < hi, other=0.0)
                n_above, total = _bracket_block(x, crow, prow, pos, pos < hi, tlo, thi, n_above, total, cand_cap)
                x = x_next
                i0 += BLOCK
        elif LOOP_WHILE:
            i0 = lo
            while i0 < hi:
                n_above, total = _bracket_step(srow, crow, prow, i0, hi, tlo, thi, n_above, total, cand_cap, BLOCK)
                i0 += BLOCK
        else:
            for i0 in range(lo, hi, BLOCK):
                n_above, total = _bracket_step(srow, crow, prow, i0, hi, tlo, thi, n_above, total, cand_cap, BLOCK)
        if STOP_AFTER == 2:
            tl.store(orow, n_above + total)
            return
        hit = (n_above < topk) & (total >= topk)
        # A missed bracket (a sample far from the row's distribution) falls back to everything: exact, slower.
        tlo = tl.where(hit, tlo, tl.full((), 0, tl.uint32))
        thi = tl.where(hit, thi, tl.full((), 0xFFFFFFFF, tl.uint32))
        n_above = tl.where(hit, n_above, 0)
        # A list that did not fit the scratch also reads the window: exact, slower.
        direct = (~hit) | (total > cand_cap)
        tl.debug_barrier()  # list entries written by other threads of this program
        threshold, need = _refine(srow, crow, lo, hi, total, direct, tlo, thi, topk - n_above, cand_cap, COMPACT,
                                  BLOCK, LIST_STEP, PASS_STEP)
        if STOP_AFTER == 3:
            tl.store(orow, threshold.to(tl.int32, bitcast=True) + need)
            return
        taken = tl.full((), 0, tl.int32)
        ties = tl.full((), 0, tl.int32)
        if direct:
            i0 = lo
            while (i0 < hi) & (taken < topk):  # stops once every winner is out
                taken, ties = _collect_step(srow, crow, prow, orow, kv_slots, i0, hi, threshold, need, taken, ties,
                                            topk, False, PAGED, BLOCK)
                i0 += BLOCK
        elif LIST_STEP:
            _collect_list(crow, prow, orow, kv_slots, total, threshold, need, topk, PAGED, PASS_STEP)
        else:
            i0 = 0
            while (i0 < total) & (taken < topk):  # the list: every winner, in position order
                taken, ties = _collect_step(srow, crow, prow, orow, kv_slots, i0, total, threshold, need, taken,
                                            ties, topk, True, PAGED, BLOCK)
                i0 += BLOCK


def list_capacity(n_keys: int, topk: int) -> int:
    """Entries of a row's list: the keys above the bracket (< topk) plus its candidates (~1/8 of a long window).

    A list that does not fit falls back to reading the window (exact, slower).
    """
    return max(1, min(n_keys, topk + max(topk, n_keys // 8)))


def scratch_columns(n_keys: int, topk: int) -> int:
    """Scratch columns per row: the list's rank bits, then its positions."""
    return 2 * list_capacity(n_keys, topk)


def select_rows(scores, ks, ke, out, row0: int, m_rows: int, topk: int, kv_slots=None, *, scratch=None,
                block=None, num_warps=None, sample=None, maxnreg=None, num_stages=None, compact=None,
                prefetch=None, float_pass=None, list_step=None, stop_after=0):
    """Top-k of rows ``[row0, row0 + m_rows)`` (scores in ``scores[0:m_rows]``) into ``out`` (int32 ``[M, topk]``).

    RAGGED ids, or PAGED slots ``kv_slots[t]`` when ``kv_slots`` is given, in position order.
    ``scratch`` (int32 ``[>= m_rows, C]``, any ``C >= 1``) holds a row's list (``C // 2`` entries of
    rank bits, then their positions); allocated here (``C =`` :func:`scratch_columns`) when not given.  The keyword arguments after it are tuning
    knobs for benchmarks; none changes the result, except ``stop_after`` (the stage cuts of
    ``_select_kernel``'s ``STOP_AFTER``: the rows end early and ``out`` holds no ids).  ``float_pass``
    ignores ``prefetch`` (its rounds load ahead on their own); ``list_step`` (the list walks one entry a
    thread) needs fewer than 8 warps.  Returns the launched Triton kernel
    (benchmarks read its registers and shared memory, which bound the resident row programs per SM).
    """
    if m_rows <= 0:
        return None
    N = scores.shape[1]
    if scratch is None:
        scratch = torch.empty((m_rows, scratch_columns(N, topk)), dtype=torch.int32, device=scores.device)
    if scratch.dtype != torch.int32 or scratch.dim() != 2 or scratch.shape[0] < m_rows or scratch.stride(1) != 1:
        raise ValueError(f"cpgraph.kernels.topk_select: scratch must be int32 [>= {m_rows}, C] with unit column "
                         f"stride, got {scratch.dtype} {tuple(scratch.shape)}")
    block = block or ((1 << 12) if interpreting() else _TUNE["SELECT_BLOCK"])
    if block > (1 << 15) or block & (block - 1):
        raise ValueError(f"cpgraph.kernels.topk_select: block must be a power of two <= 32768 (packed 16-bit "
                         f"counts), got {block}")
    sample = sample or (min(256, _TUNE["SELECT_SAMPLE"]) if interpreting() else _TUNE["SELECT_SAMPLE"])
    paged = kv_slots is not None
    ks, ke = ks.contiguous(), ke.contiguous()
    cap = _TUNE["SELECT_MAXNREG"] if maxnreg is None else maxnreg
    stages = num_stages or _TUNE["SELECT_STAGES"]
    warps = num_warps or (4 if interpreting() else _TUNE["SELECT_WARPS"])
    list_step = _TUNE["SELECT_LIST_STEP"] if list_step is None else bool(list_step)
    if list_step and 32 * warps >= 256:
        raise ValueError(f"cpgraph.kernels.topk_select: list_step needs fewer than 8 warps (32 x warps-entry steps, "
                         f"byte-packed counts), got {warps}")
    return _select_kernel[(m_rows,)](
        scores, ks, ke, kv_slots if paged else ks, out, scratch, row0, m_rows, N, scores.stride(0), scratch.stride(0),
        scratch.shape[1] // 2, topk,
        BLOCK=block, SAMPLE=sample, PAGED=paged, LOOP_WHILE=interpreting(),
        LAST_ROW_FIRST=_TUNE["SELECT_LAST_ROW_FIRST"],
        COMPACT=_TUNE["SELECT_COMPACT"] if compact is None else bool(compact),
        PREFETCH=_TUNE["SELECT_PREFETCH"] if prefetch is None else bool(prefetch),
        FLOAT_PASS=_TUNE["SELECT_FLOAT_PASS"] if float_pass is None else bool(float_pass), PASS_STEP=32 * warps,
        STOP_AFTER=int(stop_after), LIST_STEP=list_step, num_warps=warps,
        **({"maxnreg": cap} if cap and not interpreting() else {}),
        **({"num_stages": stages} if stages and not interpreting() else {}),
    )  # fmt: skip


__all__ = ["select_rows", "scratch_columns"]
