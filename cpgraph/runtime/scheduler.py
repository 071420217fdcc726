"""Which requests run in the next prefill step, and how much of each: the serving policy.

The engine (:mod:`cpgraph.runtime.prefill_engine`) calls :meth:`Scheduler.next_step`
once per step; this module holds only the policy and the arithmetic it needs,
so every rule below is testable without a model.

* **Budget.**  A step computes at most ``token_budget`` prompt tokens for at
  most ``max_batch_requests`` requests, so its row count stays inside the
  graph bucket ladder (the budget is checked against the largest row bucket
  when CUDA graphs are on) and a steady stream of steps replays captured
  graphs.
* **Chunked prefill.**  A request whose remaining prompt exceeds what the
  step has left runs as consecutive chunks: every chunk but the last ends on
  a page boundary (the planner takes page-aligned prefixes), the first is cut
  to the budget left when the request is admitted, the next ones are
  ``chunk_tokens`` long.  The whole chunk sequence is fixed at admission, so
  the pages each CP rank will need are known exactly then (page owners of a
  chunk depend on its own length only, :func:`lane_pages`).
* **FIFO and no starvation.**  Running requests get their next chunk first, in
  admission order; the oldest always fits (a chunk never exceeds the budget),
  so every admitted request advances every step it is first in line.  Waiting
  requests are admitted in arrival order; when the one in line does not fit
  (pages or budget), nobody behind it is admitted in this step, so a stream of
  short requests cannot overtake a long one indefinitely.
* **Prefixes on their way from L3.**  A waiting request whose cached prefix
  is being read from the L3 page store into L2 (started when it was queued,
  overlapping the steps before its admission) is not admitted until the read
  has landed, one step later; the requests behind it may pass it meanwhile
  (it keeps its place in line).
* **Shared prefixes in flight.**  A waiting request whose leading pages
  (``defer_shared_tokens`` or more, beyond the other request's own cache hit)
  are being computed in this step by a request that finishes in this step
  would compute them a second time; it waits one step for them to reach the
  radix cache instead (at most ``max_defer_steps`` times), and requests behind
  it may pass it meanwhile (it keeps its place in line).  A sharer that needs
  more steps is not waited for: the wait would cost more latency than the
  compute it saves.

The engine supplies ``admit(entry, budget) -> bool``: match the radix cache,
fix the chunk sequence, and reserve pages; ``False`` when the request must wait
for pages (the engine undoes the match).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np

from cpgraph.plan import plan_prefill


@dataclass(frozen=True)
class SchedulerConfig:
    token_budget: int = 2048  # prompt tokens computed per step (all requests together)
    chunk_tokens: int | None = None  # chunk length after a request's first chunk (default: the budget, in pages)
    max_batch_requests: int = 64  # requests per step (the graph runner's max_requests)
    max_waiting: int = 1024  # requests queued before admission; past that a submit is refused (HTTP 429)
    defer_shared_tokens: int = 64  # wait for an in-flight shared prefix of at least this many tokens
    max_defer_steps: int = 8  # ... for at most this many steps

    def checked(self, page_size: int) -> "SchedulerConfig":
        """This config with ``chunk_tokens`` resolved; ``ValueError`` naming a bad field."""
        for name in ("token_budget", "max_batch_requests", "max_waiting", "max_defer_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "max_defer_steps" else 1):
                raise ValueError(f"scheduler: {name} must be a positive integer, got {v!r}")
        if self.token_budget < page_size:
            raise ValueError(f"scheduler: token_budget {self.token_budget} is smaller than a page ({page_size})")
        chunk = self.chunk_tokens
        if chunk is None:
            chunk = self.token_budget // page_size * page_size
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < page_size or chunk % page_size:
            raise ValueError(f"scheduler: chunk_tokens must be a positive multiple of the page size {page_size}, "
                             f"got {chunk!r}")
        if chunk > self.token_budget:
            raise ValueError(f"scheduler: chunk_tokens {chunk} exceeds token_budget {self.token_budget}")
        if self.defer_shared_tokens < 0:
            raise ValueError(f"scheduler: defer_shared_tokens must be >= 0, got {self.defer_shared_tokens}")
        return SchedulerConfig(self.token_budget, chunk, self.max_batch_requests, self.max_waiting,
                               self.defer_shared_tokens, self.max_defer_steps)


def chunk_ends(start: int, total: int, first: int, chunk: int) -> list[int]:
    """Ends of the chunks that compute tokens ``[start, total)``: ``first`` tokens, then ``chunk`` each."""
    if start >= total:
        raise ValueError(f"chunk_ends: nothing to compute ({start} >= {total})")
    ends = [min(total, start + first)]
    while ends[-1] < total:
        ends.append(min(total, ends[-1] + chunk))
    return ends


def chunk_spans(segments: Sequence[tuple[int, int]], first: int, chunk: int, page_size: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` chunks that compute the token ranges ``segments`` in order (empty: the first cannot start).

    A chunk never spans two segments (each is one contiguous extend).  The
    first chunk takes at most ``first`` tokens (the step's budget left), the
    others at most ``chunk``; a segment that does not fit is cut on page
    boundaries.  Every segment but the last is whole pages (a hole left by an
    L3 page that failed to arrive), so every chunk but the prompt's last ends
    on a page boundary.  One segment gives :func:`first_chunk` then
    :func:`chunk_ends`.
    """
    spans, cap = [], first
    for s, e in segments:
        while s < e:
            n = e - s if e - s <= cap else cap // page_size * page_size
            if n == 0:
                return []
            spans.append((s, s + n))
            s, cap = s + n, chunk
    return spans


