"""A request's admission record: what :meth:`CacheEngine.match` found in the cache for one prompt.

Its own module because two engines build on it: :class:`~cpgraph.runtime.cache_engine.CacheEngine`
fills it in (radix hit, L2 load-backs, restored L3 pages and holes) and the serving engine keeps one
per live request to compute its chunks from (:meth:`PrefixMatch.table`, :meth:`PrefixMatch.segments`).
It is plain data plus page-table arithmetic, so it sits below both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .radix import TokenKey

_NONE = np.zeros(0, np.int64)
_NONE.setflags(write=False)

HOLE = -2  # a page table entry still to compute (a hole after a failed L3 page, or an extend page): no page yet


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
