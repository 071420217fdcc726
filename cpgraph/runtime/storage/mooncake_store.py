"""L3 in a Mooncake Store cluster (``mooncake.store.MooncakeDistributedStore``): pages shared across nodes.

A Mooncake Store is a master (``mooncake_master``: object metadata, leases,
eviction) plus clients that each contribute a memory *segment*; objects live
in the segments, and a client reads or writes them over TCP or RDMA straight
from or into memory it registered.  So:

* the L2 host pool's buffers are registered once (:meth:`register`), and
  ``get``/``put`` are ``batch_get_into_multi_buffers`` /
  ``batch_put_from_multi_buffers`` over the pool's rows: zero-copy, one
  batch call per run of pages.  A part outside registered memory has its
  whole tensor storage registered on first use.
* every object is the 64-byte header of :mod:`.object_header` (key, length,
  XXH3-64 of the bytes) followed by the page's bytes, as in the file backend:
  the header is one more byte range of the same batch call, from a small
  registered slab.  A read checks that the store returned header + object,
  that the header names this key and length, and the checksum of the bytes
  that landed in L2; anything else is a miss -- the object is removed from
  the store, the reason logged once, the bytes never used.  The store keeps
  bytes in memory and moves them over TCP or RDMA; the check covers a
  faulty segment holder, a torn transfer and an object another writer left
  under the name.
* ``segment`` is how much memory *this* process contributes (default 0: it
  only uses the store).  Pages outlive a process only in segments of
  processes that keep running -- a store service per node
  (``mooncake_client --global_segment_size=...``) or a long-lived server
  with ``segment`` set.  The master evicts under memory pressure; that is
  the size bound of this backend.
* ``metadata`` is the transfer metadata service: ``P2PHANDSHAKE`` (none; a
  peer is found through the master) or an HTTP metadata server URL
  (``mooncake_http_metadata_server``).

Batches are split into calls of at most ``MAX_RANGES_PER_CALL`` byte ranges
(the TCP transport's queue is bounded).

Unreachable masters.  ``setup`` against a master that is down retries for
about 90 s and a batch call on a dead master takes about 4 s to fail (both
measured with 0.3.13.post1), so the master's (and an HTTP metadata server's)
TCP port is probed first with a short timeout; when the probe or ``setup``
fails the store is unavailable (every call a miss, one warning).  A batch
call that fails with a transport error (``RPC_FAIL``) opens the same
circuit for ``retry_s`` seconds, after which the next call probes again.

Bind addresses: ``host`` is what this client advertises; Mooncake 0.3.13
binds its handshake listener to 0.0.0.0 and its TCP data listener to ``[::]``
whatever ``host`` is (see docs/security.md and docs/cache.md).  The tests run
everything on 127.0.0.1.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Sequence
from urllib.parse import urlparse

import numpy as np
import torch

from .base import PageStore, Parts, check_parts
from .object_header import HEADER_BYTES, check_header, checksum, encode_header, key_bytes, views

log = logging.getLogger("cpgraph.storage")

OBJECT_NOT_FOUND = -704
RPC_FAIL = -900
_ERRORS = {-1: "INTERNAL_ERROR", -200: "NO_AVAILABLE_HANDLE (store full)", -600: "INVALID_PARAMS (size mismatch)",
           OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS", -800: "TRANSFER_FAIL",
           RPC_FAIL: "RPC_FAIL"}
_TRANSPORT = (RPC_FAIL, -800)
# Byte ranges per batch call.  0.3.13.post1's TCP transport rejects transfers once its lane queue is full
# ("TCP lane queue-full rejection") and the batch then times out after 60 s: 512 pages of 6 ranges in one
# call did, 2048 pages of one range did not (measured on loopback).
MAX_RANGES_PER_CALL = 1024


def error_name(code: int) -> str:
    return f"{_ERRORS.get(int(code), 'error')} ({int(code)})"


def _address(view: memoryview) -> int:
    """The address of a (non-empty) byte memoryview's first byte."""
    return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]


