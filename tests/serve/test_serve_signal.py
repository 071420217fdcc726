"""``cpgraph serve`` as a process: SIGTERM stops admission, drains the request in flight, exits 0.

The server is the real command (``python -m cpgraph serve``) on an ephemeral
loopback port it prints at start; the client is aiohttp.  The request in
flight is long (one page per step), so SIGTERM arrives while it is computed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_utils import TIMEOUT, StderrLines, aget, apost, metric  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _start():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "cpgraph", "serve", "--model", "tiny-glm5", "--port", "0",
                             "--token-budget", "16", "--warmup-tokens", "16"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = StderrLines(proc)
    try:
        (m,) = stderr.wait_for(r"listening on (http://127\.0\.0\.1:\d+)", timeout=120)
    except AssertionError:
        proc.kill()
        raise
    return proc, m.group(1), stderr


def test_sigterm_drains_the_request_in_flight_then_exits_0():
    proc, url, stderr = _start()
    try:
        async def run():
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
                for _ in range(1200):  # bounded wait for the warm-up (<= 120 s)
                    status, _ = await aget(s, url, "/health")
                    if status == 200:
                        break
                    await asyncio.sleep(0.1)
                assert status == 200
                inflight = asyncio.ensure_future(apost(s, url, {"prompt": list(range(400)) * 2}))
                for _ in range(3000):
                    _, page = await aget(s, url, "/metrics")
                    if metric(page, "cpgraph_running_requests") == 1:
                        break
                    await asyncio.sleep(0.01)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                try:  # admission has stopped: refused while draining (or the listener is gone)
                    late, _ = await apost(s, url, {"prompt": [1, 2, 3]})
                except aiohttp.ClientConnectionError:
                    late = None
                assert late in (503, None), late
                return await inflight, late

        (status, body), late = asyncio.run(run())
        assert status == 200, body
        assert body["choices"][0]["prefill"]["chunks"] > 10  # it really was in flight for many steps
        code = proc.wait(timeout=60)
        text = stderr.text()
        assert code == 0, text
        assert "draining 1 request(s) in flight" in text
    finally:
        if proc.poll() is None:
            proc.kill()
