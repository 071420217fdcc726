"""What a caller hands the prefill engine and gets back: requests, results, handles, outcomes.

Kept apart from :mod:`cpgraph.runtime.prefill_engine` (the state machine)
so an embedding engine or the HTTP layer can build requests and read results
without the engine's internals.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .inputs import InputError
from .sampling import Sampling

log = logging.getLogger("cpgraph.runtime.prefill_engine")

FINISHED, CANCELLED, TIMEOUT, REFUSED, FAILED = "finished", "cancelled", "timeout", "refused", "failed"
OUTCOMES = (FINISHED, CANCELLED, TIMEOUT, REFUSED, FAILED)
# Why a request was refused at submit: the HTTP layer maps each to its status (413, 429, 400, 503).
REFUSALS = ("invalid", "too_long", "queue_full", "room", "stopped")


@dataclass(frozen=True)
class EngineRequest:
    """One prompt to prefill; the first token is chosen by ``sampling``."""

    tokens: Sequence[int]  # a list of ints, or a 1-D integer numpy array
    sampling: Sampling = field(default_factory=Sampling)
    top_logprobs: int = 0  # how many most likely first tokens to report with their logprobs (0-20)
    transfer_room: int | None = None  # a decode's registered Mooncake room: send this request's KV there
    timeout: float | None = None  # seconds from submit before the request is cancelled (None: the engine's)


@dataclass
class RequestResult:
    status: str  # one of OUTCOMES
    prompt_tokens: int
    token: int | None = None  # the first token (status "finished")
    logprob: float | None = None
    top_logprobs: list = field(default_factory=list)  # [(token id, logprob)], most likely first
    cached_tokens: dict = field(default_factory=lambda: {"device": 0, "host": 0})  # prompt tokens per cache tier
    computed_tokens: int = 0
    chunks: int = 0  # forward steps this request took part in
    timings: dict = field(default_factory=dict)  # seconds: queue, prefill, forward, transfer, total
    transfer: dict | None = None  # {"room", "ok", "bytes_sent"} when the request named a room
    error: str | None = None
    refusal: str | None = None  # with status "refused": one of REFUSALS
    # With an MTP draft (docs/mtp.md): the draft's greedy guess for the token after ``token``, from its logits
    # at the prompt's last position (what a decode's first speculative step verifies).
    draft_token: int | None = None

    @property
    def cached(self) -> int:
        return sum(self.cached_tokens.values())


class RequestHandle:
    """What :meth:`PrefillEngine.submit` returns: poll :meth:`done`, read :attr:`result`, or :meth:`wait`.

    One lock, and a :class:`threading.Event` only once a thread waits: the HTTP server never waits (it takes
    the result through :meth:`add_done_callback`), and an ``Event`` is a ``Condition`` and a second lock,
    built for every request and set on its answer (Python code in ``threading``, run with the host's caches
    cold right after a forward).
    """

    def __init__(self, rid: int, request: EngineRequest):
        self.id, self.request = rid, request
        self.result: RequestResult | None = None
        self._done = False
        self._event: threading.Event | None = None  # created by the first wait() before the answer
        self._callbacks: list[Callable[["RequestHandle"], None]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> RequestResult | None:
        with self._lock:
            if self._done:
                return self.result
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        event.wait(timeout)
        return self.result

    def add_done_callback(self, fn: Callable[["RequestHandle"], None]) -> None:
        """``fn(handle)`` once the result is set (at once if it is): runs in the thread that finished it."""
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, result: RequestResult) -> None:
        with self._lock:
            if self._done:
                return
            self.result = result
            self._done = True
            event, callbacks, self._callbacks = self._event, self._callbacks, []
        if event is not None:
            event.set()
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # noqa: BLE001  (a caller's callback must not stop the engine)
                log.exception("prefill engine: a done-callback of request %d raised", self.id)


@dataclass
class _Stats:
    prompt_tokens: int = 0
    computed_tokens: int = 0
    cached_tokens: dict = field(default_factory=lambda: {"device": 0, "host": 0})
    steps: dict = field(default_factory=lambda: {"graph": 0, "eager": 0})
    outcomes: dict = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    transfer_bytes: int = 0
    transfer_failures: int = 0
    last_step_tokens: int = 0
    step_seconds: float = 0.0


_GREEDY = Sampling()


def engine_request(tokens, *, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                   top_logprobs: int = 0, transfer_room: int | None = None,
                   timeout: float | None = None) -> EngineRequest:
    """An :class:`EngineRequest` from plain values; :class:`InputError` naming the bad one."""
    if seed is None and temperature == 0.0 and top_p == 1.0 and type(temperature) is float and type(top_p) is float:
        sampling = _GREEDY  # the usual request: one shared (frozen) value, not a new one checked every time
    else:
        try:
            sampling = Sampling(temperature, top_p, seed)
        except ValueError as exc:
            raise InputError(str(exc)) from None
    if not (isinstance(tokens, np.ndarray) and tokens.ndim == 1):  # an array is kept: the engine checks it as one
        tokens = list(tokens)
    return EngineRequest(tokens, sampling, top_logprobs, transfer_room, timeout)
