"""A throwaway Mooncake Store on this machine (master, metadata server, one segment holder), on loopback.

For tests, the L3 benchmark and trying the Mooncake backend on one machine.
The Mooncake wheel ships all three programs: ``mooncake_master`` (the
master binary), ``mooncake.http_metadata_server`` (the transfer metadata
service, an aiohttp server) and ``mooncake_client`` (a client process that
only contributes a memory segment, so pages outlive the processes that
wrote them).  Every listener that takes an address is given 127.0.0.1 and a
free port; the master's embedded metadata server is not used because it
binds 0.0.0.0 whatever it is told (checked with 0.3.13.post1), and the
segment holder's transfer listeners bind wildcard addresses (a Mooncake
limit, docs/security.md).

A cluster runs the same three programs on real interfaces instead; see
docs/cache.md for the flags.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str | None:
    """A program of the Mooncake wheel: inside the package directory, else on PATH."""
    try:
        import mooncake
    except ImportError:
        return None
    inside = Path(mooncake.__file__).parent / name
    if inside.is_file() and os.access(inside, os.X_OK):
        return str(inside)
    return shutil.which(name)


def missing() -> str | None:
    """Why a local Mooncake Store cannot run here (``None`` when it can)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"Mooncake is not installed ({exc}); pip install mooncake-transfer-engine-non-cuda (needs libibverbs1)"
    for name in ("mooncake_master", "mooncake_client"):
        if _binary(name) is None:
            return f"the Mooncake wheel has no {name} program"
    return None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux ``PR_SET_PDEATHSIG``), so a killed
    test or benchmark leaves no store processes behind; elsewhere a no-op."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:g} s: {log.read_text()[-2000:]}")


class LocalMooncake:
    """``with LocalMooncake() as mc: MooncakeStore(mc.master, metadata=mc.metadata)`` (module docstring).

    ``segment``: bytes of the holder's segment (what the store can hold);
    ``holder=False`` starts no holder (writers must then contribute their own
    segment and pages go when they exit).
    """

    def __init__(self, *, segment: str = "256MB", holder: bool = True, timeout: float = 30.0):
        why = missing()
        if why is not None:
            raise RuntimeError(why)
        self.segment, self.holder, self.timeout = segment, holder, timeout
        self.procs: dict[str, subprocess.Popen] = {}
        self.logdir = Path(tempfile.mkdtemp(prefix="cpgraph-mooncake-"))
        self.master_port, self.metadata_port, self.metrics_port, self.client_port = (free_port() for _ in range(4))
        self.master = f"127.0.0.1:{self.master_port}"
        self.metadata = f"http://127.0.0.1:{self.metadata_port}/metadata"

    def _start(self, name: str, cmd: list[str], port: int) -> None:
        log = self.logdir / f"{name}.log"
        env = dict(os.environ)
        env.setdefault("MC_LOG_LEVEL", "ERROR")
        with open(log, "wb") as f:
            self.procs[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                env=env, preexec_fn=_die_with_parent)
        _wait_port(port, self.procs[name], name, self.timeout, log)

    def start(self) -> "LocalMooncake":
        try:
            self._start("metadata", [sys.executable, "-m", "mooncake.http_metadata_server", "--host", "127.0.0.1",
                                     "--port", str(self.metadata_port), "--log-level", "WARNING"], self.metadata_port)
            self._start("master", [_binary("mooncake_master"), f"--rpc_port={self.master_port}",
                                   "--rpc_address=127.0.0.1", "--metrics_host=127.0.0.1",
                                   f"--metrics_port={self.metrics_port}", "--enable_http_metadata_server=false"],
                        self.master_port)
            if self.holder:
                self._start("holder", [_binary("mooncake_client"), "--host=127.0.0.1", f"--port={self.client_port}",
                                       f"--global_segment_size={self.segment}",
                                       f"--master_server_address={self.master}",
                                       f"--metadata_server={self.metadata}", "--protocol=tcp"], self.client_port)
        except BaseException:
            self.stop()
            raise
        return self

    def _stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def stop(self) -> None:
        for name in ("holder", "master", "metadata"):
            self._stop(name)
        shutil.rmtree(self.logdir, ignore_errors=True)

    def __enter__(self) -> "LocalMooncake":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
