"""Cache-aware prefill: prefixes come from the radix cache (L1) or HiCache (L2), not from the caller.

:class:`CacheEngine` owns what must persist across batches: the per-rank KV
pool (the forward writes into the same tensors every call, so cached pages
stay valid), the mirrored lane ledger, the radix tree and, optionally, the
L2 host pool.  Per :meth:`CacheEngine.prefill` call, identically on every
rank of the CP group:

1. match each prompt (at most ``(len-1) // page_size`` pages: at least one
   token must be computed to produce logits) and lock the L1 part; L2-only
   nodes right after it are loaded back with their saved owner sequence
   (locked first, so evictions cannot drop them); a failed load-back is a
   miss for those pages;
2. plan the batch with the hits as page-aligned prefixes; allocate extend
   pages with the plan's owners, evicting LRU leaves of the deficit lanes and
   retrying once when a lane is short;
3. run the extend pass (``cpgraph.runtime.engine.forward_batch``);
4. insert each prompt's whole pages; free the pages the tree did not adopt
   (duplicates, e.g. the recomputed tail page of a repeated exact hit) and
   the partial last page; back up new nodes under ``write_through``;
   unlock.  With ``CPGRAPH_DEBUG=1`` the tree fingerprints are compared
   across ranks (one collective).

Hits are reported per level: ``device`` (L1), ``host`` (loaded from L2) and
``computed`` tokens per request, plus ``l3`` (fetched from the page store
into L2, then loaded back) when the engine has an L3.

With an L3 (``l3=``: a ``file:DIR`` / ``mooncake:HOST:PORT`` spec, a
:class:`~cpgraph.runtime.storage.PageStore` or an
:class:`~cpgraph.runtime.l3.L3Config`; it needs ``host_pages > 0``) step 1
first looks past each request's radix hit for the longest run of pages the
store holds, fetches it into L2 and attaches it to the tree, so the match
that follows loads it back per layer like any L2 hit
(:mod:`cpgraph.runtime.l3`).  A page that fails to arrive is a *hole*: the
pages after it are loaded into the request's own L1 pages and only the
failed pages are computed, each as an extend over the pages before it (one
pass per hole index, before the suffix pass; :class:`PrefixMatch`).  Pages reach the store from L2: when a node is
backed up (``write_through``) or when L2 drops it and at :meth:`CacheEngine.flush_l3`
(``write_back``).  :meth:`CacheEngine.start_prefetch` /
:meth:`CacheEngine.finish_prefetch` run the L3 step ahead of a request's
admission, its reads on the L3 I/O thread (the serving engine does this for
every queued request); :meth:`CacheEngine.prefetch` is its synchronous form.

A serving engine admits requests one by one through the same public steps
:meth:`CacheEngine.prefill` is made of: :meth:`CacheEngine.match`,
:meth:`CacheEngine.alloc` per chunk, :meth:`CacheEngine.commit`,
:meth:`CacheEngine.backup_inserted`, :meth:`CacheEngine.release`.

With a ``draft`` forward (the MTP layer, docs/mtp.md) the pool holds one more
logical layer (id ``num_hidden_layers``) in the same pages: a cached page
carries the draft's records too, HiCache backs it up and loads it back as one
more payload, and every call runs the draft after the target.  The draft's
record at a page's last row depends on the token after the page, so the tree
is built with ``draft_records``: each node keeps the token that followed it
(the prompt's next token, or the draft's sampled token where the prompt ends
on a page boundary) and a match stops one page before a node end whose
token differs from the new prompt's.  That page is recomputed into this
request's own extend pages (the cached page is shared and stays intact), so
the draft's records and logits are a cold run's.  Without a draft nothing is
checked and matches are as long as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from cpgraph.ops.layer_events import layer_hooks
from cpgraph.plan import plan_prefill

from .engine import _FORMATS, check_prompts, draft_pools, forward_batch, pool_config, pool_tensors
from .hicache import DevicePages, HiCache, HostPool, LaneDeficit
from .kv_pool import KVPool, KVPoolExhausted
from .l3 import L3Config, L3Tier, PendingFetch
from .radix import RadixCache, RadixNode, TokenKey, check_consistent
from .storage import store_fingerprint, weights_identity


@dataclass
class CacheResult:
    logits: Tensor  # fp32 [B, vocab]
    hits: list[dict]  # per request: {"device": tokens, "host": tokens, ["l3": tokens,] "computed": tokens}
    device_pages_in_use: int  # this rank's L1 pages held after the batch (all cached)
    topk: list[Tensor] | None = None
    meta: object | None = None
    load_misses: int = 0  # load-backs that degraded to a miss in this call
    draft_logits: Tensor | None = None  # fp32 [B, vocab] of the MTP draft (with a draft forward)

    def totals(self) -> dict:
        tiers = ("device", "host", "l3", "computed") if self.hits and "l3" in self.hits[0] else \
            ("device", "host", "computed")
        return {k: sum(h[k] for h in self.hits) for k in tiers}


_NONE = np.zeros(0, np.int64)
_NONE.setflags(write=False)

HOLE = -2  # a page table entry still to compute (a hole after a failed L3 page, or an extend page): no page yet


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


@dataclass
class PrefixMatch:
    """What admission found in the cache for one prompt (:meth:`CacheEngine.match`); rank-identical except page ids.

    The prompt's logical pages ``[0, cached_pages)`` have KV or get it
    before the prompt's own extend runs:

    * ``[0, tree_pages)``: the radix tree's pages (L1 hits, locked; L2 hits
      loaded back), ``prefix_pages`` / ``prefix_owners``;
    * ``[tree_pages, cached_pages)``: only after an L3 page failed to
      arrive: the pages that arrived after it, loaded into pages this match
      holds (``restored_pages`` / ``restored_owners``, ``HOLE`` where a page
      failed), and ``holes``, the runs of failed pages.  A hole is computed
      as an extend over the pages before it; the pages after it stay valid
      (a page's KV depends on the tokens before it, not on how their KV was
      obtained), so only the failed pages are recomputed.

    The caller computes :meth:`segments` (holes first, in order, then the
    rest of the prompt), then :meth:`CacheEngine.commit` inserts the pages
    and :meth:`CacheEngine.release` unlocks (or, for a request that does not
    run, gives everything back).
    """

    tokens: list
    key: TokenKey
    # Snapshot at match time: a later request's match may split these nodes.
    # (Each is replaced, never written in place: the defaults share one read-only empty array, one fewer
    # allocation per field on every admission.)
    prefix_pages: np.ndarray = field(default_factory=lambda: _NONE)
    prefix_owners: np.ndarray = field(default_factory=lambda: _NONE)
    restored_pages: np.ndarray = field(default_factory=lambda: _NONE)
    restored_owners: np.ndarray = field(default_factory=lambda: _NONE)
    holes: list = field(default_factory=list)  # [(first page, end page)] to compute, inside [tree_pages, cached_pages)
    locks: list = field(default_factory=list)
    loads: list = field(default_factory=list)  # in-flight L2 -> L1 load-backs (per-layer events)
    device_hit: int = 0
    host_hit: int = 0
    l3_hit: int = 0
    holds_restored: bool = False  # the restored pages are this match's (until commit or release)

    @property
    def tree_pages(self) -> int:
        return int(self.prefix_pages.shape[0])

    @property
    def cached_pages(self) -> int:
        return self.tree_pages + int(self.restored_pages.shape[0])

    @property
    def hole_tokens(self) -> int:
        return sum(b - a for a, b in self.holes)

    def segments(self, page_size: int) -> list[tuple[int, int]]:
        """Token ranges to compute, in order: each hole (whole pages), then ``[cached_pages * page, len)``."""
        return [(a * page_size, b * page_size) for a, b in self.holes] + \
            [(self.cached_pages * page_size, len(self.tokens))]

    def table(self, page_size: int) -> tuple[np.ndarray, np.ndarray]:
        """``(page, owner)`` per logical page of the prompt: the cached ones, ``HOLE`` for the pages to compute."""
        n = -(-len(self.tokens) // page_size)
        pages = np.full(n, HOLE, dtype=np.int64)
        owners = np.full(n, HOLE, dtype=np.int64)
        t, c = self.tree_pages, self.cached_pages
        if t:  # (an empty part is skipped: these run for every admission)
            pages[:t], owners[:t] = self.prefix_pages, self.prefix_owners
        if c > t:
            pages[t:c], owners[t:c] = self.restored_pages, self.restored_owners
        return pages, owners


class CacheEngine:
    """Persistent-pool prefill engine with a radix prefix cache and optional HiCache (see module docstring).

    ``num_pages``: L1 capacity per rank (every rank the same);
    ``host_pages``: L2 capacity per rank (0 = no HiCache).  ``forward`` is
    called as ``forward(input_ids, meta, mla_pools, index_pools)``.
    ``group``/``debug_device``: where the debug fingerprint collective runs.
    ``draft``: the MTP draft forward (run after the target on its local hidden rows).
    ``l3``: the page store behind L2 (module docstring); every rank of a CP
    group opens its own (they store and fetch only their own pages).
    """

    def __init__(self, forward: Callable, model, *, num_pages: int, kv_format: str = "bf16", page_size: int = 16,
                 rank: int = 0, cp_size: int = 1, host_pages: int = 0, host_layout: str = "layer_page_first",
                 write_policy: str = "write_through", group=None, draft: Callable | None = None,
                 l3: "str | L3Config | None" = None):
        if kv_format not in _FORMATS:
            raise ValueError(f"kv_format must be 'bf16' or 'fp8', got {kv_format!r}")
        self.forward, self.model = forward, model
        self.page_size, self.rank, self.cp_size, self.group = page_size, rank, cp_size, group
        self.draft = draft
        self.pool = KVPool(pool_config(model, kv_format, page_size, num_pages, rank, draft=draft is not None))
        self.pools = pool_tensors(self.pool, model)
        self.device = DevicePages(self.pool, cp_size)
        self.tree = RadixCache(page_size, rank, cp_size, draft_records=draft is not None)
        self.hicache = None
        if host_pages:
            host = HostPool(self.pool, host_pages, cp_size, host_layout)
            self.hicache = HiCache(self.device, host, self.tree, write_policy=write_policy,
                                   evict_device=self._evict_lanes)
        self.l3: L3Tier | None = None
        if l3 is not None:
            if self.hicache is None:
                raise ValueError("an L3 needs the L2 host pool it fetches into and stores from: set host_pages > 0")
            cfg = L3Config.coerce(l3)
            store = cfg.open()
            payloads = list(zip(host.payload_ids, host.payload_bytes))
            fp = store_fingerprint(model.config.to_dict(), cfg.weights_id or weights_identity(model),
                                   self.pool.config, payloads, cp_size)
            self.l3 = L3Tier(store, self.hicache, fingerprint=fp, write_policy=cfg.write_policy,
                             with_next_token=draft is not None, group=group, device=model.device)

    # ---------------------------------------------------------------- eviction
    def _release(self, node: RadixNode) -> bool:
        """Free ``node``'s L1 pages; back it up first when HiCache is on. True = node stays (L2-only)."""
        keep = False
        if self.hicache is not None:
            if node.host_pages is None:
                handle = self.hicache.backup([node])
                if handle is not None:
                    handle.wait_all()  # later writes to the freed pages wait for the copy
                    self._store_through(handle, [node])
            keep = self.hicache.usable_from_host(node)
        self.device.free(node.device_pages, node.page_owners)
        return keep

    def _release_host(self, node: RadixNode) -> None:
        """L2 drops ``node`` with its L1 parent evicted (``write_back``: the L3 copy is made first)."""
        if self.hicache is not None:
            self.hicache.evict_host_node(node)

    def _drop_stale_host(self, node: RadixNode) -> None:
        """``insert`` revives ``node`` with other owners or another continuation: its L2 copy is stale, never stored."""
        if self.hicache is not None:
            self.hicache.release_host(node)

    def _store_through(self, handle, nodes) -> None:
        """L3 ``write_through``: store ``nodes`` once their L2 copy (``handle``) has landed on the host."""
        if self.l3 is None or self.l3.write_policy != "write_through":
            return
        if handle is not None:
            handle.synchronize()
        self.l3.put_nodes([n for n in nodes if n.host_pages is not None])

    def _evict_lanes(self, deficits: dict[int, int]) -> None:
        for lane, need in sorted(deficits.items()):
            self.tree.evict(need, self._release, lane=lane, release_host=self._release_host)

    def evict_device(self, num_pages: int | None = None) -> int:
        """Evict unlocked L1 nodes (all when ``num_pages`` is None), backing up to L2 when HiCache is on."""
        n = self.tree.device_pages_total if num_pages is None else num_pages
        return self.tree.evict(n, self._release, release_host=self._release_host)

    def alloc(self, owners) -> np.ndarray:
        """L1 pages with ``owners`` (``-1`` where another rank owns one); a short lane evicts its LRU leaves and
        retries once, then :class:`KVPoolExhausted` (nothing allocated).  Identical decisions on every rank."""
        for attempt in range(2):
            try:
                return self.device.alloc(owners)
            except LaneDeficit as exc:
                if attempt:
                    raise KVPoolExhausted(self.rank, int(np.count_nonzero(np.asarray(owners) == self.rank)),
                                          self.pool.num_free) from exc
                self._evict_lanes(exc.deficits)
        raise AssertionError("unreachable")

    def evictable_by_lane(self) -> np.ndarray:
        """``[cp_size]``: L1 pages per owner lane that eviction could free now (unlocked cached pages)."""
        if self.cp_size == 1:  # one lane: the tree keeps the count
            return np.asarray([self.tree.evictable_pages], dtype=np.int64)
        out = np.zeros(self.cp_size, dtype=np.int64)
        for node in self.tree.nodes():
            if node.device_pages is not None and node.lock_ref == 0:
                out += np.bincount(node.page_owners.astype(np.int64), minlength=self.cp_size)
        return out

    def clear(self) -> None:
        """Empty the cache: evict all of L1 (to L2 when there is one), then drop all of L2 (nothing may be locked)."""
        self.evict_device()
        if self.hicache is not None:
            self.tree.evict_host(1 << 62, self._release_host)

    # ----------------------------------------------------------------- prefill
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

    def match(self, tokens: Sequence[int], key: TokenKey | None = None, *, prefetched: "L3Prefetch | None" = None,
              fetch_l3: bool = True) -> PrefixMatch:
        """Admission of one prompt: L3 fetch past the radix hit, radix match, L1 locks, L2 load-backs.

        At most ``(len - 1) // page_size`` pages (one token is always
        computed, for the logits).  The L1 part is locked, the usable L2 run
        after it loaded back (layer L's compute waits only for layer L's
        copy, ``kv_layer_ready``), pages from L3 after a failed one restored
        (:class:`PrefixMatch`).  The L3 step is the fetch ``prefetched``
        (finished; :meth:`start_prefetch`) when given, else a fetch made now
        unless ``fetch_l3`` is False.  Every CP rank must make the same calls
        in the same order (an L3 fetch runs collectives).  The caller ends
        with :meth:`commit` then :meth:`release`, or :meth:`release` alone.
        """
        tokens = list(tokens)
        req = PrefixMatch(tokens, key if key is not None else TokenKey(tokens))
        ps = self.page_size
        limit = (len(tokens) - 1) // ps
        pf = prefetched
        if pf is not None and pf.pending is not None:
            raise ValueError("CacheEngine.match: finish_prefetch the prefetch first (every rank, same order)")
        if pf is None and fetch_l3 and self.l3 is not None:
            pf = self._start_l3(tokens, req.key, background=False)
            if pf is not None:
                self._finish_l3(pf)
        tail, fetched = None, (0, 0)
        if pf is not None:
            tail, pf.tail = pf.tail, None  # the match takes it over
            fetched = (pf.start, pf.start + pf.head_pages)
        m = self.tree.match_prefix(req.key, max_pages=limit)
        nodes = m.device_nodes
        if nodes:
            self.tree.inc_lock(nodes[-1])
            req.locks.append(nodes[-1])
        req.device_hit = m.device_len
        if self.hicache is not None and m.host_nodes:
            run = []
            for n in m.host_nodes:
                if not self.hicache.usable_from_host(n):
                    break
                run.append(n)
            if run:
                self.tree.inc_lock(run[-1])  # L2-side evictions must not drop what we load
                handle = self.hicache.load_back(run)
                if handle is None:
                    self.tree.dec_lock(run[-1])
                else:
                    req.loads.append(handle)  # layer L's compute waits for layer L's copy only (kv_layer_ready)
                    req.locks.append(run[-1])
                    nodes = nodes + run
                    # The pages of the run that the L3 fetch brought (by position: later matches may split nodes).
                    first = m.device_len // ps
                    last = first + sum(n.num_pages for n in run)
                    req.l3_hit = max(0, min(last, fetched[1]) - max(first, fetched[0])) * ps
                    req.host_hit = (last - first) * ps - req.l3_hit
        if nodes:
            req.prefix_pages = np.concatenate([n.device_pages for n in nodes])
            req.prefix_owners = np.concatenate([n.page_owners for n in nodes]).astype(np.int64)
        if tail is not None:
            self._restore_tail(req, tail)
        return req

    def commit(self, match: PrefixMatch, pages: np.ndarray, owners: np.ndarray, next_token: int = -1) -> RadixNode:
        """After the prompt's last pass: insert its whole pages, free the rest; returns the inserted path's last node.

        ``pages`` / ``owners``: the prompt's full page table (:meth:`PrefixMatch.table`
        with every ``HOLE`` filled).  Pages the tree does not adopt
        (duplicates: another request inserted the same prefix first) and the
        partial last page are freed; the restored pages now belong to the
        tree or are freed.  ``next_token``: the token after the last whole
        page as the pages were computed (-1: none).  Then, under
        ``write_through``, :meth:`backup_inserted`, and :meth:`release`.
        """
        ps = self.page_size
        full = len(match.tokens) // ps
        res = self.tree.insert(match.key[: full * ps], pages[:full], owners[:full], matched_pages=match.tree_pages,
                               drop_host=self._drop_stale_host, next_token=int(next_token))
        drop = np.concatenate([np.flatnonzero(~res.adopted), np.arange(full, pages.shape[0])])
        match.holds_restored = False
        if drop.size:
            self.device.free(pages[drop], owners[drop])
        return res.last_node

    def release(self, match: PrefixMatch) -> None:
        """Unlock ``match``'s prefix; before :meth:`commit`, also give back its restored pages.  Idempotent.

        Waits for its in-flight load-backs first: nothing may be freed or
        evicted under a copy.
        """
        for h in match.loads:
            h.wait_all()
        match.loads = []
        if match.holds_restored:
            sel = match.restored_owners >= 0
            self.device.free(match.restored_pages[sel], match.restored_owners[sel])
            match.holds_restored = False
        for node in match.locks:
            self.tree.dec_lock(node)
        match.locks = []

    @torch.no_grad()
    def prefill(self, token_lists: Sequence[Sequence[int]], *, return_topk: bool = False,
                progress: Callable[[str], None] | None = None) -> CacheResult:
        ps = self.page_size
        lists, _ = check_prompts(token_lists, None, ps, self.model.config.vocab_size)
        misses_before = self.hicache.stats["load_misses"] if self.hicache else 0
        reqs: list[PrefixMatch] = []
        allocated: list[tuple[np.ndarray, np.ndarray]] = []
        try:
            for t in lists:
                reqs.append(self.match(t))
            tables = [r.table(ps) for r in reqs]
            loads = [h for r in reqs for h in r.loads]

            def wait_for_layer(layer: int, pool=None) -> None:
                for h in loads:
                    h.wait_layer(layer)

            bucket_plan = getattr(self.forward, "plan", None) if self.cp_size > 1 else None

            def run(idx, spans, **kw):
                """One forward over request ``idx[j]``'s tokens ``spans[j]`` (an extend over all pages before it)."""
                prefix_lens, extend_lens = [s for s, _ in spans], [e - s for s, e in spans]
                if bucket_plan is not None:  # a CP graphed_forward: M must be one of its row buckets
                    plan = bucket_plan(prefix_lens, extend_lens, ps)
                else:
                    plan = plan_prefill(prefix_lens, extend_lens, cp_size=self.cp_size, page_size=ps)
                for j, (i, (s, e)) in enumerate(zip(idx, spans)):
                    own = np.asarray(plan.page_owners(j), dtype=np.int64)
                    pages = self.alloc(own)
                    allocated.append((pages, own))
                    tables[i][0][s // ps : s // ps + own.size] = pages
                    tables[i][1][s // ps : s // ps + own.size] = own
                dkw = {} if self.draft is None else dict(draft=self.draft, prompts=[reqs[i].tokens for i in idx],
                                                         draft_pools=draft_pools(self.pool, self.model))
                with layer_hooks(on_ready=wait_for_layer if loads else None):
                    return forward_batch(self.forward, plan, [reqs[i].tokens[s:e] for i, (s, e) in zip(idx, spans)],
                                         [tables[i][0][: -(-e // ps)] for i, (_, e) in zip(idx, spans)],
                                         [tables[i][1][: s // ps] for i, (s, _) in zip(idx, spans)],
                                         self.pools, self.model.device, rank=self.rank, **kw, **dkw)

            # Holes (L3 pages that failed to arrive, with pages after them restored): each is an extend over the
            # pages before it, so a request's holes run in order, one pass per hole index.
            for k in range(max((len(r.holes) for r in reqs), default=0)):
                idx = [i for i, r in enumerate(reqs) if len(r.holes) > k]
                if progress:
                    progress(f"hole pass {k + 1}: {len(idx)} request(s), "
                             f"{sum(reqs[i].holes[k][1] - reqs[i].holes[k][0] for i in idx) * ps} token(s)")
                run(idx, [(reqs[i].holes[k][0] * ps, reqs[i].holes[k][1] * ps) for i in idx])
            prefix = [r.cached_pages * ps for r in reqs]
            if progress:
                progress(f"extend pass: {len(reqs)} request(s), {sum(len(r.tokens) - p for r, p in zip(reqs, prefix))} "
                         f"token(s), cached prefix {sum(prefix)}")
            ran = run(list(range(len(reqs))), [(p, len(r.tokens)) for r, p in zip(reqs, prefix)],
                      return_topk=return_topk)
            out, meta = ran[0], ran[1]
            draft_out = ran[2] if self.draft is not None else None
            allocated = []  # from here on the pages belong to the commit step
            last_nodes = []
            # The token after each request's last whole page as its pages were computed: the prompt's, or
            # (with a draft, prompt ending on a page boundary) the sampled token the draft was given.
            sampled = None
            if self.draft is not None and any(len(r.tokens) % ps == 0 for r in reqs):
                sampled = ran[3].tolist()  # host copy after the forward, needed by the host-side tree
            for i, (r, (pages, own)) in enumerate(zip(reqs, tables)):
                full = len(r.tokens) // ps
                after = r.tokens[full * ps] if len(r.tokens) > full * ps else (sampled[i] if sampled else -1)
                last_nodes.append(self.commit(r, pages, own, next_token=after))
            self.backup_inserted(last_nodes)
        finally:
            for pages, own in allocated:  # failed before the forward finished: give the pages back
                self.device.free(pages, own)
            for r in reqs:
                self.release(r)
        check_consistent(self.tree, self.group, device=self.model.device)
        hits = [self._hits(r) for r in reqs]
        misses = (self.hicache.stats["load_misses"] if self.hicache else 0) - misses_before
        return CacheResult(out.logits, hits, int(self.device.ledger.used[self.rank]), out.topk if return_topk else None,
                           meta if return_topk else None, misses,
                           draft_logits=draft_out.logits if draft_out is not None else None)

    def _hits(self, r: PrefixMatch) -> dict:
        computed = len(r.tokens) - r.device_hit - r.host_hit - r.l3_hit
        if self.l3 is None:
            return {"device": r.device_hit, "host": r.host_hit, "computed": computed}
        return {"device": r.device_hit, "host": r.host_hit, "l3": r.l3_hit, "computed": computed}

    def backup_inserted(self, last_nodes) -> None:
        """After inserts: under ``write_through`` back up every node on the inserted paths, then store them in L3.

        ``last_nodes``: each insert's ``InsertResult.last_node``.  Whole
        paths, because a new node split by a later request of the same batch
        left its head (a node object of its own) outside the insert results.
        A no-op under ``write_back`` (nodes are backed up when L1 evicts them).
        """
        if self.hicache is None or self.hicache.write_policy != "write_through":
            return
        todo = list({id(n): n for last in last_nodes for n in _path_to(last, self.tree.root)}.values())
        handle = self.hicache.backup([n for n in todo if n.device_pages is not None])
        self._store_through(handle, todo)

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

    def close(self) -> None:
        """Release the L3 store (idempotent); the engine keeps working without it."""
        if self.l3 is not None:
            self.hicache.before_host_evict = None
            self.l3.close()
            self.l3 = None


def _false_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """``(start, length)`` of each run of ``False`` in ``mask``."""
    idx = np.flatnonzero(~mask)
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [idx.size]])
    return [(int(idx[a]), int(b - a)) for a, b in zip(starts, ends)]


def _path_to(node, root) -> list:
    """``node`` and its ancestors below ``root``."""
    out = []
    while node is not None and node is not root:
        out.append(node)
        node = node.parent
    return out


def default_capacity(token_lists, page_size: int) -> int:
    """Pages per rank that hold every prompt twice over (cached copy + one batch's extend pages)."""
    return 2 * sum(-(-len(t) // page_size) for t in token_lists) + len(token_lists)


def run_twice(engine: CacheEngine, token_lists, *, evict: bool = False,
              progress: Callable[[str], None] | None = None) -> dict:
    """``cpgraph run --cache``: prefill, optionally evict all of L1 to L2, prefill the same prompts again.

    Returns both passes' logits and per-level hits; the second pass must give
    the first pass's logits (warm-cache correctness).
    """
    first = engine.prefill(token_lists, progress=progress)
    evicted = 0
    if evict:
        if engine.hicache is None:
            raise ValueError("evicting between passes needs an L2 host pool (host_pages > 0)")
        evicted = engine.evict_device()
        if progress:
            progress(f"evicted {evicted} page(s) from L1 to L2")
    second = engine.prefill(token_lists, progress=progress)
    return {
        "first": first.logits,
        "second": second.logits,
        "hits": [first.totals(), second.totals()],
        "hits_per_request": [first.hits, second.hits],
        "evicted_pages": evicted,
        "load_misses": second.load_misses,
        "hicache": dict(engine.hicache.stats) if engine.hicache is not None else None,
    }
