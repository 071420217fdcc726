"""The L3 phase at the start of a step: queued requests' prefix reads from L3, started and finished.

Why a phase of its own (not part of admission): an L3 lookup and the
agreement on what arrived are collectives, so every rank must run them at
the same point; and the reads are slow, so they start a step ahead, on the
L3 I/O thread, overlapping a forward (docs/cache.md).  The full reasoning is
:meth:`_L3Phase._l3_phase`'s docstring.

:class:`_L3Phase` is a mixin of :class:`~cpgraph.runtime.prefill_engine.PrefillEngine`
(its only user): it reads the engine's scheduler and prefetches and emits
its ops through the engine's op log (``_broadcast``, ``_apply``).
"""

from __future__ import annotations

import itertools

from .live_request import _Live
from .scheduler import shared_prefix


class _L3Phase:
    """Leader: the L3 reads of queued requests, and whether a request's have landed (module docstring)."""

    def _l3_phase(self) -> None:
        """Leader, at the start of a step: the L3 reads of queued requests, as ops every rank applies together.

        Why a phase of its own: an L3 lookup and the agreement on what
        arrived are collectives, so every rank must run them at the same
        point -- the leader broadcasts these ops first and applies them
        after, instead of applying as it decides (as for the other ops, which
        touch only rank-local state).  Admission (``match``) then does no L3
        I/O.  Per step: every fetch started in an earlier step is finished
        (its reads ran on the L3 I/O thread during that step's forward), and
        the requests in line (up to one step's worth) that were not looked
        up yet are: their fetch starts now, and is finished at once when
        the engine has nothing running to overlap it with.  A request whose
        prompt shares a page with a fetch started in this phase waits for
        that one to land (it would read the same pages) and is looked up in
        the next step.
        """
        ops = [("l3_done", rid) for rid, pf in self._prefetches.items() if pf.fetching]
        idle = not self.scheduler.running
        started: list[_Live] = []
        for live in list(itertools.islice(self.scheduler.waiting, self.scheduler.config.max_batch_requests)):
            if live.l3_checked or live.cancel_reason is not None:
                continue
            if not idle and any(shared_prefix(live.tokens_np, o.tokens_np) >= self.page_size for o in started):
                continue
            ops.append(("l3_fetch", live.id, live.tokens, idle))
            live.l3_checked = True
            started.append(live)
        if not ops:
            return
        if self.cp_size > 1:
            self._broadcast(ops)
        for op in ops:
            self._apply(op)

    def _l3_ready(self, live: _Live) -> bool:
        """May ``live`` be admitted now: looked up in L3, and no read of its prefix still in flight."""
        pf = self._prefetches.get(live.id)
        return live.l3_checked and (pf is None or not pf.fetching)
