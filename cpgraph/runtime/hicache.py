"""HiCache: an L2 host pool per rank (owned pages only) behind the L1 device pool.

Each rank backs up and loads back only the pages it owns.  A node's page
*owner sequence* is saved in the radix node (``CPNodeMeta.page_owners``) and
load-back allocates device pages with ``alloc_pages_with_owners(saved
owners)``, so every rank's bytes land in a page that the same rank owns in
the new layout.  Loading with a plain allocation produces garbage output:
ranks then write their bytes into pages whose logical
position another rank owns.  So there is no plain-allocation fallback: an
owner-lane deficit evicts from that lane and retries once, then the request
degrades to a cache miss (recompute), visibly counted.

Transfers run per layer.  A *payload* is one layer's MLA records or one
active index layer's index-K pages, named by its logical layer id
(``("mla", 3)``, ``("index", 2)``); a node is usable from L2 only when every
payload is present.  On CUDA the copies run on a side stream and each layer
records an event, so a consumer can wait for exactly layer L
(:meth:`TransferHandle.wait_layer`); on CPU the same code runs synchronously
and the events are ``None``.

Host layouts:

* ``layer_page_first``: one host tensor per payload ``[host_pages, bytes]``;
  a layer's pages are contiguous rows, so per-layer copies are plain runs;
* ``page_first``: one tensor ``[host_pages, all payload bytes]`` (a page's
  layers side by side, the layout whole-page storage wants); copies move
  whole pages once and scatter per layer on the device.

Lane accounting for L1 and L2 uses :class:`~cpgraph.runtime.radix.LaneLedger`
mirrored on every rank, so eviction, backup and miss decisions are identical
across the CP group without communication.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .kv_pool import KVPool, OwnerLaneAllocator
from .radix import LaneLedger, RadixCache, RadixNode, check_pages_match_owners, int_array

log = logging.getLogger(__name__)

LAYOUTS = ("page_first", "layer_page_first")
WRITE_POLICIES = ("write_through", "write_back")


class LaneDeficit(RuntimeError):
    """Some owner lane lacks free pages; ``deficits`` = ``{lane: pages short}`` (identical on all ranks)."""

    def __init__(self, deficits: dict[int, int], where: str):
        self.deficits = deficits
        super().__init__(f"{where}: owner lanes short of pages {deficits}")


class DevicePages:
    """L1: this rank's :class:`KVPool` plus the all-lane ledger (same capacity on every rank)."""

    def __init__(self, pool: KVPool, cp_size: int):
        self.pool = pool
        self.rank = pool.config.rank
        self.ledger = LaneLedger([pool.config.num_pages] * cp_size)

    def alloc(self, owners) -> np.ndarray:
        """Pages for ``owners`` (``-1`` for other ranks' pages); raises :class:`LaneDeficit` (nothing allocated)."""
        return _alloc(self.ledger, self.pool, owners, "device pool")

    def free(self, pages, owners) -> None:
        """Return ``pages`` (this rank's ids, ``-1`` elsewhere) with their ``owners``; all or nothing."""
        _free(self.ledger, self.pool, self.rank, pages, owners, "DevicePages.free")


def _alloc(ledger: LaneLedger, allocator, owners, where: str) -> np.ndarray:
    """Ledger and allocator move together: validate, allocate (may raise), then record in the ledger."""
    if len(ledger.capacity) == 1 and type(owners) is np.ndarray and owners.dtype == np.int64 and owners.ndim == 1 \
            and not owners.any():
        # One lane (no CP), every owner 0 -- what the engine allocates every step: the same checks and ledger
        # update in Python ints, one reduction instead of the ~18 NumPy calls of the counts below.
        need, free = owners.shape[0], int(ledger.capacity[0]) - int(ledger.used[0])
        if need > free:
            raise LaneDeficit({0: need - free}, where)
        pages = allocator.alloc_array(owners)
        ledger.used[0] += need
        return pages
    owners = int_array(owners, f"{where}: owners")
    counts = ledger.counts(owners)  # also range-checks the owners
    short = ledger.shortfall(counts)
    if short:
        raise LaneDeficit(short, where)
    pages = allocator.alloc_array(owners)  # owners checked by ledger.counts (int64, ranks of the group)
    ledger.take_counts(counts)  # cannot fail: the deficit check above passed
    return pages


