"""HiCache L3: what goes to the page store, when, and how a prefix comes back (through L2).

L3 sits behind the L2 host pool and never talks to L1: a page reaches L3 from
its L2 copy and comes back into L2, from where the existing per-layer
load-back moves it to L1 (so layer L's compute waits only for layer L's
copy, as for any L2 hit).  Keys are :mod:`cpgraph.runtime.storage.keys`
chain hashes bound to the engine's fingerprint.

**Policies** (``write_policy``, the same names as L2's):

* ``write_through``: a node is stored when it gets its L2 copy (at insert
  under L2 ``write_through``, at L1 eviction under L2 ``write_back``);
* ``write_back``: a node is stored when L2 drops it to make room, and by
  :meth:`L3Tier.flush` (what a process calls before it exits).

**Admission** (:meth:`L3Tier.lookup` then :meth:`L3Tier.fetch`): past a
request's radix hit, the longest run of pages the store holds is fetched into
freshly allocated L2 pages and attached to the tree as an L2-only node
(``RadixCache.attach_host``); the engine's next match then loads it back
like any L2 node.  A page that fails to arrive (missing by now, corrupt,
a backend error) is a *hole*: the pages before it form the attached node,
and the pages that arrived after it are handed to the engine, which loads
them into the request's own L1 pages and computes only the hole's tokens,
as an extend over the prefix before it (a page's KV depends on the tokens
before it, not on how their KV was obtained, so the pages after a hole stay
valid).

**CP.**  Each rank stores and fetches only the pages it owns, keyed with its
rank.  Which rank stored page j is not known from the tokens, so lookup is
one all-gather of every rank's "I hold page j" bits: page j's owner is the
lowest rank that holds it, and the run ends at the first page nobody holds.
After the fetch one all-reduce (MIN) of the per-page success bits makes
every rank see the same holes.  Both collectives depend only on
state that is identical on all ranks (the tree, the mirrored L2 ledger, the
tokens), so every rank issues them in the same order; a rank whose store is
down just answers "not held".  One device: no collectives.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .hicache import WRITE_POLICIES, HiCache
from .radix import RadixNode
from .storage import PageStore, open_store, page_chain, page_key, parse_spec

log = logging.getLogger(__name__)


@dataclass
class L3Config:
    """An L3 for :class:`~cpgraph.runtime.cache_engine.CacheEngine`: where (a spec or an open store) and when.

    ``store``: ``"file:DIR[,max_bytes=SIZE]"``, ``"mooncake:HOST:PORT[,...]"``
    (:func:`cpgraph.runtime.storage.parse_spec`) or a :class:`PageStore`.
    ``weights_id``: the weights' identity in the keys (default: a sampled
    hash of the model's tensors, :func:`~cpgraph.runtime.storage.weights_identity`).
    """

    store: PageStore | str
    write_policy: str = "write_through"
    weights_id: str | None = None

    @classmethod
    def coerce(cls, value) -> "L3Config":
        """A spec string (its ``policy=`` option sets ``write_policy``), a store, or a config."""
        if isinstance(value, L3Config):
            return value
        if isinstance(value, PageStore):
            return cls(value)
        if isinstance(value, str):
            _, _, options = parse_spec(value)
            return cls(value, write_policy=options.get("policy", "write_through"))
        raise ValueError(f"l3 must be a spec string, a PageStore or an L3Config, got {type(value).__name__}")

    def open(self) -> PageStore:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"L3 write policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        return self.store if isinstance(self.store, PageStore) else open_store(self.store)


@dataclass
class PendingFetch:
    """A fetch between :meth:`L3Tier.start_fetch` and :meth:`L3Tier.finish_fetch`: its L2 pages are allocated
    (outside the tree) and this rank's reads are done (``got``) or running on the I/O thread (``future``)."""

    host_pages: np.ndarray  # this rank's L2 page per page of the run (-1: another rank's)
    owners: np.ndarray
    mine: np.ndarray  # indices of this rank's pages
    got: list | None = None
    future: Future | None = None

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def result(self) -> list:
        if self.got is None and self.future is not None:
            self.got = self.future.result()
        return self.got if self.got is not None else []


