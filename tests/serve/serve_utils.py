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
