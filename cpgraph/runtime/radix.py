"""Page-granular radix prefix cache with CP page-owner metadata.

Why page-granular: under owner-sharded KV every cached page has one owner
rank, and the planner only accepts page-aligned prefixes.  So the tree keys
whole pages: every node's key is a multiple of ``page_size`` tokens, a match
returns a page multiple, and splits happen only on page boundaries.  A
prompt's partial last page is never inserted (it is freed after the batch).

Why no communication: every rank runs the same sequence of operations on
data that is identical across the CP group (token ids, owner sequences,
lane occupancy counted per lane on every rank, a logical LRU clock), so the
tree's shape, its LRU order and every eviction decision are identical on all
ranks.  Only a node's *physical* pages differ per rank (``-1`` where another
rank owns the page).  ``CPGRAPH_DEBUG=1`` lets :func:`check_consistent`
compare a fingerprint of the rank-independent state in one collective.

Why a continuation token per node (``next_token``): with an MTP draft layer
in the pool (docs/mtp.md) the draft's record at row ``i`` depends on token
``i + 1``, so a node's last row encodes the token that followed the node
when it was computed.  Inside a node that token is the node's own next key
token; at the node's end it is ``next_token``.  A tree built with
``draft_records=True`` accepts a matched path only up to the first node end
whose ``next_token`` differs from the request's token there, minus that
page (recomputed for this request); without a draft nothing is checked.

Why views: a 64K-token hit walks a long path; copying the key tail at every
node makes matching quadratic.  :class:`TokenKey` slices in O(1) over one
shared backing buffer; a node keeps a compact ``bytes`` copy of its own key
(int32 tokens), compared with one ``memcmp``-style bytes comparison.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

_TOKEN = np.dtype("<i4")
_TB = _TOKEN.itemsize

# Page owners are stored as int8 (one byte per logical page, identical on all
# ranks), so a tree serves CP groups of at most 128 ranks.
MAX_CP_SIZE = 128


def int_array(values, name: str) -> np.ndarray:
    """``values`` as a 1-D int64 array; floats, bools and other non-integers are refused, never truncated."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of ints, got shape {arr.shape}")
    if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def check_pages_match_owners(pages: np.ndarray, owners: np.ndarray, rank: int, where: str) -> None:
    """A rank holds a page exactly where it owns one: ``pages[j] >= 0`` iff ``owners[j] == rank``, else ``-1``.

    The lane ledger counts by owner and the pool by page id; any other pairing
    would make the two disagree.
    """
    if pages.shape != owners.shape:
        raise ValueError(f"{where}: {pages.shape[0]} page(s) but {owners.shape[0]} owner(s)")
    mine = owners == rank
    bad = np.flatnonzero((mine & (pages < 0)) | (~mine & (pages != -1)))
    if bad.size:
        j = int(bad[0])
        raise ValueError(
            f"{where}: logical page {j} has owner {int(owners[j])} and page id {int(pages[j])} on rank {rank} "
            "(a rank holds a page id >= 0 exactly where it is the owner, -1 elsewhere)"
        )


class TokenKey:
    """A token sequence; ``key[a:b]`` is an O(1) view over the same backing buffer."""

    __slots__ = ("_raw", "_arr", "start", "end")

    def __init__(self, tokens, *, _raw: bytes | None = None, _arr=None, start: int = 0, end: int | None = None):
        if _raw is None:
            arr = np.asarray(tokens)
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise ValueError("TokenKey: tokens must be a 1-D sequence of ints")
            if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(_TOKEN).max):
                raise ValueError("TokenKey: token ids must be in [0, 2**31)")
            _arr = np.ascontiguousarray(arr, dtype=_TOKEN)
            _raw = _arr.tobytes()
        self._raw, self._arr = _raw, _arr
        self.start = start
        self.end = len(_arr) if end is None else end

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, s: slice) -> "TokenKey":
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise ValueError("TokenKey supports only contiguous slices")
        a, b, _ = s.indices(len(self))
        b = max(a, b)
        return TokenKey(None, _raw=self._raw, _arr=self._arr, start=self.start + a, end=self.start + b)

    def raw(self) -> bytes:
        """Compact copy of this key (int32 little-endian) -- what a node stores."""
        return self._raw[self.start * _TB : self.end * _TB]

    def tokens(self) -> np.ndarray:
        return self._arr[self.start : self.end]


