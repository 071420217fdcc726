"""Admission: a request's prefix match, its fixed chunk sequence, and the pages reserved for it up front.

Why reserve at admission: the chunk sequence is fixed when a request is
admitted, so the pages each lane will need are known exactly; a request is
admitted only if they fit what is free plus what the cache could evict, less
what running requests reserved -- a running request never waits for pages
halfway, admission waits instead (docs/serve.md, page admission).  The match
changes the cache (node splits, LRU ticks), so it is an op every rank
applies (:mod:`cpgraph.runtime.op_log`).

:class:`_Admission` is a mixin of :class:`~cpgraph.runtime.prefill_engine.PrefillEngine`
(its only user): it works on the engine's cache, scheduler and prefetches and
logs its ops and refusals through the engine (``_log``, ``_close``).
"""

from __future__ import annotations

import numpy as np

from .draft_choice import _random_seed
from .live_request import _Live
from .requests import REFUSED
from .sampling import Sampling
from .scheduler import chunk_spans, lane_pages


class _Admission:
    """Matching, chunking, reserving and releasing a request's pages (module docstring)."""

    def _admit(self, live: _Live, budget: int) -> None:
        """Match (lock L1 hits, load back L2 hits, restore L3 pages), fix the chunk sequence within ``budget``,
        reserve its pages.

        Identical on every rank.  ``live.ends`` stays empty when not even the first chunk fits the budget.
        """
        ps = self.page_size
        # The cache engine's own match (same limits, locks and rules); its L3 part was fetched in the L3 phase.
        m = self.cache.match(live.tokens, live.key, prefetched=self._prefetches.pop(live.id, None), fetch_l3=False)
        live.match = m
        live.prefix_len = m.cached_pages * ps
        live.next_chunk = 0
        spans = chunk_spans(m.segments(ps), budget, self.scheduler.config.chunk_tokens, ps)
        live.starts, live.ends = [a for a, _ in spans], [b for _, b in spans]
        live.done = live.starts[0] if spans else m.tree_pages * ps
        live.pages, live.owners = m.table(ps)
        live.reserve = lane_pages(live.starts, live.ends, self.cp_size, ps)

    def _release(self, live: _Live) -> None:
        """Give back everything the request holds: its own pages, its locks, its pending load-backs."""
        m = live.match
        if m is None:
            return
        self.cache.release(m)  # waits for its load-backs first: nothing is freed under an in-flight copy
        for pages, owners in zip(live.own_pages, live.own_owners):
            self.cache.device.free(pages, owners)
        live.own_pages, live.own_owners = [], []
        live.reserve = None

    def _available(self) -> np.ndarray:
        """Pages per lane that admissions may still promise: free + evictable - reserved by running requests."""
        if self.cp_size == 1:  # one lane: Python ints, one array (this runs at every admission)
            ledger = self.cache.device.ledger
            free = int(ledger.capacity[0]) - int(ledger.used[0]) + int(self.cache.evictable_by_lane()[0])
            for r in self.scheduler.running:
                if r.reserve is not None:
                    free -= int(r.reserve[0])
            return np.array([free], dtype=np.int64)
        reserved = np.zeros(self.cp_size, dtype=np.int64)
        for r in self.scheduler.running:
            if r.reserve is not None:
                reserved += r.reserve
        return self.cache.device.ledger.free_pages() + self.cache.evictable_by_lane() - reserved

    def _leader_admit(self, live: _Live, budget: int, ops: list) -> bool:
        # With HiCache, a cache-blind bound first: a match would start load-backs that cannot be used yet.
        if self.cache.hicache is not None:
            worst = lane_pages([0], [len(live.tokens)], self.cp_size, self.page_size)
            if (worst > self._available()).any():
                return False
        # The match has side effects (node splits, LRU ticks): it is an op, logged even when the
        # request then has to wait (``unadmit``), so every rank's tree goes through the same sequence.
        if self.draft is None:
            self._log(ops, ("admit", live.id, live.tokens, live.room, budget))
        else:  # every rank chooses the first token the draft reads: the same rule, and a seed the leader fixed
            if self.cp_size > 1 and not live.sampling.greedy and live.sampling.seed is None:
                live.sampling = Sampling(live.sampling.temperature, live.sampling.top_p, _random_seed())
            self._log(ops, ("admit", live.id, live.tokens, live.room, budget, live.sampling))
        if not live.ends or (live.reserve > self._available()).any():
            # Chunks split a prompt's pages over the lanes a little differently from one pass: a sequence
            # that exceeds a lane's capacity outright can never run, even on an empty pool.
            never = bool(live.ends) and bool((live.reserve > self.num_pages).any())
            self._log(ops, ("unadmit", live.id))
            if never:
                self.scheduler.remove(live)
                self._close(live, REFUSED, error=f"the prompt's chunks need more KV pages on one rank than the "
                                                 f"pool's {self.num_pages}", refusal="too_long")
            return False
        live.t_admit = self.clock()
        return True
