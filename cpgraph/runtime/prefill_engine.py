"""A long-running prefill engine: requests come and go, each step prefills what the scheduler chose.

:class:`PrefillEngine` is the in-process API a serving engine embeds (``cpgraph
serve`` puts HTTP in front of it)::

    engine = PrefillEngine(forward, model, num_pages=4096)
    handle = engine.submit(EngineRequest(tokens, Sampling(temperature=0.7, seed=1), top_logprobs=5))
    while not handle.done():
        engine.step()
    handle.result.token, handle.result.cached_tokens, handle.result.timings

It holds one model forward, one persistent KV pool with its radix cache and
optional HiCache (a :class:`~cpgraph.runtime.cache_engine.CacheEngine`), the
:class:`~cpgraph.runtime.scheduler.Scheduler`, and optionally a KV sink that
sends each chunk to a decode's room (``transfer``, below).

**Request life.**  ``submit`` queues (thread-safe; a request that can never
fit the pool is refused at once).  At admission the radix match runs first
(L1 hits locked, L2 hits loaded back), the chunk sequence is fixed and the
pages of every chunk are *reserved* per owner lane, so a running request can
never be stuck for pages halfway: admission waits instead.  Each step
allocates the pages of its chunks, runs one forward over all of them (each
chunk an extend over its request's cached prefix and its own earlier
chunks), sends each chunk's pages to its room, and for every request whose
last chunk ran: chooses the first token, inserts the prompt's whole pages
into the radix cache, frees the rest, unlocks.  ``cancel`` (or a passed
timeout) frees the request's own pages, unlocks its prefix and aborts its
room: the pool's lane ledger returns to what it was before the request was
admitted.  (A load-back from L2 that its match triggered stays in L1 as
cache: it is the cache's page, not the request's.)

**L3** (``l3=``).  A step begins with an *L3 phase* (:meth:`_l3_phase`): the
fetches started in the step before are finished, and the queued requests
not looked up yet are -- their prefix's reads start on the L3 I/O thread
and overlap this step's forward (finished at once when nothing runs).  A
request is admitted once its reads have landed; others may pass it
meanwhile.  Pages after one that failed to arrive are restored and the
failed ones computed as chunks of their own (holes, docs/cache.md).

**CP.**  Every rank of a CP group holds an engine over its own pool.  Rank 0
(the *leader*) runs the scheduler; every decision that changes the cache is
an *op* (``admit``, ``unadmit``, ``cancel``, ``run``, ``evict``,
``l3_drop``) applied on the leader as it is taken and sent, once per step,
to the other ranks in one broadcast over ``control_group``; they apply the
same ops in the same order (:meth:`follow`).  The L3 phase's ops
(``l3_fetch``, ``l3_done``) run collectives, so the leader broadcasts them
first, in a broadcast of their own, and applies them after.  The radix tree, LRU clock, lane ledger and plans are
functions of that op sequence alone, so every rank takes the same eviction
and allocation decisions and runs the same plan -- the forward's
collectives line up.  Only the leader samples and answers.

Requests, results and handles are in :mod:`cpgraph.runtime.requests`.

**Transfer** (``transfer``): an object with ``registered(room) -> bool``,
``send_chunk(room, table, page_start, page_end, last, first_token,
prompt_len[, draft_token]) -> bool``, ``bytes_sent(room) -> int``, ``finish(room)`` and
``abort(room)`` (``cpgraph.serve.transfer.RoomSender`` adapts a Mooncake
:class:`~cpgraph.transfer.prefill.PrefillPeer`).  Chunk k of a request goes
out right after the step that computed it: pages ``[start // page, ceil(end /
page))``, the first chunk also covering the cached prefix pages.  A sink whose
``overlap`` is true also has ``begin_chunk(room, table, page_start, page_end,
last)`` and ``end_chunk(chunk, last, first_token, prompt_len[, draft_token])
-> bool``: the engine opens each chunk before the step's forward (its layers
go out while later layers compute) and closes it after.  ``draft_token`` (the
MTP draft's guess after the first token) is passed with a request's last
chunk only when the engine runs a draft.

**Where the parts are.**  The request record is :mod:`~cpgraph.runtime.live_request`;
the op log and the followers (``follow``, ``stop_followers``, ``heartbeat``)
:mod:`~cpgraph.runtime.op_log`, the L3 phase :mod:`~cpgraph.runtime.l3_phase` and
admission :mod:`~cpgraph.runtime.admission` (mixins of :class:`PrefillEngine`); the chunk
sends :mod:`~cpgraph.runtime.chunk_transfer`, the draft's first-token choice
:mod:`~cpgraph.runtime.draft_choice`, results :mod:`~cpgraph.runtime.results`, prompt
checks :mod:`~cpgraph.runtime.prompt_limits` and the cold-step counters
:mod:`~cpgraph.runtime.forward_counters` (plain functions).  This module keeps the
public API, the step and the commit.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from contextlib import nullcontext
from typing import Callable

import numpy as np
import torch

from cpgraph.ops.checks import debug_enabled
from cpgraph.ops.layer_events import layer_hooks
from cpgraph.plan import plan_prefill

from .admission import _Admission
from .cache_engine import CacheEngine
from .chunk_transfer import begin_chunk, end_chunk, send_chunk
from .draft_choice import choose_first_tokens
from .engine import draft_pools, forward_batch
from .forward_counters import _compiles
from .graph_runner import graph_counts
from .l3_phase import _L3Phase
from .live_request import _Live
from .op_log import _OpLog
from .prompt_limits import pool_token_limit, token_ids
from .radix import check_consistent
from .requests import (CANCELLED, FAILED, FINISHED, OUTCOMES, REFUSALS, REFUSED, TIMEOUT, EngineRequest,
                       RequestHandle, RequestResult, _Stats, engine_request)
from .results import _deliver, request_result
from .sampling import Sampling, first_tokens
from .scheduler import Scheduler, SchedulerConfig, chunk_owners, lane_pages

# Importable from here as before the split (tests, benchmarks and serve import some of them).
from .cache_engine import PrefixMatch  # noqa: F401
from .draft_choice import _random_seed  # noqa: F401
from .forward_counters import _graph_replays  # noqa: F401
from .radix import TokenKey  # noqa: F401
from .scheduler import chunk_spans, shared_prefix  # noqa: F401

log = logging.getLogger(__name__)


def _graphed_draft(draft) -> bool:
    """A draft that replays its own graphs over the target's buckets (``graphed_draft``), possibly wrapped
    (a wrapper exposes the wrapped forward as ``.draft``, as the tests' recorders do)."""
    from .draft_graphs import DraftGraphs

    while draft is not None:
        if isinstance(draft, DraftGraphs):
            return True
        draft = getattr(draft, "draft", None)
    return False

STEP_LOG = 4096  # steps kept in PrefillEngine.step_log


class PrefillEngine(_OpLog, _L3Phase, _Admission):
    """Continuous CP prefill over a persistent cache (module docstring).

    ``forward(input_ids, meta, mla_pools, index_pools)`` as for
    :class:`CacheEngine` (eager, compiled, or ``graphed_forward``);
    ``num_pages`` / ``host_pages``: L1 / L2 pages per rank.  ``rank``,
    ``cp_size``, ``group`` (the compute group of the CP forward) and
    ``control_group`` (where the leader's ops are broadcast; gloo; default
    ``group``) describe a CP group; ``src`` is the leader's global rank.
    ``request_timeout``: default seconds a request may take from submit.
    ``max_prompt_tokens``: longer prompts are refused (default: what the pool
    can ever hold).  ``clock``: for tests.

    The op log, the L3 phase and admission are mixins (module docstring, where the parts are).
    """

    def __init__(self, forward: Callable, model, *, num_pages: int, page_size: int = 16, kv_format: str = "bf16",
                 rank: int = 0, cp_size: int = 1, host_pages: int = 0, host_layout: str = "layer_page_first",
                 write_policy: str = "write_through", group=None, control_group=None, src: int = 0,
                 scheduler: SchedulerConfig | None = None, request_timeout: float | None = None,
                 max_prompt_tokens: int | None = None, transfer=None, clock: Callable[[], float] = time.monotonic,
                 l3=None, draft: Callable | None = None):
        if draft is not None and getattr(forward, "runners", None) is not None and not _graphed_draft(draft):
            # A graphed target returns its hidden rows padded to the bucket; only the draft's own graphs over the
            # same buckets read them with the bucket's static meta (cpgraph.runtime.draft_graphs).
            raise ValueError("prefill engine: over CUDA-graph buckets the MTP draft must replay its own graphs: "
                             "pass graphed_draft(draft, forward)")
        self.cache = CacheEngine(forward, model, num_pages=num_pages, kv_format=kv_format, page_size=page_size,
                                 rank=rank, cp_size=cp_size, host_pages=host_pages, host_layout=host_layout,
                                 write_policy=write_policy, group=group, l3=l3, draft=draft)
        self.draft = draft
        self._draft_pools = draft_pools(self.cache.pool, model) if draft is not None else None
        self.model, self.page_size, self.rank, self.cp_size = model, page_size, rank, cp_size
        self.device = model.device  # read once: the property walks the parameters
        self.vocab = model.config.vocab_size
        if self.vocab > 2**31:  # radix keys hold int32 ids (submit's checked ids go into them unscanned)
            raise ValueError(f"prefill engine: a vocabulary of {self.vocab} ids does not fit the radix keys' int32")
        self.group, self.control_group, self.src = group, control_group if control_group is not None else group, src
        self.scheduler = Scheduler(scheduler or SchedulerConfig(), page_size)
        self.request_timeout = request_timeout
        self.transfer = transfer
        self.clock = clock
        self.num_pages = num_pages
        self.max_prompt_tokens = max_prompt_tokens or pool_token_limit(num_pages, cp_size, page_size)
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._step_lock = threading.RLock()
        self._inbox: list[_Live] = []
        self._cancels: list[tuple[int, str]] = []
        self._live: dict[int, _Live] = {}
        self._next_deadline = float("inf")  # no request's deadline comes before this (leader)
        # L3 prefetches of queued requests by id, on every rank (started, then finished, by L3-phase ops).
        self._prefetches: dict = {}
        self._stopped = False
        self.stats = self._new_stats()
        # One device: the radix commits of a step's answered requests wait for the next step (or for
        # ``commit_delay`` seconds of idle in wait_for_work), so the threads waiting on the answers run first
        # (the engine thread blocks instead of holding the GIL).  Under CP every rank commits in its step.
        self.commit_delay = 1e-3
        self._pending: list[_Live] = []  # answered, pages not yet committed (leader, cp_size == 1)
        # When the last step that ran a batch ended, and how long it took (time.monotonic): see settled().
        self._last_batch_end, self._last_batch_s = float("-inf"), 0.0
        self._stepping = False  # a step is running (its answers go out before it stamps its end time)
        # A CP forward over CUDA-graph buckets (``graphed_forward(..., cp_size=cp)``) plans its own batches:
        # under CP the gathered coordinates move with M, so M must be a row bucket (docs/cuda_graphs.md).
        # One device keeps the plain plan (the runner pads rows itself; no second planning per step).
        self._plan_rows = getattr(forward, "plan", None) if cp_size > 1 else None
        if self._plan_rows is not None and getattr(forward, "cp_size", cp_size) != cp_size:
            raise ValueError(f"prefill engine: the graphed forward is for cp_size {forward.cp_size}, the engine's "
                             f"is {cp_size}")

    # ---------------------------------------------------------------- public API
    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def submit(self, request: EngineRequest, *, checked: bool = False, wake: bool = True) -> RequestHandle:
        """Queue ``request`` (any thread); a request that is invalid, never fits, or finds the queue full
        is finished at once with status ``refused`` and an ``error`` saying why.

        ``checked``: the caller has already checked that ``request.tokens`` is a 1-D int64 array of ids in
        ``[0, vocab)`` (the HTTP layer's ``parse_completion`` does, against this engine's ``vocab``), so the
        ids are not scanned again; anything but such an array is checked as usual.  ``wake=False`` leaves
        a thread blocked in :meth:`wait_for_work` asleep: the caller steps itself (:meth:`try_step`) or
        calls :meth:`wake` afterwards."""
        rid = next(self._ids)
        handle = RequestHandle(rid, request)
        refusal, ids = self._check(request, checked)
        tokens = ids.tolist() if ids is not None else list(request.tokens)
        now = self.clock()
        with self._lock:
            if refusal is None and self._stopped:
                refusal = ("stopped", "the engine is stopped")
            if refusal is None and len(self.scheduler.waiting) + len(self._inbox) >= self.scheduler.config.max_waiting:
                refusal = ("queue_full", f"queue full ({self.scheduler.config.max_waiting} requests waiting)")
            if refusal is None:
                timeout = request.timeout if request.timeout is not None else self.request_timeout
                live = _Live(rid, tokens, request.transfer_room, handle, now,
                             None if timeout is None else now + timeout, ids)
                live.sampling = request.sampling
                self._inbox.append(live)
                if wake:
                    self._lock.notify_all()
                return handle
            self.stats.outcomes[REFUSED] += 1
        handle._finish(RequestResult(REFUSED, len(tokens), error=refusal[1], refusal=refusal[0]))
        return handle

    def check(self, request: EngineRequest) -> tuple[str, str] | None:
        """``(refusal, message)`` when ``request`` can never be served here, else ``None`` (touches no state)."""
        return self._check(request)[0]

    def _check(self, request: EngineRequest, checked: bool = False) -> tuple[tuple[str, str] | None,
                                                                           np.ndarray | None]:
        """:meth:`check`, and the prompt as an int64 array once its ids are valid (converted once, reused)."""
        tokens = request.tokens
        if not len(tokens):
            return ("invalid", "the prompt is empty"), None
        if len(tokens) > self.max_prompt_tokens:
            return ("too_long", (f"the prompt has {len(tokens)} tokens; this engine takes at most "
                                 f"{self.max_prompt_tokens}")), None
        if checked and type(tokens) is np.ndarray and tokens.dtype == np.int64 and tokens.ndim == 1:
            ids, bad = tokens, None  # the caller's checked ids (submit's docstring): two reductions saved
        else:
            ids, bad = token_ids(tokens, self.vocab)
        if ids is None:
            return ("invalid", f"token {bad!r} is not an id in [0, {self.vocab}) (the model's vocabulary)"), None
        return self._check_rest(request, len(tokens)), ids

    def _check_rest(self, request: EngineRequest, n: int) -> tuple[str, str] | None:
        if not isinstance(request.sampling, Sampling):
            return "invalid", "sampling must be a Sampling"
        k = request.top_logprobs
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 20:
            return "invalid", f"top_logprobs must be an integer in [0, 20], got {k!r}"
        if request.transfer_room is not None:
            if self.transfer is None:
                return "room", "this engine has no KV transfer configured"
            if not self.transfer.registered(request.transfer_room):
                return "room", f"room {request.transfer_room} is not registered by a decode on this prefill"
        # One rank holds every page: Python ints (this runs for every request; lane_pages builds arrays).
        need = -(-n // self.page_size) if self.cp_size == 1 else int(lane_pages([0], [n], self.cp_size,
                                                                                 self.page_size).max())
        if need > self.num_pages:
            return "too_long", (f"the prompt needs {need} KV pages on one rank; the pool holds "
                                f"{self.num_pages} per rank (it can never fit)")
        return None

    def cancel(self, handle: RequestHandle, reason: str = CANCELLED) -> None:
        """Cancel a request (any thread); it finishes with status ``cancelled`` at the next step boundary."""
        with self._lock:
            self._cancels.append((handle.id, reason))
            self._lock.notify_all()

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._cancels or len(self.scheduler) or self._pending)

    def idle(self) -> bool:
        """Nothing queued, admitted or cancelled (answered requests' commits may still be pending)."""
        with self._lock:
            return not (self._inbox or self._cancels or len(self.scheduler))

    def settled(self) -> bool:
        """Idle, and for at least as long as the last step that ran a batch took.

        Why: a request arriving then is unlikely to have company in the next step's time, so a server may run
        its step on the thread that received it (docs/serve.md, the idle fast path).  A request arriving
        right after a step -- the next of a busy period, as in a closed loop -- is not: its step belongs on the
        engine thread, so the server keeps reading the requests behind it while the forward runs."""
        return (not self._stepping and self.idle()
                and time.monotonic() - self._last_batch_end >= self._last_batch_s)

    def wait_for_work(self, timeout: float) -> bool:
        """Block until something is queued (or ``timeout`` seconds pass); True if there is work.

        Commits left by the last step are work too, but they first wait up to ``commit_delay`` seconds
        for a request: the threads that got the step's answers run meanwhile."""
        with self._lock:
            if not (self._inbox or self._cancels or len(self.scheduler)):
                self._lock.wait(min(timeout, self.commit_delay) if self._pending else timeout)
            return bool(self._inbox or self._cancels or len(self.scheduler) or self._pending)

    def wake(self) -> None:
        """Wake a thread blocked in :meth:`wait_for_work` (e.g. to let it see a stop flag)."""
        with self._lock:
            self._lock.notify_all()

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Step until nothing is queued or running (single device or the leader)."""
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise RuntimeError(f"prefill engine: still busy after {max_steps} steps")

    def snapshot(self) -> dict:
        """Gauges and counters for metrics (leader's view; pages of this rank's lane)."""
        with self._lock:
            waiting = len(self.scheduler.waiting) + len(self._inbox)
        running = list(self.scheduler.running)
        ledger = self.cache.device.ledger
        s = self.stats
        return {
            "waiting": waiting, "running": len(running),
            "running_tokens": sum(r.remaining() for r in running),
            "pages_used": int(ledger.used[self.rank]), "pages_free": int(ledger.free_pages()[self.rank]),
            "pages_cached": int(self.cache.tree.device_pages_total),
            "prompt_tokens": s.prompt_tokens, "cached_tokens": dict(s.cached_tokens),
            "computed_tokens": s.computed_tokens, "steps": dict(s.steps), "outcomes": dict(s.outcomes),
            "transfer_bytes": s.transfer_bytes, "transfer_failures": s.transfer_failures,
            "step_tokens": s.last_step_tokens, "cold_steps": self.cold_steps,
        }

    # --------------------------------------------------------------------- steps
    def step(self) -> list[RequestHandle]:
        """One scheduling step on the leader (any rank when ``cp_size == 1``); returns the handles it finished."""
        if not self.is_leader:
            raise RuntimeError("PrefillEngine.step runs on the leader (rank 0); other ranks call follow()")
        with self._step_lock:  # a reset_cache from another thread waits for the step (its commits come after answers)
            return self._stepped()

    def try_step(self) -> list[RequestHandle] | None:
        """:meth:`step` unless another thread is stepping now (then ``None`` at once, nothing done).

        Why: a server whose engine thread sleeps can run the step of a request that arrives at idle on the
        thread that received it, instead of paying two thread wake-ups (docs/serve.md, the idle fast path);
        when the engine thread is busy that thread must not wait for it."""
        if not self.is_leader:
            raise RuntimeError("PrefillEngine.try_step runs on the leader (rank 0); other ranks call follow()")
        if not self._step_lock.acquire(blocking=False):
            return None
        try:
            return self._stepped()
        finally:
            self._step_lock.release()

    def try_sync(self) -> bool:
        """:meth:`sync` unless another thread is stepping now (that step commits first itself); False then."""
        if not self._step_lock.acquire(blocking=False):
            return False
        try:
            self._flush_commits()
            return True
        finally:
            self._step_lock.release()

    def _stepped(self) -> list[RequestHandle]:
        self._stepping = True
        try:
            return self._step()
        finally:
            self._stepping = False

    def _step(self) -> list[RequestHandle]:
        t0 = time.monotonic()
        self._flush_commits()  # the last step's answered requests: their pages into the cache before any admission
        finished: list[RequestHandle] = []
        with self._lock:
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        for live in new:
            self._live[live.id] = live
            self.scheduler.enqueue(live)
            if live.deadline is not None and live.deadline < self._next_deadline:
                self._next_deadline = live.deadline
        ops: list[tuple] = []
        now = self.clock()
        doomed = False  # a request to close in this step (every one marked is closed below, in the same step)
        for rid, reason in cancels:
            live = self._live.get(rid)
            if live is not None and live.cancel_reason is None:
                live.cancel_reason = reason
                doomed = True
        if now >= self._next_deadline:  # the scan over every request only when one may have timed out
            nxt = float("inf")
            for live in self._live.values():
                if live.cancel_reason is None and live.deadline is not None:
                    if now >= live.deadline:
                        live.cancel_reason = TIMEOUT
                        doomed = True
                    elif live.deadline < nxt:
                        nxt = live.deadline
            self._next_deadline = nxt
        if self.cache.l3 is not None:
            self._l3_phase()
        for live in list(self._live.values()) if doomed else ():
            if live.cancel_reason is not None:
                if live.match is None:  # still waiting: other ranks know it only by its prefetch, if any
                    self.scheduler.remove(live)
                    del self._live[live.id]
                    if live.id in self._prefetches:
                        self._log(ops, ("l3_drop", live.id))
                    finished.append(self._close(live, live.cancel_reason))
                else:
                    self._log(ops, ("cancel", live.id))
                    finished.append(self._close(live, live.cancel_reason))
        ready = self._l3_ready if self.cache.l3 is not None else None
        batch = self.scheduler.next_step(lambda e, budget: self._leader_admit(e, budget, ops), ready)
        run = ("run", [(e.id, s, end) for e, s, end in batch])
        if batch:
            ops.append(run)
        if self.cp_size > 1:
            self._broadcast(ops)
        if batch:
            finished += self._run(run[1])
            self._last_batch_end = time.monotonic()
            self._last_batch_s = self._last_batch_end - t0
        return finished

    def fail_all(self, error: str) -> None:
        """Leader, after a fatal error: answer every queued and admitted request as failed (touches no cache state)."""
        with self._lock:
            self._stopped = True
            new, self._inbox = self._inbox, []
        for live in new + list(self._live.values()):
            self._close(live, FAILED, error=error)

    def sync(self) -> None:
        """Commit what the last step answered (any thread; waits for the step in progress).  A step answers its
        finished requests before their pages go into the radix cache (at the next step, or after
        ``commit_delay`` of idle), so a reader of the cache or the pool (tests, a debugger) calls this after an
        answer to see the state that the next step starts from."""
        with self._step_lock:
            self._flush_commits()

    def _flush_commits(self) -> None:
        pending, self._pending = self._pending, []
        for live in pending:
            self._commit(live)

    def reset_cache(self) -> None:
        """Leader, idle: empty the radix cache (L1 and L2) on every rank and zero the counters (after a warm-up).

        From another thread than the one stepping: it waits for the step in progress, which may still be
        committing the pages of requests it has already answered."""
        with self._step_lock:
            self._flush_commits()
            if self.cp_size > 1:
                self._broadcast([("evict",)])
            self._apply(("evict",))
            self.stats = self._new_stats()

    def warm_graphs(self, max_prefix_tokens: int | None = None) -> tuple[int, list[str]]:
        """Leader, idle, after one real step: prepare (compile, and on CUDA capture) every CUDA-graph bucket a
        step within the token budget can pick, with up to ``max_prefix_tokens`` cached-prefix rows (default:
        the budget), on padding rows that touch no cache state.  Returns ``(buckets prepared, summaries)``.

        Under CP the preparation runs the forward, whose collectives every rank of the group must join: it
        is an op, sent to the followers, and every rank warms the same buckets in the same order (the list
        follows from the configuration alone).  A forward without graph buckets prepares nothing.
        """
        if not self.is_leader:
            raise RuntimeError("PrefillEngine.warm_graphs runs on the leader; the other ranks follow")
        cfg = self.scheduler.config
        cap = cfg.token_budget if max_prefix_tokens is None else int(max_prefix_tokens)
        with self._step_lock:
            op = ("warm_graphs", cap)
            if self.cp_size > 1:
                self._broadcast([op])
            return self._warm_graphs(cap)

    def _warm_graphs(self, max_prefix_tokens: int) -> tuple[int, list[str]]:
        runners = getattr(self.cache.forward, "runners", None) or {}
        budget = self.scheduler.config.token_budget
        prepared, where = 0, []
        for runner in runners.values():
            prepared += runner.warm(runner.reachable_buckets(min(budget, runner.row_buckets[-1]), self.page_size,
                                                             min(max_prefix_tokens, runner.kv_buckets[-1])))
            if runner.last_warm is not None and runner.last_warm.count:
                where.append(runner.last_warm.line())  # forward warm-up vs capture vs gc: where the time goes
        return prepared, where

    def close(self) -> None:
        """Every rank, after the last step (leader: after :meth:`stop_followers`; followers: after
        :meth:`follow` returns): give back the L3 prefetches of requests never admitted, store what L3
        lacks, then release the store.  Idempotent; rank-local (no collectives), and every rank reaches
        it after the same op sequence, so their trees and ledgers agree."""
        with self._step_lock:
            self._flush_commits()
        for pf in self._prefetches.values():
            self.cache.drop_prefetch(pf)
        self._prefetches.clear()
        self.cache.flush_l3()
        self.cache.close()

    # ----------------------------------------------------------------- internals
    def _new_stats(self) -> _Stats:
        self.cold_steps = 0  # steps whose forward compiled a graph or prepared (captured) a new bucket
        self.step_log: deque = deque(maxlen=STEP_LOG)  # (forward s, tokens, chunks, cold) of the latest steps
        stats = _Stats()
        if self.cache.l3 is not None:  # the L3 tier is reported (also at 0) only where there is one
            stats.cached_tokens["l3"] = 0
        return stats

    @torch.no_grad()  # grad mode is per thread: the engine thread must not record (or compile) a backward
    def _run(self, chunks: list[tuple[int, int, int]]) -> list[RequestHandle]:
        """Allocate, forward and finish one step's chunks (every rank, same order)."""
        ps = self.page_size
        debug = debug_enabled()  # read once a step (an environment lookup each time it is called)
        lives = [self._live[rid] for rid, _, _ in chunks]
        if self._plan_rows is not None:  # CP over graph buckets: M is a row bucket from the start
            plan = self._plan_rows([s for _, s, _ in chunks], [e - s for _, s, e in chunks], ps)
        else:
            plan = plan_prefill([s for _, s, _ in chunks], [e - s for _, s, e in chunks], cp_size=self.cp_size,
                                page_size=ps)
        try:
            for j, (live, (_, s, e)) in enumerate(zip(lives, chunks)):
                owners = chunk_owners(s, e, self.cp_size, ps)  # what the reservation counted
                if debug and not np.array_equal(owners, plan.page_owners(j)):
                    raise AssertionError("prefill engine: a chunk's page owners differ from its reservation")
                pages = self.cache.alloc(owners)
                live.own_pages.append(pages)
                live.own_owners.append(owners)
                live.pages[s // ps : s // ps + owners.size] = pages
                live.owners[s // ps : s // ps + owners.size] = owners
                # One rank owns every page: the count is the length (a bincount is a NumPy call per chunk).
                live.reserve = live.reserve - (owners.shape[0] if self.cp_size == 1 else
                                               np.bincount(owners, minlength=self.cp_size))
            # Chunk [s, e) reads every page before it (cached, restored, earlier chunks) and writes its own.
            tables = [(live.pages[: -(-e // ps)], live.owners) for live, (_, _, e) in zip(lives, chunks)]
            loads = [h for live in lives for h in live.match.loads]
            # Per-layer transfer: the chunks open before the forward, so each layer's pages go out as it is written.
            early = {}
            if self.transfer is not None and getattr(self.transfer, "overlap", False):
                for j, (live, (_, _, e)) in enumerate(zip(lives, chunks)):
                    if live.room is not None and live.transfer_ok:
                        early[j] = begin_chunk(self.transfer, ps, live, tables[j][0], e, e == len(live.tokens))

            def wait_for_layer(layer: int, pool=None) -> None:
                for h in loads:
                    h.wait_layer(layer)

            t0 = time.perf_counter()
            replays0, prepared0 = self._graph_counts()
            compiles0 = _compiles()
            # With a draft, the first tokens are chosen between the target's forward and the draft's (on every
            # rank: the draft reads them at each finished prompt's last row).
            picked: dict = {}
            dkw = {} if self.draft is None else dict(
                draft=self.draft, draft_pools=self._draft_pools, prompts=[live.tokens for live in lives],
                sampled=lambda target: choose_first_tokens(target.logits, lives, chunks, picked))
            # No load-back to wait for: no block (a generator context manager, several Python calls on every step);
            # hooks installed by others (a transfer's on_written) stay in place either way.
            with layer_hooks(on_ready=wait_for_layer) if loads else nullcontext():
                ran = forward_batch(self.cache.forward, plan, [live.tokens[s:e] for live, (_, s, e) in
                                                               zip(lives, chunks)],
                                    [t for t, _ in tables], [o[: s // ps] for (_, o), (_, s, _) in
                                                             zip(tables, chunks)],
                                    self.cache.pools, self.device, rank=self.rank, **dkw)
            out = ran[0]
            logits = out.logits if self.draft is None else ran[2].logits  # (the step's last kernel: its sync)
            if logits.is_cuda:  # the step's time is its GPU time; the first token is read from it right after
                torch.cuda.current_stream(logits.device).synchronize()  # sync-ok: engine step
            forward_s = time.perf_counter() - t0
        except Exception as exc:
            if self.cp_size > 1:
                raise  # ranks may have diverged: a CP group cannot continue
            log.exception("prefill engine: a step of %d chunk(s) failed", len(chunks))
            return [self._fail(live, exc) for live in lives]
        for live in lives:
            for h in live.match.loads:
                h.wait_all()
            live.match.loads = []
        replays1, prepared1 = self._graph_counts()
        cold = prepared1 > prepared0 or _compiles() > compiles0
        self.stats.steps["graph" if replays1 > replays0 else "eager"] += 1
        self.stats.last_step_tokens = tokens = sum(e - s for _, s, e in chunks)
        self.stats.step_seconds += forward_s
        for live in lives:
            live.forward_s += forward_s
        self.cold_steps += cold
        self.step_log.append((forward_s, tokens, len(chunks), cold))
        finished, done, answers = [], [], []
        choices = {}
        if self.is_leader:  # the rows whose first token is chosen now: one device-to-host copy for all of them
            want = [j for j, (live, (_, _, e)) in enumerate(zip(lives, chunks))
                    if e == len(live.tokens) and live.handle is not None]
            if want and self.draft is not None:  # chosen before the draft ran; its guess after that token
                choices = {j: picked[j] for j in want}
                sel = logits if len(want) == logits.shape[0] else logits[want]
                for j, tok in zip(want, sel.argmax(-1).tolist()):
                    lives[j].draft_token = tok
            elif want:
                reqs = [lives[j].handle.request for j in want]
                sel = logits if len(want) == logits.shape[0] else logits[want]  # every row: no gather
                choices = dict(zip(want, first_tokens(sel, [r.sampling for r in reqs],
                                                      [r.top_logprobs for r in reqs])))
        for j, (live, (_, s, e)) in enumerate(zip(lives, chunks)):
            live.next_chunk, live.chunks = live.next_chunk + 1, live.chunks + 1
            last = e == len(live.tokens)
            live.done = e if last else live.starts[live.next_chunk]
            choice = choices.get(j)
            if j in picked:
                live.first_token = picked[j].token
            if j in early:
                end_chunk(self.transfer, self.stats, live, early[j], last, choice)
            elif live.room is not None and self.transfer is not None:
                send_chunk(self.transfer, self.stats, ps, live, tables[j][0], e, last, choice)
            if last:
                if live.room is not None and self.transfer is not None:
                    self.transfer.finish(live.room)  # every page is sent: the decode may start
                done.append(live)
                if self.is_leader and live.handle is not None:
                    finished.append(self._close(live, FINISHED, choice, answers=answers))
        # The answers go out before the radix bookkeeping.  One device: it waits for the next step (which
        # commits before it admits anything, so a request sent after an answer still finds the prompt's
        # pages); the engine thread blocks meanwhile and the threads waiting on the answers run.
        for live in done:
            self._live.pop(live.id, None)
        if self.cp_size == 1 and self.is_leader and self.commit_delay > 0:
            self._pending += done
            if debug:  # (it checks the flag again itself; read once per step here, before the answers)
                check_consistent(self.cache.tree, self.group, device=self.device)
            # Delivered last: a waiting thread (the event loop, woken by the answer's callback) needs the GIL,
            # which this thread holds until it blocks -- right after this step, in wait_for_work.  Answered
            # before the step's own bookkeeping, the loop woke only to wait for the GIL through it.
            _deliver(answers)
        else:
            _deliver(answers)
            for live in done:
                self._commit(live)
            if debug:
                check_consistent(self.cache.tree, self.group, device=self.device)
        return finished

    def _graph_counts(self) -> tuple[int, int]:
        """(replays, buckets prepared) of the target's graphs (a replayed step counts once), plus the buckets the
        draft's graphs prepared (a step that captured only the draft's graph is cold too)."""
        replays, prepared = graph_counts(self.cache.forward)
        if self.draft is not None:
            prepared += graph_counts(self.draft)[1]
        return replays, prepared

    def _commit(self, live: _Live) -> None:
        """Insert the prompt's whole pages into the radix cache; free the rest; unlock (as CacheEngine.prefill)."""
        ps, cache = self.page_size, self.cache
        full = len(live.tokens) // ps
        # The token after the last whole page as its records were computed: the prompt's, or (with a draft, a
        # prompt ending on a page boundary) the first token the draft was given (docs/mtp.md, prefix caching).
        after = live.tokens[full * ps] if len(live.tokens) > full * ps else live.first_token
        last_node = cache.commit(live.match, live.pages, live.owners, next_token=after)
        live.own_pages, live.own_owners = [], []  # the tree's now, or freed by commit
        cache.backup_inserted([last_node])  # write_through: L2 copies of the whole path, then L3
        cache.release(live.match)
        live.reserve = None

    def _fail(self, live: _Live, exc: Exception) -> RequestHandle | None:
        self._release(live)
        if live.room is not None and self.transfer is not None:
            self.transfer.abort(live.room)
        return self._close(live, FAILED, error=" ".join(f"{type(exc).__name__}: {exc}".split()))

    def _close(self, live: _Live, status: str, choice=None, error: str | None = None,
               refusal: str | None = None, answers: list | None = None) -> RequestHandle | None:
        """Leader: the request leaves the engine; build and deliver its result (``answers``: append
        ``(handle, result)`` there instead, for :func:`_deliver` at the end of the step)."""
        self.scheduler.remove(live)
        self._live.pop(live.id, None)
        res = request_result(live, status, self.clock(), self.stats, self.cache.l3 is not None, self.transfer, choice,
                             error, refusal)
        if live.handle is not None:
            if answers is None:
                live.handle._finish(res)
            else:
                answers.append((live.handle, res))
        return live.handle


__all__ = ["EngineRequest", "PrefillEngine", "RequestHandle", "RequestResult", "Sampling", "SchedulerConfig",
           "engine_request", "OUTCOMES", "REFUSALS"]