def first_chunk(remaining: int, budget: int, page_size: int) -> int:
    """Tokens of a request's first chunk given the step's budget left: all of it, or whole pages (0: none fit)."""
    if remaining <= budget:
        return remaining
    return budget // page_size * page_size


@lru_cache(maxsize=4096)
def _extend_owners(extend: int, cp_size: int, page_size: int) -> np.ndarray:
    # Owners of a request's extend pages depend only on its own extend length (request-first split).
    owners = np.asarray(plan_prefill([0], [extend], cp_size=cp_size, page_size=page_size).page_owners(0),
                        dtype=np.int64)
    owners.flags.writeable = False  # shared by every caller of the cache
    return owners


def chunk_owners(start: int, end: int, cp_size: int, page_size: int) -> np.ndarray:
    """Owner rank of each page a chunk ``[start, end)`` allocates (``start`` is page aligned); read-only."""
    if cp_size == 1:  # one rank owns everything: no plan needed
        return np.zeros(-(-(end - start) // page_size), dtype=np.int64)
    return _extend_owners(end - start, cp_size, page_size)


def lane_pages(starts: Sequence[int], ends: Sequence[int], cp_size: int, page_size: int) -> np.ndarray:
    """``[cp_size]`` pages each rank allocates for the chunks ``[starts[i], ends[i])``."""
    if cp_size == 1:
        return np.asarray([sum(-(-(e - s) // page_size) for s, e in zip(starts, ends))], dtype=np.int64)
    need = np.zeros(cp_size, dtype=np.int64)
    for s, e in zip(starts, ends):
        need += np.bincount(chunk_owners(s, e, cp_size, page_size), minlength=cp_size)
    return need


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class Scheduler:
    """FIFO admission and per-step batch forming (module docstring).

    Entries are the engine's request records; the scheduler reads
    ``tokens_np`` (int64 array), ``done`` (where the next chunk starts: the
    leading tokens whose KV exists), ``ends`` (chunk ends fixed at
    admission), ``prefix_len`` (cache hit) and keeps ``defers``.
    """

    def __init__(self, config: SchedulerConfig, page_size: int):
        self.config = config.checked(page_size)
        self.page_size = page_size
        self.waiting: deque = deque()
        self.running: list = []

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def enqueue(self, entry) -> None:
        entry.defers = 0
        self.waiting.append(entry)

    def remove(self, entry) -> None:
        if entry in self.running:
            self.running.remove(entry)
        else:
            try:
                self.waiting.remove(entry)
            except ValueError:
                pass

    def _shares_in_flight(self, entry, finishing: list) -> bool:
        """Would ``entry`` recompute leading pages that a request finishing in this step is computing?"""
        need = self.config.defer_shared_tokens
        if not need or entry.defers >= self.config.max_defer_steps:
            return False
        ps = self.page_size
        cap = (entry.tokens_np.shape[0] - 1) // ps * ps  # a hit keeps one token to compute
        for r in finishing:
            common = min(shared_prefix(entry.tokens_np, r.tokens_np), cap) // ps * ps
            if common - r.prefix_len >= max(need, ps):
                return True
        return False

    def next_step(self, admit: Callable[[object, int], bool],
                  ready: Callable[[object], bool] | None = None) -> list[tuple[object, int, int]]:
        """``[(entry, start, end)]``: the chunks of the next step (may be empty).

        ``ready(entry)`` False: the waiting entry cannot be admitted in this
        step (its prefix is still being fetched from L3); it keeps its place
        and the requests behind it may pass it.
        """
        cfg = self.config
        budget, batch, finishing = cfg.token_budget, [], []
        for e in self.running:
            if len(batch) == cfg.max_batch_requests:
                break
            end = e.ends[e.next_chunk]
            if end - e.done <= budget:
                batch.append((e, e.done, end))
                budget -= end - e.done
                if end == e.tokens_np.shape[0]:
                    finishing.append(e)
        for e in list(self.waiting):
            if len(batch) == cfg.max_batch_requests or budget == 0:
                break
            if ready is not None and not ready(e):
                continue
            if self._shares_in_flight(e, finishing):
                e.defers += 1
                continue
            if budget < self.page_size and e.tokens_np.shape[0] > budget:
                break  # only whole pages of a longer prompt can be a chunk
            if not admit(e, budget):
                break  # FIFO: nobody behind a request that does not fit yet
            self.waiting.remove(e)
            self.running.append(e)
            end = e.ends[0]
            batch.append((e, e.done, end))
            budget -= end - e.done
            if end == e.tokens_np.shape[0]:
                finishing.append(e)
        return batch
