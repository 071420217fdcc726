"""The L3 side of :class:`~cpgraph.runtime.cache_engine.CacheEngine`: fetching a prompt's stored pages into L2.

Kept apart from the engine's core (match / commit / release / alloc / evict
/ prefill) because it is a separate lifecycle: a fetch is looked up and
started (possibly on the L3 I/O thread, ahead of admission), finished
(the ranks agree on what arrived, the pages before the first failed one are
attached to the tree) and either taken over by the request's match (the
pages after a hole, its *tail*, are restored into the request's own L1
pages) or dropped.  The engine's design is described in
:mod:`cpgraph.runtime.cache_engine`; the store tier itself is
:mod:`cpgraph.runtime.l3`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .l3 import PendingFetch
from .prefix_match import HOLE, PrefixMatch
from .radix import RadixNode, TokenKey


@dataclass
class _L3Tail:
    """The pages an L3 fetch read *after* its first failed page: they wait in L2 until the match can load them."""

    start: int  # logical page of the first failed page
    host_pages: np.ndarray  # this rank's L2 page per page of the tail (-1: another rank's, or did not arrive)
    owners: np.ndarray  # owner per page, as stored
    arrived: np.ndarray  # bool per page, the same on every rank; the tail ends on an arrived page


@dataclass
class L3Prefetch:
    """One prompt's L3 fetch between :meth:`CacheEngine.start_prefetch` and its :meth:`CacheEngine.match`."""

    tokens: list
    key: TokenKey
    start: int  # logical page after the radix hit where the fetched run begins
    pending: PendingFetch | None  # reads not agreed on yet (None once finished)
    owners: np.ndarray  # owner per page of the run, as stored
    node: RadixNode | None = None  # the attached L2-only node: the pages before the first failed one
    head_pages: int = 0
    tail: _L3Tail | None = None  # the pages that arrived after a failed one

    @property
    def fetching(self) -> bool:
        return self.pending is not None


