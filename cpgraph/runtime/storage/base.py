"""The page-store interface every L3 backend implements, and its failure rules.

Why page-granular batches: the radix tree, the L2 host pool and CP page
ownership all work in whole pages, so an L3 object is exactly one page: the
page's records for every layer the pool holds (MLA records of every layer,
index-K pages of the indexer layers, the MTP draft layer when the pool has
one), concatenated in the pool's payload order.  A request asks for a run of
pages at once, which lets a backend issue one batch call (one round trip to
a Mooncake master, one pass over a thread pool of file reads).

Why host buffers: ``get`` writes straight into the rows of the L2 host pool
(``parts`` below are views of those rows), so the bytes cross at most once
from the backend into memory that the per-layer L2 -> L1 load-back already
knows how to move.  A part is a contiguous 1-D uint8 host tensor or a flat
byte ``memoryview`` of host memory (what :meth:`HostPool.page_views
<cpgraph.runtime.hicache.HostPool.page_views>` hands out: slicing one
memoryview per pool buffer costs a fraction of a microsecond, a tensor view
plus its checks and byte view several -- at 512 pages x 4 payloads per
restore that was a third of the fetch).  A backend that can read into registered memory without
a copy (Mooncake's ``batch_get_into``, ``os.preadv`` for files) does so;
:meth:`PageStore.register` tells it which memory that is.

Why no exceptions for I/O: an L3 that is down, full, read-only or returns a
corrupt object must never stop serving.  Every batch call returns one bool
per key (``False`` = miss / not stored); the backend logs each failure
*reason* once (:meth:`PageStore.warn_once`) and counts every failure in
:attr:`PageStore.stats`.  Programming errors (wrong part sizes, non-uint8
buffers) still raise.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from typing import Sequence

import torch

log = logging.getLogger("cpgraph.storage")

# One object's byte ranges, in order: contiguous 1-D uint8 host tensors or flat byte memoryviews.
Parts = Sequence["torch.Tensor | memoryview"]


def check_parts(parts: Parts, where: str, *, writable: bool = False) -> int:
    """Total bytes of one object's ``parts``; refuses anything but contiguous 1-D uint8 CPU tensors and
    C-contiguous 1-D byte memoryviews (``writable``: a read lands in them, so no read-only memoryview)."""
    total = 0
    for t in parts:
        if type(t) is memoryview:
            if t.format != "B" or t.ndim != 1 or not t.c_contiguous or (writable and t.readonly):
                raise ValueError(f"{where}: memoryview parts must be flat{' writable' if writable else ''} byte "
                                 f"views, got format {t.format!r}, {t.ndim}-D, "
                                 f"{'read-only' if t.readonly else 'writable'}")
            total += t.nbytes
            continue
        if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{where}: object parts must be contiguous 1-D uint8 host tensors, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
        total += t.numel()
    return total


class PageStore(ABC):
    """Page-granular batch ``exists`` / ``get`` / ``put`` over opaque string keys (see module docstring).

    ``keys`` come from :mod:`cpgraph.runtime.storage.keys`: a key already
    names the model, KV format, page size, CP size and owner rank, so a
    backend never interprets it.  ``parts[i]`` are object ``i``'s byte
    ranges (host memory); the object is their concatenation.
    """

    #: what reports call this store, e.g. ``file:/var/cache/cpgraph``
    name: str = "store"

    def __init__(self) -> None:
        self.stats = {"exists_queries": 0, "get_pages": 0, "get_misses": 0, "get_failures": 0, "get_bytes": 0,
                      "put_pages": 0, "put_skipped": 0, "put_failures": 0, "put_bytes": 0, "evicted_pages": 0}
        self._warned: set[str] = set()
        self._warn_lock = threading.Lock()  # batch calls may run on a thread pool

    # ------------------------------------------------------------- failures
    def warn_once(self, reason: str, message: str) -> None:
        """Log ``message`` at WARNING the first time ``reason`` occurs for this store; later ones at DEBUG."""
        with self._warn_lock:
            first = reason not in self._warned
            self._warned.add(reason)
        if not first:
            log.debug("%s: %s", self.name, message)
            return
        log.warning("%s: %s (further %s events are logged at DEBUG)", self.name, message, reason)

    @property
    def available(self) -> bool:
        """False while the store is unreachable: every call is then a miss without touching the backend."""
        return True

    @property
    def writable(self) -> bool:
        """False while puts are off (read-only directory, disk full, backend down)."""
        return self.available

    # -------------------------------------------------------------- the API
    def register(self, buffer: torch.Tensor) -> None:
        """Host memory that ``get`` writes into and ``put`` reads from (zero-copy backends register it)."""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (a hint: a later ``get`` can still miss)."""

    @abstractmethod
    def get(self, keys: Sequence[str], parts: Sequence[Parts]) -> list[bool]:
        """Read object ``i`` into ``parts[i]``; ``False`` where it is missing, short, corrupt or unreadable.

        A ``False`` object's buffers may hold partial bytes: the caller must
        not use them (it frees those host pages).
        """

    @abstractmethod
    def put(self, keys: Sequence[str], parts: Sequence[Parts]) -> list[bool]:
        """Store object ``i`` from ``parts[i]``; ``False`` where it was not stored (full, read-only, down)."""

    def close(self) -> None:
        """Release backend resources (idempotent)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"
