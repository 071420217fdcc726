"""The op log: how a CP group's ranks keep identical caches while only the leader schedules.

Why a log of ops: the radix tree, LRU clock, lane ledger and plans of a rank
are functions of the sequence of cache-changing decisions alone, so the
leader turns every such decision into an op, applies it as it takes it
(:meth:`_OpLog._log`), and sends each step's ops to the other ranks in one
broadcast over the control group; they apply the same ops in the same order
(:meth:`_OpLog.follow`) and take the same eviction and allocation decisions,
so the forward's collectives line up.  The protocol in full is in
:mod:`cpgraph.runtime.prefill_engine`'s docstring (CP).

:class:`_OpLog` is a mixin of :class:`~cpgraph.runtime.prefill_engine.PrefillEngine`
(its only user): applying an op changes the engine's own state (``_live``,
``_prefetches``, ``cache``, ``stats``) and calls its admission, release,
graph warm-up and step (``_admit``, ``_release``, ``_warm_graphs``,
``_run``), always through ``self.`` so that a wrapped method (tests) is the
one that runs.
"""

from __future__ import annotations

from .live_request import _Live


class _OpLog:
    """The leader's broadcast of ops and every rank's application of them (module docstring)."""

    def follow(self) -> None:
        """Ranks other than the leader: apply the leader's ops, step by step, until it sends ``stop``."""
        if self.is_leader:
            raise RuntimeError("PrefillEngine.follow runs on ranks other than the leader")
        while True:
            ops = self._broadcast(None)
            for op in ops:
                if op[0] == "stop":
                    return
                if op[0] == "run":
                    self._run(op[1])
                else:
                    self._apply(op)

    def stop_followers(self) -> None:
        """Leader: tell the other ranks of the CP group to return from :meth:`follow`."""
        with self._lock:
            self._stopped = True
        if self.cp_size > 1:
            with self._step_lock:  # after a step another thread may be running (heartbeat says why)
                self._broadcast([("stop",)])

    def heartbeat(self) -> None:
        """Leader, idle: an empty step keeps the followers' broadcast inside its timeout.

        Under the step lock: another thread may run a step meanwhile (``PrefillEngine.try_step``), and two
        broadcasts of the control group must never interleave."""
        if self.cp_size > 1:
            with self._step_lock:
                self._broadcast([])

    def _broadcast(self, ops: list | None) -> list:
        import torch.distributed as dist

        box = [ops]
        dist.broadcast_object_list(box, src=self.src, group=self.control_group)
        return box[0]

    def _log(self, ops: list, op: tuple) -> None:
        ops.append(op)
        self._apply(op)

    def _apply(self, op: tuple) -> None:
        kind = op[0]
        if kind == "l3_fetch":
            _, rid, tokens, now = op
            pf = self.cache.start_prefetch(tokens)
            if pf is not None:
                self._prefetches[rid] = pf
                if now:
                    self.cache.finish_prefetch(pf)
        elif kind == "l3_done":
            self.cache.finish_prefetch(self._prefetches[op[1]])
        elif kind == "l3_drop":
            self.cache.drop_prefetch(self._prefetches.pop(op[1]))
        elif kind == "admit":
            _, rid, tokens, room, budget, *sampling = op
            live = self._live.get(rid)
            if live is None:  # a follower sees the request for the first time
                live = self._live[rid] = _Live(rid, list(tokens), room, None, self.clock(), None)
            if sampling:  # with a draft (the leader's own record already holds it)
                live.sampling = sampling[0]
            self._admit(live, budget)
        elif kind == "unadmit":
            live = self._live[op[1]]
            self._release(live)
            live.match, live.starts, live.ends, live.prefix_len, live.done = None, [], [], 0, 0
            live.l3_checked = False  # looked up again before its next try: its prefetch went into this match
            if not self.is_leader:
                del self._live[op[1]]  # the leader re-sends the tokens with its next try
        elif kind == "cancel":
            live = self._live.pop(op[1])
            self._release(live)
            if live.room is not None and self.transfer is not None:
                self.transfer.abort(live.room)
        elif kind == "warm_graphs":
            self._warm_graphs(*op[1:])
        elif kind == "evict":
            if self._live or self._prefetches:
                raise RuntimeError("prefill engine: the cache is reset only while no request is admitted or queued")
            self.cache.clear()
            if not self.is_leader:  # reset_cache zeroes the counters on every rank (the leader's: in reset_cache)
                self.stats = self._new_stats()
        else:
            raise ValueError(f"prefill engine: unknown op {kind!r}")
