"""The prefill-side sender: owned pages only, coalesced, byte-capped, absolute positions.

A CP rank's page table for a request holds its physical page for every
logical page it owns and ``-1`` for the others, so "owned pages" is simply
``table[pos] >= 0``.  A chunk covers logical pages ``[page_start,
page_end)`` of the *whole request* (absolute: chunk N starts at
``start_token // page_size``, never 0), and decode's ``dst_pages`` is
indexed by that same absolute position -- a chunk-local index would write
chunk N over chunk 0 and corrupt chunked prefill.

Runs of pages that are consecutive on both sides become one block; blocks
are cut into batches of at most ``max_batch_bytes`` so one submit never
pins an unbounded amount of engine work, and a Failed room stops between
batches.  Every byte count in :class:`TransferMetrics` is of batches the
engine reported done -- not an estimate from prompt lengths.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .engine import MooncakeEngine
from .layout import PoolLayout
from .status import RoomStatus, StatusTable

AUX_BYTES = 32  # int64 [first_token, prompt_len, rank, draft_token (-1: the prefill ran no MTP draft)]


@dataclass
class RoomTarget:
    """Where decode wants one room's KV (from a REGISTER frame)."""

    room: int
    session: str
    layout: PoolLayout
    dst_pages: np.ndarray  # decode physical page per logical page of the request
    aux_ptr: int
    aux_bytes: int
    secret: str = ""  # the registrant's room secret (POLL/ABORT must present it)
    request: dict | None = field(default=None, repr=False)  # the REGISTER frame, to recognise an identical resend


@dataclass
class TransferMetrics:
    bytes_sent: int = 0
    batches: int = 0
    seconds: float = 0.0
    failures: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int, batches: int, seconds: float, ok: bool) -> None:
        with self._lock:
            if ok:
                self.bytes_sent += nbytes
                self.batches += batches
            else:
                self.failures += 1
            self.seconds += seconds