def _free(ledger: LaneLedger, allocator, rank: int, pages, owners, where: str) -> None:
    """Validate everything first (ids, owners, their pairing, both ledgers), then update both or neither."""
    pages = int_array(pages, f"{where}: pages")
    owners = int_array(owners, f"{where}: owners")
    check_pages_match_owners(pages, owners, rank, where)
    counts = ledger.check_give(owners)
    allocator.free(pages)  # validates the whole list before changing anything
    ledger.apply_give(counts)


def payloads_of(pool: KVPool) -> list[tuple[tuple[str, int], torch.Tensor]]:
    """Every per-layer payload of the pool as a byte view ``[num_pages, bytes_per_page]``, with its logical id."""
    c = pool.config
    out = []
    for layer in range(c.num_layers):
        out.append((("mla", layer), pool.mla_pool(layer).view(torch.uint8).view(c.num_pages, -1)))
    for layer in c.active_index_layers:
        out.append((("index", layer), pool.index_pool(layer).view(torch.uint8).view(c.num_pages, -1)))
    return out


class HostPool:
    """L2 of one rank: owned pages only, pinned when the device is CUDA."""

    def __init__(self, device_pool: KVPool, num_pages: int, cp_size: int, layout: str = "layer_page_first"):
        if layout not in LAYOUTS:
            raise ValueError(f"HostPool: layout must be one of {LAYOUTS}, got {layout!r}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"HostPool: num_pages must be an int >= 0, got {num_pages!r}")
        self.layout, self.num_pages = layout, num_pages
        self.rank = device_pool.config.rank
        self.payload_ids = [pid for pid, _ in payloads_of(device_pool)]
        self.payload_bytes = [v.shape[1] for _, v in payloads_of(device_pool)]
        pin = torch.device(device_pool.config.device).type == "cuda"
        if layout == "page_first":
            self.offsets = np.concatenate([[0], np.cumsum(self.payload_bytes)]).astype(np.int64)
            self.buffer = torch.zeros(num_pages, int(self.offsets[-1]), dtype=torch.uint8, pin_memory=pin)
        else:
            self.buffers = [torch.zeros(num_pages, nb, dtype=torch.uint8, pin_memory=pin) for nb in self.payload_bytes]
        self.allocator = OwnerLaneAllocator(num_pages, self.rank)
        self.ledger = LaneLedger([num_pages] * cp_size)
        self._flat: list[tuple[memoryview, int]] | None = None  # (byte view of a buffer, bytes per row), lazily

    @property
    def required_payloads(self) -> frozenset:
        return frozenset(self.payload_ids)

    def payload_view(self, j: int) -> torch.Tensor:
        """Host ``[num_pages, bytes]`` of payload ``j`` (strided under ``page_first``)."""
        if self.layout == "page_first":
            return self.buffer[:, int(self.offsets[j]) : int(self.offsets[j + 1])]
        return self.buffers[j]

    def total_bytes(self) -> int:
        return self.buffer.nbytes if self.layout == "page_first" else sum(b.nbytes for b in self.buffers)

    def tensors(self) -> list[torch.Tensor]:
        """The host tensors holding the pages (what an L3 backend registers for zero-copy transfers)."""
        return [self.buffer] if self.layout == "page_first" else list(self.buffers)

    def page_parts(self, page: int) -> list[torch.Tensor]:
        """Host page ``page`` as 1-D uint8 views, one per payload in payload order (an L3 object's byte ranges).

        Under ``page_first`` the page is one contiguous row, returned whole:
        the same bytes in the same order, so both layouts read and write the
        same L3 objects.
        """
        if self.layout == "page_first":
            return [self.buffer[page]]
        return [b[page] for b in self.buffers]

    def page_views(self, pages) -> list[list[memoryview]]:
        """:meth:`page_parts` of each page of ``pages`` as flat byte memoryviews of the same memory.

        What the L3 reads into and stores from: a slice of one memoryview per
        host buffer instead of a tensor view per payload (plus its checks and
        byte view) per page, a fraction of the per-page cost at a restore's
        hundreds of pages.  Raises ``IndexError`` for a page outside the pool
        (a slice would quietly clamp).
        """
        idx = np.asarray(pages, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_pages):
            raise IndexError(f"HostPool.page_views: pages must be in [0, {self.num_pages}), "
                             f"got {idx.min()}..{idx.max()}")
        if self._flat is None:
            self._flat = [(memoryview(t.numpy().reshape(-1)), t.shape[1]) for t in self.tensors()]
        flat = self._flat
        if len(flat) == 1:
            (v, nb), = flat
            return [[v[p * nb : (p + 1) * nb]] for p in idx.tolist()]
        return [[v[p * nb : (p + 1) * nb] for v, nb in flat] for p in idx.tolist()]

    def alloc(self, owners) -> np.ndarray:
        return _alloc(self.ledger, self.allocator, owners, "host pool")

    def free(self, pages, owners) -> None:
        _free(self.ledger, self.allocator, self.rank, pages, owners, "HostPool.free")


def _runs(idx: np.ndarray) -> list[tuple[int, int, int]]:
    """``(start_in_idx, first_value, length)`` for each run of consecutive values in ``idx``."""
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [idx.size]])
    return [(int(s), int(idx[s]), int(e - s)) for s, e in zip(starts, ends)]


