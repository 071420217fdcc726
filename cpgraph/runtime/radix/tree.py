"""The radix tree over page-aligned token keys: walking, matching, splitting, insert and locks."""

from __future__ import annotations

from typing import Callable

import numpy as np

from .consistency import tree_fingerprint
from .eviction import LRUEviction
from .keys import _TB, _TOKEN, TokenKey, int_array
from .node import MAX_CP_SIZE, CPNodeMeta, InsertResult, MatchResult, RadixNode, check_pages_match_owners


class RadixCache(LRUEviction):
    """Radix tree over page-aligned token keys; see the module docstring.

    The tree never allocates or frees pages itself: eviction calls
    ``release(node)``, which frees the node's device pages (possibly after a
    backup to L2) and returns True when the node stays in the tree as
    L2-only, False when it should be removed.
    """

    def __init__(self, page_size: int, rank: int = 0, cp_size: int = 1, draft_records: bool = False):
        for name, v in (("page_size", page_size), ("rank", rank), ("cp_size", cp_size)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"RadixCache: {name} must be an int, got {v!r}")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"RadixCache: page_size must be a power of two, got {page_size}")
        if not 1 <= cp_size <= MAX_CP_SIZE:
            raise ValueError(f"RadixCache: cp_size must be in [1, {MAX_CP_SIZE}] (page owners are int8), got {cp_size}")
        if not 0 <= rank < cp_size:
            raise ValueError(f"RadixCache: rank must be in [0, {cp_size}), got {rank}")
        self.page_size, self.rank, self.cp_size = int(page_size), int(rank), int(cp_size)
        # Pages carry MTP draft records whose last row depends on the next token (module docstring).
        self.draft_records = bool(draft_records)
        self._page_bytes = self.page_size * _TB
        self._clock = 0
        self._next_id = 1
        self.root = RadixNode(b"", CPNodeMeta.build([], page_size, rank), None, 0)
        self.root.device_pages = np.zeros(0, np.int64)
        self.root.lock_ref = 1  # never evicted
        self.device_pages_total = 0  # logical pages resident in L1
        self.locked_pages = 0  # logical L1 pages of nodes with lock_ref > 0

    # ----------------------------------------------------------------- helpers
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(self, key: bytes, meta: CPNodeMeta, parent) -> RadixNode:
        node = RadixNode(key, meta, parent, self._next_id)
        self._next_id += 1
        return node

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Split ``node`` after ``num_pages`` pages; returns the new head (parent of ``node``)."""
        head_meta, tail_meta = node.meta.split(num_pages * self.page_size)
        cut = num_pages * self._page_bytes
        head = self._new_node(node.key[:cut], head_meta, node.parent)
        head.lock_ref, head.last_access = node.lock_ref, node.last_access
        head.host_payloads = node.host_payloads
        head.in_l3 = node.in_l3
        # The head's last row was computed with the tail's first token after it (one request, one key).
        head.next_token = int(np.frombuffer(node.key, dtype=_TOKEN, count=1, offset=cut)[0])
        if node.device_pages is not None:
            head.device_pages, node.device_pages = node.device_pages[:num_pages], node.device_pages[num_pages:]
        if node.host_pages is not None:
            head.host_pages, node.host_pages = node.host_pages[:num_pages], node.host_pages[num_pages:]
        node.parent.children[node.key[: self._page_bytes]] = head
        node.key, node.meta, node.parent = node.key[cut:], tail_meta, head
        head.children[node.key[: self._page_bytes]] = node
        return head

    def _common_pages(self, raw: bytes, off: int, stop: int, node_key: bytes) -> int:
        """Whole pages of ``node_key`` equal to ``raw[off:stop]`` (used only where the fast compare failed)."""
        n = min(len(node_key), stop - off) // _TB
        a = np.frombuffer(raw, dtype=_TOKEN, count=n, offset=off)
        b = np.frombuffer(node_key, dtype=_TOKEN, count=n)
        diff = np.flatnonzero(a != b)
        common = int(diff[0]) if diff.size else n
        return common // self.page_size

    def _walk(self, key: TokenKey, max_pages: int | None):
        """Follow ``key`` down the tree, splitting at the page where it ends or diverges.

        Returns the path of fully matched nodes.  Identical on every rank: it
        depends only on token ids and the (identical) tree shape.
        """
        ps, pb = self.page_size, self._page_bytes
        n_pages = len(key) // ps
        if max_pages is not None:
            n_pages = min(n_pages, max(0, int(max_pages)))
        raw = key._raw
        off = key.start * _TB
        stop = off + n_pages * pb
        node, path, now = self.root, [], self._tick()
        while off < stop:
            child = node.children.get(raw[off : off + pb])
            if child is None:
                break
            klen = len(child.key)
            if off + klen <= stop and raw[off : off + klen] == child.key:
                child.last_access = now
                path.append(child)
                node = child
                off += klen
                continue
            common = self._common_pages(raw, off, stop, child.key)  # >= 1: the first page matched
            child = self._split(child, common)
            child.last_access = now
            path.append(child)
            off += common * pb
            break
        return path, (off - key.start * _TB) // pb

    # ----------------------------------------------------------------- public
    def _draft_exact_pages(self, key: TokenKey, path: list) -> int | None:
        """Pages of ``path`` whose draft records are a cold run's for ``key``; ``None`` when all are.

        Only node ends need checking: inside a node the next token is part of
        the node's key, which matched.  At the first node end whose
        ``next_token`` differs from ``key``'s token there, the last page
        before it is given up (its last row must be recomputed).
        """
        ps, end = self.page_size, 0
        tokens = key.tokens()
        for node in path:
            end += node.num_pages
            at = end * ps
            if at >= len(tokens) or node.next_token != int(tokens[at]):
                return end - 1
        return None

    def match_prefix(self, key: TokenKey, max_pages: int | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of ``key`` (at most ``max_pages`` pages).

        With ``draft_records`` the prefix also stops one page before the first
        node end whose ``next_token`` is not ``key``'s next token there (the
        walk is repeated with that limit, splitting the node, so the new
        head's continuation is its tail's first token, which the key matched).
        """
        path, _ = self._walk(key, max_pages)
        if self.draft_records and path:
            exact = self._draft_exact_pages(key, path)
            if exact is not None:
                path, _ = self._walk(key, exact)
        n_dev = 0
        for node in path:
            if node.device_pages is None:
                break
            n_dev += 1
        # L2-only nodes are usable only as a contiguous run right after the L1 part.
        return MatchResult(path, n_dev, self.page_size)

    def insert(self, key: TokenKey, device_pages, page_owners, matched_pages: int = 0,
               drop_host: Callable[[RadixNode], None] | None = None, next_token: int = -1) -> InsertResult:
        """Insert ``key`` (page multiple) whose pages are ``device_pages`` with owners ``page_owners``.

        ``matched_pages``: leading pages the caller took from this tree (locked
        by the caller, shared physical pages).  L2-only nodes on the path are
        revived with the caller's pages; when the caller's owner sequence
        differs from the node's saved one, the node's L2 copy (laid out for the
        old owners) is first released through ``drop_host`` and the node takes
        the new owners.

        ``next_token``: the token after the key's last row as the caller's
        pages were computed with it (-1 when unknown).  New nodes and revived
        nodes record the caller's continuation at their end; with
        ``draft_records``, a revived node whose L2 copy was computed with
        another continuation drops that copy too (its last draft row differs).
        """
        ps = self.page_size
        if not isinstance(key, TokenKey):
            raise ValueError(f"RadixCache.insert: key must be a TokenKey, got {type(key).__name__}")
        if len(key) % ps:
            raise ValueError(f"RadixCache.insert: key of {len(key)} tokens is not a page multiple ({ps})")
        n = len(key) // ps
        pages = int_array(device_pages, "RadixCache.insert: device_pages")
        owner_ids = int_array(page_owners, "RadixCache.insert: page_owners")
        if pages.shape != (n,) or owner_ids.shape != (n,):
            raise ValueError(f"RadixCache.insert: need {n} pages and owners, got {pages.shape} and {owner_ids.shape}")
        if n and (owner_ids.min() < 0 or owner_ids.max() >= self.cp_size):
            j = int(np.flatnonzero((owner_ids < 0) | (owner_ids >= self.cp_size))[0])
            raise ValueError(
                f"RadixCache.insert: page_owners[{j}] = {int(owner_ids[j])} is not a rank of the CP group "
                f"[0, {self.cp_size})"
            )
        check_pages_match_owners(pages, owner_ids, self.rank, "RadixCache.insert")
        if isinstance(matched_pages, bool) or not isinstance(matched_pages, (int, np.integer)) \
                or not 0 <= matched_pages <= n:
            raise ValueError(f"RadixCache.insert: matched_pages must be an int in [0, {n}], got {matched_pages!r}")
        matched_pages = int(matched_pages)
        if isinstance(next_token, bool) or not isinstance(next_token, (int, np.integer)) or next_token < -1:
            raise ValueError(f"RadixCache.insert: next_token must be a token id or -1, got {next_token!r}")
        next_token = int(next_token)
        tokens = key.tokens()
        owners = owner_ids.astype(np.int8)  # exact: owners < cp_size <= 128
        path, done = self._walk(key, None)
        resident = 0  # leading pages of the path already in L1: the only pages a caller can have matched
        for node in path:
            if node.device_pages is None:
                break
            resident += node.num_pages
        if matched_pages > resident:
            raise ValueError(
                f"RadixCache.insert: matched_pages={matched_pages} but only {resident} leading page(s) of the key "
                "are cached in L1"
            )
        adopted = np.zeros(n, dtype=bool)
        adopted[:matched_pages] = True
        result = InsertResult(adopted)
        pos = 0
        for node in path:
            k = node.num_pages
            if node.device_pages is None and pos >= matched_pages:
                cont = int(tokens[(pos + k) * ps]) if pos + k < n else next_token
                stale = self.draft_records and node.host_pages is not None and node.next_token != cont
                if stale or not np.array_equal(node.meta.page_owners, owners[pos : pos + k]):
                    if drop_host is None:
                        raise RuntimeError("RadixCache.insert: L2-only node with a different owner sequence or "
                                           "draft continuation on the path and no drop_host callback")
                    drop_host(node)
                    node.host_pages, node.host_payloads = None, frozenset()
                    node.meta = CPNodeMeta.build(owners[pos : pos + k], ps, self.rank)
                    node.in_l3 = False  # the L3 copy is keyed by the old owners (or continuation)
                node.next_token = cont
                node.device_pages = pages[pos : pos + k].copy()
                adopted[pos : pos + k] = True
                self.device_pages_total += k
                if node.lock_ref:
                    self.locked_pages += k
                result.revived_nodes.append(node)
            pos += k
        parent = path[-1] if path else self.root
        if done < n:
            if parent.device_pages is None:
                raise RuntimeError("RadixCache.insert: cannot attach L1 pages below an L2-only node")
            leaf = self._new_node(key.raw()[done * ps * _TB :], CPNodeMeta.build(owners[done:], ps, self.rank), parent)
            leaf.device_pages = pages[done:].copy()
            leaf.last_access = self._clock
            leaf.next_token = next_token
            parent.children[leaf.key[: self._page_bytes]] = leaf
            adopted[done:] = True
            self.device_pages_total += n - done
            result.new_nodes.append(leaf)
            parent = leaf
        result.last_node = parent
        return result

    def attach_host(self, key: TokenKey, start_pages: int, host_pages, page_owners, payloads: frozenset,
                    next_token: int = -1) -> RadixNode:
        """Attach an L2-only leaf for pages ``[start_pages, len(key) // page_size)`` of ``key`` (pages from L3).

        The tree must hold exactly the first ``start_pages`` pages of ``key``
        on a path (any residency) and nothing after them: the new node
        continues that path.  ``host_pages``: this rank's L2 page per logical
        page (``-1`` where another rank owns it), ``page_owners`` the owner
        sequence the pages were stored with; a later match finds the node
        like any other L2-only node and loads it back with those owners.
        """
        ps = self.page_size
        if len(key) % ps:
            raise ValueError(f"RadixCache.attach_host: key of {len(key)} tokens is not a page multiple ({ps})")
        n = len(key) // ps - start_pages
        pages = int_array(host_pages, "RadixCache.attach_host: host_pages")
        owner_ids = int_array(page_owners, "RadixCache.attach_host: page_owners")
        if n < 1 or pages.shape != (n,) or owner_ids.shape != (n,):
            raise ValueError(f"RadixCache.attach_host: need >= 1 page after page {start_pages} and one host page and "
                             f"owner per page, got {n} page(s), {pages.shape} and {owner_ids.shape}")
        if owner_ids.min() < 0 or owner_ids.max() >= self.cp_size:
            raise ValueError(f"RadixCache.attach_host: page owners must be ranks in [0, {self.cp_size})")
        check_pages_match_owners(pages, owner_ids, self.rank, "RadixCache.attach_host")
        path, done = self._walk(key, start_pages)
        parent = path[-1] if path else self.root
        first = key.raw()[start_pages * ps * _TB : (start_pages + 1) * ps * _TB]
        if done != start_pages or first in parent.children:
            raise ValueError(f"RadixCache.attach_host: the tree holds {done} page(s) of the key where "
                             f"{start_pages} and nothing after them are required")
        leaf = self._new_node(key.raw()[start_pages * ps * _TB :],
                              CPNodeMeta.build(owner_ids.astype(np.int8), ps, self.rank), parent)
        leaf.host_pages = pages.copy()
        leaf.host_payloads = frozenset(payloads)
        leaf.last_access = self._clock
        leaf.next_token = int(next_token)
        leaf.in_l3 = True
        parent.children[first] = leaf
        return leaf

    def extends_past(self, key: TokenKey, num_pages: int) -> bool:
        """Whether the tree holds the first ``num_pages + 1`` pages of ``key`` (a read-only walk: no split, no tick)."""
        ps, pb = self.page_size, self._page_bytes
        if len(key) < (num_pages + 1) * ps:
            return False
        target = key[: (num_pages + 1) * ps].raw()
        node, off = self.root, 0
        while off < len(target):
            child = node.children.get(target[off : off + pb])
            if child is None:
                return False
            seg = target[off : off + len(child.key)]
            if child.key[: len(seg)] != seg:
                return False
            node, off = child, off + len(seg)
        return True

    def inc_lock(self, node: RadixNode) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0 and node.device_pages is not None:
                self.locked_pages += node.num_pages
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: RadixNode) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"RadixCache.dec_lock: {node} is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.device_pages is not None:
                self.locked_pages -= node.num_pages
            node = node.parent


    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


    def _remove(self, node: RadixNode) -> None:
        """Detach ``node`` (must have no L1 pages); L2-only descendants go with it via ``release_host`` callers."""
        if node.children:
            raise RuntimeError(f"RadixCache: cannot remove {node} with children")
        del node.parent.children[node.key[: self._page_bytes]]

    def mark_loaded(self, node: RadixNode, device_pages: np.ndarray) -> None:
        """Record that ``node`` is back in L1 (after a load-back)."""
        node.device_pages = np.asarray(device_pages, dtype=np.int64)
        self.device_pages_total += node.num_pages
        if node.lock_ref:
            self.locked_pages += node.num_pages

    # ------------------------------------------------------------ consistency
    def fingerprint(self) -> str:
        """SHA-256 over the rank-independent state (shape, keys, owners, residency, locks, LRU clock)."""
        return tree_fingerprint(self)
