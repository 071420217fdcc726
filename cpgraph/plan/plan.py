"""``plan_prefill``: one deterministic description of a CP prefill batch.

Every rank calls :func:`plan_prefill` with the same lengths and gets the same
:class:`CPPlan`; there is no communication.  A rank then asks only for its own
:class:`RankPlan` (``plan.rank(r)``), which is built vectorised from the
per-request chunk table in :mod:`cpgraph.plan.split` and moved to the device
once per batch (``rank_plan.to(device)``).  Forward code reads the device
bundle and never needs a host sync.

Row layout of a rank (see ``docs/plan.md`` for a drawing)::

    [ req0 prev | req0 next | req1 prev | req1 next | ... | dummy ... dummy ]
      \\____________________ valid rows ________________/ \\_ padding ___/

Valid rows come first, in request order, each request's "prev" chunk before
its "next" chunk; all dummy rows (CP compute padding, then static padding)
sit at the tail.  Why:

* every chunk starts on a page boundary and its rows are contiguous, so a
  rank's cache write is one contiguous run of rows per chunk and whole pages
  are written by exactly one rank;
* ``valid_rows`` is a prefix of the rows, so compacting around the MoE
  router is a static-shape prefix (no data-dependent sizes) and dummy rows
  never touch KV or routing;
* dummy rows have ``token_index == req_index == -1`` and an empty key window
  (``ks == ke == 0``), so any kernel that honours the windows ignores them.

The padding provenance rules are in ``docs/contracts.md``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from .split import Split, chunk_owner, split_requests

# Row provenance codes stored in ``RankPlan.row_kind``.
ROW_VALID = 0
ROW_COMPUTE_PAD = 1  # CP compute padding: evens out row counts across ranks
ROW_STATIC_PAD = 2  # static padding: rounds rows up to ``row_align``

# Input bounds (docs/plan.md, "Bounds").  Top-k ids are int32 row ids of the
# flattened full view and kernels index rows and slots with int32, so every
# coordinate the plan emits (positions, full-view rows, gathered rows) must
# stay below 2**31; checking with Python ints before any NumPy arithmetic
# also keeps int64 from wrapping.  cp_size and the per-request chunk table
# ([B, 2*cp] int64 arrays, several of them) are bounded so planning and the
# ``cpgraph plan`` report stay small: real CP groups are 2-64 ranks.
MAX_ROWS = 2**31 - 1
MAX_CP_SIZE = 1024
MAX_PLAN_CELLS = 2**22  # requests * 2 * cp_size


def _as_int_list(name: str, values: Sequence[int]) -> list[int]:
    try:
        out = list(values)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of integers, got {values!r}") from None
    for i, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{name}[{i}] (request {i}) must be an integer, got {v!r}")
    return [int(v) for v in out]


def _check_inputs(prefix_lens, extend_lens, cp_size, page_size, row_align):
    for name, v in (("cp_size", cp_size), ("page_size", page_size), ("row_align", row_align)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {v!r}")
    cp_size, page_size, row_align = int(cp_size), int(page_size), int(row_align)
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if cp_size > MAX_CP_SIZE:
        raise ValueError(f"cp_size must be <= {MAX_CP_SIZE}, got {cp_size}")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if page_size > MAX_ROWS:
        raise ValueError(f"page_size must be < 2**31, got {page_size}")
    if row_align < 1:
        raise ValueError(f"row_align must be >= 1, got {row_align}")
    if row_align > MAX_ROWS:
        raise ValueError(f"row_align must be < 2**31, got {row_align}")
    prefix = _as_int_list("prefix_lens", prefix_lens)
    extend = _as_int_list("extend_lens", extend_lens)
    if len(prefix) != len(extend):
        raise ValueError(
            f"prefix_lens has {len(prefix)} entries but extend_lens has {len(extend)}; "
            "they must describe the same requests"
        )
    if not extend:
        raise ValueError("the batch has no requests")
    cells = len(extend) * 2 * cp_size
    if cells > MAX_PLAN_CELLS:
        raise ValueError(
            f"the plan table would have {len(extend)} requests x {2 * cp_size} chunks = {cells} cells, "
            f"more than {MAX_PLAN_CELLS}; split the batch or use a smaller cp_size"
        )
    kv_rows = 0
    for i, (p, e) in enumerate(zip(prefix, extend)):
        if e < 1:
            raise ValueError(f"request {i}: extend length must be >= 1, got {e}")
        if e > MAX_ROWS:
            raise ValueError(f"request {i}: extend length must be < 2**31, got {e}")
        if p < 0:
            raise ValueError(f"request {i}: prefix length must be >= 0, got {p}")
        if p > MAX_ROWS:
            raise ValueError(f"request {i}: prefix length must be < 2**31, got {p}")
        if p % page_size:
            raise ValueError(
                f"request {i}: prefix length {p} is not a multiple of page_size {page_size} "
                "(cached prefixes are page aligned; floor radix hits to whole pages)"
            )
        kv_rows += p + -(-e // page_size) * page_size  # Python ints: cannot wrap
    if kv_rows > MAX_ROWS:
        raise ValueError(
            f"the batch's full KV view would have {kv_rows} rows (prefixes + extend pages of all requests), "
            f"more than {MAX_ROWS} (2**31 - 1); split the batch"
        )
    return prefix, extend


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.shape, dtype=x.dtype)  # np.zeros_like is a Python wrapper: this runs per batch, per step
    if x.size > 1:
        np.cumsum(x[:-1], out=out[1:])
    return out


@lru_cache(maxsize=64)
def _seg_chunks(cp_size: int) -> np.ndarray:
    """``[cp, 2]`` chunk ids of each rank's (prev, next) segments; depends on ``cp_size`` only (read-only, shared)."""
    ranks = np.arange(cp_size, dtype=np.int64)
    out = np.stack([ranks, 2 * cp_size - 1 - ranks], axis=1)
    out.setflags(write=False)
    return out