class L3Tier:
    """One rank's L3: keys, lookup, fetch into L2, store from L2 (module docstring)."""

    def __init__(self, store: PageStore, hicache: HiCache, *, fingerprint: str, write_policy: str = "write_through",
                 with_next_token: bool = False, group=None, device="cpu"):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"L3 write policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        self.store, self.hicache, self.host, self.tree = store, hicache, hicache.host, hicache.tree
        self.fingerprint, self.write_policy = fingerprint, write_policy
        self.page_size, self.rank, self.cp_size = self.tree.page_size, self.tree.rank, self.tree.cp_size
        self.with_next_token = bool(with_next_token)
        self.group, self.device = group, torch.device(device)
        self.stats = {"lookup_pages": 0, "fetched_pages": 0, "fetch_failed_pages": 0, "stored_pages": 0,
                      "store_failed_pages": 0}
        self._lock = threading.Lock()
        self._io: ThreadPoolExecutor | None = None  # one thread: reads started by start_fetch(background=True)
        for t in self.host.tensors():
            store.register(t)
        if write_policy == "write_back":
            hicache.before_host_evict = self._write_back

    # ------------------------------------------------------------------ keys
    def chain(self, tokens: Sequence[int], num_pages: int) -> list[bytes]:
        """Chain digests of the first ``num_pages`` pages of ``tokens``."""
        return page_chain(tokens, self.page_size, num_pages, with_next_token=self.with_next_token)

    def key(self, digest: bytes, owner: int) -> str:
        return page_key(self.fingerprint, digest, owner)

    # ------------------------------------------------------------ collectives
    def _gather(self, bits: np.ndarray) -> np.ndarray:
        """``[cp, n]``: every rank's ``bits`` (one all-gather)."""
        import torch.distributed as dist

        local = torch.as_tensor(bits.astype(np.uint8)).to(self.device)
        out = [torch.empty_like(local) for _ in range(self.cp_size)]
        dist.all_gather(out, local, group=self.group)
        return torch.stack(out).cpu().numpy().astype(bool)  # sync-ok (admission, host-side decision)

    def _all_min(self, bits: np.ndarray) -> np.ndarray:
        import torch.distributed as dist

        t = torch.as_tensor(bits.astype(np.int32)).to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t.cpu().numpy().astype(bool)  # sync-ok (admission, host-side decision)

    # ----------------------------------------------------------------- fetch
    def lookup(self, digests: Sequence[bytes]) -> np.ndarray:
        """Owner rank of each page of the leading run of ``digests`` that the store holds (int64, maybe empty)."""
        n = len(digests)
        if n == 0:
            return np.zeros(0, np.int64)
        if self.cp_size == 1:
            held = self._leading_held(digests)[None, :]
        else:  # a rank holds only the pages it owned: its own misses say nothing, so ask about every page
            self.stats["lookup_pages"] += n
            held = self._gather(np.asarray(self._store_call(self.store.exists, [self.key(d, self.rank) for d in digests]),
                                           dtype=bool))
        anyone = held.any(axis=0)
        run = int(np.argmin(anyone)) if not anyone.all() else n
        return np.argmax(held[:, :run], axis=0).astype(np.int64)  # the lowest rank holding each page

    def _leading_held(self, digests: Sequence[bytes]) -> np.ndarray:
        """One device: ``exists`` in growing chunks (1, 4, 16, ... pages), stopping at the first miss.

        A cold prompt then costs one lookup, not one per page (a file store
        answers each with a ``stat``).
        """
        n = len(digests)
        held = np.zeros(n, dtype=bool)
        start, chunk = 0, 1
        while start < n:
            stop = min(n, start + chunk)
            got = np.asarray(self._store_call(self.store.exists, [self.key(d, 0) for d in digests[start:stop]]),
                             dtype=bool)
            self.stats["lookup_pages"] += stop - start
            held[start:stop] = got
            if not got.all():
                break
            start, chunk = stop, chunk * 4
        return held

    def fetch(self, digests: Sequence[bytes], owners: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Read the pages (this rank's only) into new L2 pages: ``(host pages, arrived)``, or ``None``.

        ``host pages``: this rank's L2 page per page of the run (``-1`` where
        another rank owns it, or where the page did not arrive); ``arrived``:
        whether *every* rank read the page (one all-reduce MIN under CP), so
        the mask -- and with it the set of pages to recompute -- is the same
        on every rank.  The L2 pages of the pages that did not arrive are
        freed again.  The run may be shorter than asked when L2 cannot hold it
        (the leading pages that fit); ``None`` when L2 has no room at all,
        even after dropping least-recently-used L2-only leaves.
        """
        pending = self.start_fetch(digests, owners)
        return None if pending is None else self.finish_fetch(pending)

    def start_fetch(self, digests: Sequence[bytes], owners: np.ndarray, *,
                    background: bool = False) -> "PendingFetch | None":
        """:meth:`fetch`'s first half: allocate the L2 pages and read into them (on the I/O thread if
        ``background``); rank-identical up to the reads, which :meth:`finish_fetch` agrees on."""
        owners = np.asarray(owners, dtype=np.int64)
        hp = self.hicache.alloc_host(owners)
        if hp is None:
            fit = self._pages_that_fit(owners)  # identical on every rank: the ledger is mirrored
            if fit == 0:
                return None
            owners, digests = owners[:fit], digests[:fit]
            hp = self.hicache.alloc_host(owners)
            if hp is None:
                return None
        mine = np.flatnonzero(hp >= 0)
        pending = PendingFetch(hp, owners, mine)
        if mine.size:
            self._host_quiet()
            keys = [self.key(digests[j], self.rank) for j in mine.tolist()]
            parts = self.host.page_views(hp[mine])  # byte views of the L2 rows: the reads land there
            if background:
                if self._io is None:
                    self._io = ThreadPoolExecutor(1, thread_name_prefix="cpgraph-l3-io")
                pending.future = self._io.submit(self._store_call, self.store.get, keys, parts)
            else:
                pending.got = self._store_call(self.store.get, keys, parts)
        return pending

    def finish_fetch(self, pending: "PendingFetch") -> tuple[np.ndarray, np.ndarray]:
        """:meth:`fetch`'s second half: wait for this rank's reads, agree on the arrivals (CP), free the failed."""
        hp, owners = pending.host_pages, pending.owners
        n = owners.shape[0]
        ok = np.ones(n, dtype=bool)
        if pending.mine.size:
            ok[pending.mine] = np.asarray(pending.result(), dtype=bool)
        if self.cp_size > 1:
            ok = self._all_min(ok)
        arrived = int(ok.sum())
        self.stats["fetched_pages"] += arrived
        self.stats["fetch_failed_pages"] += n - arrived
        if arrived < n:
            log.info("L3 fetch: %d of %d page(s) arrived; the others are recomputed", arrived, n)
            self.host.free(hp[~ok], owners[~ok])
            hp = np.where(ok, hp, -1)
        return hp, ok

    def discard(self, pending: "PendingFetch") -> None:
        """Give back a started fetch's L2 pages without using them (rank-local: no agreement needed)."""
        if pending.mine.size:
            pending.result()  # never free rows the I/O thread is still writing
        self.host.free(pending.host_pages, pending.owners)

    def _store_call(self, fn, *args):
        """Store calls run one at a time: the engine thread's puts and lookups beside the I/O thread's reads."""
        with self._lock:
            return fn(*args)

    def close(self) -> None:
        """Wait for the I/O thread, then release the store (idempotent)."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        self.store.close()

    def _host_quiet(self) -> None:
        """Wait for HiCache's side stream before the host touches L2 rows (CUDA; a no-op on CPU).

        L1 eviction only orders the compute stream after its backup copy
        (``wait_all``), so an L2 page may still be landing when L2 drops its
        node and hands the page to a fetch, or when write-back reads it.
        """
        if self.hicache.cuda:
            self.hicache.stream.synchronize()

    def _pages_that_fit(self, owners: np.ndarray) -> int:
        free = self.host.ledger.free_pages()
        counts = np.zeros((owners.shape[0], free.shape[0]), np.int64)
        counts[np.arange(owners.shape[0]), owners] = 1
        fits = (np.cumsum(counts, axis=0) <= free).all(axis=1)
        return int(np.argmin(fits)) if not fits.all() else owners.shape[0]

    # ----------------------------------------------------------------- store
    def _node_digests(self, node: RadixNode) -> tuple[list[bytes], int]:
        """``(digests of the node's pages, index of its first page on the path)``, from the tokens root -> node."""
        path = []
        n = node
        while n is not None and n is not self.tree.root:
            path.append(n)
            n = n.parent
        raw = b"".join(p.key for p in reversed(path))
        tokens = np.frombuffer(raw, dtype="<i4").astype(np.int64)
        total = tokens.shape[0] // self.page_size
        first = total - node.num_pages
        if self.with_next_token:
            if node.next_token < 0:  # the last page's draft row has no known continuation: cannot key it
                total -= 1
            else:
                tokens = np.concatenate([tokens, [node.next_token]])
        return self.chain(tokens, total)[first:], first

    def put_nodes(self, nodes: Sequence[RadixNode]) -> int:
        """Store this rank's pages of ``nodes`` (each must have its L2 copy); returns pages stored.

        A node is marked ``in_l3`` when every page of it this rank owns was
        stored (and could be keyed: under a draft, a last page with no known
        continuation cannot).
        """
        keys, parts, spans = [], [], []
        for node in nodes:
            if node.in_l3 or node.host_pages is None or not self.hicache.usable_from_host(node):
                continue
            digests, _ = self._node_digests(node)
            begin = len(keys)
            hps = np.asarray(node.host_pages[: len(digests)], dtype=np.int64)
            mine = np.flatnonzero(hps >= 0).tolist()
            keys += [self.key(digests[j], self.rank) for j in mine]
            parts += self.host.page_views(hps[mine])
            spans.append((node, begin, len(keys), len(digests) == node.num_pages))
        if keys:
            self._host_quiet()
        ok = np.asarray(self._store_call(self.store.put, keys, parts) if keys else [], dtype=bool)
        stored = int(ok.sum())
        self.stats["stored_pages"] += stored
        self.stats["store_failed_pages"] += int(ok.size - stored)
        for node, a, b, complete in spans:
            node.in_l3 = complete and bool(ok[a:b].all())
        return stored

    def _write_back(self, node: RadixNode) -> None:
        """``write_back``: L2 is about to drop ``node``; store it first (a failure only loses the copy)."""
        self.put_nodes([node])

    def flush(self, nodes) -> int:
        """Store every node in ``nodes`` that has an L2 copy and no L3 copy yet; returns pages stored."""
        return self.put_nodes([n for n in nodes if n.host_pages is not None and not n.in_l3])
