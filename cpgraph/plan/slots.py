"""Cache slot of each token position, from a request's page table (the planner's slot rule).

``slot = page_table_row[pos // page_size] * page_size + pos % page_size``,
``-1`` for a foreign page or a dummy row.  It lives with the planner because
the plan defines both sides of it (which pages a rank owns, which positions
its rows hold), and the batch metadata (:mod:`cpgraph.models.batch`, a
rank's cache-write slots) must derive slots without importing the runtime;
:mod:`cpgraph.runtime.kv_pool` re-exports it next to the pages it indexes.
"""

from __future__ import annotations

import numpy as np
import torch


def is_pow2(x) -> bool:
    """``x`` is a positive power-of-two int (a page size); bools are not ints here."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and not x & (x - 1)


def slots_for_positions(page_table_row, positions, page_size: int):
    """Slot of each token position: ``page_table_row[pos // page_size] * page_size + pos % page_size``.

    ``page_table_row`` holds one request's physical page per logical page
    (``-1`` where another rank owns it); ``positions`` are absolute token
    positions (``-1`` for dummy rows).  A position on a foreign page or a
    negative position gives slot ``-1``, so stores skip it.  Tensors stay on
    their device with no host sync (positions must then be in range; on
    CPU an out-of-range page raises from ``index_select``); numpy arrays or
    lists return a numpy array and are range-checked.
    """
    if not is_pow2(page_size):
        raise ValueError(f"slots_for_positions: page_size must be a positive power of two, got {page_size!r}")
    if isinstance(positions, torch.Tensor) or isinstance(page_table_row, torch.Tensor):
        pos = torch.as_tensor(positions).to(torch.int64)
        table = torch.as_tensor(page_table_row, device=pos.device).to(torch.int64)
        valid = pos >= 0
        if table.shape[0] == 0:  # no pages: every position is foreign or a dummy
            return torch.full_like(pos, -1)
        page = table.index_select(0, torch.where(valid, pos // page_size, 0).reshape(-1)).view(pos.shape)
        slot = page * page_size + pos % page_size
        return torch.where(valid & (page >= 0), slot, -1)
    pos = np.asarray(positions, dtype=np.int64)
    table = np.asarray(page_table_row, dtype=np.int64)
    valid = pos >= 0
    logical = np.where(valid, pos // page_size, 0)
    past = valid & (logical >= table.shape[0])
    if past.any():
        raise ValueError(
            f"slots_for_positions: position {pos[past][0]} is past the "
            f"{table.shape[0]} page(s) of the page table (page_size {page_size})"
        )
    page = table[logical] if table.size else np.full(pos.shape, -1, dtype=np.int64)
    return np.where(valid & (page >= 0), page * page_size + pos % page_size, -1)


__all__ = ["is_pow2", "slots_for_positions"]
