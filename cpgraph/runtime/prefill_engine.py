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
prompt_len) -> bool``, ``bytes_sent(room) -> int``, ``finish(room)`` and
``abort(room)`` (``cpgraph.serve.transfer.RoomSender`` adapts a Mooncake
:class:`~cpgraph.transfer.prefill.PrefillPeer`).  Chunk k of a request goes
out right after the step that computed it: pages ``[start // page, ceil(end /
page))``, the first chunk also covering the cached prefix pages.  A sink whose
``overlap`` is true also has ``begin_chunk(room, table, page_start, page_end,
last)`` and ``end_chunk(chunk, last, first_token, prompt_len) -> bool``: the
engine opens each chunk before the step's forward (its layers go out while
later layers compute) and closes it after.
"""

from __future__ import annotations

import itertools
import logging
import os
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

from .cache_engine import CacheEngine, PrefixMatch
from .engine import draft_pools, forward_batch
from .graph_runner import graph_counts
from .radix import TokenKey, check_consistent
from .requests import (CANCELLED, FAILED, FINISHED, OUTCOMES, REFUSALS, REFUSED, TIMEOUT, EngineRequest,
                       RequestHandle, RequestResult, _Stats, engine_request)
from .sampling import Sampling, first_tokens
from .scheduler import Scheduler, SchedulerConfig, chunk_owners, chunk_spans, lane_pages, shared_prefix

log = logging.getLogger(__name__)

STEP_LOG = 4096  # steps kept in PrefillEngine.step_log


class _Live:
    """The engine's record of one admitted-or-waiting request (the same on every rank once admitted)."""

    def __init__(self, rid: int, tokens: list[int], room: int | None, handle: RequestHandle | None, now: float,
                 deadline: float | None, tokens_np: np.ndarray | None = None):
        self.id, self.tokens, self.room, self.handle = rid, tokens, room, handle
        if tokens_np is None:
            self.tokens_np = np.asarray(tokens, dtype=np.int64)
            self.key = TokenKey(self.tokens_np)
        else:  # submit's array, already checked against the vocabulary (< 2**31 ids: PrefillEngine.__init__)
            self.tokens_np, self.key = tokens_np, TokenKey.from_checked(tokens_np)
        self.match: PrefixMatch | None = None
        self.prefix_len = 0  # tokens with KV from the cache (all tiers) at admission
        self.done = 0  # where the next chunk starts: the leading tokens whose KV exists
        self.starts: list[int] = []  # chunk sequence fixed at admission: holes first (docs/cache.md), then the rest
        self.ends: list[int] = []
        self.next_chunk = 0
        self.defers = 0
        self.pages = self.owners = None  # page table of the whole prompt (PrefixMatch.table, chunks filled in)
        self.own_pages: list[np.ndarray] = []
        self.own_owners: list[np.ndarray] = []
        self.reserve: np.ndarray | None = None
        self.cancel_reason: str | None = None
        self.l3_checked = False  # leader: its L3 lookup ran (a prefetch started, or nothing to fetch)
        self.t_submit, self.t_admit, self.deadline = now, None, deadline
        self.transfer_s, self.transfer_ok, self.sent_pages, self.chunks = 0.0, True, 0, 0
        # With a draft: how the first token is chosen (on every rank: the draft reads it), the chosen token
        # (the radix node's next token when the prompt ends on a page boundary) and the draft's guess after it.
        self.sampling: Sampling | None = None
        self.first_token, self.draft_token = -1, None

    def remaining(self) -> int:
        """Prompt tokens still to compute (the chunks not run yet)."""
        return sum(e - s for s, e in zip(self.starts[self.next_chunk:], self.ends[self.next_chunk:]))


