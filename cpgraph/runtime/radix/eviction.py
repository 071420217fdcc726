"""LRU eviction of the radix tree: L1 leaves (optionally of one owner lane) and L2-only leaves.

Decisions depend only on rank-independent state (tree shape, logical LRU
clock, page owners), so every rank of a CP group evicts the same nodes.
"""

from __future__ import annotations

import heapq
from typing import Callable

import numpy as np

from .node import RadixNode


class LRUEviction:
    """Eviction methods of :class:`~cpgraph.runtime.radix.RadixCache` (mixed into it; uses its tree state)."""

    @property
    def evictable_pages(self) -> int:
        return self.device_pages_total - self.locked_pages

    def _is_device_leaf(self, node: RadixNode) -> bool:
        return (node is not self.root and node.device_pages is not None and node.lock_ref == 0
                and not any(c.device_pages is not None for c in node.children.values()))

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
