"""Folded rerange: point-to-point transfers straight into the output (no placement pass).

``cp_rerange`` is an all-gather into a ``[world * M]`` buffer followed by a
placement pass that reads every gathered row again and writes it to its
global position: on 2 H200s that pass costs 26-31% of the all-gather.  But
the placement has structure: each rank's compute rows are contiguous runs
(per request: its "prev" chunk, then its "next" chunk) and each run lands on
a contiguous run of output rows.  So every run can travel as one P2P message
(``isend`` of a row slice, ``irecv`` into a slice of the output) and arrive
where it belongs: no gathered buffer, no second pass.  The runs this rank
computed itself are copied locally, on a side stream so the copy overlaps
the NCCL transfer.  Dummy rows are never sent (the all-gather ships them).

Runs are planned on the host from the plan (same list on every rank, so
the sends and receives pair up in order per peer): ``(src_rank, src_row,
dst_row, length)``.  Nothing reads device data on the host.

Selection: this is an optional provider of ``cpgraph::cp_rerange`` on CUDA,
registered only when ``CPGRAPH_RERANGE=p2p`` (``cpgraph.kernels`` does it at
import; the provider registry logs the choice once).  The provider needs
the runs of the ``rerange_index`` it is given: attach them once per batch
with :func:`attach_runs`; a call without attached runs takes the all-gather
path (logged once).  The result equals the all-gather path bit for bit
(both only copy bytes).
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger("cpgraph.kernels")

Run = tuple[int, int, int, int]  # (src_rank, src_row, dst_row, length)
ENV = "CPGRAPH_RERANGE"
PROVIDER_NAME = "p2p"


# ------------------------------------------------------------------ planning
def runs_from_rerange_index(rerange_index, num_rows: int) -> list[Run]:
    """Maximal runs of ``rerange_index`` (gathered row per output row) as ``(rank, row, dst, length)``.

    A run breaks where the source row is not the previous one plus one or
    the source rank changes.  Host-side (NumPy); call it once per batch.
    """
    if num_rows < 1:
        raise ValueError(f"cpgraph.rerange_runs: 'num_rows' must be >= 1, got {num_rows!r}")
    g = np.asarray(rerange_index.numpy() if isinstance(rerange_index, torch.Tensor) else rerange_index, dtype=np.int64)
    if g.ndim != 1:
        raise ValueError(f"cpgraph.rerange_runs: 'rerange_index' must be 1-D, got shape {g.shape}")
    if g.size == 0:
        return []
    if g.min() < 0:
        raise ValueError("cpgraph.rerange_runs: 'rerange_index' must not contain negative rows")
    rank, row = g // num_rows, g % num_rows
    brk = np.flatnonzero((g[1:] != g[:-1] + 1) | (rank[1:] != rank[:-1])) + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [g.size]])
    return [(int(rank[s]), int(row[s]), int(s), int(e - s)) for s, e in zip(starts, ends)]


def rerange_runs(plan) -> list[Run]:
    """Runs of a :class:`cpgraph.plan.CPPlan` (identical on every rank)."""
    return runs_from_rerange_index(plan.rerange_index, plan.num_rows)


# ------------------------------------------------------------------ transfer
_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def _check_runs(runs: Sequence[Run], world: int, num_rows: int) -> int:
    total = 0
    for run in runs:
        q, s, d, n = run
        if not (0 <= q < world and n >= 0 and 0 <= s and s + n <= num_rows and d >= 0):
            raise ValueError(f"cpgraph.rerange_p2p: run {run!r} is out of range (world {world}, {num_rows} rows)")
        total = max(total, d + n)
    return total


def rerange_p2p(rows: torch.Tensor, runs: Sequence[Run], group=None, num_out: int | None = None) -> torch.Tensor:
    """``out[d:d+n] = rows_of_rank_q[s:s+n]`` for every run ``(q, s, d, n)``, without an all-gather.

    ``rows``: this rank's ``[M, ...]`` compute rows.  ``runs``: the same list
    on every rank (:func:`rerange_runs`); they must cover ``[0, num_out)``
    exactly once (a row no run names is left uninitialised).  ``group``: the
    CP process group (default: world).  Every rank gets the whole output.
    """
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    total = _check_runs(runs, world, rows.shape[0])
    num_out = total if num_out is None else num_out
    rows = rows.contiguous()
    out = rows.new_empty((num_out, *rows.shape[1:]))
    own = [r for r in runs if r[0] == rank and r[3] > 0]
    cuda = rows.is_cuda
    if cuda and own:  # local runs on a side stream, overlapping the transfer below
        cur = torch.cuda.current_stream(rows.device)
        side = _side_stream(rows.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            for _, s, d, n in own:
                out[d : d + n].copy_(rows[s : s + n])
        # No record_stream needed: the current stream waits for ``side`` before
        # returning, so every later use or free of rows/out is ordered after it.
    else:
        for _, s, d, n in own:
            out[d : d + n].copy_(rows[s : s + n])
    ops = []
    peers = [q for q in range(world) if q != rank]
    for q in peers:  # same order on both sides of every pair: my runs to q, q's runs from q
        gq = dist.get_global_rank(group, q)
        for _, s, d, n in own:
            ops.append(dist.P2POp(dist.isend, rows[s : s + n], gq, group))
        for src, s, d, n in runs:
            if src == q and n > 0:
                ops.append(dist.P2POp(dist.irecv, out[d : d + n], gq, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()  # NCCL: the current stream waits (no host sync); gloo: blocks
    if cuda and own:
        torch.cuda.current_stream(rows.device).wait_stream(_side_stream(rows.device))
    return out


# ------------------------------------------------------------------ provider
# id(tensor) -> (weak reference, runs); keyed by identity because a tensor's
# ``==`` is elementwise (a WeakKeyDictionary would compare tensors by value).
_RUNS: dict[int, tuple] = {}
_WARNED: set = set()


def attach_runs(rerange_index: torch.Tensor, runs: Sequence[Run]) -> torch.Tensor:
    """Remember the host runs of a (device) ``rerange_index``; returns it (build both once per batch)."""
    key = id(rerange_index)
    _RUNS[key] = (weakref.ref(rerange_index), list(runs))
    weakref.finalize(rerange_index, _RUNS.pop, key, None)
    return rerange_index


def attached_runs(rerange_index: torch.Tensor):
    """The runs attached to this very tensor, or ``None``."""
    entry = _RUNS.get(id(rerange_index))
    return entry[1] if entry is not None and entry[0]() is rerange_index else None


def cp_rerange_p2p(rows: torch.Tensor, rerange_index: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """Provider of ``cpgraph::cp_rerange`` (the op's arguments): P2P runs when attached, else all-gather."""
    from cpgraph.ops.collectives import cp_rerange_decomposed, resolve_group

    runs = attached_runs(rerange_index)
    if runs is None:
        if "no-runs" not in _WARNED:
            _WARNED.add("no-runs")
            log.warning("cpgraph::cp_rerange p2p: no runs attached to rerange_index; using the all-gather path")
        return cp_rerange_decomposed(rows, rerange_index, group_name, world_size)
    group = resolve_group("cp_rerange", group_name, world_size)
    return rerange_p2p(rows, runs, group, num_out=rerange_index.shape[0])


def enabled() -> bool:
    """``CPGRAPH_RERANGE=p2p`` selects the folded rerange."""
    return os.environ.get(ENV, "").strip().lower() == PROVIDER_NAME
