"""The shape-bucket arithmetic of the CUDA-graph runner: ladders, bounds, plans in buckets.

Why a module of its own: what a bucket is, which bucket a batch lands in
and which buckets a token budget can reach is pure integer arithmetic over
the plan's lengths (no tensors, no CUDA), shared by the runner
(:mod:`cpgraph.runtime.graph_runner`, whose docstring describes the padding
each bucket value fixes), by the planner-facing ``plan`` of a graphed forward
and by the serve warm-up.  Every CP rank computes it alone, from the plan's
lengths, and picks the same bucket without talking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from cpgraph.models.batch import MIN_PREFIX_ROWS
from cpgraph.plan import CPPlan, plan_prefill

DEFAULT_MAX_ROWS = 8192
DEFAULT_MAX_KV_ROWS = 1 << 20


def bucket_ladder(lo: int, hi: int, steps: int = 2) -> tuple[int, ...]:
    """Geometric bucket values from ``lo`` up to the first one >= ``hi``.

    Each octave ``[2**e, 2**(e+1))`` holds ``steps`` values ``2**e * (1 + j/steps)``
    (rounded up to ints), so a batch is padded by at most a factor ``1 + 1/steps``.
    """
    if lo < 1 or hi < lo or steps < 1:
        raise ValueError(f"bucket_ladder: need 1 <= lo <= hi and steps >= 1, got lo={lo}, hi={hi}, steps={steps}")
    out: list[int] = []
    e = 0
    while True:
        base = 1 << e
        for j in range(steps):
            v = math.ceil(base * (steps + j) / steps)
            if v >= lo and (not out or v > out[-1]):
                out.append(v)
                if v >= hi:
                    return tuple(out)
        e += 1


DEFAULT_ROW_BUCKETS = bucket_ladder(16, DEFAULT_MAX_ROWS, 2)  # 16, 24, 32, 48, ..., 8192


def pick_bucket(ladder: Sequence[int], n: int, what: str) -> int:
    """Smallest ladder value >= ``n``; ``ValueError`` past the largest bucket."""
    for v in ladder:
        if v >= n:
            return v
    raise ValueError(f"graph_runner: {what} {n} exceeds the largest bucket {ladder[-1]}; split the batch or raise the limit")


def kv_rows_bound(m: int, p: int, max_requests: int, page_size: int, cp_size: int = 1) -> int:
    """The most KV-view rows ``N`` a step with ``m`` compute rows and ``p`` cached-prefix rows per rank can have.

    ``N = sum(prefix_i) + sum(ceil(e_i / page) * page)`` (the whole view, the same on every rank).  Each
    rank holds at most ``p`` prefix rows and ``m`` compute rows, so ``sum(prefix_i) <= cp * p`` and
    ``sum(e_i) <= cp * m``; each of at most ``min(max_requests, cp * m)`` requests adds under a page of
    slack.  At ``cp_size == 1``: ``p + m + B * (page - 1)``.
    """
    return cp_size * (p + m) + min(max_requests, cp_size * m) * (page_size - 1)


def plan_in_buckets(row_buckets: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int], *,
                    cp_size: int, page_size: int) -> CPPlan:
    """``plan_prefill`` whose per-rank rows ``M`` are a value of ``row_buckets`` (static padding, ``row_kind == 2``).

    Under CP the gathered coordinates (``rank * M + row``) move with ``M``, so a batch that replays a
    bucket's graph is planned with the bucket's ``M`` from the start.  The plain plan is kept when its
    ``M`` already is a bucket (no second planning).
    """
    plan = plan_prefill(prefix_lens, extend_lens, cp_size=cp_size, page_size=page_size)
    if plan.num_rows in row_buckets:
        return plan
    rows = pick_bucket(row_buckets, plan.num_rows, "compute rows")
    return plan_prefill(prefix_lens, extend_lens, cp_size=cp_size, page_size=page_size, row_align=rows)


@dataclass(frozen=True)
class Bucket:
    """Static shapes of one graph: compute rows, KV-view rows, requests, CP size."""

    rows: int
    kv_rows: int
    prefix_rows: int
    requests: int
    cp_size: int = 1


def reachable_buckets(row_buckets: Sequence[int], kv_buckets: Sequence[int], max_requests: int, cp_size: int,
                      derived_page_size: int | None, token_budget: int, page_size: int,
                      max_prefix_tokens: int = 0) -> list[Bucket]:
    """The arithmetic of :meth:`GraphRunner.reachable_buckets <cpgraph.runtime.graph_runner.GraphRunner.reachable_buckets>`
    over the runner's ladders; ``derived_page_size`` is the runner's ``page_size`` (``None``: ``N`` not derived).

    One device: a step of extends ``e_i`` over page-aligned prefixes ``p_i`` has ``M = sum(e_i)`` rows,
    ``P = sum(p_i)`` and ``N = P + sum(ceil(e_i / page) * page)`` KV-view rows, so
    ``P + M <= N <= P + M + B * (page - 1)``: several ``N`` buckets per ``(M, P)`` pair, unless the runner
    derives ``N`` from them (``page_size``), which leaves one bucket per pair.  Under CP ``M`` and ``P`` are
    one rank's rows, and one rank may hold all of a step's rows (small requests, each inside one chunk)
    and own all of its prefix pages, so the same ``(M, P)`` ladder applies; ``N`` (the whole view)
    reaches ``cp * (P + M)`` plus the page slack (:func:`kv_rows_bound`).
    """
    budget = int(token_budget)
    rows = [m for m in row_buckets if m < pick_bucket(row_buckets, budget, "compute rows")]
    rows.append(pick_bucket(row_buckets, budget, "compute rows"))
    # (bucket, smallest, largest P it holds); a step without cached prefix rows carries MIN_PREFIX_ROWS
    # pad rows (build_batch), its own bucket (see pick)
    prefixes = [(MIN_PREFIX_ROWS, MIN_PREFIX_ROWS, MIN_PREFIX_ROWS)]
    if max_prefix_tokens >= page_size:
        top = pick_bucket(kv_buckets, max_prefix_tokens, "cached-prefix rows")
        lo = max(page_size, MIN_PREFIX_ROWS + 1)
        for v in kv_buckets:
            if v >= lo:
                hi = min(v, max_prefix_tokens) // page_size * page_size
                if hi >= lo:
                    prefixes.append((v, lo, hi))
                lo = v + 1
            if v >= top:
                break
    if derived_page_size is not None and derived_page_size != page_size:
        raise ValueError(f"graph_runner: page_size {page_size} differs from the runner's {derived_page_size}")
    out, m_lo = [], 1
    for m in rows:
        m_hi = min(m, budget)
        for p, p_lo, p_hi in prefixes:
            if derived_page_size is not None:
                n = kv_rows_bound(m, p, max_requests, derived_page_size, cp_size)
                out.append(Bucket(m, pick_bucket(kv_buckets, n, "KV-view rows"), p, max_requests, cp_size))
                continue
            n_lo, n_hi = p_lo + m_lo, kv_rows_bound(m_hi, p_hi, max_requests, page_size, cp_size)
            for n in kv_buckets:
                if n >= n_lo:
                    out.append(Bucket(m, n, p, max_requests, cp_size))
                if n >= n_hi:
                    break
        m_lo = m + 1
    return out
