"""Host-side descriptors for ``cpgraph::cp_materialize_kv`` (owner-sharded KV).

Built once per batch, on every rank, from data every rank already has: the
plan and the owner rank of every cached prefix page (recorded in the radix
tree, identical on all ranks).  Only ``send_slots`` needs this rank's own
physical page ids.  No communication: all ranks derive the same padded
prefix row count ``P`` and the same destinations, so the single all-gather
in the op has uniform shapes.

Layout of one rank's contribution to the gather::

    [ P prefix rows (pages this rank owns, full-view order, -1 padded) | M compute rows ]

The gathered buffer is rank-major: rank ``r``'s block starts at row
``r * (P + M)`` (:class:`GatherLayout`, the one definition of these
coordinates).  ``kv_source`` says, for every full-view row, which gathered
row it comes from (``-1``: page-tail slack, a zero row).  Because it maps
*destinations to sources*, no full-view row can be written twice.  Padding
``P`` or ``M`` (a CUDA-graph bucket) moves every rank's block, so a padded
batch re-maps ``kv_source`` with :meth:`GatherLayout.repad`.

Why per request: the builder walks prefix pages *per request*, so two
requests whose cached prefix shares one physical page on its owner get that
page sent twice, once for each request's full-view rows.  No full-view row
is written by two gathered rows, so nothing depends on which write lands
last.  Vectorised NumPy throughout (loops are over requests at most, never
over tokens or pages).  See ``docs/ops/collectives.md`` for a drawing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from .plan import MAX_ROWS, CPPlan, _exclusive_cumsum


@dataclass(frozen=True)
class GatherLayout:
    """Row coordinates of the rank-major gathered buffer ``[cp_size * (P + M)]``.

    Rank ``r`` contributes one block of ``P + M`` rows: its ``P`` prefix rows
    (``prefix_rows``), then its ``M`` compute rows (``num_rows``).  Every
    gathered-row index (``kv_source``) is built from :meth:`prefix_row` and
    :meth:`compute_row`, so padding is re-expressed through the same two
    functions rather than by an offset that holds for rank 0 only.  The row
    functions take ints or integer arrays / tensors alike.
    """

    cp_size: int
    prefix_rows: int
    num_rows: int

    @property
    def block_rows(self) -> int:
        return self.prefix_rows + self.num_rows

    @property
    def total_rows(self) -> int:
        return self.cp_size * self.block_rows

    def prefix_row(self, rank, j):
        """Gathered row of rank ``rank``'s prefix row ``j`` (``0 <= j < P``)."""
        return rank * self.block_rows + j

    def compute_row(self, rank, j):
        """Gathered row of rank ``rank``'s compute row ``j`` (``0 <= j < M``)."""
        return rank * self.block_rows + self.prefix_rows + j

    def repad(self, kv_source: torch.Tensor, padded: "GatherLayout") -> torch.Tensor:
        """``kv_source`` of the same batch once every rank's block is padded to ``padded``'s ``P'`` and ``M'``.

        Each entry is split into (rank, prefix row ``j`` or compute row ``j``)
        and rebuilt in ``padded``: the padded rows (``-1`` prefix slots, dummy
        compute rows) are never named; ``-1`` stays ``-1``.  Device tensor
        arithmetic only (no host sync).
        """
        if padded.cp_size != self.cp_size or padded.prefix_rows < self.prefix_rows or padded.num_rows < self.num_rows:
            raise ValueError(f"GatherLayout.repad: cannot pad {self} to {padded} (same cp_size, no fewer rows)")
        named = kv_source.clamp(min=0)
        rank = torch.div(named, max(self.block_rows, 1), rounding_mode="floor")
        offset = named - rank * self.block_rows
        as_prefix = padded.prefix_row(rank, offset)
        as_compute = padded.compute_row(rank, offset - self.prefix_rows)
        row = torch.where(offset < self.prefix_rows, as_prefix, as_compute)
        return torch.where(kv_source >= 0, row, kv_source)


