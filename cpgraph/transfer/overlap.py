"""Per-layer overlap: send layer L's pages while layers L+1.. still compute.

Protocol (each rule closes a way for a transfer to hang, drop or duplicate a layer):

* the forward thread calls :meth:`LayerTransferManager.on_layer_end` after
  layer L wrote its KV; every ``group`` layers it records ONE event (CUDA:
  ``torch.cuda.Event`` on the current stream; CPU eager: the hook runs after
  the layer's kernels returned, so the event is already complete) and
  enqueues ``(context, layers, event)`` for every active context -- O(1)
  work per layer on the forward thread, one submit per group;
* worker threads wait the event (never the compute stream) and submit the
  group asynchronously;
* ``note`` dedups per layer: a layer that fires again (a second forward
  while a context is still open) is not enqueued twice, so the completion
  target is capped at the layer count;
* :meth:`finish` waits for exactly the layers enqueued, then synchronously
  sends the layers no hook fired for (e.g. an MTP layer the model does not
  hook, or a trailing partial group) -- the set sent always equals the
  context's layer set;
* a worker exception is counted, logged, and still counts the layer as
  processed, so completion can never hang; every wait has a deadline and a
  timeout fails the room;
* :meth:`drop` (abort) stops further submits and drains in-flight batches
  before returning, so the caller may free pages only after it.

Hooks: :func:`attach_layer_hooks` installs an ``on_written`` hook for the
``cpgraph::kv_layer_written`` op that every attention layer calls right after
its KV stores (``cpgraph.ops.layer_events``).  The op is opaque to the
compiler, so the hook fires per layer, in program order, in eager mode and
inside Inductor-compiled CP graphs alike (Inductor writes caches in place; a
graph run without reinplacing is detected and falls back to sending after the
forward, logged once).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Sequence

log = logging.getLogger("cpgraph.transfer")


class _DoneEvent:
    """CPU stand-in for a device event: eager CPU kernels finished before the hook ran."""

    def synchronize(self) -> None:
        return None


def default_event_factory(device_type: str = "cpu"):
    if device_type == "cuda":
        import torch

        def make():
            ev = torch.cuda.Event()
            ev.record()
            return ev

        return make
    return _DoneEvent


class LayerContext:
    """One (room, chunk) whose layers are sent per layer.

    ``submit(layers) -> [(batch_id, bytes)]`` (async), ``send_sync(layers) -> rc``,
    ``wait(submitted, t0) -> rc``, ``is_failed() -> bool`` come from the sender.
    """

    def __init__(self, key, layers: Sequence[int], submit: Callable, send_sync: Callable, wait: Callable,
                 is_failed: Callable[[], bool]):
        self.key = key
        self.layers = tuple(layers)
        self._layer_set = set(self.layers)
        self.submit, self.send_sync, self.wait, self.is_failed = submit, send_sync, wait, is_failed
        self.enqueued: set[int] = set()
        self.pending: list[int] = []
        self.processed = 0
        self.errors = 0
        self.submitted: list[tuple[int, int]] = []
        self.aborted = False
        self.sync_layers: list[int] = []
        self.t0 = time.perf_counter()
        self.cond = threading.Condition()

    def wants(self, layer: int) -> bool:
        return layer in self._layer_set and layer not in self.enqueued and layer not in self.pending


class LayerTransferManager:
    def __init__(self, hooked_layers: int, group: int = 1, workers: int = 2, timeout: float = 30.0,
                 event_factory: Callable | None = None):
        if group < 1 or workers < 1 or hooked_layers < 1:
            raise ValueError("group, workers and hooked_layers must be >= 1")
        self.hooked_layers, self.group, self.timeout = hooked_layers, group, timeout
        self.event_factory = event_factory or default_event_factory()
        self._active: list[LayerContext] = []
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.worker_errors = 0
        self._threads = [threading.Thread(target=self._work, name=f"kv-layer-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    # forward thread -------------------------------------------------------------
    def register(self, ctx: LayerContext) -> None:
        with self._lock:
            if any(c.key == ctx.key for c in self._active):
                raise ValueError(f"a per-layer context for {ctx.key!r} is already active")
            self._active.append(ctx)

    def on_layer_end(self, layer: int) -> None:
        with self._lock:
            active = list(self._active)
        if not active:
            return
        boundary = layer == self.hooked_layers - 1
        flush = []
        for ctx in active:
            if ctx.wants(layer):
                ctx.pending.append(layer)
            if ctx.pending and (len(ctx.pending) >= self.group or boundary):
                flush.append(ctx)
        if not flush:
            return
        event = self.event_factory()  # one event per flush, shared by every context
        for ctx in flush:
            layers, ctx.pending = ctx.pending, []
            with ctx.cond:
                ctx.enqueued.update(layers)
            self._queue.put((ctx, layers, event))

    # workers ----------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                ctx, layers, event = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                if not ctx.aborted and not ctx.is_failed():
                    event.synchronize()
                    got = ctx.submit(layers)
                    with ctx.cond:
                        ctx.submitted.extend(got)
            except Exception:  # noqa: BLE001  (count, log, never hang completion)
                log.exception("per-layer transfer of layers %s for %r failed", layers, ctx.key)
                with ctx.cond:
                    ctx.errors += 1
                self.worker_errors += 1
            finally:
                with ctx.cond:
                    ctx.processed += len(layers)
                    ctx.cond.notify_all()

    def _wait_processed(self, ctx: LayerContext, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with ctx.cond:
            while ctx.processed < len(ctx.enqueued):
                left = deadline - time.monotonic()
                if left <= 0:
                    log.error("per-layer transfer %r: %d/%d layers processed at the timeout",
                              ctx.key, ctx.processed, len(ctx.enqueued))
                    return False
                ctx.cond.wait(min(left, 0.1))
        return True

    def _deactivate(self, ctx: LayerContext) -> None:
        with self._lock:
            if ctx in self._active:
                self._active.remove(ctx)

    # completion -------------------------------------------------------------------
    def finish(self, ctx: LayerContext, timeout: float | None = None) -> int:
        """Wait the enqueued layers, send the rest synchronously, wait every batch; 0 on success."""
        self._deactivate(ctx)
        ok = self._wait_processed(ctx, self.timeout if timeout is None else timeout)
        rc = 0 if ok and ctx.errors == 0 else -1
        with ctx.cond:
            missing = [layer for layer in ctx.layers if layer not in ctx.enqueued]
            submitted = list(ctx.submitted)
        ctx.sync_layers = missing
        if rc == 0 and missing and not ctx.is_failed():
            rc = ctx.send_sync(missing)
        wrc = ctx.wait(submitted, ctx.t0)  # always drain what was submitted
        if ctx.is_failed():
            return -1
        return rc or wrc

    def drop(self, ctx: LayerContext, timeout: float | None = None) -> bool:
        """Abort: stop new submits, drain in-flight ones; True when fully drained."""
        ctx.aborted = True
        self._deactivate(ctx)
        ok = self._wait_processed(ctx, self.timeout if timeout is None else timeout)
        with ctx.cond:
            submitted = list(ctx.submitted)
        ctx.wait(submitted, ctx.t0)
        return ok

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2.0)


class _LayerHookHandle:
    """Keeps the per-layer ``on_written`` hook installed until ``remove()``.

    ``pools[L]`` is the runtime's MLA buffer of layer L (the memory registered
    with the transfer engine).  A graph run without reinplacing (``aot_eager``)
    hands the hook a functional copy and writes the buffer back only at graph
    end; such a layer is not enqueued here, so ``finish`` sends it after the
    forward (correct, no overlap) -- logged once.
    """

    def __init__(self, manager: "LayerTransferManager", pools, on_fallback: Callable[[str], None] | None = None):
        from cpgraph.ops.layer_events import layer_hooks

        self._manager = manager
        self._pools = pools
        self._on_fallback = on_fallback
        self._warned = False
        self.fallback_layers = 0  # hook calls that saw a functional copy (left to finish)
        self._installed = layer_hooks(on_written=self._on_written)
        self._installed.__enter__()

    def _on_written(self, layer: int, pool) -> None:
        if self._pools is not None and pool.data_ptr() != self._pools[layer].data_ptr():
            self.fallback_layers += 1
            if not self._warned:
                self._warned = True
                msg = ("the forward writes KV through a functional copy (a graph run without reinplacing, e.g. "
                       "aot_eager); layers are sent after the forward, without overlap")
                if self._on_fallback is not None:
                    self._on_fallback(msg)
                else:
                    log.warning("cpgraph transfer: %s", msg)
            return
        self._manager.on_layer_end(layer)

    def remove(self) -> None:
        if self._installed is not None:
            self._installed.__exit__(None, None, None)
            self._installed = None


def attach_layer_hooks(model, manager: LayerTransferManager, pool=None,
                       on_fallback: Callable[[str], None] | None = None) -> list:
    """Call ``manager.on_layer_end(L)`` when layer ``L`` of ``model`` has written its KV; returns the handles.

    Works for eager and Inductor-compiled forwards (see the module docstring).
    ``pool``: the runtime's :class:`~cpgraph.runtime.kv_pool.KVPool` whose
    buffers are being sent, to detect a forward that writes through
    functional copies (such layers are left to ``finish``).  That fallback is
    logged once per handle at WARNING, or handed to ``on_fallback(message)``
    instead when the caller reports it itself (``cpgraph pd`` reports it once
    for all its ranks).
    """
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise ValueError("attach_layer_hooks needs a cpgraph DSA model (model.model.layers)")
    # Every logical layer of the pool: the target's and, when the pool holds it, the MTP draft layer.
    n = getattr(getattr(pool, "config", None), "num_layers", len(model.model.layers))
    buffers = None if pool is None else [pool.mla_pool(i) for i in range(n)]
    return [_LayerHookHandle(manager, buffers, on_fallback)]
