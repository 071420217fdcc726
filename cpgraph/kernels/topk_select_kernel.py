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

This module holds only the kernel that runs the stages in order; their jit functions live by stage
(:mod:`.topk_bracket` for 1 and 2, :mod:`.topk_refine` for 3, :mod:`.topk_collect` for 4, the
shared encodings in :mod:`.topk_bits`), and the launch, its tuning and the scratch sizing in
:mod:`.topk_select`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .topk_bracket import _bracket_block, _bracket_step, _float_pass, _ranks_in_place, _sample_bracket, _window
from .topk_collect import _collect_list, _collect_step
from .topk_refine import _refine


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
