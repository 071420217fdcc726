"""Per-layer KV events: where layer L's cache is about to be read, and where it has been written.

The runtime overlaps KV traffic with compute layer by layer: HiCache loads
layer L's cached pages back from host memory while earlier layers compute,
and the prefill->decode transfer ships layer L's pages while later layers
compute.  Both need a point *inside* the forward, in program order, at which
layer L is reached.  These two ops are those points:

* ``kv_layer_ready(pool, layer)`` runs before layer ``layer`` reads its cached
  prefix: a registered ``on_ready(layer, pool)`` hook makes the compute stream wait
  for that layer's load-back (and only that layer's);
* ``kv_layer_written(pool, layer)`` runs after the layer's KV stores: a
  registered ``on_written(layer, pool)`` hook records an event and hands the
  layer to the transfer workers.

They are custom ops (opaque to the compiler), so they run at their place in
program order in eager mode and inside a compiled graph alike.  Each declares
the layer's pool as mutated: that is the ordering fact they carry (the pool's
contents become valid / final at this point), and it keeps them from being
dead-code eliminated.  Without hooks they do nothing.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import Tensor

_HOOKS: dict[str, Callable[[int, Tensor], None] | None] = {"ready": None, "written": None}
_KEEP = object()  # layer_hooks' default: the hook of that kind already installed stays


@contextlib.contextmanager
def layer_hooks(on_ready=_KEEP, on_written=_KEEP):
    """Install per-layer hooks ``hook(layer, pool)`` for a ``with`` block (restores the previous ones).

    A kind left out keeps the hook already installed (``None`` removes it for the block): the HiCache
    load-back installs ``on_ready`` around a forward while a transfer's ``on_written`` hook stays in
    place, and each must see every layer.

    ``pool`` is the tensor the op received.  In eager mode and in Inductor
    graphs (which write caches in place) it is the runtime's pool buffer.  A
    graph executed without reinplacing (``aot_eager``) passes a functional
    copy and writes the real buffer back only when the graph ends: a hook
    that reads the real buffer must compare ``pool.data_ptr()`` with it and,
    if they differ, not assume the layer's bytes are there yet.
    """
    previous = dict(_HOOKS)
    if on_ready is not _KEEP:
        _HOOKS["ready"] = on_ready
    if on_written is not _KEEP:
        _HOOKS["written"] = on_written
    try:
        yield
    finally:
        _HOOKS.update(previous)


def hooks_installed() -> bool:
    """Whether any hook is installed now (a caller with nothing to install may then skip :func:`layer_hooks`)."""
    return _HOOKS["ready"] is not None or _HOOKS["written"] is not None


def _check(op: str, pool, layer) -> None:
    if not isinstance(pool, Tensor):
        raise ValueError(f"cpgraph.{op}: argument 'pool' must be a tensor, got {type(pool).__name__}")
    if not isinstance(layer, (int, torch.SymInt)) or isinstance(layer, bool):
        raise ValueError(f"cpgraph.{op}: argument 'layer' must be an int, got {layer!r}")


@torch.library.custom_op("cpgraph::kv_layer_ready", mutates_args=("pool",))
def kv_layer_ready(pool: Tensor, layer: int) -> None:
    """Layer ``layer`` is about to read its cached KV from ``pool``; runs the ``on_ready`` hook."""
    _check("kv_layer_ready", pool, layer)
    hook = _HOOKS["ready"]
    if hook is not None:
        hook(layer, pool)


@kv_layer_ready.register_fake
def _kv_layer_ready_fake(pool, layer):
    _check("kv_layer_ready", pool, layer)


@torch.library.custom_op("cpgraph::kv_layer_written", mutates_args=("pool",))
def kv_layer_written(pool: Tensor, layer: int) -> None:
    """Layer ``layer`` has written this forward's KV into ``pool``; runs the ``on_written`` hook."""
    _check("kv_layer_written", pool, layer)
    hook = _HOOKS["written"]
    if hook is not None:
        hook(layer, pool)


@kv_layer_written.register_fake
def _kv_layer_written_fake(pool, layer):
    _check("kv_layer_written", pool, layer)