@dataclass
class CPNodeMeta:
    """CP metadata of one radix node, page-granular.

    ``page_owners``: owner rank of each logical page (int8, identical on all
    ranks; load-back must allocate pages with exactly this owner sequence).
    ``owned_positions``: the node's logical page indices (positions in page
    units) this rank owns, i.e. where it holds bytes.
    """

    page_owners: np.ndarray
    page_size: int
    owned_positions: np.ndarray

    @classmethod
    def build(cls, page_owners, page_size: int, rank: int) -> "CPNodeMeta":
        owners = np.asarray(page_owners)
        if owners.ndim != 1 or (owners.size and not np.issubdtype(owners.dtype, np.integer)):
            raise ValueError("CPNodeMeta: page_owners must be a 1-D int sequence")
        if owners.size and (owners.min() < 0 or owners.max() > 127):
            raise ValueError("CPNodeMeta: page owners must be ranks in [0, 127]")
        owners = owners.astype(np.int8)
        return cls(owners, int(page_size), np.flatnonzero(owners == rank).astype(np.int64))

    def __post_init__(self):
        ps = self.page_size
        if ps < 1 or ps & (ps - 1):
            raise ValueError(f"CPNodeMeta: page_size must be a power of two, got {ps}")
        if self.page_owners.dtype != np.int8:
            raise ValueError("CPNodeMeta: page_owners must be int8")

    @property
    def num_pages(self) -> int:
        return int(self.page_owners.shape[0])

    def split(self, num_tokens: int) -> tuple["CPNodeMeta", "CPNodeMeta"]:
        """Split after ``num_tokens`` tokens (must be page aligned): ``(head, tail)``."""
        if num_tokens % self.page_size:
            raise ValueError(f"CPNodeMeta.split: {num_tokens} tokens is not a multiple of page size {self.page_size}")
        k = num_tokens // self.page_size
        if not 0 < k < self.num_pages:
            raise ValueError(f"CPNodeMeta.split: split page {k} outside (0, {self.num_pages})")
        own = self.owned_positions
        cut = int(np.searchsorted(own, k))
        head = CPNodeMeta(self.page_owners[:k].copy(), self.page_size, own[:cut].copy())
        tail = CPNodeMeta(self.page_owners[k:].copy(), self.page_size, own[cut:] - k)
        return head, tail


class LaneLedger:
    """Pages in use per owner lane (rank), mirrored identically on every rank.

    Every rank applies the same allocations and frees (by owner sequence), so
    every rank knows every lane's occupancy without communicating; decisions
    such as "lane 3 is short by 2 pages, evict for it" are therefore taken
    identically everywhere.
    """

    def __init__(self, capacity: Sequence[int]):
        self.capacity = np.asarray(capacity, dtype=np.int64)
        self.used = np.zeros_like(self.capacity)

    @property
    def num_lanes(self) -> int:
        return int(self.capacity.shape[0])

    def counts(self, owners) -> np.ndarray:
        owners = int_array(owners, "LaneLedger: owners")
        if owners.size and (owners.min() < 0 or owners.max() >= self.num_lanes):
            raise ValueError(f"LaneLedger: owner outside [0, {self.num_lanes})")
        return np.bincount(owners, minlength=self.num_lanes)

    def free_pages(self) -> np.ndarray:
        return self.capacity - self.used

    def deficit(self, owners) -> dict[int, int]:
        """``{lane: pages short}`` for an allocation of ``owners`` (empty when it fits)."""
        short = self.counts(owners) - self.free_pages()
        return {int(r): int(short[r]) for r in np.flatnonzero(short > 0)}

    def take(self, owners) -> None:
        c = self.counts(owners)
        if (c > self.free_pages()).any():
            raise RuntimeError("LaneLedger.take: allocation exceeds a lane's capacity (check deficit first)")
        self.used += c

    def check_give(self, owners) -> np.ndarray:
        """Validate a release of ``owners`` without applying it; returns the per-lane counts for :meth:`apply_give`."""
        c = self.counts(owners)
        if (c > self.used).any():
            lane = int(np.argmax(c > self.used))
            raise RuntimeError(
                f"LaneLedger.give: freeing {int(c[lane])} page(s) of lane {lane}, which holds {int(self.used[lane])}"
            )
        return c

    def apply_give(self, counts: np.ndarray) -> None:
        self.used -= counts

    def give(self, owners) -> None:
        self.apply_give(self.check_give(owners))


