"""Control-channel server (prefill ranks) and client (decode): request/reply over TCP frames.

The server binds ``127.0.0.1`` by default, serves each connection on its own
daemon thread, and closes a connection after a malformed frame (counted in
``rejected``) -- the handler never sees it.  Every socket has a timeout and
every loop a stop flag, so a dead peer costs at most one timeout.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable

from .frames import MAX_FRAME_BYTES, FrameError, recv_frame, send_frame

log = logging.getLogger("cpgraph.transfer")


class ControlServer:
    def __init__(self, handler: Callable[[dict], dict], host: str = "127.0.0.1", port: int = 0,
                 max_frame_bytes: int = MAX_FRAME_BYTES, timeout: float = 10.0):
        self.handler, self.max_frame_bytes, self.timeout = handler, max_frame_bytes, timeout
        self.rejected = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(16)
        self._sock.settimeout(0.1)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="kv-control", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, OSError):
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.timeout)
        with conn:
            while not self._stop.is_set():
                try:
                    msg = recv_frame(conn, self.max_frame_bytes)
                except FrameError as exc:
                    self.rejected += 1
                    log.warning("control: rejected frame: %s", exc)
                    return
                except (ConnectionError, OSError):
                    return
                try:
                    reply = self.handler(msg)
                    send_frame(conn, reply, self.max_frame_bytes)
                except (ConnectionError, OSError):
                    return
                except Exception:  # noqa: BLE001  (a handler bug must not kill the server)
                    log.exception("control: handler failed on %s", msg.get("type"))
                    return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close()


def request(address: str, msg: dict, timeout: float = 5.0, max_frame_bytes: int = MAX_FRAME_BYTES) -> dict:
    """One request/reply to ``host:port``; raises ``ConnectionError``/``TimeoutError``/``FrameError``."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.settimeout(timeout)
        send_frame(s, msg, max_frame_bytes)
        return recv_frame(s, max_frame_bytes)
