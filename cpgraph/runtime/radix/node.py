"""Node bookkeeping of the radix tree: CP page-owner metadata, nodes, and the match/insert results.

A node's physical pages differ per rank (``-1`` where another rank owns the
page); everything else here is identical on every rank of the CP group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Page owners are stored as int8 (one byte per logical page, identical on all
# ranks), so a tree serves CP groups of at most 128 ranks.
MAX_CP_SIZE = 128


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


class RadixNode:
    __slots__ = ("key", "children", "parent", "meta", "device_pages", "host_pages", "host_payloads", "lock_ref",
                 "last_access", "node_id", "next_token", "in_l3")

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
        # This rank's pages of the node are in the L3 store (set by cpgraph.runtime.l3; never decides a collective).
        self.in_l3 = False

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
