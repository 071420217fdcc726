"""A thin wrapper around Mooncake's ``TransferEngine`` (the only data path).

Why a wrapper: the raw binding reports failure as ``-1`` (sync calls) or a
batch id of ``0`` (async submit), logs through its own glog to file
descriptor 2, and needs the package installed with a Debian library beside
it.  The wrapper imports it lazily with an actionable message, pins the
metadata mode to ``P2PHANDSHAKE`` (no metadata server: the session id is
``host:rpc_port``), and keeps every call a plain pass-through -- we never
copy bytes ourselves.  ``protocol`` is ``"tcp"`` (tests, loopback) or
``"rdma"`` (clusters; ``device_name`` then names the NICs, e.g. ``"mlx5_0"``).

Logging.  The engine's verbosity follows the ``cpgraph`` logger: call
:func:`set_log_level` (the CLI does for ``-v``) before the first engine is
built, or let :class:`MooncakeEngine` derive it from the logger's effective
level.  Mooncake reads ``MC_LOG_LEVEL`` once, when its module is loaded, and
its most quiet setting is ``ERROR``; on every successful TCP start it still
prints one ERROR line ("Local segment descriptor not found") and glog's
"Logging before InitGoogleLogging" notice.  So ``initialize`` runs with
file descriptor 2 redirected to a temporary file: those two known lines go
to our logger at DEBUG, anything else the engine printed is written back to
stderr unchanged.  A ``MC_LOG_LEVEL`` set by the user is left alone.

Bind addresses.  ``host`` is what the engine *advertises* (the session id).
Mooncake 0.3.13.post1 binds its handshake (RPC) listener to ``0.0.0.0`` and
its TCP data listener to ``[::]`` (dual stack) whatever ``host`` is;
``MC_TCP_BIND_ADDRESS`` and ``MC_LEGACY_RPC_PORT_BINDING`` do not change
that (checked).  :attr:`MooncakeEngine.listeners` reports what the engine
really listens on and :attr:`~MooncakeEngine.exposed` the listeners not on
``host``; ``strict_bind=True`` refuses to run with any.  See
``docs/security.md``.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
from typing import Sequence

import torch

PROTOCOLS = ("tcp", "rdma")
log = logging.getLogger("cpgraph.transfer")

_OURS = "_CPGRAPH_MC_LOG_LEVEL"  # marks an MC_LOG_LEVEL that we set (the user's own is never overridden)
_BENIGN_INIT_LINES = ("Local segment descriptor not found", "Logging before InitGoogleLogging")
_init_lock = threading.Lock()


def engine_log_level(level: int) -> str:
    """Mooncake's ``MC_LOG_LEVEL`` for a Python logging level: quiet (ERROR) unless verbose."""
    if level <= logging.DEBUG:
        return "INFO"
    if level <= logging.INFO:
        return "WARNING"
    return "ERROR"


def set_log_level(level: int | None = None) -> str | None:
    """Make Mooncake's own log follow ``level`` (default: the ``cpgraph`` logger's effective level).

    Sets ``MC_LOG_LEVEL`` for this process and the processes it starts.  It
    takes effect only if Mooncake was not imported yet (it reads the variable
    once); returns the value in force, or ``None`` when the user's own
    ``MC_LOG_LEVEL`` was kept.
    """
    user = os.environ.get("MC_LOG_LEVEL")
    if user is not None and user != os.environ.get(_OURS):
        return None
    if level is None:
        level = logging.getLogger("cpgraph").getEffectiveLevel()
    value = engine_log_level(level)
    if "mooncake.engine" in sys.modules and value != user:
        log.debug("Mooncake is already loaded; MC_LOG_LEVEL=%s applies to processes started from now on", value)
    os.environ["MC_LOG_LEVEL"] = os.environ[_OURS] = value
    return value


def _load_engine_class():
    if "mooncake.engine" not in sys.modules:
        set_log_level()
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "the Mooncake transfer engine is not installed: pip install 'cpgraph[transfer]' "
            "(CPU machines: mooncake-transfer-engine-non-cuda, which needs Debian libibverbs1; "
            f"GPU machines: mooncake-transfer-engine) ({exc})"
        ) from None
    return TransferEngine


def mooncake_available() -> bool:
    """True when the binding imports (sets the engine's log level first, like every engine start)."""
    try:
        _load_engine_class()
    except RuntimeError:
        return False
    return True


def _call_quietly(fn, *args):
    """``fn(*args)`` with fd 2 captured; known start-up noise goes to DEBUG, the rest back to stderr."""
    with _init_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            try:
                return fn(*args)
            finally:
                os.dup2(saved, 2)
        finally:
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode("utf-8", "replace")
            other = []
            for line in text.splitlines():
                if any(b in line for b in _BENIGN_INIT_LINES):
                    log.debug("mooncake: %s", line)
                elif line.strip():
                    other.append(line)
            if other:
                sys.stderr.write("\n".join(other) + "\n")
                sys.stderr.flush()


def _socket_inodes() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _hex_ip(h: str) -> str:
    import ipaddress

    raw = bytes.fromhex(h)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # /proc prints 4 host-order words
    addr = ipaddress.IPv6Address(words)
    return str(addr.ipv4_mapped) if addr.ipv4_mapped else str(addr)


def listening_sockets(inodes: set[str] | None = None) -> list[tuple[str, int]]:
    """``(ip, port)`` of this process's listening TCP sockets (optionally only those ``inodes``).

    Read from ``/proc/net/tcp{,6}`` (Linux); ``[]`` where that is unavailable.
    """
    inodes = _socket_inodes() if inodes is None else inodes
    found = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                ip, port = cols[1].rsplit(":", 1)
                found.append((_hex_ip(ip), int(port, 16)))
    return found


def _is_wildcard(ip: str) -> bool:
    return ip in ("0.0.0.0", "::")


def _host_ip(host: str) -> str:
    import ipaddress
    import socket

    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        try:
            return socket.gethostbyname(host)
        except OSError:
            return host


class MooncakeEngine:
    """One Mooncake engine endpoint; ``session_id`` is what peers pass as ``target``."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 strict_bind: bool = False):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        cls = _load_engine_class()
        before = _socket_inodes()
        self._engine = cls()
        rc = _call_quietly(self._engine.initialize, host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}")
        self.host, self.protocol = host, protocol
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()
        self.listeners = listening_sockets(_socket_inodes() - before)
        self.exposed = [(ip, port) for ip, port in self.listeners if ip != _host_ip(host)]
        if self.exposed:
            where = ", ".join(f"{'*' if _is_wildcard(ip) else ip}:{port}" for ip, port in self.exposed)
            msg = (f"Mooncake engine for {host} also listens on {where} (its listeners ignore the host; "
                   "see docs/security.md)")
            if strict_bind:
                self.close()
                raise RuntimeError(msg + "; strict_bind refuses to run so exposed")
            log.info(msg)

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
