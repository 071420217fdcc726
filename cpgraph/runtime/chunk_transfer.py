"""Sending a request's KV pages to its decode's room, chunk by chunk (the engine's ``transfer`` sink).

Why apart from the step: what a chunk sends is a function of the request's
record alone -- every page not sent yet up to the chunk's end, so the first
chunk also carries the cached prefix and the one after a hole the restored
pages -- and the sink's failure is the request's (``transfer_ok``), counted
once.  The sink's interface is in :mod:`cpgraph.runtime.prefill_engine`'s
docstring (``send_chunk``; with ``overlap``, ``begin_chunk`` / ``end_chunk``).
"""

from __future__ import annotations

import time

import numpy as np

from .live_request import _Live
from .requests import _Stats


def _draft(live: _Live, last: bool) -> dict:
    """The MTP draft's guess for the last chunk's aux record, passed only when there is one (a sink without a
    draft need not take the keyword)."""
    return {"draft_token": live.draft_token} if last and live.draft_token is not None else {}


def send_chunk(transfer, stats: _Stats, page_size: int, live: _Live, table: np.ndarray, e: int, last: bool,
               choice) -> None:
    # Every page not sent yet up to this chunk's end: the first chunk also sends the cached prefix, the one
    # after a hole the restored pages between them.
    first_page, end_page = live.sent_pages, -(-e // page_size)
    live.sent_pages = end_page
    t0 = time.perf_counter()
    ok = live.transfer_ok and transfer.send_chunk(
        live.room, table, first_page, end_page, last, None if choice is None else choice.token, len(live.tokens),
        **_draft(live, last))
    live.transfer_s += time.perf_counter() - t0
    if live.transfer_ok and not ok:
        stats.transfer_failures += 1
    live.transfer_ok = bool(ok)


def begin_chunk(transfer, page_size: int, live: _Live, table: np.ndarray, e: int, last: bool):
    """``transfer.begin_chunk`` for the pages not sent yet up to ``e`` (as :func:`send_chunk`), before the forward."""
    first_page, end_page = live.sent_pages, -(-e // page_size)
    live.sent_pages = end_page
    t0 = time.perf_counter()
    chunk = transfer.begin_chunk(live.room, table, first_page, end_page, last)
    live.transfer_s += time.perf_counter() - t0
    return chunk


def end_chunk(transfer, stats: _Stats, live: _Live, chunk, last: bool, choice) -> None:
    t0 = time.perf_counter()
    ok = transfer.end_chunk(chunk, last, None if choice is None else choice.token, len(live.tokens),
                            **_draft(live, last))
    live.transfer_s += time.perf_counter() - t0
    if live.transfer_ok and not ok:
        stats.transfer_failures += 1
    live.transfer_ok = bool(ok)