class PrefillEngine:
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
    """

    def __init__(self, forward: Callable, model, *, num_pages: int, page_size: int = 16, kv_format: str = "bf16",
                 rank: int = 0, cp_size: int = 1, host_pages: int = 0, host_layout: str = "layer_page_first",
                 write_policy: str = "write_through", group=None, control_group=None, src: int = 0,
                 scheduler: SchedulerConfig | None = None, request_timeout: float | None = None,
                 max_prompt_tokens: int | None = None, transfer=None, clock: Callable[[], float] = time.monotonic,
                 l3=None, draft: Callable | None = None):
        if draft is not None and getattr(forward, "runners", None) is not None:
            raise ValueError("prefill engine: the MTP draft is not served over CUDA-graph buckets (a graphed "
                             "forward); run the target without graphs")
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
        self.max_prompt_tokens = max_prompt_tokens or self._pool_token_limit()
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

    def submit(self, request: EngineRequest, *, checked: bool = False) -> RequestHandle:
        """Queue ``request`` (any thread); a request that is invalid, never fits, or finds the queue full
        is finished at once with status ``refused`` and an ``error`` saying why.

        ``checked``: the caller has already checked that ``request.tokens`` is a 1-D int64 array of ids in
        ``[0, vocab)`` (the HTTP layer's ``parse_completion`` does, against this engine's ``vocab``), so the
        ids are not scanned again; anything but such an array is checked as usual."""
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
            return self._step()

    def _step(self) -> list[RequestHandle]:
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
        return finished

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
            self._broadcast([("stop",)])

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

    def heartbeat(self) -> None:
        """Leader, idle: an empty step keeps the followers' broadcast inside its timeout."""
        if self.cp_size > 1:
            self._broadcast([])

    # ----------------------------------------------------------------- internals
    def _new_stats(self) -> _Stats:
        self.cold_steps = 0  # steps whose forward compiled a graph or prepared (captured) a new bucket
        self.step_log: deque = deque(maxlen=STEP_LOG)  # (forward s, tokens, chunks, cold) of the latest steps
        stats = _Stats()
        if self.cache.l3 is not None:  # the L3 tier is reported (also at 0) only where there is one
            stats.cached_tokens["l3"] = 0
        return stats

    def _pool_token_limit(self) -> int:
        # The longest prompt whose pages fit on every lane: binary search over lengths (owners are per length).
        lo, hi = 1, self.num_pages * self.cp_size * self.page_size
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (lane_pages([0], [mid], self.cp_size, self.page_size) <= self.num_pages).all():
                lo = mid
            else:
                hi = mid - 1
        return lo

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

    def _admit(self, live: _Live, budget: int) -> None:
        """Match (lock L1 hits, load back L2 hits, restore L3 pages), fix the chunk sequence within ``budget``,
        reserve its pages.

        Identical on every rank.  ``live.ends`` stays empty when not even the first chunk fits the budget.
        """
        ps = self.page_size
        # The cache engine's own match (same limits, locks and rules); its L3 part was fetched in the L3 phase.
        m = self.cache.match(live.tokens, live.key, prefetched=self._prefetches.pop(live.id, None), fetch_l3=False)
        live.match = m
        live.prefix_len = m.cached_pages * ps
        live.next_chunk = 0
        spans = chunk_spans(m.segments(ps), budget, self.scheduler.config.chunk_tokens, ps)
        live.starts, live.ends = [a for a, _ in spans], [b for _, b in spans]
        live.done = live.starts[0] if spans else m.tree_pages * ps
        live.pages, live.owners = m.table(ps)
        live.reserve = lane_pages(live.starts, live.ends, self.cp_size, ps)

    def _release(self, live: _Live) -> None:
        """Give back everything the request holds: its own pages, its locks, its pending load-backs."""
        m = live.match
        if m is None:
            return
        self.cache.release(m)  # waits for its load-backs first: nothing is freed under an in-flight copy
        for pages, owners in zip(live.own_pages, live.own_owners):
            self.cache.device.free(pages, owners)
        live.own_pages, live.own_owners = [], []
        live.reserve = None

    def _available(self) -> np.ndarray:
        """Pages per lane that admissions may still promise: free + evictable - reserved by running requests."""
        if self.cp_size == 1:  # one lane: Python ints, one array (this runs at every admission)
            ledger = self.cache.device.ledger
            free = int(ledger.capacity[0]) - int(ledger.used[0]) + int(self.cache.evictable_by_lane()[0])
            for r in self.scheduler.running:
                if r.reserve is not None:
                    free -= int(r.reserve[0])
            return np.array([free], dtype=np.int64)
        reserved = np.zeros(self.cp_size, dtype=np.int64)
        for r in self.scheduler.running:
            if r.reserve is not None:
                reserved += r.reserve
        return self.cache.device.ledger.free_pages() + self.cache.evictable_by_lane() - reserved

    def _leader_admit(self, live: _Live, budget: int, ops: list) -> bool:
        # With HiCache, a cache-blind bound first: a match would start load-backs that cannot be used yet.
        if self.cache.hicache is not None:
            worst = lane_pages([0], [len(live.tokens)], self.cp_size, self.page_size)
            if (worst > self._available()).any():
                return False
        # The match has side effects (node splits, LRU ticks): it is an op, logged even when the
        # request then has to wait (``unadmit``), so every rank's tree goes through the same sequence.
        if self.draft is None:
            self._log(ops, ("admit", live.id, live.tokens, live.room, budget))
        else:  # every rank chooses the first token the draft reads: the same rule, and a seed the leader fixed
            if self.cp_size > 1 and not live.sampling.greedy and live.sampling.seed is None:
                live.sampling = Sampling(live.sampling.temperature, live.sampling.top_p, _random_seed())
            self._log(ops, ("admit", live.id, live.tokens, live.room, budget, live.sampling))
        if not live.ends or (live.reserve > self._available()).any():
            # Chunks split a prompt's pages over the lanes a little differently from one pass: a sequence
            # that exceeds a lane's capacity outright can never run, even on an empty pool.
            never = bool(live.ends) and bool((live.reserve > self.num_pages).any())
            self._log(ops, ("unadmit", live.id))
            if never:
                self.scheduler.remove(live)
                self._close(live, REFUSED, error=f"the prompt's chunks need more KV pages on one rank than the "
                                                 f"pool's {self.num_pages}", refusal="too_long")
            return False
        live.t_admit = self.clock()
        return True

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
                        early[j] = self._begin_send(live, tables[j][0], e, e == len(live.tokens))

            def wait_for_layer(layer: int, pool=None) -> None:
                for h in loads:
                    h.wait_layer(layer)

            t0 = time.perf_counter()
            replays0, prepared0 = graph_counts(self.cache.forward)
            compiles0 = _compiles()
            # No load-back to wait for: no block (a generator context manager, several Python calls on every step);
            # hooks installed by others (a transfer's on_written) stay in place either way.
            # With a draft, the first tokens are chosen between the target's forward and the draft's (on every
            # rank: the draft reads them at each finished prompt's last row).
            picked: dict = {}
            dkw = {} if self.draft is None else dict(
                draft=self.draft, draft_pools=self._draft_pools, prompts=[live.tokens for live in lives],
                sampled=lambda target: self._choose(target.logits, lives, chunks, picked))
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
        replays1, prepared1 = graph_counts(self.cache.forward)
        cold = prepared1 > prepared0 or _compiles() > compiles0
        self.stats.steps["graph" if replays1 > replays0 else "eager"] += 1
        self.stats.last_step_tokens = tokens = sum(e - s for _, s, e in chunks)
        self.stats.step_seconds += forward_s
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
                self._end_send(live, early[j], last, choice)
            elif live.room is not None and self.transfer is not None:
                self._send(live, tables[j][0], s, e, last, choice)
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

    def _choose(self, logits, lives: list, chunks: list, picked: dict):
        """Every rank, between the target's forward and the draft's: the first token of each request whose last
        chunk ran (same logits, same rule and seed on every rank: the admit op carries them), as the ``[B]`` ids
        the draft reads at those rows (0 elsewhere: rows inside a prompt read the prompt's next token)."""
        ends = [j for j, (live, (_, _, e)) in enumerate(zip(lives, chunks)) if e == len(live.tokens)]
        ids = torch.zeros(len(chunks), dtype=torch.int64)
        if ends:
            sel = logits if len(ends) == logits.shape[0] else logits[ends]
            tops = [lives[j].handle.request.top_logprobs if lives[j].handle is not None else 0 for j in ends]
            for j, c in zip(ends, first_tokens(sel, [lives[j].sampling for j in ends], tops)):
                picked[j] = c
                ids[j] = c.token
        return ids

    def _send(self, live: _Live, table: np.ndarray, s: int, e: int, last: bool, choice) -> None:
        # Every page not sent yet up to this chunk's end: the first chunk also sends the cached prefix, the one
        # after a hole the restored pages between them.
        first_page, end_page = live.sent_pages, -(-e // self.page_size)
        live.sent_pages = end_page
        t0 = time.perf_counter()
        ok = live.transfer_ok and self.transfer.send_chunk(
            live.room, table, first_page, end_page, last, None if choice is None else choice.token, len(live.tokens))
        live.transfer_s += time.perf_counter() - t0
        if live.transfer_ok and not ok:
            self.stats.transfer_failures += 1
        live.transfer_ok = bool(ok)

    def _begin_send(self, live: _Live, table: np.ndarray, e: int, last: bool):
        """``transfer.begin_chunk`` for the pages not sent yet up to ``e`` (as :meth:`_send`), before the forward."""
        first_page, end_page = live.sent_pages, -(-e // self.page_size)
        live.sent_pages = end_page
        t0 = time.perf_counter()
        chunk = self.transfer.begin_chunk(live.room, table, first_page, end_page, last)
        live.transfer_s += time.perf_counter() - t0
        return chunk

    def _end_send(self, live: _Live, chunk, last: bool, choice) -> None:
        t0 = time.perf_counter()
        ok = self.transfer.end_chunk(chunk, last, None if choice is None else choice.token, len(live.tokens))
        live.transfer_s += time.perf_counter() - t0
        if live.transfer_ok and not ok:
            self.stats.transfer_failures += 1
        live.transfer_ok = bool(ok)

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
        now = self.clock()
        m = live.match
        hits = {"device": m.device_hit, "host": m.host_hit} if m is not None and status == FINISHED else \
            {"device": 0, "host": 0}
        if self.cache.l3 is not None:
            hits["l3"] = m.l3_hit if m is not None and status == FINISHED else 0
        admitted = live.t_admit if live.t_admit is not None else now
        res = RequestResult(status, len(live.tokens), cached_tokens=hits, chunks=live.chunks,
                            computed_tokens=len(live.tokens) - sum(hits.values()) if status == FINISHED else 0,
                            timings={"queue": admitted - live.t_submit, "prefill": now - admitted,
                                     "transfer": live.transfer_s, "total": now - live.t_submit},
                            error=error, refusal=refusal)
        if status in (CANCELLED, TIMEOUT) and error is None:
            res.error = "cancelled by the client" if status == CANCELLED else "the request timed out"
        if choice is not None:
            res.token, res.logprob, res.top_logprobs = choice.token, choice.logprob, choice.top
            res.draft_token = live.draft_token
        if live.room is not None:
            sent = self.transfer.bytes_sent(live.room) if self.transfer is not None else 0
            res.transfer = {"room": live.room, "ok": status == FINISHED and live.transfer_ok, "bytes_sent": sent}
            self.stats.transfer_bytes += sent
        s = self.stats
        s.outcomes[status] += 1
        if status == FINISHED:
            s.prompt_tokens += len(live.tokens)
            s.computed_tokens += res.computed_tokens
            for tier, n in hits.items():
                s.cached_tokens[tier] = s.cached_tokens.get(tier, 0) + n
        if live.handle is not None:
            if answers is None:
                live.handle._finish(res)
            else:
                answers.append((live.handle, res))
        return live.handle


def _random_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1


def _deliver(answers: list) -> None:
    for handle, res in answers:
        handle._finish(res)



def token_ids(tokens, vocab: int) -> tuple[np.ndarray | None, object]:
    """``(tokens as an int64 array, None)``, or ``(None, the first entry that is not a token id in [0, vocab))``.

    Vectorised (prompts are long); a 1-D integer array -- what the HTTP layer
    hands over after its own checks -- skips the per-element type scan.
    """
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            return None, tokens.reshape(-1)[0]
        arr = tokens.astype(np.int64, copy=False)
    else:
        if not set(map(type, tokens)) <= {int, np.int64}:
            return None, next(t for t in tokens if type(t) not in (int, np.int64))
        if max(map(abs, tokens)) >= 2**63:
            return None, next(t for t in tokens if not 0 <= t < vocab)
        arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):  # two reductions; the position only on a refusal
        return None, tokens[int(np.flatnonzero((arr < 0) | (arr >= vocab))[0])]
    return arr, None


def _graph_replays(forward) -> int:
    """Replays of captured CUDA graphs so far, for a ``graphed_forward`` (0 for any other forward)."""
    return graph_counts(forward)[0]


_DYNAMO_COUNTERS = None  # torch._dynamo.utils.counters, imported at the first step (importing dynamo is slow)


def _compiles() -> int:
    """Graphs TorchDynamo compiled so far in this process (a dict read: cheap enough for every step).

    The counters object is looked up once: an ``import`` statement inside the function ran the import
    machinery twice per step, around every forward."""
    global _DYNAMO_COUNTERS
    if _DYNAMO_COUNTERS is None:
        from torch._dynamo.utils import counters

        _DYNAMO_COUNTERS = counters
    return _DYNAMO_COUNTERS["stats"]["unique_graphs"]


__all__ = ["EngineRequest", "PrefillEngine", "RequestHandle", "RequestResult", "Sampling", "SchedulerConfig",
           "engine_request", "OUTCOMES", "REFUSALS"]
