"""The HTTP front of a prefill node (aiohttp): OpenAI completions, health, models, metrics, drain on SIGTERM.

Two threads: the asyncio event loop answers HTTP; one *engine thread* owns
the :class:`~cpgraph.runtime.prefill_engine.PrefillEngine` and calls
``step()`` while there is work.  A handler submits its prompts (the
engine's submit is thread-safe) and awaits futures that the engine thread
resolves through ``call_soon_threadsafe``.

The idle fast path (``idle_steps_on_loop``, on by default): a request that
finds the engine settled -- nothing queued or admitted, and idle for at least
as long as its last step took (``PrefillEngine.settled``) -- has its first
step run on the event loop itself, right after every handler made runnable
in the same turn of the loop has submitted (they share the step), and the
engine thread is not woken.  At idle the two thread wake-ups of the hand-off
(loop to engine thread, and back) are most of what serving adds to a request
on a virtualised host (docs/serve.md); this path has none.  What it costs:
the loop answers nothing else for the length of that one step (a health
check or a new request waits at most one step, as a new request would for
the engine thread's step anyway).  Whatever is left after it (chunks, or
requests that arrived meanwhile) goes to the engine thread.  A request that
comes right after a step (the next of a busy period) goes to the engine
thread too, so the loop keeps reading the requests behind it while the
forward runs: taken then, the path would put the HTTP work of a busy period
in series with its forwards (a closed loop of clients lost 12 % of its
throughput so).

A client that disconnects cancels its handler (``handler_cancellation``),
which cancels its requests: their pages are freed at the next step boundary.

Lifecycle: the server listens at once and answers ``/health`` with 503 until
the engine thread has run its warm-up (the first forward compiles), then
200.  :meth:`PrefillServer.shutdown` (SIGTERM or SIGINT under
:meth:`serve_forever`) stops admission (new completions get 503), waits for
the requests in flight to be answered, stops the engine thread -- which tells
the other CP ranks to stop -- and closes the listener.

Every error is a JSON body in OpenAI's shape; an unexpected exception in a
handler is a 500 for that request, logged, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
from typing import Callable

from aiohttp import web

from cpgraph.runtime.prefill_engine import CANCELLED, FINISHED, REFUSED, TIMEOUT, engine_request

from .metrics import CONTENT_TYPE, ServeMetrics
from .protocol import ApiError, completion_response, parse_completion

log = logging.getLogger("cpgraph.serve")

MAX_BODY_BYTES = 64 << 20  # a 1M-token prompt as JSON ids fits
_REFUSAL_STATUS = {"too_long": (413, "prompt"), "queue_full": (429, None), "room": (400, "kv_transfer.room"),
                   "stopped": (503, None), "invalid": (400, "prompt")}


_JSON_HEADERS = {"Content-Type": "application/json; charset=utf-8"}
_dumps = json.JSONEncoder(separators=(",", ":")).encode  # one encoder for every response


def _json(status: int, body: dict) -> web.Response:
    return web.Response(body=_dumps(body).encode(), status=status, headers=_JSON_HEADERS)


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None) -> web.Response:
    return _json(status, ApiError(status, message, param, kind, code).body())


class PrefillServer:
    """HTTP server + engine thread around one leader :class:`PrefillEngine` (module docstring).

    ``served``: model names a request may give (the first is reported);
    ``encode``/``decode``: the tokenizer (``None``: token ids only, tokens
    shown as decimal ids); ``warmup``: called once in the engine thread
    before ``/health`` turns 200; ``transfer_info``: what ``GET
    /v1/kv_transfer`` tells a decode (the prefill peers' control addresses);
    ``heartbeat``: seconds between idle broadcasts to CP followers;
    ``idle_steps_on_loop``: the idle fast path (module docstring).
    """

    def __init__(self, engine, *, served: tuple[str, ...], host: str = "127.0.0.1", port: int = 0,
                 encode: Callable[[str], list[int]] | None = None, decode: Callable[[int], str] | None = None,
                 warmup: Callable[[], None] | None = None, transfer_info: dict | None = None,
                 heartbeat: float = 5.0, drain_timeout: float = 600.0, max_model_len: int | None = None,
                 idle_steps_on_loop: bool = True):
        self.engine, self.served, self.host, self.port = engine, tuple(served), host, port
        self.encode, self.decode, self.warmup = encode, decode, warmup
        self.transfer_info, self.heartbeat, self.drain_timeout = transfer_info, heartbeat, drain_timeout
        self.max_model_len = max_model_len or engine.max_prompt_tokens
        self.metrics = ServeMetrics(engine)
        self.ready = False
        self.draining = False
        self.failed: str | None = None  # the engine thread died (a bug): health reports it
        self.created = int(time.time())
        self._in_flight = 0
        self._counters: dict = {}
        self.idle_steps_on_loop = idle_steps_on_loop
        self._inline_scheduled = False  # a step on the loop is queued for this turn's submissions
        self._loop_ident: int | None = None
        self._stop_engine = threading.Event()
        self._engine_thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._done: asyncio.Event | None = None

    # ------------------------------------------------------------------ engine thread
    def _engine_main(self) -> None:
        try:
            _use_engine_device(self.engine)
            if self.warmup is not None:
                self.warmup()
            self.ready = True
            log.info("cpgraph serve: warmed up; ready")
            while not self._stop_engine.is_set():
                if self.engine.wait_for_work(self.heartbeat):
                    self.engine.step()
                else:
                    self.engine.heartbeat()
        except BaseException as exc:  # noqa: BLE001  (report through /health; never hang the handlers)
            self._engine_failed(exc, "the engine thread")
        finally:
            try:
                self.engine.stop_followers()
            except Exception:  # noqa: BLE001
                log.exception("cpgraph serve: could not stop the CP followers")
            try:
                self.engine.close()  # L3: store what it lacks, release the store (each follower does the same)
            except Exception:  # noqa: BLE001
                log.exception("cpgraph serve: could not flush the L3 page store")

    def _engine_failed(self, exc: BaseException, where: str) -> None:
        self.failed = " ".join(f"{type(exc).__name__}: {exc}".split())
        log.error("cpgraph serve: a step on %s failed", where, exc_info=exc)
        self.engine.fail_all(f"the engine failed: {self.failed}")  # no handler waits forever
        if self._loop is not None:  # and the process ends (status 1) instead of serving 503s forever
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.shutdown()))
        self._stop_engine.set()
        self.engine.wake()

    # ---------------------------------------------------------------- idle fast path
    def _step_on_loop(self) -> None:
        """The step of the requests submitted this turn while the engine was idle (module docstring)."""
        self._inline_scheduled = False
        if self.failed:
            return
        try:
            ran = self.engine.try_step()
        except BaseException as exc:  # noqa: BLE001  (as the engine thread: answer everything, then stop)
            self._engine_failed(exc, "the event loop")
            return
        if ran is None or not self.engine.idle():
            self.engine.wake()  # the engine thread was stepping, or chunks / new arrivals are left: it takes over
        else:  # the answered requests' radix commits, after the responses are out (as the engine thread's wait)
            self._loop.call_later(self.engine.commit_delay, self._commit_on_loop)

    def _commit_on_loop(self) -> None:
        if self.engine.idle() and not self.failed:  # else the next step (on either thread) commits first itself
            self.engine.try_sync()

    def _answer(self, fut: asyncio.Future, handle) -> None:
        """A handle's done-callback: resolve ``fut`` on the loop (directly when already on it)."""
        if threading.get_ident() == self._loop_ident:
            self._loop.call_soon(_resolve, fut, handle.result)
        else:
            self._loop.call_soon_threadsafe(_resolve, fut, handle.result)

    # ------------------------------------------------------------------------ app
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/kv_transfer", self._kv_transfer)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        endpoint = request.path if request.match_info.route.resource is not None else "other"
        try:
            resp = await handler(request)
        except web.HTTPException as exc:  # aiohttp's own: 404 unknown path, 405, 413 body too large
            resp = _error(exc.status, exc.reason or "error", kind="invalid_request_error")
        except asyncio.CancelledError:
            self.metrics.responses.labels(endpoint, "disconnected").inc()
            raise
        except Exception as exc:  # noqa: BLE001  (never die on one request)
            log.exception("cpgraph serve: %s %s failed", request.method, request.path)
            resp = _error(500, " ".join(f"internal error: {type(exc).__name__}: {exc}".split()), kind="server_error")
        # Counted once the response is on its way: a callback of the loop's next turn runs after aiohttp has
        # handed it to the socket (its write waits only when the socket is full), and before the loop reads
        # another request, so a /metrics read after the response counts it.
        asyncio.get_running_loop().call_soon(self._count, endpoint, resp.status)
        return resp

    def _count(self, endpoint: str, status: int) -> None:
        counter = self._counters.get((endpoint, status))
        if counter is None:  # one labelled child per (endpoint, status), looked up once
            counter = self._counters[endpoint, status] = self.metrics.responses.labels(endpoint, str(status))
        counter.inc()

    async def _health(self, request: web.Request) -> web.Response:
        if self.failed:
            return _json(503, {"status": "failed", "error": self.failed})
        if self.draining:
            return _json(503, {"status": "draining"})
        if not self.ready:
            return _json(503, {"status": "loading"})
        return _json(200, {"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        return _json(200, {"object": "list", "data": [{"id": self.served[0], "object": "model", "created": self.created,
                                                       "owned_by": "cpgraph", "max_model_len": self.max_model_len}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _kv_transfer(self, request: web.Request) -> web.Response:
        if self.transfer_info is None:
            return _error(404, "this prefill node has no KV transfer configured (start it with --kv-transfer)")
        return _json(200, self.transfer_info)

    async def _completions(self, request: web.Request) -> web.Response:
        if self.draining or self.failed or not self.ready:
            why = "shutting down" if self.draining else "failed" if self.failed else "still loading"
            return _error(503, f"the server is {why}", kind="server_error")
        try:  # the bytes straight to the parser (it detects UTF-8); another declared charset decodes first
            raw = await request.read()
            charset = request.charset
            body = json.loads(raw if charset is None or charset.lower() in ("utf-8", "utf8") else raw.decode(charset))
        # ValueError covers JSONDecodeError, UnicodeDecodeError and integers past the parser's digit limit;
        # RecursionError is what arrays or objects nested too deeply raise; LookupError an unknown charset.
        except (ValueError, LookupError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else " ".join(str(exc).split())[:200]
            return _error(400, f"the request body is not JSON: {why}")
        try:
            comp = parse_completion(body, served=self.served, vocab=self.engine.vocab,
                                    max_prompt_tokens=self.engine.max_prompt_tokens, encode=self.encode)
        except ApiError as exc:
            return _json(exc.status, exc.body())
        room = comp.kv_transfer["room"] if comp.kv_transfer else None
        self._in_flight += 1
        try:
            return await self._run(comp, room)
        finally:
            self._in_flight -= 1

    async def _run(self, comp, room) -> web.Response:
        loop = asyncio.get_running_loop()
        futures, handles = [], []
        # The idle fast path: this turn's step is already queued on the loop, or the engine has settled.
        on_loop = self._inline_scheduled or (self.idle_steps_on_loop and self.engine.settled())
        for tokens in comp.prompts:
            fut = loop.create_future()
            # parse_completion checked the ids against the engine's vocabulary: submit takes them as they are.
            h = self.engine.submit(engine_request(tokens, temperature=comp.temperature, top_p=comp.top_p,
                                                  seed=comp.seed, top_logprobs=comp.logprobs or 0,
                                                  transfer_room=room), checked=True, wake=not on_loop)
            h.add_done_callback(lambda h, fut=fut: self._answer(fut, h))
            futures.append(fut)
            handles.append(h)
        if on_loop and not self._inline_scheduled:
            # After the handlers already runnable in this turn have submitted: they share the step.
            self._inline_scheduled = True
            loop.call_soon(self._step_on_loop)
        try:
            results = [await futures[0]] if len(futures) == 1 else await asyncio.gather(*futures)
        except asyncio.CancelledError:  # the client went away: free what its requests hold
            for h in handles:
                self.engine.cancel(h, CANCELLED)
            raise
        bad = next((r for r in results if r.status != FINISHED), None)
        if bad is not None:
            for h in handles:
                self.engine.cancel(h, CANCELLED)
            if bad.status == REFUSED:
                status, param = _REFUSAL_STATUS.get(bad.refusal, (400, None))
                return _error(status, bad.error, param, code="context_length_exceeded" if status == 413 else None)
            if bad.status == TIMEOUT:
                return _error(504, bad.error or "the request timed out", kind="timeout")
            return _error(500, bad.error or f"the request {bad.status}", kind="server_error")
        # The TTFT histogram after the response is written (the loop's next turn), as the response counter.
        loop.call_soon(self._observe_ttft, results)
        resp = completion_response(comp, results, self.decode)
        if self.transfer_info is not None:
            for c in resp["choices"]:
                if "kv_transfer" in c:
                    c["kv_transfer"]["peers"] = list(self.transfer_info.get("peers", []))
        return _json(200, resp)

    def _observe_ttft(self, results) -> None:
        for r in results:
            self.metrics.ttft.observe(r.timings["total"])

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Listen, and start the engine thread (warm-up first)."""
        self._loop = asyncio.get_running_loop()
        self._loop_ident = threading.get_ident()
        _use_engine_device(self.engine)  # the idle fast path steps on this thread
        self._done = asyncio.Event()
        self._runner = web.AppRunner(self.make_app(), handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the bound port (port 0: ephemeral)
        self._engine_thread = threading.Thread(target=self._engine_main, name="cpgraph-engine", daemon=True)
        self._engine_thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def shutdown(self) -> None:
        """Stop admission, drain the requests in flight, stop the engine (and the CP followers), close."""
        if self.draining:
            return
        self.draining = True
        log.info("cpgraph serve: draining %d request(s) in flight", self._in_flight)
        deadline = time.monotonic() + self.drain_timeout
        while (self._in_flight or self.engine.has_work()) and time.monotonic() < deadline and not self.failed:
            await asyncio.sleep(0.02)
        self._stop_engine.set()
        self.engine.wake()
        if self._engine_thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._engine_thread.join)
        if self._runner is not None:
            await self._runner.cleanup()
        self._done.set()

    async def _serve(self, install_signals: bool) -> None:
        await self.start()
        if install_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.shutdown()))
        self._started.set()
        await self._done.wait()

    def serve_forever(self, on_listening: Callable[[str], None] | None = None) -> int:
        """Run in the main thread until SIGTERM/SIGINT has drained the server (exit status 0), or the engine
        failed (1, after answering every request it held)."""
        async def main():
            task = asyncio.ensure_future(self._serve(install_signals=True))
            while not self._started.is_set() and not task.done():
                await asyncio.sleep(0.01)
            if on_listening is not None and self._started.is_set():
                on_listening(self.url)
            await task

        asyncio.run(main())
        return 0 if not self.failed else 1

    # ----------------------------------------------------- background (tests, embedding)
    def start_background(self, timeout: float = 60.0) -> "PrefillServer":
        """Serve from a background thread (no signal handlers); returns once listening."""
        def run():
            asyncio.run(self._serve(install_signals=False))

        self._thread = threading.Thread(target=run, name="cpgraph-http", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError("cpgraph serve: the server did not start listening")
        return self

    def stop(self, timeout: float = 120.0) -> None:
        """Drain and stop a :meth:`start_background` server."""
        if self._loop is None or self._thread is None:
            return
        asyncio.run_coroutine_threadsafe(self.shutdown(), self._loop).result(timeout)
        self._thread.join(timeout)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready:
            if self.failed:
                raise RuntimeError(f"cpgraph serve: the engine failed: {self.failed}")
            if time.monotonic() > deadline:
                raise TimeoutError("cpgraph serve: not ready in time")
            time.sleep(0.01)


def _use_engine_device(engine) -> None:
    """Make the engine's GPU this thread's current device: CUDA's current device is per thread (a new thread
    starts on device 0), and kernels launched on the current device -- Triton's, a CUDA graph's capture --
    must run on the one that holds the engine's tensors (a CP rank's own GPU)."""
    device = getattr(engine, "device", None)
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.set_device(device)


def _resolve(fut: asyncio.Future, result) -> None:
    if not fut.done():
        fut.set_result(result)