@dataclass(frozen=True)
class MaterializeDescriptors:
    """What rank ``rank`` passes to ``cp_materialize_kv`` (int64 tensors).

    * ``send_slots`` ``[P]``: physical KV slots (``page * page_size + offset``)
      this rank gathers from its local pool to build ``prefix_rows``, owned
      pages in full-view order, ``-1`` padding (gathers return zero rows);
    * ``kv_source`` ``[kv_rows]``: for every full-view row, its row in the
      rank-major gathered buffer ``[cp * (P + M)]`` (rank ``r``'s prefix row
      ``j`` at ``r * (P + M) + j``, its compute row ``j`` at
      ``r * (P + M) + P + j``); ``-1`` for page-tail slack.  Dummy rows and
      padding are simply never named;
    * ``kv_rows``: rows of the full view (``sum(kv_lens)``, page-tail slack
      included); ``prefix_rows_per_rank`` = ``P``, ``num_rows`` = ``M``.
    """

    rank: int
    cp_size: int
    page_size: int
    prefix_rows_per_rank: int
    num_rows: int
    kv_rows: int
    send_slots: torch.Tensor
    kv_source: torch.Tensor

    @property
    def layout(self) -> GatherLayout:
        """The coordinates ``kv_source`` indexes."""
        return GatherLayout(self.cp_size, self.prefix_rows_per_rank, self.num_rows)

    def to(self, device, non_blocking: bool = False) -> "MaterializeDescriptors":
        """Copy the index tensors to ``device`` once per batch."""
        return replace(
            self,
            send_slots=self.send_slots.to(device, non_blocking=non_blocking),
            kv_source=self.kv_source.to(device, non_blocking=non_blocking),
        )


def _concat_per_request(name: str, per_request, expected: np.ndarray) -> np.ndarray:
    """Concatenate per-request int sequences after checking their count and lengths."""
    try:
        items = list(per_request)
    except TypeError:
        raise ValueError(f"{name} must be a list with one sequence per request") from None
    if len(items) != expected.size:
        raise ValueError(f"{name} has {len(items)} entries but the plan has {expected.size} requests")
    arrays = []
    for i, seq in enumerate(items):
        a = np.asarray(seq)
        if a.ndim != 1:
            raise ValueError(f"{name}[{i}] (request {i}) must be a 1-D sequence of integers")
        if a.size and a.dtype.kind not in "iu":
            raise ValueError(f"{name}[{i}] (request {i}) must hold integers, got dtype {a.dtype}")
        if a.size != expected[i]:
            raise ValueError(
                f"{name}[{i}] (request {i}) has {a.size} entries but the request has {expected[i]} cached prefix pages"
            )
        arrays.append(a.astype(np.int64, copy=False))
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)


def _first_bad(mask: np.ndarray, req: np.ndarray, page: np.ndarray) -> str:
    j = int(np.argmax(mask))
    return f"request {int(req[j])}, prefix page {int(page[j])}"


