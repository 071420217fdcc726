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

The match record lives in :mod:`cpgraph.runtime.prefix_match`, the L3
fetch steps (:meth:`CacheEngine.start_prefetch` and the rest, the
``L3Prefetch`` record) in :mod:`cpgraph.runtime.l3_prefetch` (a base class
of :class:`CacheEngine`), and the ``cpgraph run --cache`` helpers
(``run_twice``, ``default_capacity``) in :mod:`cpgraph.runtime.cache_run`;
all stay importable from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from cpgraph.ops.layer_events import layer_hooks
from cpgraph.plan import plan_prefill

from .cache_run import default_capacity, run_twice  # noqa: F401  (re-exported)
from .engine import _FORMATS, check_prompts, draft_pools, forward_batch, pool_config, pool_tensors
from .hicache import DevicePages, HiCache, HostPool, LaneDeficit
from .kv_pool import KVPool, KVPoolExhausted
from .l3 import L3Config, L3Tier
from .l3_prefetch import L3Prefetch, L3PrefetchMixin, _false_runs, _L3Tail  # noqa: F401  (re-exported)
from .prefix_match import HOLE, _NONE, PrefixMatch  # noqa: F401  (re-exported)
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


class CacheEngine(L3PrefetchMixin):
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
    # (the fetch steps and flush_l3: L3PrefetchMixin, l3_prefetch.py)
    def close(self) -> None:
        """Release the L3 store (idempotent); the engine keeps working without it."""
        if self.l3 is not None:
            self.hicache.before_host_evict = None
            self.l3.close()
            self.l3 = None


def _path_to(node, root) -> list:
    """``node`` and its ancestors below ``root``."""
    out = []
    while node is not None and node is not root:
        out.append(node)
        node = node.parent
    return out
