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

Two entry points:

* ``cpgraph::cp_rerange_p2p`` (what the compiled CP forward uses on CUDA +
  NCCL, see ``rerange_form`` in :mod:`cpgraph.ops.collectives`): its CUDA
  provider :func:`cp_rerange_p2p_blocks` needs no host runs.  Every message
  is a rank's whole ``M``-row block (a shape, so nothing is read from the
  device and the call can be captured in a CUDA graph); peers' blocks land
  in a staging buffer laid out like the all-gather, this rank's rows are
  placed on a side stream while the transfer runs, the peers' rows by one
  gather pass after it.  Registered for ``cuda`` when the CUDA providers
  bind (:func:`cpgraph.kernels.register_triton_providers`).
* the run-based path below (:func:`rerange_p2p`), which also skips dummy
  rows and receives straight into the output where a peer's rows form one
  run, but needs the host runs of each batch.

Selection of the run-based path: an optional provider of ``cpgraph::cp_rerange`` on CUDA,
registered only when ``CPGRAPH_RERANGE=p2p`` (``cpgraph.kernels`` does it when
the CUDA providers bind; the provider registry logs the choice once).  The provider needs
the runs of the ``rerange_index`` it is given: attach them once per batch
with :func:`attach_runs`; a call without attached runs takes the all-gather
path (counted as ``reference`` with the reason in the provider report, a
WARNING once: :mod:`cpgraph.ops.ledger`).  The result equals the all-gather path bit for bit
(both only copy bytes).
"""

from __future__ import annotations

import os
import weakref
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist


Run = tuple[int, int, int, int]  # (src_rank, src_row, dst_row, length)
# Where this rank's own rows are placed relative to the transfer (CUDA): "overlap" (side stream,
# enqueued after the transfer), "before" (side stream, enqueued first) or "after" (current stream).
OWN_PLACEMENT = os.environ.get("CPGRAPH_RERANGE_OWN", "overlap")
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


def send_blocks(runs: Sequence[Run], world: int) -> list[tuple[int, int] | None]:
    """Per rank, the row range ``[lo, hi)`` covering all its runs (``None`` if it has none).

    Each rank sends this one block to every peer as ONE message: NCCL pays
    roughly 60 us per extra message in a group on the H200 pair (measured:
    235 MB as 16 messages 1.88 ms, as 1 message 0.95 ms), far more than a
    local placement of the same bytes.  Valid rows come first in a rank's
    compute layout, so the block is exactly its valid rows (no dummy row
    travels); gaps, if a planner ever left some, would travel unused.
    """
    blocks: list = [None] * world
    for q, s, _, n in runs:
        if n <= 0:
            continue
        lo, hi = blocks[q] if blocks[q] is not None else (s, s + n)
        blocks[q] = (min(lo, s), max(hi, s + n))
    return blocks


def receive_direct(runs: Sequence[Run], world: int, rank: int) -> bool:
    """The choice rule, from the run list only: receive straight into the output iff every peer's rows
    form ONE run there (its block lands contiguously: no placement pass, nothing to stage).

    Otherwise every peer block is received into a staging buffer laid out
    like the all-gather result (peer ``q``'s row ``j`` at ``q * M + j``) and
    placed by one gather pass over the peers' rows.  The rule only chooses
    where THIS rank receives; messages (one block per ordered pair, sizes
    from the plan) are the same either way, so ranks need not agree on it.
    """
    count = [0] * world
    for q, _, _, n in runs:
        if n > 0:
            count[q] += 1
    return all(count[q] <= 1 for q in range(world) if q != rank)


def rerange_p2p(
    rows: torch.Tensor, runs: Sequence[Run], group=None, num_out: int | None = None, rerange_index=None
) -> torch.Tensor:
    """``out[d:d+n] = rows_of_rank_q[s:s+n]`` for every run ``(q, s, d, n)``, without an all-gather.

    ``rows``: this rank's ``[M, ...]`` compute rows.  ``runs``: the same list
    on every rank (:func:`rerange_runs`); they must cover ``[0, num_out)``
    exactly once (a row no run names is left uninitialised).  ``group``: the
    CP process group (default: world).  Every rank gets the whole output.

    Transfer: each rank sends its block of valid rows to every peer as one
    message (:func:`send_blocks`).  Receive: straight into the output when
    every peer's rows form one run there, else into a staging buffer
    followed by one placement pass (:func:`receive_direct`).
    ``rerange_index`` (the device index the runs came from, optional): lets
    the placement run as ONE gather kernel per side (Triton, on CUDA or
    under the interpreter) instead of one ``copy_`` per run.  This rank's
    own rows are placed on a side stream while the transfer runs.
    """
    group = group if group is not None else dist.group.WORLD
    m = rows.shape[0]
    plan = _schedule(runs, group, m)
    rank, world, own, direct, use_staging = plan.rank, plan.world, plan.own, plan.direct, plan.use_staging
    num_out = plan.total if num_out is None else num_out
    use_kernel = rerange_index is not None and _kernel_ok(rows)
    rows = rows.contiguous()
    out = rows.new_empty((num_out, *rows.shape[1:]))
    staging = rows.new_empty((world * m, *rows.shape[1:])) if use_staging else None
    ops = []
    for gq, send, recv in plan.peers:  # one message per ordered pair: my block to q, q's block from q
        if send is not None:
            ops.append(dist.P2POp(dist.isend, rows[send[0] : send[1]], gq, group))
        if recv is not None:
            dst = out if direct else staging
            ops.append(dist.P2POp(dist.irecv, dst[recv[0] : recv[1]], gq, group))
    cuda = rows.is_cuda
    own_index = rerange_index if use_kernel else None
    if OWN_PLACEMENT == "after" or not cuda:
        works = dist.batch_isend_irecv(ops) if ops else []
        for work in works:
            work.wait()  # NCCL: the current stream waits (no host sync); gloo: blocks
        if own:
            _place_own(rows, out, own, rank, m, own_index)
    else:
        side = _side_stream(rows.device)
        if own:
            side.wait_stream(torch.cuda.current_stream(rows.device))
        if own and OWN_PLACEMENT == "before":
            with torch.cuda.stream(side):
                _place_own(rows, out, own, rank, m, own_index)
        works = dist.batch_isend_irecv(ops) if ops else []
        if own and OWN_PLACEMENT != "before":  # "overlap": transfer enqueued first, then the local pass
            with torch.cuda.stream(side):
                _place_own(rows, out, own, rank, m, own_index)
        # No record_stream needed: the current stream waits for ``side`` before
        # returning, so every later use or free of rows/out is ordered after it.
        for work in works:
            work.wait()
    if staging is not None:
        _place_peers(staging, out, runs, rank, m, rerange_index if use_kernel else None)
    if cuda and own and OWN_PLACEMENT != "after":
        torch.cuda.current_stream(rows.device).wait_stream(_side_stream(rows.device))
    return out


class _Schedule:
    """Host-side transfer plan of one run list on one rank (cached: host time before the NCCL launch
    is latency the transfer waits for; planning it per call cost ~0.1 ms on the H200 host)."""

    __slots__ = ("rank", "world", "total", "own", "direct", "use_staging", "peers")


_SCHEDULES: dict = {}


def _schedule(runs: Sequence[Run], group, m: int) -> _Schedule:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    key = (tuple(runs), getattr(group, "group_name", id(group)), rank, world, m)
    plan = _SCHEDULES.get(key)
    if plan is not None:
        return plan
    plan = _Schedule()
    plan.rank, plan.world = rank, world
    plan.total = _check_runs(runs, world, m)
    blocks = send_blocks(runs, world)
    plan.own = [r for r in runs if r[0] == rank and r[3] > 0]
    plan.direct = receive_direct(runs, world, rank)
    plan.peers = []
    plan.use_staging = False
    for q in range(world):
        if q == rank:
            continue
        recv = None
        if blocks[q] is not None:
            lo, hi = blocks[q]
            if plan.direct:
                ((_, s, d, n),) = [r for r in runs if r[0] == q and r[3] > 0]
                recv = (d, d + n)
            else:
                recv = (q * m + lo, q * m + hi)
                plan.use_staging = True
        plan.peers.append((dist.get_global_rank(group, q), blocks[rank], recv))
    if len(_SCHEDULES) > 64:  # one entry per batch shape in practice; keep the dict bounded
        _SCHEDULES.clear()
    _SCHEDULES[key] = plan
    return plan


def _kernel_ok(rows: torch.Tensor) -> bool:
    from .move import interpreting

    return rows.is_cuda or interpreting()


def _gather_rows(src: torch.Tensor, out: torch.Tensor, index: torch.Tensor, lo: int, hi: int, keep: bool) -> None:
    """One gather launch: out rows whose index is in ``[lo, hi)`` (``keep``) or outside it (not ``keep``)."""
    from .move import Layout, byte_rows, move_rows

    s, d = byte_rows(src), byte_rows(out)
    width = d.shape[1]
    if width == 0 or index.shape[0] == 0:
        return
    move_rows(s, d, index, index.shape[0], width, Layout(s.stride(0)), Layout(width), gather=True,
              skip=(lo, hi), keep=keep)  # fmt: skip


def _place_own(rows, out, own, rank: int, m: int, index) -> None:
    if index is not None:
        _gather_rows(rows, out, index, rank * m, rank * m + m, keep=True)
    else:
        for _, s, d, n in own:
            out[d : d + n].copy_(rows[s : s + n])


def _place_peers(staging, out, runs, rank: int, m: int, index) -> None:
    if index is not None:
        _gather_rows(staging, out, index, rank * m, rank * m + m, keep=False)
    else:
        for q, s, d, n in runs:
            if q != rank and n > 0:
                out[d : d + n].copy_(staging[q * m + s : q * m + s + n])


# ------------------------------------------------------------------ provider
# id(tensor) -> (weak reference, runs); keyed by identity because a tensor's
# ``==`` is elementwise (a WeakKeyDictionary would compare tensors by value).
_RUNS: dict[int, tuple] = {}


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
        from cpgraph.ops import ledger
        from cpgraph.ops.providers import REFERENCE

        ledger.fell_back("cp_rerange", rows.device.type, REFERENCE,
                         "no host runs attached to rerange_index (the all-gather form)", instead_of=PROVIDER_NAME)
        return cp_rerange_decomposed(rows, rerange_index, group_name, world_size)
    group = resolve_group("cp_rerange", group_name, world_size)
    return rerange_p2p(rows, runs, group, num_out=rerange_index.shape[0], rerange_index=rerange_index)


def enabled() -> bool:
    """``CPGRAPH_RERANGE=p2p`` selects the folded rerange."""
    return os.environ.get(ENV, "").strip().lower() == PROVIDER_NAME


# ------------------------------------------------------ block provider (compiled path)
def exchange_and_place(rows: torch.Tensor, rerange_index: torch.Tensor, group) -> torch.Tensor:
    """``out[t] = gathered[rerange_index[t]]`` with the gathered rows moved as one P2P block per ordered pair.

    No host runs: each rank sends all its ``M`` rows (dummies included, as
    the all-gather does) to every peer and receives each peer's block at
    ``q * M`` of a staging buffer.  This rank's own rows are placed from
    ``rows`` on a side stream while the transfer runs (CUDA; after it on
    CPU), the peers' rows by one gather pass that skips the own range.
    Nothing here reads device data or depends on anything but shapes and
    the rank, so it is CUDA-graph capturable (warm the NCCL communicator up
    before capturing).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    m = rows.shape[0]
    rows = rows.contiguous()
    out = rows.new_empty((rerange_index.shape[0], *rows.shape[1:]))
    if world == 1 or m == 0:
        if m:
            _gather_rows(rows, out, rerange_index, 0, m, keep=True)
        return out
    staging = rows.new_empty((world * m, *rows.shape[1:]))
    ops = []
    for q in range(world):
        if q == rank:
            continue
        peer = dist.get_global_rank(group, q)
        ops.append(dist.P2POp(dist.isend, rows, peer, group))
        ops.append(dist.P2POp(dist.irecv, staging[q * m : (q + 1) * m], peer, group))
    own = (rank * m, rank * m + m)
    if rows.is_cuda:
        side = _side_stream(rows.device)
        side.wait_stream(torch.cuda.current_stream(rows.device))
        works = dist.batch_isend_irecv(ops)
        with torch.cuda.stream(side):  # transfer enqueued first, then the local pass beside it
            _gather_rows(rows, out, rerange_index, *own, keep=True)
        for work in works:
            work.wait()  # the current stream waits for the transfer (no host sync)
        _gather_rows(staging, out, rerange_index, *own, keep=False)
        torch.cuda.current_stream(rows.device).wait_stream(side)
    else:  # CPU (gloo): blocking transfer, then the two placement passes (Triton only under the interpreter)
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if _kernel_ok(rows):
            _gather_rows(rows, out, rerange_index, *own, keep=True)
            _gather_rows(staging, out, rerange_index, *own, keep=False)
        else:
            staging[own[0] : own[1]].copy_(rows)
            out = torch.ops.cpgraph.take_rows(staging, rerange_index)
    return out


def cp_rerange_p2p_blocks(
    rows: torch.Tensor, rerange_index: torch.Tensor, group_name: str, world_size: int, min_bytes: int
) -> torch.Tensor:
    """Provider of ``cpgraph::cp_rerange_p2p`` (the op's arguments; bit-equal to its reference)."""
    from cpgraph.ops.collectives import (
        RERANGE_P2P_BACKENDS,
        cp_rerange_decomposed,
        group_backend,
        rerange_payload_bytes,
        resolve_group,
    )

    from cpgraph.ops import ledger

    if rerange_payload_bytes(rows) < min_bytes:  # by design: small messages are faster through the all-gather
        ledger.ran_as("cp_rerange_p2p", rows.device.type, ALL_GATHER, "payload below min_bytes")
        return cp_rerange_decomposed(rows, rerange_index, group_name, world_size)
    group = resolve_group("cp_rerange_p2p", group_name, world_size)
    backend = group_backend(group_name, "cuda") if rows.is_cuda else None
    if rows.is_cuda and backend not in RERANGE_P2P_BACKENDS:
        # A cached graph lowered for NCCL run on another backend: same bytes through the all-gather form.
        ledger.fell_back("cp_rerange_p2p", rows.device.type, ALL_GATHER, f"a {backend} group, not NCCL",
                         instead_of=BLOCK_PROVIDER_NAME)
        return cp_rerange_decomposed(rows, rerange_index, group_name, world_size)
    return exchange_and_place(rows, rerange_index, group)


def register_block_provider(device_types=("cuda",)) -> None:
    """Make :func:`cp_rerange_p2p_blocks` the provider of ``cpgraph::cp_rerange_p2p`` on ``device_types``."""
    from cpgraph.ops.providers import register_provider  # (imports cpgraph.ops: the op exists first)

    for device_type in device_types:
        register_provider("cp_rerange_p2p", device_type, BLOCK_PROVIDER_NAME, cp_rerange_p2p_blocks)


BLOCK_PROVIDER_NAME = "p2p_blocks"
ALL_GATHER = "all_gather"  # the report's name for cp_rerange_decomposed run by the P2P providers