class L3PrefetchMixin:
    """:class:`~cpgraph.runtime.cache_engine.CacheEngine`'s L3 steps (its base class; see the module docstring).

    Uses the engine's ``page_size``, ``tree`` (the radix cache), ``hicache``
    (the L2) and ``l3`` (the :class:`~cpgraph.runtime.l3.L3Tier`, ``None``
    without an L3); :meth:`match` is the engine's.
    """

    def _start_l3(self, tokens: list, key: TokenKey, background: bool) -> "L3Prefetch | None":
        """Look up the L3-resident pages right after the prompt's radix hit and start reading them into L2.

        ``None`` when there is nothing to fetch.  Every condition here
        depends only on rank-identical state (tokens, tree, mirrored
        ledgers), so all CP ranks take the same branch and issue the same
        collectives inside :meth:`L3Tier.lookup`.
        """
        limit = (len(tokens) - 1) // self.page_size
        m = self.tree.match_prefix(key, max_pages=limit)
        start = sum(n.num_pages for n in m.nodes)
        if start >= limit or self.tree.extends_past(key, start):
            return None  # all cached, or the tree goes on (an MTP draft back-off): nothing for L3 to add
        if not all(n.device_pages is not None or self.hicache.usable_from_host(n) for n in m.nodes):
            return None
        digests = self.l3.chain(tokens, limit)[start:]
        owners = self.l3.lookup(digests)
        if owners.size == 0:
            return None
        anchor = m.nodes[-1] if m.nodes else None
        if anchor is not None:
            self.tree.inc_lock(anchor)  # L2 room for the fetch must not come from this prompt's own path
        try:
            pending = self.l3.start_fetch(digests[: owners.size], owners, background=background)
        finally:
            if anchor is not None:
                self.tree.dec_lock(anchor)
        return None if pending is None else L3Prefetch(tokens, key, start, pending, pending.owners)

    def _finish_l3(self, pf: "L3Prefetch") -> None:
        """Agree on what arrived; attach the pages before the first failed one to the tree as an L2-only node.

        The pages that arrived after it (the tail) stay in L2 outside the
        tree, in ``pf.tail``, until :meth:`match` restores them.  A fetch
        started ahead of admission is attached only if the tree still holds
        exactly the prompt's first ``pf.start`` pages (other requests may
        have cached or evicted pages meanwhile); else its pages are freed.
        """
        hp, arrived = self.l3.finish_fetch(pf.pending)
        pf.pending = None
        owners, n, ps = pf.owners, int(hp.size), self.page_size
        if (pf.start and not self.tree.extends_past(pf.key, pf.start - 1)) or self.tree.extends_past(pf.key, pf.start):
            self.hicache.host.free(hp[arrived], owners[arrived])  # (-1 where another rank owns a page)
            return
        cut = int(np.argmin(arrived)) if not arrived.all() else n
        if cut < n and arrived[cut:].any():
            last = n - int(np.argmax(arrived[::-1]))  # the tail ends on its last arrived page
            pf.tail = _L3Tail(pf.start + cut, hp[cut:last], owners[cut:last], arrived[cut:last].copy())
        if cut:
            end = pf.start + cut
            pf.node = self.tree.attach_host(pf.key[: end * ps], pf.start, hp[:cut], owners[:cut],
                                            self.hicache.host.required_payloads, next_token=int(pf.tokens[end * ps]))
            pf.head_pages = cut

    def _drop_tail(self, tail: _L3Tail) -> None:
        """Give back a tail's L2 pages (the fetch already freed those of the pages that did not arrive)."""
        sel = tail.arrived
        self.hicache.host.free(tail.host_pages[sel], tail.owners[sel])

    def _restore_tail(self, req: PrefixMatch, tail: _L3Tail) -> None:
        """Load the tail's arrived pages into pages ``req`` holds, leaving holes at the failed ones.

        Only when the tree prefix reaches the tail (``tree_pages ==
        tail.start``): if an L2 load-back before it degraded to a miss, so
        does the tail (the request computes from the end of its prefix).
        The tail's L2 pages are freed once the copy is issued: any later
        host-side write into L2 rows first waits for HiCache's side stream.
        """
        sel = tail.arrived
        loaded = None
        if req.tree_pages == tail.start:
            loaded = self.hicache.load_pages(tail.host_pages[sel], tail.owners[sel])
        self._drop_tail(tail)
        if loaded is None:
            return
        pages, handle = loaded
        req.restored_pages = np.full(sel.shape[0], HOLE, dtype=np.int64)
        req.restored_owners = np.full(sel.shape[0], HOLE, dtype=np.int64)
        req.restored_pages[sel], req.restored_owners[sel] = pages, tail.owners[sel]
        req.holes = [(tail.start + a, tail.start + a + n) for a, n in _false_runs(sel)]
        req.holds_restored = True
        req.loads.append(handle)
        req.l3_hit += int(sel.sum()) * self.page_size

    # --------------------------------------------------------------------- L3
    def prefetch(self, token_lists: Sequence[Sequence[int]]) -> list[int]:
        """Fetch each prompt's L3-resident prefix (past its radix hit) into L2 now; returns tokens fetched per prompt.

        The synchronous form of :meth:`start_prefetch` + :meth:`finish_prefetch`:
        the pages stay in L2 as cache, where a later :meth:`prefill` or
        :meth:`match` finds them (as ``host`` hits); pages after a failed
        one are not kept (the tree cannot hold them).  Every CP rank must
        call it with the same prompts (it runs the lookup collectives).
        Without an L3 it fetches nothing.
        """
        out = []
        for tokens in token_lists:
            tokens = list(tokens)
            pf = None
            if self.l3 is not None and len(tokens) > self.page_size:
                pf = self._start_l3(tokens, TokenKey(tokens), background=False)
            if pf is None:
                out.append(0)
                continue
            self._finish_l3(pf)
            out.append(pf.head_pages * self.page_size if pf.node is not None else 0)
            self.drop_prefetch(pf)
        return out

    def start_prefetch(self, tokens: Sequence[int], key: TokenKey | None = None) -> "L3Prefetch | None":
        """Start fetching a queued prompt's L3-resident prefix into L2 on the L3 I/O thread; ``None``: nothing to fetch.

        For a scheduler: call it when a request is queued, go on computing
        other requests, then :meth:`finish_prefetch` before the request's
        :meth:`match` (``prefetched=``), so the read overlapped the compute.
        The lookup runs now (every CP rank, same order: it is a collective);
        the L2 pages stay allocated, outside the tree, until the finish.
        """
        if self.l3 is None or len(tokens) <= self.page_size:
            return None
        tokens = list(tokens)
        return self._start_l3(tokens, key if key is not None else TokenKey(tokens), background=True)

    def finish_prefetch(self, pf: "L3Prefetch") -> int:
        """Wait for ``pf``'s reads, agree on what arrived (CP: a collective), attach it; returns the tokens kept."""
        if pf.pending is not None:
            self._finish_l3(pf)
        kept = pf.head_pages if pf.node is not None else 0
        if pf.tail is not None:
            kept += int(pf.tail.arrived.sum())
        return kept * self.page_size

    def drop_prefetch(self, pf: "L3Prefetch") -> None:
        """Give back what ``pf`` holds outside the tree (reads in flight, a tail); rank-local, no collectives."""
        if pf.pending is not None:
            self.l3.discard(pf.pending)
            pf.pending = None
        if pf.tail is not None:
            self._drop_tail(pf.tail)
            pf.tail = None

    def flush_l3(self) -> int:
        """Store every cached node that has no L3 copy yet (L1-only nodes are backed up to L2 first, room permitting).

        What a process calls before it exits under ``write_back`` (whose
        stores otherwise happen only when L2 drops a node); under
        ``write_through`` it stores what an earlier write failed to.
        Returns the pages this rank stored.
        """
        if self.l3 is None:
            return 0
        nodes = list(self.tree.nodes())
        handle = self.hicache.backup([n for n in nodes if n.device_pages is not None and n.host_pages is None])
        if handle is not None:
            handle.synchronize()
        return self.l3.flush(nodes)


def _false_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """``(start, length)`` of each run of ``False`` in ``mask``."""
    idx = np.flatnonzero(~mask)
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [idx.size]])
    return [(int(idx[a]), int(b - a)) for a, b in zip(starts, ends)]