def owned_runs(table: Sequence[int], dst_pages: Sequence[int], page_start: int, page_end: int) -> np.ndarray:
    """``[R, 3]`` runs ``(src_page, dst_page, n_pages)`` of the owned pages in ``[page_start, page_end)``.

    Runs merge neighbours that are consecutive on both sides; logical order is kept.
    """
    table = np.asarray(table, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    if not 0 <= page_start <= page_end <= table.shape[0]:
        raise ValueError(f"chunk pages [{page_start}, {page_end}) outside the request's {table.shape[0]} pages")
    if page_end > dst.shape[0]:
        raise ValueError(f"decode registered {dst.shape[0]} pages, the chunk reaches page {page_end}")
    pos = np.arange(page_start, page_end, dtype=np.int64)
    pos = pos[table[pos] >= 0]
    if pos.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    src, dpg = table[pos], dst[pos]
    if (dpg < 0).any():
        raise ValueError("decode has no page for a logical page this rank sends")
    brk = np.ones(pos.size, dtype=bool)
    brk[1:] = (src[1:] != src[:-1] + 1) | (dpg[1:] != dpg[:-1] + 1)
    starts = np.flatnonzero(brk)
    lens = np.diff(np.append(starts, pos.size))
    return np.stack([src[starts], dpg[starts], lens], axis=1)


def layer_blocks(runs: np.ndarray, src_base: int, dst_base: int, page_bytes: int):
    """Byte blocks ``(src_ptrs, dst_ptrs, lens)`` of one layer's pool for ``runs``."""
    return (src_base + runs[:, 0] * page_bytes, dst_base + runs[:, 1] * page_bytes, runs[:, 2] * page_bytes)


def cap_batches(src, dst, lens, max_bytes: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Split blocks into batches of at most ``max_bytes`` (blocks larger than that are cut)."""
    if max_bytes < 1:
        raise ValueError(f"max_batch_bytes must be >= 1, got {max_bytes}")
    batches, cur, size = [], ([], [], []), 0
    for s, d, n in zip(np.asarray(src).tolist(), np.asarray(dst).tolist(), np.asarray(lens).tolist()):
        while n > 0:
            take = min(n, max_bytes - size)
            cur[0].append(s), cur[1].append(d), cur[2].append(take)
            s, d, n, size = s + take, d + take, n - take, size + take
            if size == max_bytes:
                batches.append(cur)
                cur, size = ([], [], []), 0
    if cur[2]:
        batches.append(cur)
    return batches


@dataclass
class ChunkPlan:
    """One chunk of one room on this rank: the runs every layer sends."""

    room: int
    target: RoomTarget
    runs: np.ndarray
    page_start: int
    page_end: int
    last: bool


class KVSender:
    """Sends this rank's owned pages of registered rooms through a :class:`MooncakeEngine`."""

    def __init__(self, engine: MooncakeEngine, local: PoolLayout, statuses: StatusTable,
                 max_batch_bytes: int = 32 << 20):
        self.engine, self.local, self.statuses = engine, local, statuses
        self.max_batch_bytes = int(max_batch_bytes)
        self.metrics: dict[int, TransferMetrics] = {}
        self._lock = threading.Lock()

    def metric(self, room: int) -> TransferMetrics:
        """The room's counters, created on first use (only for rooms this rank sends: bounded by its rooms)."""
        with self._lock:
            return self.metrics.setdefault(room, TransferMetrics())

    def bytes_sent(self, room: int) -> int:
        """Bytes the engine completed for ``room``; 0 for a room never sent (creates no entry)."""
        with self._lock:
            m = self.metrics.get(room)
        return 0 if m is None else m.bytes_sent

    def forget(self, room: int) -> None:
        with self._lock:
            self.metrics.pop(room, None)

    def plan(self, target: RoomTarget, table, page_start: int, page_end: int, last: bool) -> ChunkPlan:
        return ChunkPlan(target.room, target, owned_runs(table, target.dst_pages, page_start, page_end),
                         page_start, page_end, last)

    def layer_batches(self, plan: ChunkPlan, layers: Sequence[int]):
        """Batches for the MLA pages (and index-K pages, on index layers) of ``layers``."""
        if plan.runs.shape[0] == 0:
            return []
        L, R = self.local, plan.target.layout
        blocks = []
        for layer in layers:
            blocks.append(layer_blocks(plan.runs, L.mla_ptrs[layer], R.mla_ptrs[layer], L.mla_page_bytes))
            if layer in L.index_layers:
                j = L.index_layers.index(layer)
                blocks.append(layer_blocks(plan.runs, L.index_ptrs[j], R.index_ptrs[j], L.index_page_bytes))
        src, dst, lens = (np.concatenate([b[k] for b in blocks]) for k in range(3))
        return cap_batches(src, dst, lens, self.max_batch_bytes)

    def send_layers(self, plan: ChunkPlan, layers: Sequence[int]) -> int:
        """Blocking send of ``layers``; stops (returns -1) once the room is Failed."""
        m = self.metric(plan.room)
        for src, dst, lens in self.layer_batches(plan, layers):
            if self.statuses.failed(plan.room):
                return -1
            t0 = time.perf_counter()
            rc = self.engine.write(plan.target.session, src, dst, lens)
            m.add(sum(lens), 1, time.perf_counter() - t0, rc == 0)
            if rc != 0:
                self.statuses.fail(plan.room)
                return rc
        return 0

    def submit_layers(self, plan: ChunkPlan, layers: Sequence[int]) -> list[tuple[int, int]]:
        """Async submit of ``layers``; returns ``(batch_id, bytes)`` pairs (batch id 0 = submit failed)."""
        out = []
        for src, dst, lens in self.layer_batches(plan, layers):
            if self.statuses.failed(plan.room):
                break
            bid = self.engine.submit(plan.target.session, src, dst, lens)
            out.append((bid, sum(lens)))
            if bid == 0:
                self.statuses.fail(plan.room)
                break
        return out

    def wait_submitted(self, room: int, submitted: Sequence[tuple[int, int]], seconds_from: float) -> int:
        """Wait async batches and account the bytes of the ones that completed."""
        if not submitted:
            return 0
        rc = self.engine.wait([b for b, _ in submitted])
        self.metric(room).add(sum(n for _, n in submitted), len(submitted), time.perf_counter() - seconds_from, rc == 0)
        if rc != 0:
            self.statuses.fail(room)
        return rc

    def send_aux(self, plan: ChunkPlan, aux_src_ptr: int) -> int:
        """Write the aux record (first token) with the last chunk."""
        if self.statuses.failed(plan.room):
            return -1
        n = min(AUX_BYTES, plan.target.aux_bytes)
        rc = self.engine.write(plan.target.session, [aux_src_ptr], [plan.target.aux_ptr], [n])
        self.metric(plan.room).add(n, 1, 0.0, rc == 0)
        if rc != 0:
            self.statuses.fail(plan.room)
        return rc

    def status_after_chunk(self, plan: ChunkPlan, rc: int) -> RoomStatus:
        if rc != 0:
            self.statuses.fail(plan.room)
        elif plan.last:
            self.statuses.update(plan.room, RoomStatus.SUCCESS)
        else:
            self.statuses.update(plan.room, RoomStatus.TRANSFERRING)
        return self.statuses.get(plan.room)
