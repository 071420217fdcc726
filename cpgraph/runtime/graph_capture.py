"""Capture one CUDA graph into a shared pool, and the bookkeeping of where the time and memory went.

Why a module of its own: the warm-up-then-capture sequence (side stream,
allocator cache emptied first so the reserved-memory growth is the pool's
new segments) is shared by the :class:`~cpgraph.runtime.graph_runner.GraphRunner`
and its companion graphs (the MTP draft's, :mod:`cpgraph.runtime.draft_graphs`),
which join the runner's pool; the stats records are what both report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from .graph_buckets import Bucket


@dataclass
class CaptureStats:
    bucket: Bucket
    warmup_s: float  # the calls on the bucket's shapes before its capture (a compiled forward compiles in the first)
    capture_s: float  # the capture itself (0 when not captured)
    pool_bytes: int  # growth of reserved CUDA memory across the capture: the shared pool's new segments
    replays: int = 0
    calls: int = 1  # forward calls in warmup_s


@dataclass(frozen=True)
class WarmSummary:
    """Where one :meth:`GraphRunner.warm` call spent its time (``total_s`` is its wall time)."""

    count: int  # buckets prepared
    total_s: float
    warmup_s: float  # forward calls before the captures (compile, autotune, lazy initialisation)
    capture_s: float  # the captures themselves
    collect_s: float  # the one garbage collection before the first capture (0 when nothing was captured)

    def line(self) -> str:
        return (f"{self.count} bucket(s) in {self.total_s:.1f} s: forward warm-up {self.warmup_s:.1f} s, "
                f"capture {self.capture_s:.1f} s, gc {self.collect_s:.1f} s")


def capture_graph(fn: Callable[[], object], bucket: Bucket, device, pool, calls: int,
                  t0: float) -> tuple[torch.cuda.CUDAGraph, object, CaptureStats]:
    """Warm ``fn`` up with ``calls`` calls on a side stream, then capture it into ``pool``.

    Returns the graph, the captured outputs (static buffers) and the stats; ``t0`` is when the bucket's
    preparation began (its warm-up time counts from there).  Shared by the runner and its companion
    graphs (the MTP draft's), which join the same pool.
    """
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
        for _ in range(calls):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    # torch.cuda.graph empties the allocator's cache on entry; do it first (cheap, unlike a collection)
    # so that the growth of reserved memory measured across the capture is the graph pool's new segments.
    torch.cuda.empty_cache()
    t1 = time.perf_counter()
    before = torch.cuda.memory_reserved(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    return graph, out, CaptureStats(bucket, t1 - t0, t2 - t1, torch.cuda.memory_reserved(device) - before,
                                    calls=calls)
