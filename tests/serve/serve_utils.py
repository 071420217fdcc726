"""Real HTTP on loopback for the serve tests: an aiohttp client, one event loop per call.

``post`` / ``get`` return ``(status, parsed JSON or text)``; ``post_many``
sends its bodies concurrently.  ``logprob_table`` turns a choice's
``top_logprobs`` (keyed by decimal token id: the bundled models have no
tokenizer) into ``{id: logprob}``.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

TIMEOUT = aiohttp.ClientTimeout(total=300)


async def _read(resp):
    text = await resp.text()
    try:
        return resp.status, json.loads(text)
    except json.JSONDecodeError:
        return resp.status, text


async def apost(session, url, body):
    kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, (bytes, str)) \
        else {"json": body}
    async with session.post(url + "/v1/completions", **kw) as resp:
        return await _read(resp)


async def aget(session, url, path):
    async with session.get(url + path) as resp:
        return await _read(resp)


def post(url, body):
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            return await apost(s, url, body)
    return asyncio.run(run())


def post_many(url, bodies):
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            return await asyncio.gather(*(apost(s, url, b) for b in bodies))
    return asyncio.run(run())


def get(url, path):
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            return await aget(s, url, path)
    return asyncio.run(run())


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample of a Prometheus text page, e.g. ``metric(page, "cpgraph_kv_pages", 'state="used"')``."""
    want = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    raise KeyError(want)


def logprob_table(choice) -> dict[int, float]:
    return {int(k): v for k, v in choice["logprobs"]["top_logprobs"][0].items()}


class StderrLines:
    """A server process's stderr, read line by line on a thread.

    Why: a blocking ``readline`` cannot time out (a server that stops writing
    without exiting hangs the test forever), and a pipe nobody reads blocks
    the server once its buffer fills.  ``wait_for`` returns the matches of a
    pattern on the lines read so far and to come, or raises ``AssertionError``
    with everything read at its deadline or at EOF; ``text`` waits for EOF.
    """

    def __init__(self, proc):
        import queue
        import threading

        self._queue: queue.Queue = queue.Queue()
        self.lines: list[str] = []
        self._done = False
        self._thread = threading.Thread(target=self._pump, args=(proc.stderr,), daemon=True)
        self._thread.start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def _take(self, timeout: float) -> bool:
        """Move one line (or EOF) into ``lines``; False on EOF or when nothing came within ``timeout``."""
        import queue

        if self._done:
            return False
        try:
            line = self._queue.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return False
        if line is None:
            self._done = True
            return False
        self.lines.append(line)
        return True

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 240.0) -> list:
        import re
        import time

        deadline = time.monotonic() + timeout
        while True:
            found = [m for line in self.lines for m in re.finditer(pattern, line)]
            if len(found) >= count:
                return found
            if not self._take(deadline - time.monotonic()) and (self._done or time.monotonic() >= deadline):
                raise AssertionError(f"{count} x {pattern!r} not seen in {timeout:.0f} s:\n" + "".join(self.lines))

    def text(self, timeout: float = 120.0) -> str:
        """Everything the process wrote, once it closed stderr (or what came within ``timeout``)."""
        import time

        deadline = time.monotonic() + timeout
        while not self._done and time.monotonic() < deadline:
            self._take(deadline - time.monotonic())
        return "".join(self.lines)
