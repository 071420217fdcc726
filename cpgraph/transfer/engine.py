"""A thin wrapper around Mooncake's ``TransferEngine`` (the only data path).

Why a wrapper: the raw binding reports failure as ``-1`` (sync calls) or a
batch id of ``0`` (async submit), logs through glog, and needs the package
installed with a Debian library beside it.  The wrapper imports it lazily
with an actionable message, pins the metadata mode to ``P2PHANDSHAKE`` (no
metadata server: the session id is ``host:rpc_port``), binds to loopback by
default, and keeps every call a plain pass-through -- we never copy bytes
ourselves.  ``protocol`` is ``"tcp"`` (tests, loopback) or ``"rdma"``
(clusters; ``device_name`` then names the NICs, e.g. ``"mlx5_0"``).
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

import torch

PROTOCOLS = ("tcp", "rdma")


def _load_engine_class():
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "the Mooncake transfer engine is not installed: pip install 'cpgraph[transfer]' "
            "(CPU machines: mooncake-transfer-engine-non-cuda, which needs Debian libibverbs1; "
            f"GPU machines: mooncake-transfer-engine) ({exc})"
        ) from None
    return TransferEngine


class MooncakeEngine:
    """One Mooncake engine endpoint; ``session_id`` is what peers pass as ``target``."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = ""):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        self._engine = _load_engine_class()()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}")
        self.host, self.protocol = host, protocol
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()

    # memory ------------------------------------------------------------------
    def register(self, t: torch.Tensor) -> None:
        """Register a contiguous tensor's bytes (idempotent per base address)."""
        if not isinstance(t, torch.Tensor) or not t.is_contiguous():
            raise ValueError("register: expects a contiguous tensor")
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        if n == 0:
            return
        with self._lock:
            if self._registered.get(ptr) == n:
                return
            rc = self._engine.register_memory(ptr, n)
            if rc != 0:
                raise RuntimeError(f"Mooncake register_memory({ptr:#x}, {n}) returned {rc}")
            self._registered[ptr] = n

    def unregister_all(self) -> None:
        with self._lock:
            for ptr in list(self._registered):
                self._engine.unregister_memory(ptr)
            self._registered.clear()

    # data ----------------------------------------------------------------------
    def write(self, target: str, src: Sequence[int], dst: Sequence[int], lens: Sequence[int]) -> int:
        """Blocking batched write; ``0`` on success, negative on failure (dead or unregistered peer)."""
        if not lens:
            return 0
        return int(self._engine.batch_transfer_sync_write(target, list(src), list(dst), list(lens)))

    def submit(self, target: str, src: Sequence[int], dst: Sequence[int], lens: Sequence[int]) -> int:
        """Non-blocking batched write; returns a batch id, ``0`` when the submit itself failed."""
        return int(self._engine.batch_transfer_async_write(target, list(src), list(dst), list(lens)))

    def wait(self, batch_ids: Sequence[int]) -> int:
        """Block until the batches finish; ``0`` when all succeeded."""
        ids = [int(b) for b in batch_ids]
        if not ids:
            return 0
        if any(b == 0 for b in ids):
            return -1
        return int(self._engine.get_batch_transfer_status(ids))

    def close(self) -> None:
        self.unregister_all()
