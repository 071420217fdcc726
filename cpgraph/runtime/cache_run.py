"""``cpgraph run --cache``: the CLI's use of a :class:`~cpgraph.runtime.cache_engine.CacheEngine`.

The two-pass warm-cache check and the default L1 capacity for a fixed set of
prompts are what ``cpgraph run --cache`` needs (``cli_run_cache``, and each rank
in ``cp_run``), not part of the engine: the serving engine uses neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # annotation only: cache_engine re-exports this module's names, so it imports this one
    from .cache_engine import CacheEngine


def default_capacity(token_lists, page_size: int) -> int:
    """Pages per rank that hold every prompt twice over (cached copy + one batch's extend pages)."""
    return 2 * sum(-(-len(t) // page_size) for t in token_lists) + len(token_lists)


def run_twice(engine: CacheEngine, token_lists, *, evict: bool = False,
              progress: Callable[[str], None] | None = None) -> dict:
    """``cpgraph run --cache``: prefill, optionally evict all of L1 to L2, prefill the same prompts again.

    Returns both passes' logits and per-level hits; the second pass must give
    the first pass's logits (warm-cache correctness).
    """
    first = engine.prefill(token_lists, progress=progress)
    evicted = 0
    if evict:
        if engine.hicache is None:
            raise ValueError("evicting between passes needs an L2 host pool (host_pages > 0)")
        evicted = engine.evict_device()
        if progress:
            progress(f"evicted {evicted} page(s) from L1 to L2")
    second = engine.prefill(token_lists, progress=progress)
    return {
        "first": first.logits,
        "second": second.logits,
        "first_draft": first.draft_logits,  # the MTP draft's, when the engine runs one (else None)
        "second_draft": second.draft_logits,
        "hits": [first.totals(), second.totals()],
        "hits_per_request": [first.hits, second.hits],
        "evicted_pages": evicted,
        "load_misses": second.load_misses,
        "hicache": dict(engine.hicache.stats) if engine.hicache is not None else None,
    }