def _expand_segments(seg_start: np.ndarray, seg_len: np.ndarray) -> np.ndarray:
    """``concat([arange(s, s + n) for s, n in zip(seg_start, seg_len)])`` without a loop.

    Built as one running sum over a buffer of ones with a jump at each segment
    start: a single allocation and a single pass, which matters for the
    million-entry rerange index.
    """
    keep = seg_len > 0
    start, length = seg_start[keep], seg_len[keep]
    total = int(length.sum())
    out = np.ones(total, dtype=np.int64)
    if total == 0:
        return out
    first = _exclusive_cumsum(length)
    prev_last = np.empty_like(start)
    prev_last[0] = -1
    prev_last[1:] = start[:-1] + length[:-1] - 1
    out[first] = start - prev_last
    out[0] = start[0]
    return np.cumsum(out, out=out)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


@dataclass(frozen=True)
class RankPlan:
    """What rank ``rank`` computes, as int64 tensors (the device bundle).

    Per-row tensors have length ``num_rows`` (M, equal on every rank):

    * ``token_index``: row -> index into the batch's concatenated extend
      tokens (request 0's extend, then request 1's, ...), ``-1`` for a dummy;
    * ``positions``: absolute position ``prefix + offset`` (``0`` for a dummy);
    * ``req_index``: the row's request, ``-1`` for a dummy;
    * ``ks``/``ke``: the row's causal key window ``[ks, ke)`` in the
      flattened full-view coordinates described below (``ks == ke == 0`` for
      a dummy, an empty window);
    * ``row_kind``: provenance, ``ROW_VALID``/``ROW_COMPUTE_PAD``/``ROW_STATIC_PAD``.

    ``valid_rows`` (length ``num_valid``) lists the real rows in row order;
    with this planner's layout it is ``arange(num_valid)``, but consumers must
    index through it rather than assume the prefix.  ``num_valid_tensor`` is
    the same count as a ``[1]`` tensor for static-shape device code.

    Full-view coordinates: request ``i`` owns rows
    ``[kv_start[i], kv_start[i] + kv_lens[i])`` of a flattened ragged buffer,
    where ``kv_lens[i] = prefix + pages * page_size`` (page-tail slack is
    included so pages stay whole; slack rows are never inside any window).
    A valid row at position ``p`` of request ``i`` has
    ``ks = kv_start[i]`` and ``ke = ks + p + 1``.

    Per-request tensors (length B, identical on all ranks): ``prefix_lens``,
    ``extend_lens``, ``extend_start`` (offset in the concatenated extend
    tokens), ``kv_start``, ``kv_lens``, ``last_token_index`` (gathered row of
    each request's last token in the rank-major ``[cp * M]`` all-gather).
    ``extend_page_owner`` (length sum of extend pages) gives the owner rank of
    every extend page, request-major; ``extend_page_start`` indexes into it.
    ``rerange_index`` (length = total extend tokens) is present only when
    requested, since only the full-hidden-states output needs it.
    """

    rank: int
    cp_size: int
    page_size: int
    num_rows: int
    num_valid: int
    compute_padding: int
    static_padding: int
    token_index: torch.Tensor
    positions: torch.Tensor
    req_index: torch.Tensor
    ks: torch.Tensor
    ke: torch.Tensor
    row_kind: torch.Tensor
    valid_rows: torch.Tensor
    num_valid_tensor: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_start: torch.Tensor
    kv_start: torch.Tensor
    kv_lens: torch.Tensor
    last_token_index: torch.Tensor
    extend_page_owner: torch.Tensor
    extend_page_start: torch.Tensor
    rerange_index: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """All tensor fields by name (``rerange_index`` only if present)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v
        return out

    def to(self, device, non_blocking: bool = False) -> "RankPlan":
        """Copy every tensor to ``device`` once; the result is the device bundle."""
        moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors().items()}
        return replace(self, **moved)


class CPPlan:
    """The split of one prefill batch over a CP group (identical on all ranks).

    Holds only the per-request chunk table; per-rank rows are derived on
    demand by :meth:`rank`, so a rank never pays for other ranks' rows.
    """

    def __init__(self, prefix_lens: list[int], extend_lens: list[int], split: Split, row_align: int):
        self.cp_size = split.cp_size
        self.page_size = split.page_size
        self.row_align = row_align
        self.prefix_lens = np.asarray(prefix_lens, dtype=np.int64)
        self.extend_lens = split.extend_lens
        self.split = split
        self.num_requests = len(extend_lens)
        self.num_tokens = int(self.extend_lens.sum())
        self.extend_start = _exclusive_cumsum(self.extend_lens)
        self.num_pages = split.num_pages
        self.kv_lens = self.prefix_lens + self.num_pages * self.page_size
        self.kv_start = _exclusive_cumsum(self.kv_lens)
        tok_len = split.tok_len  # [B, 2cp], used twice below
        self.valid_per_rank = split.valid_rows_per_rank(tok_len)
        raw = max(int(self.valid_per_rank.max()), 1)
        self.compute_rows = raw  # rows before static (bucket) padding
        self.num_rows = -(-raw // row_align) * row_align
        if self.cp_size * self.num_rows > MAX_ROWS:
            raise ValueError(
                f"the all-gather of compute rows would have cp_size {self.cp_size} x {self.num_rows} rows = "
                f"{self.cp_size * self.num_rows}, more than {MAX_ROWS} (2**31 - 1); split the batch or lower row_align"
            )
        # Rank-local row offset of each (rank, request, side) segment; side 0 = prev, 1 = next.
        self._seg_chunk = _seg_chunks(self.cp_size)  # [cp, 2]
        seg_len = tok_len[:, self._seg_chunk]  # [B, cp, 2]
        seg_len = seg_len.transpose(1, 0, 2).reshape(self.cp_size, -1)  # [cp, B*2] in row order
        self._seg_len = seg_len
        self._seg_row = np.cumsum(seg_len, axis=1) - seg_len  # [cp, B*2]
        self._extend_page_owner: np.ndarray | None = None
        self._last_token: tuple[np.ndarray, np.ndarray] | None = None

    # ------------------------------------------------------------------ pages
    @property
    def page_tail_slack(self) -> np.ndarray:
        """``[B]`` positions after the last valid token inside the last page."""
        return self.num_pages * self.page_size - self.extend_lens

    @property
    def compute_padding(self) -> np.ndarray:
        """``[cp]`` dummy rows added per rank to reach the common row count."""
        return self.compute_rows - self.valid_per_rank

    @property
    def static_padding(self) -> int:
        """Dummy rows per rank added by rounding up to ``row_align``."""
        return self.num_rows - self.compute_rows

    def page_owners(self, i: int) -> list[int]:
        """Owner rank of each extend page of request ``i`` (``ceil(extend/page)`` entries)."""
        self._check_request(i)
        return [int(x) for x in self._extend_page_owner_of(np.array([i]))]

    def _extend_page_owner_of(self, reqs: np.ndarray) -> np.ndarray:
        n = 2 * self.cp_size
        sizes = (self.split.page_end - self.split.page_start)[reqs]  # [b, 2cp]
        owners = np.broadcast_to(chunk_owner(n), sizes.shape)
        return np.repeat(owners.reshape(-1), sizes.reshape(-1))

    # ------------------------------------------------------------------ ranks
    @property
    def extend_page_owner(self) -> np.ndarray:
        """Owner rank of every extend page, request-major (computed once; read-only)."""
        if self._extend_page_owner is None:
            owners = self._extend_page_owner_of(np.arange(self.num_requests))
            owners.setflags(write=False)
            self._extend_page_owner = owners
        return self._extend_page_owner

    def rank_segments(self, r: int) -> list[tuple[int, int, int]]:
        """``(request, first position, end position)`` of each non-empty row run of rank ``r``, in row order.

        O(requests): reports read this instead of building the rank's rows.
        """
        self._check_rank(r)
        lens = self._seg_len[r]
        k = np.flatnonzero(lens)
        req = k // 2
        start = self.prefix_lens[req] + self.split.tok_start[req, self._seg_chunk[r, k % 2]]
        return list(zip(req.tolist(), start.tolist(), (start + lens[k]).tolist()))

    def page_owner_runs(self, i: int) -> list[tuple[int, int, int]]:
        """``(first page, end page, owner)`` runs of request ``i``'s extend pages (O(cp), not O(pages))."""
        self._check_request(i)
        sp = self.split
        a, b = sp.page_start[i], sp.page_end[i]
        keep = b > a
        runs: list[tuple[int, int, int]] = []
        for a, b, o in zip(a[keep].tolist(), b[keep].tolist(), chunk_owner(2 * self.cp_size)[keep].tolist()):
            if runs and runs[-1][2] == o and runs[-1][1] == a:
                runs[-1] = (runs[-1][0], b, o)
            else:
                runs.append((a, b, o))
        return runs

    def _check_rank(self, r) -> None:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < self.cp_size:
            raise ValueError(f"rank must be in [0, {self.cp_size}), got {r!r}")

    def rank(self, r: int, *, rerange: bool = False) -> RankPlan:
        """Build rank ``r``'s bundle (CPU tensors); ``rerange`` adds ``rerange_index``."""
        rows = self._rank_rows(r)
        return RankPlan(
            rank=int(r),
            cp_size=self.cp_size,
            page_size=self.page_size,
            num_rows=self.num_rows,
            num_valid=rows["num_valid"],
            compute_padding=int(self.compute_rows - rows["num_valid"]),
            static_padding=self.static_padding,
            token_index=_t(rows["token_index"]),
            positions=_t(rows["positions"]),
            req_index=_t(rows["req_index"]),
            ks=_t(rows["ks"]),
            ke=_t(rows["ke"]),
            row_kind=_t(rows["row_kind"]),
            valid_rows=torch.arange(rows["num_valid"], dtype=torch.int64),
            num_valid_tensor=torch.tensor([rows["num_valid"]], dtype=torch.int64),
            prefix_lens=_t(self.prefix_lens),
            extend_lens=_t(self.extend_lens),
            extend_start=_t(self.extend_start),
            kv_start=_t(self.kv_start),
            kv_lens=_t(self.kv_lens),
            last_token_index=_t(self.last_token_index),
            extend_page_owner=torch.from_numpy(self.extend_page_owner.copy()),
            extend_page_start=_t(_exclusive_cumsum(self.num_pages)),
            rerange_index=_t(self.rerange_index) if rerange else None,
        )

    def _rank_rows(self, r: int) -> dict:
        """Rank ``r``'s per-row arrays (NumPy), O(rows + requests)."""
        self._check_rank(r)
        sp = self.split
        B = self.num_requests
        seg_req = np.repeat(np.arange(B, dtype=np.int64), 2)
        seg_chunk = np.tile(self._seg_chunk[r], B)
        seg_start = sp.tok_start[seg_req, seg_chunk]
        seg_len = self._seg_len[r]
        offs = _expand_segments(seg_start, seg_len)  # offset within request extend
        req = np.repeat(seg_req, seg_len)
        nv = offs.size
        M = self.num_rows

        token_index = np.full(M, -1, dtype=np.int64)
        positions = np.zeros(M, dtype=np.int64)
        req_index = np.full(M, -1, dtype=np.int64)
        ks = np.zeros(M, dtype=np.int64)
        ke = np.zeros(M, dtype=np.int64)
        row_kind = np.full(M, ROW_STATIC_PAD, dtype=np.int64)
        token_index[:nv] = self.extend_start[req] + offs
        positions[:nv] = self.prefix_lens[req] + offs
        req_index[:nv] = req
        ks[:nv] = self.kv_start[req]
        ke[:nv] = ks[:nv] + positions[:nv] + 1
        row_kind[:nv] = ROW_VALID
        row_kind[nv : self.compute_rows] = ROW_COMPUTE_PAD
        return dict(num_valid=nv, token_index=token_index, positions=positions, req_index=req_index, ks=ks, ke=ke,
                    row_kind=row_kind)

    # ---------------------------------------------------------------- rerange
    @property
    def last_token_index(self) -> np.ndarray:
        """``[B]`` row of each request's last token in the rank-major ``[cp*M]`` gather."""
        rank, row = self._last_token_rank_row()
        return rank * self.num_rows + row

    def last_token_owner(self, i: int) -> tuple[int, int]:
        """``(rank, row)`` holding request ``i``'s last token."""
        self._check_request(i)
        rank, row = self._last_token_rank_row()
        return int(rank[i]), int(row[i])

    def _last_token_rank_row(self) -> tuple[np.ndarray, np.ndarray]:
        # Cached: per-request callers (reports, to_dict) would otherwise pay O(B * cp) each.
        if self._last_token is None:
            self._last_token = self._compute_last_token_rank_row()
        return self._last_token

    def _compute_last_token_rank_row(self) -> tuple[np.ndarray, np.ndarray]:
        sp = self.split
        last = self.extend_lens - 1
        # Empty chunks only occur at the back (the remainder goes to the front
        # chunks), so the last token lies in the last chunk starting at or before it.
        chunk = (sp.tok_start <= last[:, None]).sum(axis=1) - 1
        n = 2 * self.cp_size
        rank = np.where(chunk < self.cp_size, chunk, n - 1 - chunk)
        side = (chunk >= self.cp_size).astype(np.int64)
        seg = np.arange(self.num_requests) * 2 + side
        row = self._seg_row[rank, seg] + last - sp.tok_start[np.arange(self.num_requests), chunk]
        return rank.astype(np.int64), row.astype(np.int64)

    @property
    def rerange_index(self) -> np.ndarray:
        """For every extend token in global order, its row in the ``[cp*M]`` gather."""
        B, cp = self.num_requests, self.cp_size
        sp = self.split
        # Segment table over (rank, request, side), flattened rank-major.
        ranks = np.repeat(np.arange(cp), 2 * B)
        seg_chunk = self._seg_chunk[ranks, np.tile(np.arange(2), cp * B)]
        seg_req = np.tile(np.repeat(np.arange(B), 2), cp)
        tok0 = self.extend_start[seg_req] + sp.tok_start[seg_req, seg_chunk]  # global token start
        row0 = ranks * self.num_rows + self._seg_row.reshape(-1)  # gathered row start
        length = self._seg_len.reshape(-1)
        order = np.argsort(tok0, kind="stable")  # segments are disjoint; empty ones add nothing
        return _expand_segments(row0[order], length[order])

    # ------------------------------------------------------------------- misc
    def _check_request(self, i) -> None:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < self.num_requests:
            raise ValueError(f"request index must be in [0, {self.num_requests}), got {i!r}")

    def to_dict(self) -> dict:
        """A JSON-ready description of the whole plan (all ranks; for tools, not hot paths)."""
        ranks = []
        for r in range(self.cp_size):
            rows = self._rank_rows(r)  # rows only: each rank costs O(M + B), the whole dict O(cp * M + B * cp)
            ranks.append(
                {
                    "rank": r,
                    "num_valid": rows["num_valid"],
                    "compute_padding": int(self.compute_rows - rows["num_valid"]),
                    "static_padding": self.static_padding,
                    **{k: rows[k].tolist() for k in ("token_index", "req_index", "positions", "ks", "ke", "row_kind")},
                }
            )
        return {
            "cp_size": self.cp_size,
            "page_size": self.page_size,
            "row_align": self.row_align,
            "num_rows": self.num_rows,
            "compute_rows": self.compute_rows,
            "requests": [
                {
                    "prefix": int(self.prefix_lens[i]),
                    "extend": int(self.extend_lens[i]),
                    "extend_pages": int(self.num_pages[i]),
                    "first_extend_page": int(self.prefix_lens[i] // self.page_size),
                    "page_owners": self.page_owners(i),
                    "page_tail_slack": int(self.page_tail_slack[i]),
                    "kv_start": int(self.kv_start[i]),
                    "last_token": dict(zip(("rank", "row"), self.last_token_owner(i))),
                }
                for i in range(self.num_requests)
            ],
            "ranks": ranks,
            "rerange_index": self.rerange_index.tolist(),
            "last_token_index": self.last_token_index.tolist(),
        }

    def fingerprint(self) -> str:
        """SHA-256 over the canonical JSON form; equal plans give equal strings."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


def plan_prefill(
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    *,
    cp_size: int,
    page_size: int,
    row_align: int = 1,
) -> CPPlan:
    """Plan a CP prefill batch.

    ``prefix_lens[i]`` is request i's cached (page-aligned) prefix and
    ``extend_lens[i]`` its new tokens.  Raises ``ValueError`` naming the
    offending request and value on bad input.  The result depends only on the
    arguments, so every rank computes the same plan without communicating.
    """
    plan = _one_request_plan(prefix_lens, extend_lens, cp_size, page_size, row_align)
    if plan is not None:
        return plan
    prefix, extend = _check_inputs(prefix_lens, extend_lens, cp_size, page_size, row_align)
    split = split_requests(np.asarray(extend, dtype=np.int64), cp_size=int(cp_size), page_size=int(page_size))
    return CPPlan(prefix, extend, split, int(row_align))


def _one_request_plan(prefix_lens, extend_lens, cp_size, page_size, row_align) -> CPPlan | None:
    """:func:`plan_prefill` of one request without CP, from Python ints (``None``: take the general path).

    Why: the serving engine plans every step, and at idle a step is one request on one rank.  The general
    path costs ~35 NumPy calls (the chunk table, cumsums, bincounts over ``[B, 2cp]`` arrays), and right
    after a forward, with the host's caches cold, each costs several times its warm price; here the same
    table is a handful of Python integers put into arrays once.  Every field equals the general path's
    (same values, dtypes and shapes: ``tests/plan/test_plan.py``).  Anything unusual -- another type, a
    bound crossed, a bad value -- goes to the general path, which checks it and names what is wrong.
    """
    if type(cp_size) is not int or cp_size != 1 or type(page_size) is not int or type(row_align) is not int:
        return None
    if type(prefix_lens) not in (list, tuple) or type(extend_lens) not in (list, tuple):
        return None
    if len(extend_lens) != 1 or len(prefix_lens) != 1:
        return None
    p, e = prefix_lens[0], extend_lens[0]
    if type(p) is not int or type(e) is not int:
        return None
    ps = page_size
    if not (1 <= ps <= MAX_ROWS and not ps & (ps - 1) and 1 <= row_align <= MAX_ROWS):
        return None
    if not (1 <= e <= MAX_ROWS and 0 <= p <= MAX_ROWS and not p % ps):
        return None
    pages = -(-e // ps)
    num_rows = -(-e // row_align) * row_align
    if p + pages * ps > MAX_ROWS or num_rows > MAX_ROWS:
        return None
    # split_requests for one request and 2 chunks: the first chunk takes the odd page (the remainder goes
    # to the front chunks), token bounds clipped to the extend length.
    mid = (pages + 1) // 2
    t0 = min(mid * ps, e)
    i64 = np.int64
    ext = np.array([e], dtype=i64)
    num_pages = np.array([pages], dtype=i64)
    split = Split(1, ps, ext, num_pages, np.array([[0, mid]], dtype=i64), np.array([[mid, pages]], dtype=i64),
                  np.array([[0, t0]], dtype=i64), np.array([[t0, e]], dtype=i64))
    plan = CPPlan.__new__(CPPlan)  # the attributes CPPlan.__init__ sets, in its order
    plan.cp_size, plan.page_size, plan.row_align = 1, ps, row_align
    plan.prefix_lens = np.array([p], dtype=i64)
    plan.extend_lens = ext
    plan.split = split
    plan.num_requests = 1
    plan.num_tokens = e
    plan.extend_start = np.zeros(1, dtype=i64)
    plan.num_pages = num_pages
    plan.kv_lens = np.array([p + pages * ps], dtype=i64)
    plan.kv_start = np.zeros(1, dtype=i64)
    plan.valid_per_rank = np.array([e], dtype=i64)
    plan.compute_rows = e
    plan.num_rows = num_rows
    plan._seg_chunk = _seg_chunks(1)
    plan._seg_len = np.array([[t0, e - t0]], dtype=i64)
    plan._seg_row = np.array([[0, t0]], dtype=i64)
    plan._extend_page_owner = None
    plan._last_token = None
    return plan