class RadixNode:
    __slots__ = ("key", "children", "parent", "meta", "device_pages", "host_pages", "host_payloads", "lock_ref",
                 "last_access", "node_id", "next_token")

    def __init__(self, key: bytes, meta: CPNodeMeta | None, parent, node_id: int):
        self.key = key
        self.children: dict[bytes, RadixNode] = {}
        self.parent = parent
        self.meta = meta
        self.device_pages: np.ndarray | None = None  # L1: this rank's page per logical page (-1 foreign)
        self.host_pages: np.ndarray | None = None  # L2: this rank's host page per logical page (-1 foreign)
        self.host_payloads: frozenset = frozenset()  # payload ids present in L2, e.g. ("mla", 3), ("index", 2)
        self.lock_ref = 0
        self.last_access = 0
        self.node_id = node_id
        # Token after the node's last row when its pages were computed (-1: unknown, never matches).
        self.next_token = -1

    @property
    def num_pages(self) -> int:
        return self.meta.num_pages

    @property
    def page_owners(self) -> np.ndarray:
        return self.meta.page_owners

    @property
    def on_device(self) -> bool:
        return self.device_pages is not None

    @property
    def on_host(self) -> bool:
        return self.host_pages is not None

    def __repr__(self) -> str:
        return (f"RadixNode(id={self.node_id}, pages={self.num_pages if self.meta else 0}, "
                f"device={self.on_device}, host={self.on_host}, lock={self.lock_ref})")


@dataclass
class MatchResult:
    """A page-aligned prefix hit.

    ``nodes`` is the matched path (root excluded); the first ``num_device_nodes``
    are in L1 (device), the rest are L2-only.  ``device_pages``/``page_owners``
    cover the L1 part: for each logical page its owner rank and this rank's
    physical page (``-1`` where another rank owns it).
    """

    nodes: list
    num_device_nodes: int
    page_size: int

    @property
    def device_nodes(self) -> list:
        return self.nodes[: self.num_device_nodes]

    @property
    def host_nodes(self) -> list:
        return self.nodes[self.num_device_nodes :]

    @property
    def device_len(self) -> int:
        """L1 hit in tokens (a page multiple)."""
        return sum(n.num_pages for n in self.device_nodes) * self.page_size

    @property
    def host_len(self) -> int:
        return sum(n.num_pages for n in self.host_nodes) * self.page_size

    @property
    def page_owners(self) -> np.ndarray:
        parts = [n.meta.page_owners for n in self.device_nodes]
        return np.concatenate(parts) if parts else np.zeros(0, np.int8)

    @property
    def device_pages(self) -> np.ndarray:
        parts = [n.device_pages for n in self.device_nodes]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    @property
    def last_device_node(self):
        return self.nodes[self.num_device_nodes - 1] if self.num_device_nodes else None


@dataclass
class InsertResult:
    """``adopted[j]``: the tree now references the caller's page j (pages before ``matched`` count as adopted).

    The caller frees its pages where ``adopted`` is False: they duplicate
    pages the tree already holds (e.g. the recomputed tail of a repeated
    exact hit, or a prefix two requests of one batch both computed).
    """

    adopted: np.ndarray
    new_nodes: list = field(default_factory=list)
    revived_nodes: list = field(default_factory=list)
    last_node: object = None


