"""Replay the forward from CUDA graphs, one graph per shape bucket.

Why: a small extend (8 requests x 32 new tokens) launches a few hundred
kernels whose GPU time is shorter than the host time to launch them, so the
forward runs at host speed.  A captured CUDA graph replays all of them with
one launch.  A graph replays fixed shapes, so every input is padded to a
*bucket*, and a batch of any size up to the largest bucket replays a graph
that was captured (and, for a compiled forward, compiled) once.

What sets the shapes of the forward's inputs (see ``BatchMeta``):

* ``M`` compute rows (``input_ids``, ``positions``, ``ks``, ``ke``,
  ``row_slots``): rounded up by the **planner** with ``row_align`` (static
  padding, ``row_kind == 2``, docs/contracts.md), so dummy rows keep their
  provenance.  :meth:`GraphRunner.plan` picks the bucket and plans with it.
  On one device (``cp_size == 1``) the runner may also append the same dummy
  rows itself (token 0, position 0, empty window ``ks == ke == 0``, slot
  ``-1``): at ``cp_size == 1`` no gathered coordinate depends on ``M``, so
  that equals the planner's static padding.  Under CP the gathered
  coordinates (``rank * M + row``) move with ``M``: plan with the bucket;
* ``N`` rows of the full KV view (``kv_source``) and ``P`` cached-prefix
  rows per rank (``prefix_slots``): each padded here to its own KV bucket
  with ``-1`` (a ``-1`` slot reads a zero record; a ``-1`` source row is
  zero and lies past every key window).  A batch without cached prefix
  rows already carries ``MIN_PREFIX_ROWS`` ``-1`` rows (``build_batch``)
  and keeps that small ``P`` as its bucket.  ``kv_source`` indexes the
  rank-major gather of every rank's ``[P prefix rows | M compute rows]``
  block (``GatherLayout``; at ``cp_size == 1`` the one block is
  ``cat(prefix rows, current rows)``), so padding ``P`` (or ``M``) moves
  every rank's block: each entry is re-expressed as (rank, row within the
  block) and rebuilt in the padded layout (``GatherLayout.repad``), never
  shifted by one offset;
* ``B`` requests (``last_token_index``) padded with row 0 to
  ``max_requests`` and ``T`` tokens (``rerange_index``) padded with row 0
  to ``cp_size * M``; the padded logits rows are dropped on the way out.
  Both index the gathered hidden states (``rank * M + row``), which the
  prefix padding does not touch and ``M`` padding does only at
  ``cp_size == 1``, where every index is rank 0's.

The bucket key ``(M, N, P)`` comes from the plan's lengths alone, so every CP
rank picks the same bucket without talking.  Ladders are geometric
(:func:`bucket_ladder`): ``steps`` values per octave bound the padding to
``2**(1/steps)``-ish of the batch (rows: 16, 24, 32, 48, ...).

Memory: all graphs share one private memory pool.  That is safe because
static inputs live outside the pool, graphs are replayed one at a time on one
stream, and a replay's logits are copied out before the next replay (a
replay may overwrite another graph's output buffers).

On a machine without CUDA (or with ``capture=False``) the runner still pads
to buckets and calls the forward on the padded static buffers: the bucket
logic and the compile count are testable on CPU, only the capture is not.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import fields
from typing import Callable, Sequence

import torch
from torch import Tensor

from cpgraph.models.batch import MIN_PREFIX_ROWS
from cpgraph.ops.providers import bind_providers
from cpgraph.plan import CPPlan, GatherLayout

# The bucket arithmetic and the capture bookkeeping live in their own modules; every name is
# re-exported here, where callers (draft_graphs, the engines, serve, tests) import it from.
from .graph_buckets import (DEFAULT_MAX_KV_ROWS, DEFAULT_MAX_ROWS, DEFAULT_ROW_BUCKETS,  # noqa: F401  (re-exported)
                            Bucket, bucket_ladder, kv_rows_bound, pick_bucket, plan_in_buckets, reachable_buckets)
from .graph_capture import CaptureStats, WarmSummary, capture_graph  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)


class _Static:
    """The padded input buffers of one bucket, allocated outside any graph pool."""

    def __init__(self, bucket: Bucket, like_meta, device):
        from cpgraph.models.batch import BatchMeta

        m, n = bucket.rows, bucket.kv_rows
        self.cp_size = bucket.cp_size
        lengths = {"positions": m, "ks": m, "ke": m, "row_slots": m, "prefix_slots": bucket.prefix_rows, "kv_source": n,
                   "last_token_index": bucket.requests, "rerange_index": bucket.cp_size * m}  # fmt: skip
        self.fill = {"row_slots": -1, "prefix_slots": -1, "kv_source": -1}  # every other field pads with 0
        self.ids = torch.zeros(m, dtype=torch.long, device=device)
        self.meta = BatchMeta(**{
            f.name: torch.full((lengths[f.name],), self.fill.get(f.name, 0), dtype=getattr(like_meta, f.name).dtype,
                               device=device)
            for f in fields(BatchMeta)
        })  # fmt: skip

    def load(self, ids: Tensor, meta) -> None:
        m = ids.shape[0]
        if m < self.ids.shape[0]:
            self.ids[m:].zero_()
        self.ids[:m].copy_(ids)
        batch = GatherLayout(self.cp_size, meta.prefix_slots.shape[0], m)
        padded = GatherLayout(self.cp_size, self.meta.prefix_slots.shape[0], self.ids.shape[0])
        if self.cp_size != 1 and padded.num_rows != batch.num_rows:  # bucket_for refuses these batches
            raise ValueError("graph_runner: under CP the batch must be planned with GraphRunner.plan (M a bucket)")
        for f in fields(meta):
            src, dst = getattr(meta, f.name), getattr(self.meta, f.name)
            if f.name == "kv_source" and padded != batch:  # every rank's block is padded: re-map the gathered rows
                src = batch.repad(src, padded)
            n = src.shape[0]
            if n < dst.shape[0]:
                dst[n:].fill_(self.fill.get(f.name, 0))
            dst[:n].copy_(src)


class GraphRunner:
    """Pad a batch to its bucket and replay that bucket's CUDA graph (captured on first use).

    ``forward(input_ids, meta) -> logits [B, vocab]`` (or a tuple whose first
    entry is the logits: the others stay on the bucket's static outputs,
    :meth:`outputs`, for a companion graph such as the MTP draft's) is the eager model or a
    compiled one (``cpgraph.compile(model, cp, dynamic=False)`` compiles once
    per bucket, before its capture), with the KV pools bound in a closure:
    pools are mutated in place and must keep their addresses
    (``torch._dynamo.mark_static_address``).  Build batches with
    :meth:`plan` so that ``M`` is a bucket.  ``capture=None`` captures when
    the device is CUDA.
    """

    def __init__(
        self,
        forward: Callable[[Tensor, object], Tensor],
        *,
        max_requests: int,
        row_buckets: Sequence[int] | None = None,
        kv_buckets: Sequence[int] | None = None,
        cp_size: int = 1,
        capture: bool | None = None,
        warmup_calls: int = 2,
        page_size: int | None = None,
    ):
        if max_requests < 1:
            raise ValueError(f"graph_runner: max_requests must be >= 1, got {max_requests}")
        self.forward = forward
        self.max_requests = int(max_requests)
        self.row_buckets = tuple(row_buckets or DEFAULT_ROW_BUCKETS)
        self.kv_buckets = tuple(kv_buckets or bucket_ladder(64, DEFAULT_MAX_KV_ROWS, 4))
        for name, lad in (("row_buckets", self.row_buckets), ("kv_buckets", self.kv_buckets)):
            if any(b <= a for a, b in zip(lad, lad[1:])) or lad[0] < 1:
                raise ValueError(f"graph_runner: {name} must be increasing positive ints, got {lad}")
        self.cp_size = int(cp_size)
        if self.cp_size < 1:
            raise ValueError(f"graph_runner: cp_size must be >= 1, got {cp_size}")
        if page_size is not None and page_size < 1:
            raise ValueError(f"graph_runner: page_size (KV-view rows derived from the other buckets) must be "
                             f"positive, got {page_size}")
        self.page_size = page_size
        self.capture = capture
        self.warmup_calls = max(1, int(warmup_calls))
        self.stats: dict[Bucket, CaptureStats] = {}
        self.last_warm: WarmSummary | None = None  # the latest warm() call's summary
        self.graph_replays = 0  # calls that replayed a captured graph (a counter: cheap to read every step)
        self._like = None  # (meta, device) of the first batch: dtypes and device of synthetic warm-up buffers
        self._static: dict[Bucket, _Static] = {}
        self._graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self._out: dict[Bucket, Tensor] = {}
        self._pool = None
        self.last_bucket: Bucket | None = None  # the bucket of the latest call (a companion graph replays after it)
        self._last_out = None  # that call's outputs (the captured buffers, or the eager call's tensors)
        # Graphs captured over this runner's buckets and statics (the MTP draft's, cpgraph.runtime.draft_graphs):
        # warm() prepares their bucket right after its own.
        self.companions: list = []

    # ----------------------------------------------------------------- plan
    def plan(self, prefix_lens: Sequence[int], extend_lens: Sequence[int], page_size: int) -> CPPlan:
        """``plan_prefill`` with ``row_align`` set to the batch's row bucket, so ``M`` is a bucket."""
        return plan_in_buckets(self.row_buckets, prefix_lens, extend_lens, cp_size=self.cp_size, page_size=page_size)

    def bucket_for(self, ids: Tensor, meta) -> Bucket:
        m = ids.shape[0]
        if m not in self.row_buckets:
            if self.cp_size != 1:
                raise ValueError(f"graph_runner: the batch has {m} rows, not a row bucket; plan it with GraphRunner.plan")
            m = pick_bucket(self.row_buckets, m, "compute rows")  # one device: dummy rows appended on load
        b = meta.last_token_index.shape[0]
        if b > self.max_requests:
            raise ValueError(f"graph_runner: {b} requests exceed max_requests={self.max_requests}")
        if meta.rerange_index.shape[0] > self.cp_size * m:
            raise ValueError("graph_runner: rerange_index is longer than cp_size * rows; wrong cp_size?")
        n, p = meta.kv_source.shape[0], meta.prefix_slots.shape[0]
        # A batch without cached prefix rows carries MIN_PREFIX_ROWS ``-1`` rows (build_batch): its own
        # small bucket, not the smallest KV bucket (which would gather that many zero rows per layer).
        p_bucket = p if p <= MIN_PREFIX_ROWS else pick_bucket(self.kv_buckets, p, "cached-prefix rows")
        if self.page_size is not None:  # N follows from the (M, P) buckets: one bucket per pair, not per triple
            n = max(n, self._kv_rows(m, p_bucket))
        return Bucket(m, pick_bucket(self.kv_buckets, n, "KV-view rows"), p_bucket, self.max_requests, self.cp_size)

    def _kv_rows(self, m: int, p: int) -> int:
        return kv_rows_bound(m, p, self.max_requests, self.page_size, self.cp_size)

    # ------------------------------------------------------------------ run
    def __call__(self, ids: Tensor, meta) -> Tensor:
        """fp32 logits ``[B, vocab]`` of the batch (a copy: safe across later calls)."""
        bucket = self.bucket_for(ids, meta)
        static = self._static.get(bucket)
        if static is None:
            static = self._static[bucket] = _Static(bucket, meta, ids.device)
        static.load(ids, meta)
        if self._like is None:
            self._like = (meta, ids.device)
        if bucket not in self.stats:
            # As warm() does: the runner's first bucket gets warmup_calls, a later one a single call (the
            # compile, autotuning and workspaces are behind it; a bucket first used under load waits on it).
            self._prepare(bucket, static, ids.device, calls=self.warmup_calls if not self._graphs else 1)
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
            self.graph_replays += 1
            out = self._out[bucket]
        else:
            out = self.forward(static.ids, static.meta)
        self.stats[bucket].replays += 1
        self.last_bucket, self._last_out = bucket, out
        logits = out[0] if isinstance(out, tuple) else out
        return logits[: meta.last_token_index.shape[0]].clone()

    def outputs(self) -> tuple:
        """The latest call's outputs after the logits (padded to its bucket; a captured graph's static buffers,
        overwritten by the next replay of any graph of the pool)."""
        out = self._last_out
        return out[1:] if isinstance(out, tuple) else ()

    def static_inputs(self, bucket: Bucket) -> "_Static":
        """The padded input buffers of ``bucket`` (what its graph reads; a companion graph reads them too)."""
        return self._static[bucket]

    def captured_outputs(self, bucket: Bucket) -> tuple | None:
        """The static outputs after the logits of ``bucket``'s captured graph (``None`` when not captured)."""
        if bucket not in self._graphs:
            return None
        out = self._out[bucket]
        return tuple(out[1:]) if isinstance(out, tuple) else ()

    def graph_pool(self):
        """The memory pool every graph of this runner is captured into (a companion graph joins it)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def _capturing(self, device) -> bool:
        want = self.capture if self.capture is not None else torch.device(device).type == "cuda"
        if want and not torch.cuda.is_available():
            raise ValueError("graph_runner: capture=True needs CUDA")
        return bool(want)

    def _prepare(self, bucket: Bucket, static: _Static, device, calls: int | None = None) -> None:
        """First use of a bucket: warm up (compile, autotune) on the static buffers, then capture.

        ``calls`` forward calls on a side stream before the capture (default ``warmup_calls``).  No garbage
        collection here: ``gc.collect()`` cost ~0.4 s per call on the H200 in a process holding Inductor's
        state (326 buckets: 122 s of a 156 s warm-up, the captures themselves 0.02 s each), and a bucket
        first used under load must not pay that.  ``torch.cuda.graph`` itself collects only with
        ``torch.compiler.config.force_cudagraph_gc``; :meth:`warm` collects once before its first capture.
        """
        bind_providers(torch.device(device).type)  # before warm-up and capture, not at their first op call
        t0 = time.perf_counter()
        if not self._capturing(device):
            self.forward(static.ids, static.meta)
            self.stats[bucket] = CaptureStats(bucket, time.perf_counter() - t0, 0.0, 0)
            return
        calls = self.warmup_calls if calls is None else max(1, int(calls))
        graph, out, stats = capture_graph(lambda: self.forward(static.ids, static.meta), bucket, device,
                                          self.graph_pool(), calls, t0)
        self._graphs[bucket], self._out[bucket], self.stats[bucket] = graph, out, stats
        log.info("graph_runner: captured %s in %.2f s (+%.2f s warm-up, %d call(s)), pool +%d B", bucket,
                 stats.capture_s, stats.warmup_s, calls, stats.pool_bytes)  # fmt: skip

    def warm(self, buckets: Sequence[Bucket]) -> int:
        """Prepare (compile and, on CUDA, capture) each bucket not prepared yet, on all-padding inputs.

        Padding rows write no KV record and read zero records (module
        docstring), so this touches no cache state.  Needs one real batch
        first (it fixes the buffers' dtypes and device).  Returns how many
        buckets were prepared now; :attr:`last_warm` (and an INFO line) says
        where the time went.

        When capturing: one ``gc.collect()`` before the first capture (dead
        reference cycles may hold CUDA blocks the capture could reuse; one
        collection, not one per bucket, see :meth:`_prepare`).  The runner's
        first captured bucket gets ``warmup_calls`` calls before its capture;
        every later one gets one: the lazy initialisation (cuBLAS handles,
        kernel loading, allocator state) that a second call guards against
        happened on the first bucket, and a compiled forward's compile and
        autotune for the new shapes happen in that one call.
        """
        if self._like is None:
            raise RuntimeError("graph_runner: warm needs one real batch first (dtypes and device of the inputs)")
        meta, device = self._like
        t0 = time.perf_counter()
        todo = [b for b in dict.fromkeys(buckets) if b not in self.stats]
        collect_s = 0.0
        if todo and self._capturing(device):
            gc.collect()
            collect_s = time.perf_counter() - t0
        for bucket in todo:
            static = self._static.get(bucket)
            if static is None:
                static = self._static[bucket] = _Static(bucket, meta, device)
            self._prepare(bucket, static, device, calls=self.warmup_calls if not self._graphs else 1)
            for companion in self.companions:
                companion.warm_bucket(self, bucket)
        done = [self.stats[b] for b in todo]
        self.last_warm = WarmSummary(len(todo), time.perf_counter() - t0, sum(s.warmup_s for s in done),
                                     sum(s.capture_s for s in done), collect_s)
        if todo:
            log.info("graph_runner: warm prepared %s", self.last_warm.line())
        return len(todo)

    def reachable_buckets(self, token_budget: int, page_size: int, max_prefix_tokens: int = 0) -> list[Bucket]:
        """Every bucket a step of at most ``token_budget`` tokens and ``max_prefix_tokens`` cached-prefix rows
        (at most ``max_requests`` requests) can pick (a superset: some may never occur).

        The arithmetic (how ``M``, ``P`` and ``N`` bound each other, on one device and under CP):
        :func:`cpgraph.runtime.graph_buckets.reachable_buckets`.
        """
        return reachable_buckets(self.row_buckets, self.kv_buckets, self.max_requests, self.cp_size, self.page_size,
                                 token_budget, page_size, max_prefix_tokens)

    def capture_report(self) -> list[dict]:
        """One dict per bucket: shapes, warm-up / capture seconds, warm-up calls, pool growth, replays."""
        return [{"rows": s.bucket.rows, "kv_rows": s.bucket.kv_rows, "prefix_rows": s.bucket.prefix_rows,
                 "requests": s.bucket.requests,
                 "warmup_s": s.warmup_s, "capture_s": s.capture_s, "pool_mib": s.pool_bytes / 2**20,
                 "warmup_calls": s.calls, "replays": s.replays, "captured": s.bucket in self._graphs}
                for s in self.stats.values()]  # fmt: skip


def bind_pool_addresses(tensors) -> None:
    """Mark KV pool tensors as static for a compiled forward that CUDA graphs capture: a graph binds their
    addresses, so the compiled code must not treat them as inputs it may copy."""
    for t in tensors:
        torch._dynamo.mark_static_address(t)


def graphed_forward(model_forward: Callable, *, max_requests: int, cp_size: int = 1, **runner_kw) -> Callable:
    """A drop-in ``forward(input_ids, meta, mla_pools, index_pools)`` that replays CUDA graphs.

    For callers that take a forward function (``run_prefill``, ``CacheEngine``,
    ``PrefillEngine``): a :class:`GraphRunner` per set of KV pool tensors (a
    captured graph binds their addresses, so a new pool gets its own graphs).
    Returns a ``ForwardOutput`` holding the logits (and, with
    ``return_local_hidden=True``, the hidden rows the MTP draft reads: padded
    to the bucket, see :func:`cpgraph.runtime.draft_graphs.graphed_draft`);
    ``return_topk`` is not captured and raises.  ``page_size`` (runner keyword):
    derive the KV-view bucket from the row and prefix buckets, so the buckets
    a token budget can form are few enough to warm all of them
    (:meth:`GraphRunner.reachable_buckets`, ``cpgraph serve``).

    One device: rows are padded to the bucket on load.  Under CP
    (``cp_size > 1``, ``model_forward`` the CP-compiled forward of this
    rank) a batch must be planned with its row bucket: the caller plans with
    ``forward.plan(prefix_lens, extend_lens, page_size)``
    (:func:`plan_in_buckets`; the :class:`PrefillEngine` does when the
    forward has it), and every rank of the group replays the same bucket,
    since the bucket follows from the plan's lengths alone.
    """
    from cpgraph.models.model import ForwardOutput

    runners: dict[tuple, GraphRunner] = {}
    row_buckets = tuple(runner_kw.get("row_buckets") or DEFAULT_ROW_BUCKETS)

    def forward(input_ids, meta, mla_pools, index_pools, return_local_hidden: bool = False, **kw):
        if any(kw.values()):
            raise ValueError(f"graphed_forward: {sorted(k for k, v in kw.items() if v)} not supported (logits only)")
        hidden = bool(return_local_hidden)
        key = (*(t.data_ptr() for t in (*mla_pools, *index_pools)), hidden)
        runner = runners.get(key)
        if runner is None:
            mla, index = list(mla_pools), list(index_pools)
            kw_rows = {**runner_kw, "row_buckets": row_buckets}
            if hidden:  # the draft's input rows are an output of the graph (a static buffer it reads after)
                def run(i, m):
                    out = model_forward(i, m, mla, index, return_local_hidden=True)
                    return out.logits, out.local_hidden
            else:
                def run(i, m):
                    return model_forward(i, m, mla, index).logits
            runner = runners[key] = GraphRunner(run, max_requests=max_requests, cp_size=cp_size, **kw_rows)
        forward.last_runner = runner
        logits = runner(input_ids, meta)
        return ForwardOutput(logits, None, None, runner.outputs()[0] if hidden else None)

    def plan(prefix_lens, extend_lens, page_size: int) -> CPPlan:
        return plan_in_buckets(row_buckets, prefix_lens, extend_lens, cp_size=cp_size, page_size=page_size)

    forward.runners = runners
    forward.last_runner = None  # the runner of the latest call (graphed_draft replays its bucket after it)
    forward.cp_size = cp_size
    forward.plan = plan
    return forward


def graph_counts(forward) -> tuple[int, int]:
    """``(graph replays, buckets prepared)`` so far of a ``graphed_forward`` ((0, 0) for any other forward)."""
    runners = getattr(forward, "runners", None)
    if not runners:
        return 0, 0
    return sum(r.graph_replays for r in runners.values()), sum(len(r.stats) for r in runners.values())
