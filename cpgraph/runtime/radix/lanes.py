"""Per-lane page occupancy mirrored on every rank (no communication needed for eviction decisions)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .keys import int_array


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
        return self.shortfall(self.counts(owners))

    def shortfall(self, counts: np.ndarray) -> dict[int, int]:
        """:meth:`deficit` of per-lane ``counts`` (an allocation counted once, checked, then taken)."""
        short = counts - self.free_pages()
        if short.max() <= 0:  # the usual case, on every allocation: one reduction
            return {}
        return {int(r): int(short[r]) for r in np.flatnonzero(short > 0)}

    def take(self, owners) -> None:
        self.take_counts(self.counts(owners))

    def take_counts(self, counts: np.ndarray) -> None:
        if (counts > self.free_pages()).any():
            raise RuntimeError("LaneLedger.take: allocation exceeds a lane's capacity (check deficit first)")
        self.used += counts

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
