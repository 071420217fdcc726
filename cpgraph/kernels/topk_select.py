"""The top-k selection's host side: the launch, its tuning choice and the scratch sizing.

The kernel itself (:func:`_select_kernel`, in :mod:`.topk_select_kernel`; its design is that
module's docstring) is pure device code over static sizes: the window bounds stay on the device,
nothing is read back, so a launch is CUDA-graph capturable.  Everything decided on the host lives
here: the grid (one program per row), the knobs taken from :mod:`.indexer_tuning` (or a
benchmark's overrides, smaller ones under the interpreter), the checks that keep the kernel's
packed counts valid, and the scratch a row's list needs (:func:`scratch_columns`, which the
memory plan also uses).  :func:`select_rows` is what the indexer's providers call.

The kernel is split by stage -- :mod:`.topk_bits` (encodings every stage shares),
:mod:`.topk_bracket` (sample bracket and window pass), :mod:`.topk_refine` (histogram passes),
:mod:`.topk_collect` (position-ordered collection) -- and its jit functions are re-exported here
under their old names (``benchmarks/sass_loops.py`` compiles ``_select_kernel`` from this module).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .indexer_tuning import _TUNE
from .move import interpreting
# The kernel's jit functions, re-exported under the names this module had before the split (benchmarks and
# tests reach them here).
from .topk_bits import _byte, _list_load, _pack4, _rank_bits, _rank_float, _scan4
from .topk_bracket import (_at, _bracket_block, _bracket_step, _float_pass, _float_step, _list_append, _ranks_in_place,
                           _sample_bracket, _window)
from .topk_collect import _collect_entries, _collect_list, _collect_round, _collect_step, _collect_write
from .topk_refine import _digit_hist, _digits, _hist_entries, _list_hist, _refine
from .topk_select_kernel import _select_kernel

_U32_MAX = 0xFFFFFFFF


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
