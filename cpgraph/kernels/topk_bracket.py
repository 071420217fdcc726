"""Stages 1 and 2 of the top-k selection: the sampled bracket and the one pass over the window.

Why together: they are the stages that always read the row's window (its clamped bounds, a
sample of it, then every key of it once), and they produce what the later stages walk instead of
the window (unless the bracket missed or the list overflowed): the bracket ``[tlo, thi]``, the
count of keys above it, and the list of every key ranked at least ``tlo`` (rank bits and
position, in position order, in the scratch row).  Two forms of the pass: ``BLOCK``-key blocks on
rank bits (:func:`_bracket_step`), or ``FLOAT_PASS`` on fp32 compares one key a thread
(:func:`_float_pass`).  The design: :mod:`.topk_select_kernel`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .topk_bits import _rank_bits, _rank_float


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
