"""The MTP draft replayed from CUDA graphs, one per bucket of the target's :class:`GraphRunner`.

Why a graph of its own, not the draft inside the target's graph: the draft
reads, at each finished prompt's last row, the first token the host chose
from the target's logits (greedy or sampled: docs/mtp.md, "Served by
``cpgraph serve``"), and that token exists only after the target's replay.
So a step replays two graphs of the same bucket: the target's (its logits
copied out; the hidden rows the draft reads stay in the graph's static output
buffer), then, once the host has chosen, the draft's.

The draft's graph reads the target bucket's static inputs (the padded
``BatchMeta``: its rows, slots and windows are the target's), the target
graph's hidden output, and static draft inputs of its own, padded as the
target pads (``next_ids`` 0 and ``last_of`` -1 on dummy rows: they read no
sampled token and write no KV; ``sampled`` 0 past the batch's requests).
Its bucket is the target's, so under CP every rank replays the same one.

Memory: the draft's graph is captured into the target runner's pool.  It
reads the target graph's hidden output, which stays allocated (the runner
holds it), and replays right after the target's graph, before any other
graph of the pool runs: the order the pool's sharing needs (docs/cuda_graphs.md).

On a machine without CUDA the draft runs on the padded buffers without
capture, so the padding is testable on CPU (as for the runner itself).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from torch import Tensor

from cpgraph.models.batch import DraftInputs
from cpgraph.models.mtp import DraftOutput

from .graph_runner import Bucket, CaptureStats, GraphRunner, capture_graph

log = logging.getLogger(__name__)


class _DraftStatic:
    """The padded draft inputs of one bucket, allocated outside any graph pool."""

    def __init__(self, bucket: Bucket, like: DraftInputs, device):
        m = bucket.rows
        self.next_ids = torch.zeros(m, dtype=like.next_ids.dtype, device=device)
        self.last_of = torch.full((m,), -1, dtype=like.last_of.dtype, device=device)
        self.sampled = torch.zeros(bucket.requests, dtype=like.sampled.dtype, device=device)
        self.inputs = DraftInputs(self.next_ids, self.last_of, self.sampled)

    def load(self, d: DraftInputs) -> None:
        for dst, src, fill in ((self.next_ids, d.next_ids, 0), (self.last_of, d.last_of, -1),
                               (self.sampled, d.sampled, 0)):
            n = src.shape[0]
            if n > dst.shape[0]:
                raise ValueError(f"draft graphs: {n} draft rows or requests exceed the bucket's {dst.shape[0]}")
            if n < dst.shape[0]:
                dst[n:].fill_(fill)
            dst[:n].copy_(src.to(dst.device, dst.dtype))


class DraftGraphs:
    """``draft(hidden, dinputs, meta, mla, index) -> DraftOutput`` replaying the draft's graph of the bucket
    the target's ``graphed_forward`` replayed last (build it with :func:`graphed_draft`).

    ``hidden`` and ``meta`` are the target's of the same step (``hidden`` padded
    to the bucket); the graph reads the target bucket's static buffers, which
    hold them.  ``stats`` / ``graph_replays`` count as a runner's do
    (:func:`cpgraph.runtime.graph_runner.graph_counts` reads them through
    :attr:`runners`).
    """

    def __init__(self, draft: Callable, target: Callable, *, warmup_calls: int = 2):
        if getattr(target, "runners", None) is None:
            raise ValueError("graphed_draft: the target must be a graphed_forward (its buckets are the draft's)")
        self.draft, self.target = draft, target
        self.warmup_calls = max(1, int(warmup_calls))
        self.stats: dict[tuple, CaptureStats] = {}
        self.graph_replays = 0
        self.runners = {"draft": self}  # graph_counts sums replays and prepared buckets over this
        self._static: dict[tuple, _DraftStatic] = {}
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._out: dict[tuple, Tensor] = {}
        self._like: tuple | None = None  # (draft inputs, hidden) of the first call: dtypes and widths
        self._pools: dict[int, tuple] = {}  # id(runner) -> the draft layer's (mla, index) pools its graphs bind

    def __call__(self, hidden: Tensor, dinputs: DraftInputs, meta, mla: Tensor, index: Tensor) -> DraftOutput:
        runner: GraphRunner = self.target.last_runner
        if runner is None or runner.last_bucket is None:
            raise RuntimeError("graphed_draft: the target's graphed forward has not run a batch yet")
        if self not in runner.companions:
            runner.companions.append(self)
        bucket = runner.last_bucket
        if self._like is None:
            self._like = (dinputs, hidden)
        self._pools[id(runner)] = (mla, index)
        key = (id(runner), bucket)
        static = self._static.get(key)
        if static is None:
            static = self._static[key] = _DraftStatic(bucket, dinputs, hidden.device)
        static.load(dinputs)
        if key not in self.stats:
            self._prepare(runner, bucket, static, calls=self.warmup_calls if not self._graphs else 1)
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            self.graph_replays += 1
            out = self._out[key]
        else:
            out = self._forward(runner, bucket, static)
        self.stats[key].replays += 1
        return DraftOutput(out[: meta.last_token_index.shape[0]].clone())

    def warm_bucket(self, runner: GraphRunner, bucket: Bucket) -> None:
        """Prepare the draft's graph of ``bucket`` right after the target's (``GraphRunner.warm``), on the
        padding the target's warm-up left in the static buffers (no KV write).  Needs one real call first."""
        key = (id(runner), bucket)
        if self._like is None or id(runner) not in self._pools or key in self.stats:
            return
        static = self._static[key] = _DraftStatic(bucket, self._like[0], self._like[1].device)
        self._prepare(runner, bucket, static, calls=1)

    # ----------------------------------------------------------------- internals
    def _hidden(self, runner: GraphRunner, bucket: Bucket) -> Tensor:
        """The hidden rows the bucket's draft reads: the target graph's static output when captured, else the
        latest call's (the same bucket: the draft runs right after it), else zeros (warm-up on padding)."""
        captured = runner.captured_outputs(bucket)
        if captured is not None:
            return captured[0]
        if runner.last_bucket == bucket and runner.outputs():
            return runner.outputs()[0]
        like = self._like[1]
        return torch.zeros(bucket.rows, like.shape[1], dtype=like.dtype, device=like.device)

    def _forward(self, runner: GraphRunner, bucket: Bucket, static: _DraftStatic) -> Tensor:
        mla, index = self._pools[id(runner)]
        return self.draft(self._hidden(runner, bucket), static.inputs, runner.static_inputs(bucket).meta,
                          mla, index).logits

    def _prepare(self, runner: GraphRunner, bucket: Bucket, static: _DraftStatic, calls: int) -> None:
        """First use of a bucket: warm up (compile) on the static buffers, then capture into the runner's pool."""
        key = (id(runner), bucket)
        device = static.next_ids.device
        t0 = time.perf_counter()
        if runner.captured_outputs(bucket) is None:  # the target is not captured (CPU): nor is the draft
            self._forward(runner, bucket, static)
            self.stats[key] = CaptureStats(bucket, time.perf_counter() - t0, 0.0, 0, replays=0, calls=1)
            return
        graph, out, stats = capture_graph(lambda: self._forward(runner, bucket, static), bucket, device,
                                          runner.graph_pool(), calls, t0)
        self._graphs[key], self._out[key], self.stats[key] = graph, out, stats
        log.info("draft graphs: captured %s in %.2f s (+%.2f s warm-up)", bucket, stats.capture_s, stats.warmup_s)


def graphed_draft(draft: Callable, target: Callable, **kw) -> DraftGraphs:
    """The MTP draft forward replayed from CUDA graphs over ``target``'s buckets (``target``: the
    ``graphed_forward`` the engine runs; it must be called with ``return_local_hidden=True``, as
    ``forward_batch`` does with a draft)."""
    return DraftGraphs(draft, target, **kw)