def _quiet_mooncake() -> None:
    """Mooncake's own log at ERROR unless the user set ``MC_LOG_LEVEL`` or cpgraph logs at INFO/DEBUG."""
    if "MC_LOG_LEVEL" in os.environ:
        return
    level = logging.getLogger("cpgraph").getEffectiveLevel()
    os.environ["MC_LOG_LEVEL"] = "INFO" if level <= logging.DEBUG else "WARNING" if level <= logging.INFO else "ERROR"


def _probe(host: str, port: int, timeout: float) -> str | None:
    """``None`` when a TCP connection to ``host:port`` opens within ``timeout``, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def _host_port(addr: str, what: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{what}: expected HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


class MooncakeStore(PageStore):
    """Pages in a Mooncake Store (module docstring).  ``master``: ``HOST:PORT`` of ``mooncake_master``."""

    def __init__(self, master: str = "127.0.0.1:50051", *, metadata: str = "P2PHANDSHAKE", host: str = "127.0.0.1",
                 protocol: str = "tcp", device: str = "", segment: int = 0, buffer: int = 16 << 20,
                 probe_timeout: float = 1.0, retry_s: float = 30.0):
        super().__init__()
        self.master, self.metadata, self.host, self.protocol = master, metadata, host, protocol
        self.name = f"mooncake:{master}"
        self.segment, self.buffer = int(segment), int(buffer)
        self.probe_timeout, self.retry_s = float(probe_timeout), float(retry_s)
        self._endpoints = [_host_port(master, "mooncake master")]
        if metadata != "P2PHANDSHAKE":
            url = urlparse(metadata)
            if url.scheme != "http" or not url.hostname:
                raise ValueError("mooncake metadata: expected P2PHANDSHAKE or http://HOST:PORT/metadata, "
                                 f"got {metadata!r}")
            self._endpoints.append((url.hostname, url.port or 80))
        self._store = None
        self._down_until = 0.0  # circuit open until then (monotonic)
        self._registered: list[tuple[int, int]] = []
        self._pending: list[torch.Tensor] = []  # registered before the store came up
        self._headers = torch.zeros(0, HEADER_BYTES, dtype=torch.uint8)  # one row per object of a batch call
        self._connect()

    # -------------------------------------------------------- connection
    def _connect(self) -> bool:
        for host, port in self._endpoints:
            why = _probe(host, port, self.probe_timeout)
            if why is not None:
                self._open_circuit("unreachable", f"{host}:{port} unreachable ({why}); every L3 lookup is a miss, "
                                                  f"retried in {self.retry_s:g} s")
                return False
        try:
            _quiet_mooncake()
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            self._open_circuit("missing", f"Mooncake is not installed ({exc}); pip install "
                                          "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine")
            self._down_until = float("inf")
            return False
        store = MooncakeDistributedStore()
        rc = store.setup(self.host, self.metadata, self.segment, self.buffer, self.protocol, "", self.master)
        if rc != 0:
            self._open_circuit("setup", f"setup against master {self.master} failed (rc {rc}); every L3 lookup is "
                                        f"a miss, retried in {self.retry_s:g} s")
            return False
        self._store = store
        self._registered = []
        for t in self._pending:
            self._register_now(t)
        return True

    def _open_circuit(self, reason: str, message: str) -> None:
        self._down_until = time.monotonic() + self.retry_s
        self.warn_once(reason, message)

    def _ready(self) -> bool:
        if self._store is not None and time.monotonic() >= self._down_until:
            return True
        if time.monotonic() < self._down_until:
            return False
        return self._connect()

    @property
    def available(self) -> bool:
        return self._store is not None and time.monotonic() >= self._down_until

    def _transport_failed(self, codes) -> bool:
        bad = [int(c) for c in codes if int(c) in _TRANSPORT]
        if bad:
            self._open_circuit("transport", f"the store stopped answering ({error_name(bad[0])}); "
                                            f"L3 off for {self.retry_s:g} s, serving goes on")
            return True
        return False

    def _batches(self, keys, ptrs, lens):
        """Calls of at most :data:`MAX_RANGES_PER_CALL` byte ranges (the TCP transport's queue is bounded)."""
        start, ranges = 0, 0
        for i, p in enumerate(ptrs):
            if ranges and ranges + len(p) > MAX_RANGES_PER_CALL:
                yield list(keys[start:i]), list(ptrs[start:i]), list(lens[start:i])
                start, ranges = i, 0
            ranges += len(p)
        if start < len(keys):
            yield list(keys[start:]), list(ptrs[start:]), list(lens[start:])

    def _call(self, fn, keys, ptrs, lens) -> list[int]:
        """``fn`` over :meth:`_batches`; after a transport error the rest of the batch is not attempted."""
        codes: list[int] = []
        for k, p, n in self._batches(keys, ptrs, lens):
            got = [int(c) for c in fn(k, p, n)]
            codes += got
            if any(c in _TRANSPORT for c in got):
                codes += [RPC_FAIL] * (len(keys) - len(codes))
                break
        return codes

    # ------------------------------------------------------ registration
    def register(self, buffer: torch.Tensor) -> None:
        if buffer.device.type != "cpu":
            raise ValueError(f"MooncakeStore.register: host memory only, got a tensor on {buffer.device}")
        self._pending.append(buffer)
        if self._store is not None:
            self._register_now(buffer)

    def _register_now(self, buffer: torch.Tensor) -> None:
        storage = buffer.untyped_storage()
        ptr, n = storage.data_ptr(), storage.nbytes()
        if any(a <= ptr and ptr + n <= a + m for a, m in self._registered):
            return
        rc = self._store.register_buffer(ptr, n)
        if rc != 0:
            self.warn_once("register", f"register_buffer of {n} bytes failed (rc {rc}); transfers from it fail")
            return
        self._registered.append((ptr, n))

    def _header_rows(self, n: int) -> torch.Tensor:
        """``[n, 64]`` registered host rows for the headers of one batch call.

        The slab grows by doubling; an outgrown slab stays alive (and
        registered): memory a transport has registered is never freed under it.
        """
        if self._headers.shape[0] < n:
            self._headers = torch.zeros(max(n, 2 * self._headers.shape[0], 256), HEADER_BYTES, dtype=torch.uint8)
            self.register(self._headers)
        return self._headers[:n]

    def _ptrs(self, parts: Parts, header: torch.Tensor) -> tuple[list[int], list[int]]:
        """Byte ranges of one object: its header row, then its parts (tensors or byte memoryviews)."""
        ptrs, sizes = [header.data_ptr()], [HEADER_BYTES]
        for t in parts:
            if type(t) is memoryview:
                p, n = (_address(t) if t.nbytes else 0), t.nbytes
            else:
                p, n = t.data_ptr(), t.numel()
            if n and not any(a <= p and p + n <= a + m for a, m in self._registered):
                if type(t) is memoryview:  # memory the caller did not register: register this range
                    t = torch.frombuffer(t, dtype=torch.uint8)
                self._pending.append(t)
                self._register_now(t)
            ptrs.append(p)
            sizes.append(n)
        return ptrs, sizes

    # ------------------------------------------------------------- calls
    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.stats["exists_queries"] += len(keys)
        if not keys or not self._ready():
            return [False] * len(keys)
        codes = list(self._store.batch_is_exist(list(keys)))
        if self._transport_failed(codes):
            return [False] * len(keys)
        return [int(c) == 1 for c in codes]

    def get(self, keys: Sequence[str], parts: Sequence[Parts]) -> list[bool]:
        if len(keys) != len(parts):
            raise ValueError(f"MooncakeStore.get: {len(keys)} key(s) but {len(parts)} part list(s)")
        sizes = [check_parts(p, "MooncakeStore.get", writable=True) for p in parts]
        raw_keys = [key_bytes(k, "MooncakeStore") for k in keys]
        if not keys or not self._ready():
            self.stats["get_misses"] += len(keys)
            return [False] * len(keys)
        heads = self._header_rows(len(keys))
        ptrs, lens = zip(*(self._ptrs(p, heads[i]) for i, p in enumerate(parts)))
        codes = self._call(self._store.batch_get_into_multi_buffers, keys, ptrs, lens)
        if self._transport_failed(codes):
            self.stats["get_failures"] += len(keys)
            return [False] * len(keys)
        out = []
        for i, (code, size) in enumerate(zip(codes, sizes)):
            problem = None
            if int(code) == HEADER_BYTES + size:
                problem = self._verify(heads[i], raw_keys[i], parts[i], size)
                if problem is None:
                    self.stats["get_pages"] += 1
                    self.stats["get_bytes"] += size
                    out.append(True)
                    continue
            if int(code) == OBJECT_NOT_FOUND:
                self.stats["get_misses"] += 1
            elif problem is not None or int(code) >= 0:
                self.stats["get_failures"] += 1
                what = problem or f"{int(code)} bytes stored, {HEADER_BYTES + size} expected with the header"
                self.warn_once("corrupt", f"object {keys[i]} failed verification ({what}); removed, never loaded, "
                                          "the page is recomputed")
                self._remove(keys[i])
            else:
                self.stats["get_failures"] += 1
                self.warn_once(f"get_{int(code)}", f"a page read failed ({error_name(code)}); the page is recomputed")
            out.append(False)
        return out

    @staticmethod
    def _verify(header: torch.Tensor, key_raw: bytes, parts: Parts, size: int) -> str | None:
        """What is wrong with an object read into ``header`` + ``parts``, or ``None``."""
        want, problem = check_header(header.numpy().tobytes(), key_raw, size)
        if problem is None and checksum(views(parts)) != want:
            problem = "checksum mismatch"
        return problem

    def _remove(self, key: str) -> None:
        """Drop an object that failed verification, so a lookup misses it and a put can store it again.

        ``force``: the read just took a lease on the object (a plain remove
        answers -706, "has lease"); a corrupt object must go regardless.
        """
        try:
            rc = self._store.remove(key, True)
        except Exception as exc:  # noqa: BLE001  (a failed removal only costs a second failed read)
            rc = str(exc)
        if rc not in (0, OBJECT_NOT_FOUND):
            log.debug("%s: removing %s failed (%s)", self.name, key, rc)

    def put(self, keys: Sequence[str], parts: Sequence[Parts]) -> list[bool]:
        if len(keys) != len(parts):
            raise ValueError(f"MooncakeStore.put: {len(keys)} key(s) but {len(parts)} part list(s)")
        sizes = [check_parts(p, "MooncakeStore.put") for p in parts]
        raw_keys = [key_bytes(k, "MooncakeStore") for k in keys]
        if not keys or not self._ready():
            self.stats["put_skipped"] += len(keys)
            return [False] * len(keys)
        heads = self._header_rows(len(keys))
        rows = heads.numpy()
        for i, (p, size) in enumerate(zip(parts, sizes)):
            rows[i] = np.frombuffer(encode_header(raw_keys[i], size, checksum(views(p))), dtype=np.uint8)
        ptrs, lens = zip(*(self._ptrs(p, heads[i]) for i, p in enumerate(parts)))
        codes = self._call(self._store.batch_put_from_multi_buffers, keys, ptrs, lens)
        if self._transport_failed(codes):
            self.stats["put_failures"] += len(keys)
            return [False] * len(keys)
        out = []
        for code, size in zip(codes, sizes):
            ok = int(code) in (0, -705)  # stored, or another writer stored the same page first
            if ok:
                self.stats["put_pages"] += 1
                self.stats["put_bytes"] += size
            else:
                self.stats["put_failures"] += 1
                self.warn_once(f"put_{int(code)}", f"a page write failed ({error_name(code)}); not stored")
            out.append(ok)
        return out

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception as exc:  # noqa: BLE001  (closing must not fail a run that is ending)
                self.warn_once("close", f"close failed: {exc}")