def materialize_descriptors(
    plan: CPPlan,
    prefix_page_owners: Sequence[Sequence[int]],
    local_prefix_pages: Sequence[Sequence[int]],
    rank: int,
) -> MaterializeDescriptors:
    """Descriptors of rank ``rank`` for one batch (CPU tensors; ``.to(device)`` after).

    ``prefix_page_owners[i]``: owner rank of each cached prefix page of
    request ``i`` (``prefix_lens[i] // page_size`` entries, identical on all
    ranks).  ``local_prefix_pages[i]``: this rank's physical page of each of
    those pages, ``-1`` where another rank owns it.  Raises ``ValueError``
    naming the request on inconsistent input (an owned page without a local
    page, or a local page for a page someone else owns, is exactly the
    owner-sequence mismatch that would load bytes into the wrong pages).
    """
    if not isinstance(plan, CPPlan):
        raise ValueError(f"plan must be a CPPlan, got {type(plan).__name__}")
    cp, ps, B = plan.cp_size, plan.page_size, plan.num_requests
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, {cp}), got {rank!r}")
    rank = int(rank)

    pages_per_req = plan.prefix_lens // ps  # prefix lengths are page aligned (planner-checked)
    owners = _concat_per_request("prefix_page_owners", prefix_page_owners, pages_per_req)
    local = _concat_per_request("local_prefix_pages", local_prefix_pages, pages_per_req)
    num_pages = owners.size
    req = np.repeat(np.arange(B, dtype=np.int64), pages_per_req)
    page_in_req = np.arange(num_pages, dtype=np.int64) - np.repeat(_exclusive_cumsum(pages_per_req), pages_per_req)

    bad = (owners < 0) | (owners >= cp)
    if bad.any():
        raise ValueError(f"prefix_page_owners: owner outside [0, {cp}) at {_first_bad(bad, req, page_in_req)}")
    mine = owners == rank
    bad = mine & (local < 0)
    if bad.any():
        raise ValueError(f"local_prefix_pages: rank {rank} owns {_first_bad(bad, req, page_in_req)} but has no page")
    bad = ~mine & (local != -1)
    if bad.any():
        raise ValueError(
            f"local_prefix_pages: {_first_bad(bad, req, page_in_req)} is owned by another rank but has a local "
            f"page on rank {rank} (must be -1)"
        )

    # Slots and gathered rows are int32-addressable (docs/plan.md, "Bounds"): check before allocating.
    bad = mine & (local > (MAX_ROWS + 1) // ps - 1)
    if bad.any():
        raise ValueError(
            f"local_prefix_pages: page {int(local[np.argmax(bad)])} at {_first_bad(bad, req, page_in_req)} "
            f"has slots past {MAX_ROWS} (2**31 - 1) with page_size {ps}"
        )

    # Prefix: k-th owned page of each owner, in full-view (request, page) order.
    counts = np.bincount(owners, minlength=cp)
    pages_per_rank = int(counts.max()) if num_pages else 0
    gathered = cp * (pages_per_rank * ps + plan.num_rows)
    if gathered > MAX_ROWS:
        raise ValueError(
            f"materialize: the all-gather would have {cp} ranks x ({pages_per_rank * ps} prefix + {plan.num_rows} "
            f"compute) rows = {gathered}, more than {MAX_ROWS} (2**31 - 1); split the batch"
        )
    order = np.argsort(owners, kind="stable")
    slot_in_owner = np.empty(num_pages, dtype=np.int64)
    slot_in_owner[order] = np.arange(num_pages, dtype=np.int64) - _exclusive_cumsum(counts)[owners[order]]
    page_row = plan.kv_start[req] + page_in_req * ps  # first full-view row of each page
    page_dest = np.full((cp, pages_per_rank), -1, dtype=np.int64)
    page_dest[owners, slot_in_owner] = page_row
    offsets = np.arange(ps, dtype=np.int64)
    prefix_dest = np.where(page_dest[..., None] >= 0, page_dest[..., None] + offsets, -1).reshape(-1)

    send_pages = np.full(pages_per_rank, -1, dtype=np.int64)
    send_pages[: int(mine.sum())] = local[mine]
    send_slots = np.where(send_pages[:, None] >= 0, send_pages[:, None] * ps + offsets, -1).reshape(-1)

    # Current: extend token t of request i lands after the request's prefix.
    rerange = plan.rerange_index  # gathered row of every extend token, global order
    tok_req = np.repeat(np.arange(B, dtype=np.int64), plan.extend_lens)
    tok_off = np.arange(plan.num_tokens, dtype=np.int64) - plan.extend_start[tok_req]
    current_dest = np.full(cp * plan.num_rows, -1, dtype=np.int64)
    current_dest[rerange] = plan.kv_start[tok_req] + plan.prefix_lens[tok_req] + tok_off

    # Invert: source row of every full-view row in the rank-major gathered buffer.
    P, M = pages_per_rank * ps, plan.num_rows
    layout, ranks = GatherLayout(cp, P, M), np.arange(cp, dtype=np.int64)[:, None]
    prefix_src = layout.prefix_row(ranks, np.arange(P, dtype=np.int64)).reshape(-1)
    current_src = layout.compute_row(ranks, np.arange(M, dtype=np.int64)).reshape(-1)
    kv_rows = int(plan.kv_lens.sum())
    kv_source = np.full(kv_rows, -1, dtype=np.int64)
    keep = prefix_dest >= 0
    kv_source[prefix_dest[keep]] = prefix_src[keep]
    keep = current_dest >= 0
    kv_source[current_dest[keep]] = current_src[keep]

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

    return MaterializeDescriptors(
        rank=rank,
        cp_size=cp,
        page_size=ps,
        prefix_rows_per_rank=pages_per_rank * ps,
        num_rows=plan.num_rows,
        kv_rows=kv_rows,
        send_slots=t(send_slots),
        kv_source=t(kv_source),
    )
