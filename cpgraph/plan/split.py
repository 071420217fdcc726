"""Page-aligned zigzag split of each request's extend pages over a CP group.

This module is pure arithmetic on small per-request arrays (``[B]`` and
``[B, 2*cp]``): nothing here is per token or per page, so planning stays cheap
for 100K-token requests.  See ``docs/plan.md`` for the drawn-out example and
``docs/contracts.md`` for the ownership contract this implements.

Why zigzag: with causal attention the cost of a query row grows with its
position.  Cutting a request into ``2*cp`` chunks and giving rank ``r`` chunk
``r`` ("prev") and chunk ``2*cp-1-r`` ("next") pairs a cheap early chunk with
an expensive late one, so every rank does about the same attention work.

Why page-aligned and per request: a KV page must have exactly one compute
owner, otherwise two ranks would write (or neither would own) the same page.
Splitting a batch as one long sequence would cut pages of one request at
another request's boundary and mix top-k ranges: the output stays plausible
but is silently wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


def chunk_owner(num_chunks: int) -> np.ndarray:
    """Rank that computes each of the ``2*cp`` chunks: ``c`` or ``2*cp-1-c`` (a fresh array)."""
    return _chunk_owner(num_chunks).copy()


@lru_cache(maxsize=64)
def _chunk_owner(num_chunks: int) -> np.ndarray:
    # Shared and read-only: every plan of the same CP size reads the same owners (planning runs every step).
    cp = num_chunks // 2
    c = np.arange(num_chunks, dtype=np.int64)
    out = np.where(c < cp, c, num_chunks - 1 - c)
    out.setflags(write=False)
    return out


@dataclass(frozen=True)
class Split:
    """Chunk boundaries of every request, in pages and in extend tokens.

    All arrays are int64.  ``page_start``/``page_end`` are ``[B, 2*cp]`` page
    indices relative to the first extend page of the request;
    ``tok_start``/``tok_end`` are the same chunks in extend-token offsets,
    clipped to the request's extend length (the last page may hold page-tail
    slack, which belongs to no token).
    """

    cp_size: int
    page_size: int
    extend_lens: np.ndarray  # [B]
    num_pages: np.ndarray  # [B] extend pages P = ceil(extend / page)
    page_start: np.ndarray  # [B, 2cp]
    page_end: np.ndarray  # [B, 2cp]
    tok_start: np.ndarray  # [B, 2cp]
    tok_end: np.ndarray  # [B, 2cp]

    @property
    def tok_len(self) -> np.ndarray:
        return self.tok_end - self.tok_start

    def rank_chunks(self, rank: int) -> tuple[int, int]:
        """The (prev, next) chunk ids computed by ``rank``."""
        return rank, 2 * self.cp_size - 1 - rank

    def valid_rows_per_rank(self, tok_len: np.ndarray | None = None) -> np.ndarray:
        """``[cp]`` number of real token rows each rank computes (``tok_len``: :attr:`tok_len`, if at hand)."""
        owners = _chunk_owner(2 * self.cp_size)
        per_chunk = (self.tok_len if tok_len is None else tok_len).sum(axis=0)  # [2cp]
        return np.bincount(owners, weights=per_chunk, minlength=self.cp_size).astype(np.int64)


def split_requests(extend_lens: np.ndarray, *, cp_size: int, page_size: int) -> Split:
    """Cut every request's extend pages into ``2*cp`` contiguous chunks.

    Chunk sizes are ``P // (2*cp)`` pages, with the remainder ``P % (2*cp)``
    added one page each to the *first* chunks, so every rank derives the same
    boundaries from the lengths alone.
    """
    n = 2 * cp_size
    ext = np.asarray(extend_lens, dtype=np.int64)
    pages = (ext + page_size - 1) // page_size
    base, rem = np.divmod(pages, n)
    sizes = base[:, None] + (np.arange(n, dtype=np.int64)[None, :] < rem[:, None])
    page_end = sizes.cumsum(axis=1)
    page_start = page_end - sizes
    col = ext[:, None]
    tok_start = np.minimum(page_start * page_size, col)
    tok_end = np.minimum(page_end * page_size, col)
    return Split(cp_size, page_size, ext, pages, page_start, page_end, tok_start, tok_end)