@dataclass
class TransferHandle:
    """Per-layer completion of one backup or load-back (events are ``None`` on CPU: already done)."""

    layer_events: dict  # logical layer id -> torch.cuda.Event | None
    pages: int
    bytes: int

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait for layer ``layer``'s copy only."""
        ev = self.layer_events.get(layer)
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)

    def wait_all(self) -> None:
        for layer in sorted(self.layer_events):
            self.wait_layer(layer)

    def synchronize(self) -> None:
        for ev in self.layer_events.values():
            if ev is not None:
                ev.synchronize()


class HiCache:
    """L1 <-> L2 transfers and the owner-preserving load-back (see module docstring)."""

    def __init__(self, device: DevicePages, host: HostPool, tree: RadixCache, *,
                 write_policy: str = "write_through", evict_device: Callable[[dict], None] | None = None):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"HiCache: write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        self.device, self.host, self.tree = device, host, tree
        self.write_policy = write_policy
        self.evict_device = evict_device  # callback: {lane: pages} -> evicts L1 for those lanes
        # Called with an L2-only node just before L2 drops it to make room (the L3 write-back hook).
        self.before_host_evict: Callable[[RadixNode], None] | None = None
        self.payloads = payloads_of(device.pool)
        self.layers = sorted({pid[1] for pid, _ in self.payloads})
        dev = torch.device(device.pool.config.device)
        self.cuda = dev.type == "cuda"
        self.torch_device = dev
        self.stream = torch.cuda.Stream(device=dev) if self.cuda else None
        self.stats = {"backup_pages": 0, "load_pages": 0, "load_misses": 0, "backup_misses": 0,
                      "backup_bytes": 0, "load_bytes": 0}

    # --------------------------------------------------------------- helpers
    def _ctx(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _event(self):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def _owned(self, node_pages: np.ndarray, host_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mine = node_pages >= 0
        return node_pages[mine], host_pages[mine]

    def release_host(self, node: RadixNode) -> None:
        """Free ``node``'s L2 pages (the tree clears the node's fields)."""
        if node.host_pages is not None:
            self.host.free(node.host_pages, node.page_owners)

    def evict_host_node(self, node: RadixNode) -> None:
        """Drop ``node``'s L2 copy because L2 needs the room: :attr:`before_host_evict` first, then free."""
        if self.before_host_evict is not None and node.host_pages is not None:
            self.before_host_evict(node)
        self.release_host(node)

    def usable_from_host(self, node: RadixNode) -> bool:
        """All payloads (MLA of every layer, index-K of every active index layer) present in L2."""
        return node.host_pages is not None and node.host_payloads >= self.host.required_payloads

    # ---------------------------------------------------------------- backup
    def backup(self, nodes: Sequence[RadixNode]) -> TransferHandle | None:
        """Copy ``nodes`` (in L1) to L2 per layer; nodes that cannot get host pages stay un-backed.

        Host-lane deficits first drop least-recently-used L2-only leaves of
        the deficit lanes, then retry once.  Returns the handle, or ``None``
        when nothing was copied.
        """
        todo, host_lists = [], []
        for node in nodes:
            if node.device_pages is None or node.host_pages is not None:
                continue
            hp = self.alloc_host(node.page_owners)
            if hp is None:
                self.stats["backup_misses"] += 1
                continue
            node.host_pages = hp
            todo.append(node)
            host_lists.append(hp)
        if not todo:
            return None
        dev = np.concatenate([n.device_pages for n in todo])
        hst = np.concatenate(host_lists)
        d_idx, h_idx = self._owned(dev, hst)
        handle = self._copy(d_idx, h_idx, to_host=True)
        for node in todo:
            node.host_payloads = self.host.required_payloads
        self.stats["backup_pages"] += int(sum(n.num_pages for n in todo))
        self.stats["backup_bytes"] += handle.bytes
        return handle

    def alloc_host(self, owners) -> np.ndarray | None:
        """L2 pages for ``owners``; a lane deficit drops the lane's LRU L2-only leaves and retries once; else None."""
        for attempt in range(2):
            try:
                return self.host.alloc(owners)
            except LaneDeficit as exc:
                if attempt:
                    return None
                for lane, need in exc.deficits.items():
                    self.tree.evict_host(need, self.evict_host_node, lane=lane)
        return None

    # ------------------------------------------------------------- load back
    def load_back(self, nodes: Sequence[RadixNode]) -> TransferHandle | None:
        """Bring L2-only ``nodes`` (a contiguous path, parent first) back to L1, owner-preserving.

        Allocates with the nodes' saved owner sequence.  On a lane deficit:
        evict L1 for the deficit lanes (``evict_device``) and retry once; if
        still short return ``None`` -- the caller treats the nodes as a cache
        miss and recomputes.  Never a plain allocation.
        """
        nodes = [n for n in nodes]
        if not nodes:
            return None
        if not all(self.usable_from_host(n) and n.device_pages is None for n in nodes):
            raise ValueError("HiCache.load_back: every node must be L2-only with all payloads present")
        loaded = self.load_pages(np.concatenate([n.host_pages for n in nodes]),
                                 np.concatenate([n.page_owners for n in nodes]))
        if loaded is None:
            return None
        pages, handle = loaded
        start = 0
        for n in nodes:
            self.tree.mark_loaded(n, pages[start : start + n.num_pages])
            start += n.num_pages
        return handle

    def load_pages(self, host_pages, owners) -> tuple[np.ndarray, TransferHandle] | None:
        """Copy L2 pages that no node holds into new L1 pages with ``owners``: ``(device pages, handle)`` or None.

        What :meth:`load_back` does for a node, for pages the tree cannot hold
        yet (the L3 pages after a failed one, docs/cache.md): the same
        owner-preserving allocation, the same evict-and-retry-once on a lane
        deficit, ``None`` (counted in ``load_misses``) when still short.  The
        L2 pages stay allocated: the caller frees them (every later host-side
        write into L2 rows waits for the side stream first).
        """
        hst = int_array(host_pages, "HiCache.load_pages: host_pages")
        owners = int_array(owners, "HiCache.load_pages: owners")
        pages = None
        for attempt in range(2):
            try:
                pages = self.device.alloc(owners)
                break
            except LaneDeficit as exc:
                if attempt or self.evict_device is None:
                    break
                self.evict_device(exc.deficits)
        if pages is None:
            self.stats["load_misses"] += 1
            log.info("HiCache load-back of %d page(s) degraded to a cache miss (owner-lane deficit)", owners.size)
            return None
        # alloc_pages_with_owners guarantees the owner pattern: our pages sit exactly where we own.
        d_idx, h_idx = self._owned(pages, hst)
        handle = self._copy(d_idx, h_idx, to_host=False)
        self.stats["load_pages"] += int(owners.size)
        self.stats["load_bytes"] += handle.bytes
        return pages, handle

    # -------------------------------------------------------------- transfers
    def _copy(self, dev_pages: np.ndarray, host_pages: np.ndarray, *, to_host: bool) -> TransferHandle:
        """Move pages between L1 and L2, layer by layer, recording one event per logical layer."""
        events, total = {}, 0
        n = int(dev_pages.size)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream())  # see writes of earlier forwards / frees
        with self._ctx():
            d_idx = torch.as_tensor(dev_pages, dtype=torch.int64).to(self.torch_device, non_blocking=True)
            order = np.argsort(host_pages, kind="stable")  # host runs are contiguous rows
            h_sorted, d_sorted = host_pages[order], d_idx[torch.as_tensor(order).to(self.torch_device)]
            runs = _runs(h_sorted)
            if self.host.layout == "page_first":
                total = self._copy_page_first(d_sorted, runs, n, to_host, events)
            else:
                for layer in self.layers:
                    for j, (pid, view) in enumerate(self.payloads):
                        if pid[1] != layer:
                            continue
                        total += self._copy_payload(j, view, d_sorted, runs, n, to_host)
                    events[layer] = self._event()
        return TransferHandle(events, n, total)

    def _copy_payload(self, j, view, d_idx, runs, n, to_host) -> int:
        host = self.host.payload_view(j)
        nb = view.shape[1]
        if n == 0:
            return 0
        if to_host:
            staged = view.index_select(0, d_idx)
            for s, h0, ln in runs:
                host[h0 : h0 + ln].copy_(staged[s : s + ln], non_blocking=self.cuda)
        else:
            staged = torch.empty(n, nb, dtype=torch.uint8, device=view.device)
            for s, h0, ln in runs:
                staged[s : s + ln].copy_(host[h0 : h0 + ln], non_blocking=self.cuda)
            view.index_copy_(0, d_idx, staged)
        return n * nb

    def _copy_page_first(self, d_idx, runs, n, to_host, events) -> int:
        host, offs = self.host.buffer, self.host.offsets
        width = host.shape[1]
        if n == 0:
            for layer in self.layers:
                events[layer] = self._event()
            return 0
        device = self.payloads[0][1].device
        staged = torch.empty(n, width, dtype=torch.uint8, device=device)
        if to_host:
            for layer in self.layers:
                for j, (pid, view) in enumerate(self.payloads):
                    if pid[1] == layer:
                        staged[:, int(offs[j]) : int(offs[j + 1])] = view.index_select(0, d_idx)
            for s, h0, ln in runs:
                host[h0 : h0 + ln].copy_(staged[s : s + ln], non_blocking=self.cuda)
            for layer in self.layers:
                events[layer] = self._event()
        else:
            for s, h0, ln in runs:  # whole pages in one copy per run ...
                staged[s : s + ln].copy_(host[h0 : h0 + ln], non_blocking=self.cuda)
            for layer in self.layers:  # ... then a per-layer scatter on the device
                for j, (pid, view) in enumerate(self.payloads):
                    if pid[1] == layer:
                        view.index_copy_(0, d_idx, staged[:, int(offs[j]) : int(offs[j + 1])])
                events[layer] = self._event()
        return n * width