class RadixCache:
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

    @property
    def evictable_pages(self) -> int:
        return self.device_pages_total - self.locked_pages

    def _is_device_leaf(self, node: RadixNode) -> bool:
        return (node is not self.root and node.device_pages is not None and node.lock_ref == 0
                and not any(c.device_pages is not None for c in node.children.values()))

    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def evict(self, num_pages: int, release: Callable[[RadixNode], bool], lane: int | None = None,
              release_host: Callable[[RadixNode], None] | None = None) -> int:
        """Evict unlocked L1 leaves, least recently used first, until ``num_pages`` pages are freed.

        With ``lane`` set, only pages owned by that rank count and only leaves
        holding such pages are chosen (the deficit-lane eviction of load-back).
        ``release(node)`` frees the node's device pages and returns True if
        the node stays as L2-only; otherwise the node is removed together with
        any L2-only descendants (their host pages go through ``release_host``:
        without this node they could never be matched).  Returns the pages
        freed (of ``lane``).
        """

        def gain(node):
            if lane is None:
                return node.num_pages
            return int(np.count_nonzero(node.meta.page_owners == lane))

        heap = [(n.last_access, n.node_id, n) for n in self.nodes() if self._is_device_leaf(n) and gain(n) > 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            keep = release(node)  # first: if it raises, the node still holds its pages and the counts agree
            freed += gain(node)
            self.device_pages_total -= node.num_pages
            node.device_pages = None
            parent = node.parent
            if not keep:
                self._remove_subtree(node, release_host)
            if self._is_device_leaf(parent) and gain(parent) > 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def evict_host(self, num_pages: int, release_host: Callable[[RadixNode], None], lane: int | None = None) -> int:
        """Drop L2-only leaves (LRU) until ``num_pages`` host pages (of ``lane``) are freed."""

        def gain(node):
            return node.num_pages if lane is None else int(np.count_nonzero(node.meta.page_owners == lane))

        def candidate(n):
            return (n.device_pages is None and n.host_pages is not None and not n.children and n.lock_ref == 0
                    and gain(n) > 0)

        heap = [(n.last_access, n.node_id, n) for n in self.nodes() if candidate(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            freed += gain(node)
            release_host(node)
            node.host_pages, node.host_payloads = None, frozenset()
            parent = node.parent
            self._remove(node)
            if parent is not self.root and candidate(parent):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def _remove_subtree(self, node: RadixNode, release_host) -> None:
        for child in list(node.children.values()):
            self._remove_subtree(child, release_host)
        if node.host_pages is not None:
            if release_host is None:
                raise RuntimeError(f"RadixCache: dropping {node} needs a release_host callback")
            release_host(node)
            node.host_pages, node.host_payloads = None, frozenset()
        self._remove(node)

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
        h = hashlib.sha256()
        h.update(f"{self.page_size}|{self._clock}|{self.device_pages_total}|{self.locked_pages}".encode())
        stack = [self.root]
        while stack:
            node = stack.pop()
            h.update(node.key)
            h.update(node.meta.page_owners.tobytes())
            h.update(f"|{node.node_id}|{node.on_device}|{node.on_host}|{sorted(node.host_payloads)}|"
                     f"{node.lock_ref}|{node.last_access}|{node.next_token}|{len(node.children)}".encode())
            stack.extend(node.children[k] for k in sorted(node.children))
        return h.hexdigest()


def check_consistent(tree: RadixCache, group=None, device="cpu", force: bool = False) -> None:
    """Debug: compare ``tree.fingerprint()`` across the CP group in ONE collective (all-gather).

    Runs only with ``CPGRAPH_DEBUG=1`` (or ``force``); raises ``RuntimeError``
    naming the ranks whose tree differs from rank 0's.
    """
    if not force:
        from cpgraph.ops.checks import debug_enabled

        if not debug_enabled():
            return
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    digest = torch.frombuffer(bytearray(bytes.fromhex(tree.fingerprint())), dtype=torch.uint8).to(device)
    out = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, digest, group=group)
    bad = [r for r, d in enumerate(out) if not torch.equal(d, out[0])]  # sync-ok (debug only)
    if bad:
        raise RuntimeError(f"radix tree diverged across CP ranks: ranks {bad} differ from rank 0")
