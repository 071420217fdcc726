"""What a request gets back when it leaves the engine: its result, the engine's counters, the hand-off.

Why apart from the engine: the result is a function of the request's record
(its match, chunks, timings, transfer) and how it ended, whichever way it
ends (answered, cancelled, timed out, refused, failed); the engine only
takes the request out of its scheduler and hands the result over.  The
hand-off itself (:func:`_deliver`) runs last in a step: the threads woken by
an answer need the GIL the engine thread holds until it blocks.
"""

from __future__ import annotations

from .live_request import _Live
from .requests import CANCELLED, FINISHED, TIMEOUT, RequestResult, _Stats


def request_result(live: _Live, status: str, now: float, stats: _Stats, l3: bool, transfer, choice=None,
                   error: str | None = None, refusal: str | None = None) -> RequestResult:
    """The result of ``live`` leaving the engine with ``status`` at ``now``, counted in ``stats`` (``l3``: the
    cache has an L3 tier, reported in the hits; ``transfer``: the engine's KV sink, or None)."""
    m = live.match
    hits = {"device": m.device_hit, "host": m.host_hit} if m is not None and status == FINISHED else \
        {"device": 0, "host": 0}
    if l3:
        hits["l3"] = m.l3_hit if m is not None and status == FINISHED else 0
    admitted = live.t_admit if live.t_admit is not None else now
    res = RequestResult(status, len(live.tokens), cached_tokens=hits, chunks=live.chunks,
                        computed_tokens=len(live.tokens) - sum(hits.values()) if status == FINISHED else 0,
                        timings={"queue": admitted - live.t_submit, "prefill": now - admitted,
                                 "forward": live.forward_s, "transfer": live.transfer_s, "total": now - live.t_submit},
                        error=error, refusal=refusal)
    if status in (CANCELLED, TIMEOUT) and error is None:
        res.error = "cancelled by the client" if status == CANCELLED else "the request timed out"
    if choice is not None:
        res.token, res.logprob, res.top_logprobs = choice.token, choice.logprob, choice.top
        res.draft_token = live.draft_token
    if live.room is not None:
        sent = transfer.bytes_sent(live.room) if transfer is not None else 0
        res.transfer = {"room": live.room, "ok": status == FINISHED and live.transfer_ok, "bytes_sent": sent}
        stats.transfer_bytes += sent
    stats.outcomes[status] += 1
    if status == FINISHED:
        stats.prompt_tokens += len(live.tokens)
        stats.computed_tokens += res.computed_tokens
        for tier, n in hits.items():
            stats.cached_tokens[tier] = stats.cached_tokens.get(tier, 0) + n
    return res


def _deliver(answers: list) -> None:
    for handle, res in answers:
        handle._finish(res)
