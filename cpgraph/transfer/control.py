"""Control-channel server (prefill ranks) and client (decode): request/reply over TCP frames.

Why each bound (numbers in ``docs/security.md``): the control port is
reachable by every process that can reach the bind address, so nothing a
client does may cost the server unbounded threads, time or memory.

* The server binds ``host`` (``127.0.0.1`` by default) and nothing else.
* At most ``max_connections`` connections are served at once, one daemon
  thread each; a connection over the cap is closed at once (counted in
  ``refused_connections``).
* Every frame must arrive whole within ``timeout`` seconds of the server
  starting to wait for it -- a per-frame deadline, not a per-read one, so a
  client trickling bytes (or idling) is cut off (counted in ``timed_out``).
* A malformed frame closes its connection (counted in ``rejected``); the
  handler never sees it.  Only the first rejection is logged at WARNING, the
  rest at DEBUG, so a flood of garbage cannot flood the log either.
* ``close()`` stops accepting and shuts every open connection down.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable

from .frames import MAX_FRAME_BYTES, FrameError, recv_frame, send_frame

log = logging.getLogger("cpgraph.transfer")

DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_FRAME_TIMEOUT = 10.0


class ControlServer:
    """``handler(msg, peer_host) -> reply`` for each valid frame, under the bounds above."""

    def __init__(self, handler: Callable[[dict, str], dict], host: str = "127.0.0.1", port: int = 0,
                 max_frame_bytes: int = MAX_FRAME_BYTES, timeout: float = DEFAULT_FRAME_TIMEOUT,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        if timeout <= 0 or max_connections < 1:
            raise ValueError(f"ControlServer: timeout must be > 0 and max_connections >= 1, "
                             f"got {timeout} and {max_connections}")
        self.handler, self.max_frame_bytes, self.timeout = handler, max_frame_bytes, timeout
        self.max_connections = max_connections
        self.rejected = self.refused_connections = self.timed_out = 0
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(16)
        self._sock.settimeout(0.1)
        self.host = self._sock.getsockname()[0]
        self.address = f"{self.host}:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="kv-control", daemon=True)
        self._thread.start()

    @property
    def active_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, OSError):
                continue
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if full:
                    self.refused_connections += 1
                else:
                    self._conns.add(conn)
            if full:
                log.debug("control: connection refused, %d connections open (cap)", self.max_connections)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kv-control-conn", daemon=True).start()

    def _count_rejected(self, exc: Exception) -> None:
        with self._lock:
            self.rejected += 1
            first = self.rejected == 1
        (log.warning if first else log.debug)("control: rejected frame (%d so far): %s", self.rejected, exc)

    def _serve(self, conn: socket.socket) -> None:
        try:
            peer_host = conn.getpeername()[0]
            while not self._stop.is_set():
                try:
                    msg = recv_frame(conn, self.max_frame_bytes, timeout=self.timeout)
                except FrameError as exc:
                    self._count_rejected(exc)
                    return
                except TimeoutError:
                    with self._lock:
                        self.timed_out += 1
                    return
                except (ConnectionError, OSError):
                    return
                try:
                    reply = self.handler(msg, peer_host)
                    conn.settimeout(self.timeout)  # sendall: the timeout bounds the whole reply
                    send_frame(conn, reply, self.max_frame_bytes)
                except (ConnectionError, OSError):
                    return
                except Exception:  # noqa: BLE001  (a handler bug must not kill the server)
                    log.exception("control: handler failed on %s", msg.get("type"))
                    return
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def request(address: str, msg: dict, timeout: float = 5.0, max_frame_bytes: int = MAX_FRAME_BYTES) -> dict:
    """One request/reply to ``host:port`` within ``timeout`` seconds in all.

    Raises ``ConnectionError``/``TimeoutError`` (both ``OSError``) or ``FrameError``.
    """
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.settimeout(max(1e-3, deadline - time.monotonic()))
        send_frame(s, msg, max_frame_bytes)
        return recv_frame(s, max_frame_bytes, timeout=max(1e-3, deadline - time.monotonic()))
