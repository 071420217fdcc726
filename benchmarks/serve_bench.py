"""Load benchmark of ``cpgraph serve``: Poisson arrivals with shared prefixes, over real HTTP on loopback.

Trace (``--seed``): ``--shared`` of the requests (default 70%) start with one of ``--systems`` system
prompts (default 8, lengths uniform in ``--system-len``, default 1K-4K tokens) followed by a suffix
(``--suffix-len``, default 64-2K); the others are unrelated prompts of the same length distribution.
Token ids are random (the bundled and kernel-shaped models have no tokenizer).

The server runs in this process (:class:`cpgraph.serve.app.PrefillServer`, its engine thread and
aiohttp loop), warmed up as ``cpgraph serve`` is (:func:`cpgraph.serve.node.warm_up`: every compile
class, and with ``--cuda-graphs`` every bucket of the token budget); the load client is aiohttp in the
main thread.  Phases, each starting from an empty cache:

1. **idle overhead**: ``--idle`` rounds, one request at a time: a direct ``PrefillEngine.submit``
   + ``handle.wait`` from this thread, a ``POST /v1/completions`` through the aiohttp client and one
   through a lean keep-alive socket client (:class:`LeanClient`); each is timed against its own
   forward (``stats.step_seconds``) and the HTTP ones also against the engine's own submit-to-result
   time: medians of HTTP overhead (client time - engine time), scheduling overhead (engine time -
   forward) and their sum, per request and per client, next to each client's floor (the same body
   posted to a bare aiohttp server); and the unloaded TTFT (p50/p99 of the HTTP times; prompts of the
   trace's lengths, no cache hit); and, per client, the overhead *against direct calls*: the server's
   overhead minus the direct calls' scheduling (medians), i.e. what HTTP adds to an engine embedded in
   process, which pays admission, planning, sampling and the same two thread hand-offs; and against a
   stricter base, a caller that steps the engine itself (``submit(wake=False)`` + ``step()``: no
   hand-off at all).  The server takes its idle fast path (the step on the event loop) unless
   ``--engine-thread-only``;
2. **saturation**: a pass of the trace that is not reported (every shape the load forms seen once),
   then the trace all at once (burst) and closed-loop (``--concurrency`` clients, each sending its
   next request when answered): requests/s and computed tokens/s; the closed-loop rate is the
   saturation the rates below are fractions of;
3. **rates**: Poisson arrivals at ``--rates`` (fractions of the saturation rate, default 0.25 0.5
   0.8 1.0 1.2): TTFT p50/p99/max (arrival -> response, client side), offered vs served requests/s
   and how long the server drained after the last arrival (a server that falls behind shows here),
   throughput, cache-hit ratio (cached / prompt tokens from the responses), forward time per step
   (p99 and max) and cold steps (compiled or captured under load; 0 after a complete warm-up),
   graph-replay share (steps that replayed a captured CUDA graph, from ``/metrics``).  With
   ``--rate-seeds N`` each rate runs over N Poisson draws (an empty cache each): the p99 of one draw of
   ~100 requests is about its largest TTFT or two, so the 0.8 x ratio is also given over the pooled
   TTFTs of all draws and per draw (median, p10-p90).

4. **queueing model** (~a second, plus 12 direct forwards): the step time is fitted as
   ``a + b * tokens`` from the fastest of three direct forwards at each of four prompt lengths (a busy
   machine only ever slows a forward down), and the same trace and Poisson arrivals (at 0.8 of the modelled saturation)
   are replayed through the real :class:`~cpgraph.runtime.scheduler.Scheduler` under that cost, and
   through an ideal FIFO server (no steps, no overhead), at the same rate and at 0.8 of its own capacity (the
   queueing floor of the target's reading for this trace).  What the model cannot reach no scheduling
   can on this hardware; what the run loses beyond the model is server overhead and contention.
   ``--model-cost FIXED_MS PER_TOKEN_MS`` runs this phase alone under a given fit (no model, no server).

Targets from the issue: overhead <= 1 ms per request at idle; at 0.8 of saturation p99 TTFT <= 3x
the unloaded TTFT; on a GPU with ``--cuda-graphs``, >= 90% of steady-state steps replay a graph.
Each phase prints the machine's load average: on a shared machine wall-clock figures include
waiting for a core.

    python benchmarks/serve_bench.py --device cpu --model tiny --system-len 64 256 --suffix-len 8 128 \\
        --requests 64 --token-budget 512                                      # CPU check (minutes)
    python benchmarks/serve_bench.py --device cuda --model kernel --backend inductor --cuda-graphs \\
        --page 64 --num-pages 8192 --token-budget 8192 --requests 256 --out serve_h200.json   # one H200
    python benchmarks/serve_bench.py --device cuda --model production --backend inductor --cuda-graphs \
        --page 64 --num-pages 4096 --token-budget 8192 --requests 128 --out serve_h200_v32.json   # V3.2 layers
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build_trace(args, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    lo, hi = args.system_len
    systems = [rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(args.systems)]
    out = []
    for _ in range(args.requests):
        suffix = rng.integers(0, vocab, int(rng.integers(args.suffix_len[0], args.suffix_len[1] + 1))).tolist()
        if rng.random() < args.shared:
            out.append(systems[int(rng.integers(len(systems)))] + suffix)
        else:
            out.append(rng.integers(0, vocab, int(rng.integers(lo, hi + 1)) + len(suffix)).tolist())
    return out


def build_server(args):
    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout
    from cpgraph.runtime.scheduler import SchedulerConfig
    from cpgraph.serve.app import PrefillServer
    from cpgraph.serve.node import ServeSpec, build_engine, make_forward

    if args.model == "tiny":
        model = from_pretrained("tiny-glm5", device=args.device).eval()
    elif args.model == "production":
        # Two DeepSeek-V3.2 layers at the released sizes (one dense, one MoE with 256 experts), random weights
        # drawn on the device: the stack of benchmarks/production_shape.py (tiny sizes on CPU).
        from production_shape import bench_config, build_random_model

        model = build_random_model(bench_config("v32", 2, tiny=args.device == "cpu"), args.device)
    else:
        from cuda_graph_bench import kernel_shaped_model

        model = kernel_shaped_model(args.device)
    model.kv_layout = make_layout(model, "bf16", args.page)
    spec = ServeSpec(model="bench", backend=args.backend, page_size=args.page, num_pages=args.num_pages,
                     token_budget=args.token_budget, max_batch_requests=args.max_batch_requests,
                     max_queue=max(1024, 2 * args.requests), cuda_graphs=args.cuda_graphs, request_timeout=None,
                     derive_kv_bucket=not args.own_kv_buckets)
    engine = build_engine(model, make_forward(model, spec), spec)
    from dataclasses import replace

    engine.scheduler.config = replace(engine.scheduler.config, defer_shared_tokens=args.defer_tokens)
    assert isinstance(engine.scheduler.config, SchedulerConfig)
    from cpgraph.serve.node import warm_up

    # What `cpgraph serve` runs before /health turns 200: every compile class and (--cuda-graphs) every bucket.
    prefix = args.warmup_prefix_tokens if args.warmup_prefix_tokens >= 0 else None
    t0 = time.perf_counter()
    server = PrefillServer(engine, served=("bench",), warmup=lambda: warm_up(engine, 64, prefix),
                           idle_steps_on_loop=not args.engine_thread_only).start_background()
    server.wait_ready(3600)
    server.warmup_s = time.perf_counter() - t0
    return server


def _pct(values, q):
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


async def _post(session, url, tokens):
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json={"prompt": tokens, "max_tokens": 1}) as resp:
        body = await resp.json()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {body}")
    return time.perf_counter() - t0, body


async def _metrics(session, url) -> dict:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("cpgraph_steps_total{"):
            out[line.split('"')[1]] = float(line.split()[-1])
    return out


class LeanClient:
    """A minimal keep-alive HTTP/1.1 client on one blocking socket: what a round trip costs without a client
    library (request line, three headers, ``Content-Length`` body; the response's status, headers and body)."""

    def __init__(self, url: str):
        import socket
        from urllib.parse import urlsplit

        u = urlsplit(url)
        self.host, self.port, self.path = u.hostname, u.port, u.path
        self.sock = socket.create_connection((self.host, self.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.head = f"Host: {self.host}:{self.port}\r\nContent-Type: application/json\r\n".encode()

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.sock.sendall(b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s" % (path.encode(), self.head,
                                                                                   len(data), data))
        while b"\r\n\r\n" not in self.buf:
            self._recv()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next(int(v) for k, _, v in (ln.partition(b":") for ln in lines[1:]) if k.lower() == b"content-length")
        while len(self.buf) < length:
            self._recv()
        out, self.buf = self.buf[:length], self.buf[length:]
        return status, json.loads(out)

    def _recv(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk

    def close(self) -> None:
        self.sock.close()


def lean_client_main(url: str, echo: str) -> None:
    """``--lean-client``: the lean client in a process of its own (a remote client does not share the server's
    GIL).  Reads prompts (JSON list) from stdin; per prompt, after an idle pause: one completion, the same body to
    the bare server at once, and again around a wait as long as the engine's time; prints the times as JSON."""
    prompts = json.loads(sys.stdin.read())
    server, bare, out = LeanClient(url), LeanClient(echo), []
    engine_s = 0.0
    for p in prompts:
        time.sleep(0.002 + engine_s)  # idle: past the last request's step (the server's settled rule)
        t0 = time.perf_counter()
        status, body = server.post("/v1/completions", {"prompt": p, "max_tokens": 1})
        dt = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body}")
        pre = body["choices"][0]["prefill"]
        engine_s = pre["timings_ms"]["total"] / 1e3
        t0 = time.perf_counter()
        bare.post("/echo", {"prompt": p, "max_tokens": 1})
        floor = time.perf_counter() - t0
        time.sleep(0.002)
        t0 = time.perf_counter()
        bare.post("/echo", {"prompt": p, "max_tokens": 1, "wait_s": engine_s})
        out.append({"total": dt, "engine": engine_s, "chunks": pre["chunks"], "floor": floor,
                    "handoff_floor": time.perf_counter() - t0 - engine_s})
    server.close()
    bare.close()
    print(json.dumps(out))


def _remote_lean(server, echo: str, prompts) -> list[dict]:
    """Run :func:`lean_client_main` in a subprocess; each request's forward from the engine's step log (at idle a
    step holds one request: request k's steps are the next ``chunks`` entries)."""
    import subprocess

    eng = server.engine
    eng.step_log.clear()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--lean-client", server.url, echo],
                          input=json.dumps(prompts), capture_output=True, text=True, check=False,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode:
        raise RuntimeError(f"the lean client process failed:\n{proc.stderr[-4000:]}")
    rows, steps = json.loads(proc.stdout), list(eng.step_log)
    k = 0
    for r in rows:
        r["forward"] = sum(f for f, _, _, _ in steps[k:k + r["chunks"]])
        k += r["chunks"]
    return rows


def start_echo_server() -> str:
    """A bare aiohttp app on a loop thread of its own, as the server's: its round trip is the HTTP floor.

    With ``"wait_s"`` in the body the handler first awaits a worker thread that sleeps that long (the
    server's shape: a future resolved from another thread after the forward), so the round trip minus
    ``wait_s`` is the floor of the same hand-off, the loop thread's wake-ups after an idle wait included.
    """
    import threading

    from aiohttp import web

    async def echo(request):
        body = await request.json()
        if body.get("wait_s"):
            await asyncio.get_running_loop().run_in_executor(None, time.sleep, body["wait_s"])
        return web.json_response({"tokens": len(body["prompt"])})

    box, ready = {}, threading.Event()

    def serve():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/echo", echo)
        runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        box["url"] = f"http://127.0.0.1:{runner.addresses[0][1]}/echo"
        ready.set()
        loop.run_forever()

    threading.Thread(target=serve, name="echo-http", daemon=True).start()
    ready.wait(30)
    return box["url"]


def idle_overhead(server, trace, n: int) -> dict:
    """Per request at idle, each request timed against its own forward (same run, no pairing noise).

    Direct calls: ``submit`` + ``wait`` from this thread minus the forward time of the step(s) that ran
    it = scheduling + the hand-off to and from the engine thread.  HTTP, through each client (aiohttp,
    and :class:`LeanClient`: a keep-alive socket with no client library): the client's time minus the
    engine's own submit-to-result time of the request (its ``timings.total``) = HTTP, JSON and the
    event loop; plus that engine time minus the forward = scheduling.  The floor, per client: the same
    body posted to a bare aiohttp handler (its own loop thread, as the server's) -- what the client and
    server stacks cost before cpgraph does anything.
    """
    import aiohttp

    from cpgraph.runtime.prefill_engine import engine_request

    eng = server.engine
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, eng.vocab, len(trace[i % len(trace)])).tolist() for i in range(3 * n)]
    own_steps = [rng.integers(0, eng.vocab, len(trace[i % len(trace)])).tolist() for i in range(n)]
    keys = ("direct_sched", "aiohttp_http", "aiohttp_sched", "aiohttp_total", "lean_http", "lean_sched", "lean_total",
            "forward", "aiohttp_floor", "lean_floor", "aiohttp_handoff_floor", "lean_handoff_floor", "remote_total",
            "remote_http", "remote_sched", "remote_floor", "remote_handoff_floor", "direct_handoff", "direct_queue",
            "direct_in_step", "caller_steps_sched")
    v = {k: [] for k in keys}
    echo = start_echo_server()
    # Each prompt length once first (compiles, CUDA-graph captures of its buckets), then an empty
    # cache: the phase measures the steady state, not the first use of a shape.
    for length in sorted({len(p) for p in prompts}):
        eng.submit(engine_request(rng.integers(0, eng.vocab, length).tolist())).wait()
    eng.reset_cache()
    lean, lean_echo = LeanClient(server.url), LeanClient(echo)

    def rest():
        """Idle before a request: 2 ms, and at least as long as the last step took (``engine.settled()``: the
        engine thread has finished that step and its bookkeeping, and the server takes its idle fast path)."""
        time.sleep(0.002)
        while not eng.settled():
            time.sleep(0.0005)

    def account(kind, dt, body, fwd):
        engine_s = body["choices"][0]["prefill"]["timings_ms"]["total"] / 1e3
        v[f"{kind}_total"].append(dt)
        v[f"{kind}_http"].append(dt - engine_s)
        v[f"{kind}_sched"].append(engine_s - fwd)
        v["forward"].append(fwd)

    async def run():
        async with aiohttp.ClientSession() as s:
            for i in range(n):  # distinct prompts: every request computes its whole prompt
                rest()
                f0 = eng.stats.step_seconds
                t0 = time.perf_counter()
                handle = eng.submit(engine_request(prompts[3 * i]))
                handle.wait()
                dt = time.perf_counter() - t0
                v["direct_sched"].append(dt - (eng.stats.step_seconds - f0))
                t = handle.result.timings  # where it went: the engine's own clock of the request
                v["direct_handoff"].append(dt - t["total"])
                v["direct_queue"].append(t["queue"])
                v["direct_in_step"].append(t["prefill"] - t["forward"])
                rest()
                # The in-process API's other form: the caller steps the engine itself (no thread hand-off).
                f0 = eng.stats.step_seconds
                t0 = time.perf_counter()
                handle = eng.submit(engine_request(own_steps[i]), wake=False)
                while not handle.done():
                    eng.step()
                v["caller_steps_sched"].append(time.perf_counter() - t0 - (eng.stats.step_seconds - f0))
                eng.sync()  # its radix commit, outside the timing (the engine thread's path commits while idle)
                rest()
                f0 = eng.stats.step_seconds
                dt, body = await _post(s, server.url, prompts[3 * i + 1])
                account("aiohttp", dt, body, eng.stats.step_seconds - f0)
                rest()
                f0 = eng.stats.step_seconds
                t0 = time.perf_counter()
                status, body = lean.post("/v1/completions", {"prompt": prompts[3 * i + 2], "max_tokens": 1})
                dt = time.perf_counter() - t0
                if status != 200:
                    raise RuntimeError(f"HTTP {status}: {body}")
                account("lean", dt, body, eng.stats.step_seconds - f0)
                t0 = time.perf_counter()
                async with s.post(echo, json={"prompt": prompts[3 * i + 1], "max_tokens": 1}) as resp:
                    await resp.json()
                v["aiohttp_floor"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                lean_echo.post("/echo", {"prompt": prompts[3 * i + 2], "max_tokens": 1})
                v["lean_floor"].append(time.perf_counter() - t0)
                wait = v["forward"][-1]  # the same hand-off after an idle wait, around a sleep as long as the forward
                rest()
                t0 = time.perf_counter()
                async with s.post(echo, json={"prompt": prompts[3 * i + 1], "max_tokens": 1, "wait_s": wait}) as resp:
                    await resp.json()
                v["aiohttp_handoff_floor"].append(time.perf_counter() - t0 - wait)
                rest()
                t0 = time.perf_counter()
                lean_echo.post("/echo", {"prompt": prompts[3 * i + 2], "max_tokens": 1, "wait_s": wait})
                v["lean_handoff_floor"].append(time.perf_counter() - t0 - wait)

    try:
        asyncio.run(run())
    finally:
        lean.close()
        lean_echo.close()
    for r in _remote_lean(server, echo, [prompts[3 * i + 2] for i in range(n)]):
        v["remote_total"].append(r["total"])
        v["remote_http"].append(r["total"] - r["engine"])
        v["remote_sched"].append(r["engine"] - r["forward"])
        v["remote_floor"].append(r["floor"])
        v["remote_handoff_floor"].append(r["handoff_floor"])
    med = lambda x: 1e3 * statistics.median(x)  # noqa: E731
    out = {"requests": n, "prompt_tokens": [len(prompts[3 * i + 1]) for i in range(n)],
           "forward_ms": [1e3 * f for f in v["forward"]], "forward_ms_p50": med(v["forward"]),
           "direct_scheduling_overhead_ms_p50": med(v["direct_sched"]),
           "caller_steps_scheduling_overhead_ms_p50": med(v["caller_steps_sched"]),
           # The direct calls' scheduling, split by the engine's own timings of each request: the caller's
           # submit and wake-up outside the engine, submit -> admitted (the engine thread's wake-up and the
           # admission), and admitted -> answer less the forward (planning, sampling, the result).
           "direct_split_ms_p50": {"handoff": med(v["direct_handoff"]), "queue": med(v["direct_queue"]),
                                   "in_step": med(v["direct_in_step"])}}
    for kind in ("aiohttp", "lean", "remote"):
        http, sched = v[f"{kind}_http"], v[f"{kind}_sched"]
        out[kind] = {"http_overhead_ms_p50": med(http), "scheduling_overhead_ms_p50": med(sched),
                     "server_overhead_ms_p50": med([a + b for a, b in zip(http, sched)]),
                     "http_floor_ms_p50": med(v[f"{kind}_floor"]),
                     "http_above_floor_ms_p50": med(http) - med(v[f"{kind}_floor"]),
                     "handoff_floor_ms_p50": med(v[f"{kind}_handoff_floor"]),
                     "server_above_handoff_floor_ms_p50": med([a + b for a, b in zip(http, sched)])
                     - med(v[f"{kind}_handoff_floor"]),
                     # What serving over HTTP adds to an in-process PrefillEngine call (both pay admission,
                     # planning, sampling and the two thread hand-offs; forwards taken out).
                     "overhead_vs_direct_ms_p50": med([a + b for a, b in zip(http, sched)]) - med(v["direct_sched"]),
                     # ... and against a caller that steps the engine itself: no hand-off at all (a stricter base).
                     "overhead_vs_caller_steps_ms_p50": med([a + b for a, b in zip(http, sched)])
                     - med(v["caller_steps_sched"]),
                     "unloaded_ttft_ms_p50": 1e3 * _pct(v[f"{kind}_total"], 50),
                     "unloaded_ttft_ms_p99": 1e3 * _pct(v[f"{kind}_total"], 99)}
    # The headline figures: aiohttp client (what the rate phases use), as before.
    a = out["aiohttp"]
    out.update({k: a[k] for k in ("http_overhead_ms_p50", "scheduling_overhead_ms_p50", "server_overhead_ms_p50",
                                  "http_floor_ms_p50", "unloaded_ttft_ms_p50", "unloaded_ttft_ms_p99")})
    return out


def _steps(eng) -> dict:
    """The forward time of the steps since the engine's last counter reset: p50 / p99 / max, and cold steps."""
    fw = [1e3 * f for f, _, _, _ in list(eng.step_log)]
    return {"steps_total": len(fw), "step_ms_p50": _pct(fw, 50), "step_ms_p99": _pct(fw, 99),
            "step_ms_max": max(fw) if fw else float("nan"), "cold_steps": eng.cold_steps}


def load(server, trace, rate: float | None, seed: int, concurrency: int | None = None) -> dict:
    """Send the trace: Poisson at ``rate`` req/s (open loop), or closed loop with ``concurrency`` clients
    each sending its next request when the last one is answered (``rate`` None), or all at once (both
    None); TTFT, offered and served rates, throughput, step times."""
    import aiohttp

    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(trace)) if rate is None else rng.exponential(1.0 / rate, len(trace))
    arrivals = np.cumsum(gaps)
    ttft, bodies, done_at = [], [], []

    async def one(s, t_arrive, tokens, start):
        await asyncio.sleep(max(0.0, start + t_arrive - time.perf_counter()))
        t0 = time.perf_counter()
        dt, body = await _post(s, server.url, tokens)
        ttft.append(dt + (t0 - (start + t_arrive)))  # from the scheduled arrival (a late send counts)
        bodies.append(body)
        done_at.append(time.perf_counter() - start)

    async def worker(s, queue):
        while queue:
            tokens = queue.pop()
            dt, body = await _post(s, server.url, tokens)
            ttft.append(dt)
            bodies.append(body)

    async def run():
        conn = aiohttp.TCPConnector(limit=0)  # no client-side queue: every request is on the wire at once
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), connector=conn) as s:
            m0 = await _metrics(s, server.url)
            start = time.perf_counter()
            if rate is None and concurrency:
                queue = list(reversed(trace))
                await asyncio.gather(*(worker(s, queue) for _ in range(concurrency)))
            else:
                await asyncio.gather(*(one(s, t, p, start) for t, p in zip(arrivals, trace)))
            wall = time.perf_counter() - start
            m1 = await _metrics(s, server.url)
        return wall, m0, m1

    server.engine.reset_cache()
    wall, m0, m1 = asyncio.run(run())
    prompt = sum(b["usage"]["prompt_tokens"] for b in bodies)
    cached = sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)
    steps = {k: m1.get(k, 0) - m0.get(k, 0) for k in ("graph", "eager")}
    out = {"rate_rps": rate, "concurrency": concurrency, "requests": len(trace), "wall_s": wall,
           "throughput_rps": len(trace) / wall, "computed_tok_s": (prompt - cached) / wall,
           "prompt_tok_s": prompt / wall, "ttft_ms_p50": 1e3 * _pct(ttft, 50), "ttft_ms_p99": 1e3 * _pct(ttft, 99),
           "ttft_ms_max": 1e3 * max(ttft), "ttft_ms": [1e3 * t for t in ttft],
           "cache_hit_ratio": cached / max(prompt, 1), "steps": steps,
           "graph_replay_share": steps["graph"] / max(1, steps["graph"] + steps["eager"]), **_steps(server.engine)}
    if rate is not None:  # offered: the trace's own arrival rate; served: completions per second over the same span
        span = float(arrivals[-1])
        out["offered_rps"] = (len(trace) - 1) / span if span > 0 else float("inf")
        out["served_rps"] = (len(trace) - 1) / max(1e-9, max(done_at) - min(done_at))
        out["drain_s"] = max(done_at) - span  # past the last arrival: a server that fell behind drains long
    return out


def _computed_tokens(trace, page: int) -> np.ndarray:
    """Tokens each request computes with an unbounded radix cache: past the whole pages it shares with earlier ones."""
    seen, out = [], []
    for p in trace:
        arr = np.asarray(p)
        hit = 0
        for q in seen:
            n = min(arr.shape[0], q.shape[0])
            diff = np.flatnonzero(arr[:n] != q[:n])
            hit = max(hit, int(diff[0]) if diff.size else n)
        hit = min(hit // page * page, (arr.shape[0] - 1) // page * page)
        out.append(arr.shape[0] - hit)
        seen.append(arr)
    return np.asarray(out, dtype=np.float64)


def _robust_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """``(a, b)`` of ``y = a + b x`` by Theil-Sen (median pairwise slope): forwards slowed by a busy machine
    are outliers that a least-squares fit would follow."""
    i, j = np.triu_indices(x.shape[0], 1)
    keep = x[j] != x[i]
    b = float(np.median((y[j] - y[i])[keep] / (x[j] - x[i])[keep])) if keep.any() else float(np.median(y / x))
    b = max(b, 1e-9)
    return max(float(np.median(y - b * x)), 0.0), b


def step_cost(server, lens=(64, 128, 256, 512), repeats: int = 3) -> tuple[float, float]:
    """``(a ms, b ms/token)`` of one step, from the fastest of ``repeats`` direct forwards per prompt length."""
    from cpgraph.runtime.prefill_engine import engine_request

    eng = server.engine
    rng = np.random.default_rng(2)
    lens = [n for n in lens if n <= eng.max_prompt_tokens]
    best = []
    for n in lens:
        times = []
        for _ in range(repeats):
            f0 = eng.stats.step_seconds
            eng.submit(engine_request(rng.integers(0, eng.vocab, n).tolist())).wait()  # distinct: no cache hit
            times.append(1e3 * (eng.stats.step_seconds - f0))
        best.append(min(times))
    return _robust_line(np.asarray(lens, float), np.asarray(best, float))


def model_budgets(args) -> list[int]:
    """The token budgets the queueing model replays: ``--model-budgets``, or the run's budget with a quarter,
    a half and twice it beside the small ones (64-512), each at least a page."""
    if args.model_budgets:
        return sorted({b for b in args.model_budgets if b >= args.page})
    tb = args.token_budget
    return sorted({b for b in (64, 128, 256, 512, tb // 4, tb // 2, tb, 2 * tb) if b >= args.page})


def queueing_model(trace, cost: tuple[float, float], args, seeds: int = 20) -> dict:
    """The scheduler and an ideal FIFO server under the step cost ``(a, b)`` (module docstring, 4)."""
    from cpgraph.runtime.scheduler import Scheduler, SchedulerConfig, chunk_spans

    a, b = cost
    full = np.asarray([len(p) for p in trace], dtype=np.float64)
    comp = _computed_tokens(trace, args.page)
    page = args.page

    class Entry:
        def __init__(self, i):
            self.i, self.tokens_np = i, np.full(int(full[i]), i, dtype=np.int64)  # distinct: no deferral
            self.n, self.prefix_len = int(full[i]), int(full[i] - comp[i])
            self.done, self.next_chunk, self.starts, self.ends = self.prefix_len, 0, [], []

    def scheduled(arrivals, budget):
        sched = Scheduler(SchedulerConfig(token_budget=budget, defer_shared_tokens=0,
                                          max_batch_requests=args.max_batch_requests), page)

        def admit(e, left):
            spans = chunk_spans([(e.prefix_len, e.n)], left, sched.config.chunk_tokens, page)
            e.starts, e.ends = [x for x, _ in spans], [y for _, y in spans]
            return bool(spans)

        entries = [Entry(i) for i in range(len(trace))]
        t, k, ttft = 0.0, 0, {}
        while len(ttft) < len(entries):
            while k < len(entries) and arrivals[k] <= t:
                sched.enqueue(entries[k])
                k += 1
            batch = sched.next_step(admit)
            if not batch:
                t = arrivals[k]
                continue
            t += a + b * sum(end - st for _, st, end in batch)
            for e, _, end in batch:
                e.next_chunk += 1
                e.done = end if end == e.n else e.starts[e.next_chunk]
                if end == e.n:
                    sched.remove(e)
                    ttft[e.i] = t - arrivals[e.i]
        return np.asarray([ttft[i] for i in range(len(entries))]), t

    def fifo(arrivals):  # the device's per-token cost only: no steps, no fixed cost (a lower bound for any policy)
        free, out = 0.0, []
        for t, c in zip(arrivals, comp):
            free = max(t, free) + b * c
            out.append(free - t)
        return np.asarray(out)

    unloaded = float(np.percentile(a + b * full, 99))
    out = {"step_ms": {"fixed": a, "per_token": b}, "unloaded_ttft_ms_p99": unloaded, "budgets": {}}
    for budget in model_budgets(args):
        _, wall = scheduled(np.zeros(len(trace)), budget)
        rate = 0.8 * len(trace) / wall
        ratios = []
        for seed in range(seeds):
            gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(trace))
            ratios.append(float(np.percentile(scheduled(np.cumsum(gaps), budget)[0], 99)) / unloaded)
        out["budgets"][budget] = {"saturation_rps": len(trace) / wall * 1e3,
                                  "p99_over_unloaded_p50": float(np.median(ratios)),
                                  "p99_over_unloaded_p10": float(np.percentile(ratios, 10)),
                                  "p99_over_unloaded_p90": float(np.percentile(ratios, 90))}
    _, wall = scheduled(np.zeros(len(trace)), args.token_budget)
    rate = 0.8 * len(trace) / wall
    ideal = [float(np.percentile(fifo(np.cumsum(np.random.default_rng(s).exponential(1.0 / rate, len(trace)))), 99))
             / unloaded for s in range(seeds)]
    out["ideal_fifo_p99_over_unloaded_p50"] = float(np.median(ideal))
    # The same ideal server at 0.8 of ITS OWN capacity (1 / (b * mean computed tokens)): the queueing floor of the
    # target's reading (Poisson arrivals at 0.8 of saturation) for this trace, which no FIFO policy goes under.
    own = 0.8 / (b * float(comp.mean()))
    floor = [float(np.percentile(fifo(np.cumsum(np.random.default_rng(s).exponential(1.0 / own, len(trace)))), 99))
             / unloaded for s in range(seeds)]
    out["ideal_fifo_own_saturation_p99_over_unloaded_p50"] = float(np.median(floor))
    return out


def print_queueing_model(qm: dict, trace, fit: str = "given") -> None:
    per_budget = ", ".join(f"budget {k}: {v['p99_over_unloaded_p50']:.2f} ({v['p99_over_unloaded_p10']:.2f}-"
                           f"{v['p99_over_unloaded_p90']:.2f}), saturation {v['saturation_rps']:.2f} req/s"
                           for k, v in qm["budgets"].items())
    lens = [len(p) for p in trace]
    print(f"queueing model over {len(trace)} requests (prompt p50 {int(np.median(lens))} tokens; step = "
          f"{qm['step_ms']['fixed']:.2f} ms + {qm['step_ms']['per_token']:.4f} ms/token, {fit}; p99 TTFT at 0.8 x "
          f"saturation / unloaded p99, median of 20 arrival seeds (p10-p90)): ideal FIFO server "
          f"{qm['ideal_fifo_p99_over_unloaded_p50']:.2f} (at 0.8 of its own capacity: "
          f"{qm['ideal_fifo_own_saturation_p99_over_unloaded_p50']:.2f}); this scheduler: {per_budget}", flush=True)


def _load() -> str:
    return "load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "kernel", "production"), default="tiny",
                    help="tiny-glm5; the kernel-shaped model (hidden 2048, 8 experts); two DeepSeek-V3.2 layers at "
                         "the released sizes (random weights; tiny sizes on CPU)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--backend", choices=("eager", "aot_eager", "inductor"), default="eager")
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=4096)
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--max-batch-requests", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128, help="requests per load phase")
    ap.add_argument("--defer-tokens", type=int, default=64,
                    help="wait for an in-flight shared prefix of at least this many tokens (0: never wait)")
    ap.add_argument("--idle", type=int, default=20, help="requests of the idle-overhead phase")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="clients of the closed-loop saturation phase (default: twice the requests of a full step)")
    ap.add_argument("--engine-thread-only", action="store_true",
                    help="the server steps only on its engine thread (cpgraph serve --engine-thread-only): no idle "
                         "fast path, for the comparison")
    ap.add_argument("--own-kv-buckets", action="store_true",
                    help="--cuda-graphs: KV-view rows bucketed on their own (less padding, several buckets per row "
                         "and prefix bucket: many more to warm, so pair it with a small --warmup-prefix-tokens) "
                         "instead of derived from the row and prefix buckets")
    ap.add_argument("--warmup-prefix-tokens", type=int, default=-1,
                    help="--cuda-graphs: warm-up prepares every bucket up to this many cached-prefix rows per step "
                         "(default -1: the token budget)")
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--system-len", type=int, nargs=2, default=(1024, 4096))
    ap.add_argument("--suffix-len", type=int, nargs=2, default=(64, 2048))
    ap.add_argument("--shared", type=float, default=0.7)
    ap.add_argument("--rates", type=float, nargs="+", default=(0.25, 0.5, 0.8, 1.0, 1.2),
                    help="arrival rates as fractions of the measured saturation rate")
    ap.add_argument("--rate-seeds", type=int, default=1,
                    help="each rate phase this many times, over other Poisson arrival draws of the same rate: the "
                         "p99 of one phase is about its largest TTFT or two, so the 0.8 x ratio is also reported "
                         "over the pooled TTFTs and per draw (median, range)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the figures as JSON")
    ap.add_argument("--idle-only", action="store_true", help="the warm-up and the idle-overhead phase only")
    ap.add_argument("--model-cost", type=float, nargs=2, metavar=("FIXED_MS", "PER_TOKEN_MS"), default=None,
                    help="only the queueing model (4), under this step cost (a fit from another run's report, "
                         "'queueing_model.step_ms'): no model, no server, seconds on any machine")
    ap.add_argument("--model-budgets", type=int, nargs="+", default=None,
                    help="token budgets the queueing model replays (default: 64-512, and the run's budget with a "
                         "quarter, a half and twice it)")
    ap.add_argument("--lean-client", nargs=2, metavar=("URL", "ECHO_URL"), help=argparse.SUPPRESS)
    if "--lean-client" in sys.argv:  # the idle phase's out-of-process client (no model, no server)
        a = ap.parse_args()
        lean_client_main(*a.lean_client)
        return
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model_cost is not None:
        if min(args.model_cost) < 0 or max(args.model_cost) <= 0:
            ap.error(f"--model-cost takes FIXED_MS >= 0 and PER_TOKEN_MS >= 0, not both 0; got {args.model_cost}")
        trace = build_trace(args, 1 << 20)
        qm = queueing_model(trace, tuple(args.model_cost), args)
        print_queueing_model(qm, trace)
        if args.out:
            Path(args.out).write_text(json.dumps({"args": vars(args), "queueing_model": qm}, indent=1))
        return

    server = build_server(args)
    report = {"args": vars(args), "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    try:
        trace = build_trace(args, server.engine.vocab)
        lens = [len(p) for p in trace]
        print(f"trace: {len(trace)} requests, prompt tokens p50 {int(np.median(lens))} max {max(lens)}; "
              f"{args.shared:.0%} share one of {args.systems} system prompts", flush=True)
        server.engine.reset_cache()
        print(f"[{_load()}]", flush=True)
        report["warmup_s"] = server.warmup_s
        print(f"warm-up (node.warm_up, before /health is 200): {server.warmup_s:.1f} s", flush=True)
        report["idle"] = idle = idle_overhead(server, trace, args.idle)
        for kind, what in (("aiohttp", "aiohttp client"), ("lean", "lean keep-alive socket client"),
                           ("remote", "lean client in a process of its own")):
            k = idle[kind]
            print(f"idle, {what}: forward {idle['forward_ms_p50']:.2f} ms; overhead per request: HTTP "
                  f"{k['http_overhead_ms_p50']:.3f} ms + scheduling {k['scheduling_overhead_ms_p50']:.3f} ms = "
                  f"{k['server_overhead_ms_p50']:.3f} ms; a bare aiohttp server's round trip of the same body: "
                  f"{k['http_floor_ms_p50']:.3f} ms (HTTP above it: {k['http_above_floor_ms_p50']:.3f} ms), with "
                  f"the same thread hand-off around a forward-long wait: {k['handoff_floor_ms_p50']:.3f} ms (server "
                  f"overhead above it: {k['server_above_handoff_floor_ms_p50']:.3f} ms); "
                  f"unloaded TTFT p50 {k['unloaded_ttft_ms_p50']:.1f} ms p99 {k['unloaded_ttft_ms_p99']:.1f} ms; "
                  f"against direct engine calls: {k['overhead_vs_direct_ms_p50']:.3f} ms (against a caller stepping "
                  f"the engine itself: {k['overhead_vs_caller_steps_ms_p50']:.3f} ms)", flush=True)
        split = idle["direct_split_ms_p50"]
        print(f"idle, direct engine calls: scheduling {idle['direct_scheduling_overhead_ms_p50']:.3f} ms (medians: "
              f"caller's hand-off {split['handoff']:.3f}, queue {split['queue']:.3f}, in-step less the forward "
              f"{split['in_step']:.3f}); a caller stepping the engine itself: "
              f"{idle['caller_steps_scheduling_overhead_ms_p50']:.3f} ms", flush=True)
        if args.idle_only:
            return
        print(f"[{_load()}]", flush=True)
        # A pass of the whole trace first (not reported): every shape the load phases form has been seen once.
        warm = load(server, trace, None, args.seed)
        print(f"warm pass (burst, not reported): {warm['throughput_rps']:.2f} req/s, {warm['cold_steps']} cold "
              f"step(s) of {warm['steps_total']}", flush=True)
        report["burst"] = burst = load(server, trace, None, args.seed)
        mean_computed = max(1.0, burst["computed_tok_s"] * burst["wall_s"] / len(trace))
        conc = args.concurrency or max(2, min(len(trace), round(2 * args.token_budget / mean_computed)))
        report["saturation"] = sat = load(server, trace, None, args.seed, concurrency=conc)
        for name, r in (("burst (all at once)", burst), (f"closed loop ({conc} clients)", sat)):
            print(f"saturation, {name}: {r['throughput_rps']:.2f} req/s, {r['computed_tok_s']:.0f} computed tok/s, "
                  f"cache hit {r['cache_hit_ratio']:.2f}; {r['steps_total']} steps"
                  f" (forward p50 {r['step_ms_p50']:.1f} ms p99 {r['step_ms_p99']:.1f} ms max {r['step_ms_max']:.1f} "
                  f"ms, {r['cold_steps']} cold)", flush=True)
        report["rates"] = []
        for frac in args.rates:
            print(f"[{_load()}]", flush=True)
            draws = [load(server, trace, frac * sat["throughput_rps"], args.seed + 1 + k)
                     for k in range(max(1, args.rate_seeds))]
            r = draws[0]  # the line below is the first draw's; the pooled figures follow it
            r["fraction_of_saturation"] = frac
            if len(draws) > 1:
                r["draws"] = [{k: d[k] for k in ("ttft_ms", "ttft_ms_p50", "ttft_ms_p99", "ttft_ms_max", "throughput_rps",
                                                 "offered_rps", "served_rps", "cold_steps", "graph_replay_share")}
                              for d in draws]
                pooled = [t for d in draws for t in d["ttft_ms"]]
                r["pooled"] = {"requests": len(pooled), "ttft_ms_p50": _pct(pooled, 50),
                               "ttft_ms_p99": _pct(pooled, 99),
                               "graph_replay_share": float(np.mean([d["graph_replay_share"] for d in draws])),
                               "cold_steps": sum(d["cold_steps"] for d in draws)}
            report["rates"].append(r)
            print(f"rate {frac:.2f} x sat = {r['rate_rps']:.2f} req/s (offered {r['offered_rps']:.2f}, served "
                  f"{r['served_rps']:.2f}, drained {r['drain_s']:.2f} s after the last arrival): TTFT p50 "
                  f"{r['ttft_ms_p50']:.1f} ms p99 {r['ttft_ms_p99']:.1f} ms max {r['ttft_ms_max']:.1f} ms; "
                  f"{r['computed_tok_s']:.0f} computed tok/s; cache hit {r['cache_hit_ratio']:.2f}; {r['steps_total']} "
                  f"steps, forward p99 {r['step_ms_p99']:.1f} ms max {r['step_ms_max']:.1f} ms, {r['cold_steps']} "
                  f"cold; graph replays {r['graph_replay_share']:.0%}", flush=True)
            if "pooled" in r:
                p99s = [d["ttft_ms_p99"] for d in r["draws"]]
                print(f"rate {frac:.2f} x sat over {len(p99s)} arrival draws: pooled TTFT p50 "
                      f"{r['pooled']['ttft_ms_p50']:.1f} ms p99 {r['pooled']['ttft_ms_p99']:.1f} ms "
                      f"({r['pooled']['requests']} requests); per draw p99 median {np.median(p99s):.1f} ms "
                      f"({min(p99s):.1f}-{max(p99s):.1f}); served {min(d['served_rps'] for d in r['draws']):.2f}-"
                      f"{max(d['served_rps'] for d in r['draws']):.2f} req/s; {r['pooled']['cold_steps']} cold steps",
                      flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1))
        at80 = next((r for r in report["rates"] if abs(r["fraction_of_saturation"] - 0.8) < 1e-9), None)
        if at80 is not None:
            unloaded = idle["unloaded_ttft_ms_p99"]
            ratio = at80["ttft_ms_p99"] / unloaded
            report["p99_at_0.8_over_unloaded_p99"] = ratio
            print(f"p99 TTFT at 0.8 x saturation / unloaded p99 TTFT: {ratio:.2f} (target <= 3)")
            if "pooled" in at80:
                per = [d["ttft_ms_p99"] / unloaded for d in at80["draws"]]
                report["p99_at_0.8_over_unloaded_p99_pooled"] = pooled = at80["pooled"]["ttft_ms_p99"] / unloaded
                report["p99_at_0.8_over_unloaded_p99_per_draw"] = per
                print(f"... over {len(per)} arrival draws: pooled {pooled:.2f}; per draw median {np.median(per):.2f} "
                      f"(p10-p90 {np.percentile(per, 10):.2f}-{np.percentile(per, 90):.2f})", flush=True)
        server.engine.reset_cache()
        report["queueing_model"] = qm = queueing_model(trace, step_cost(server), args)
        print_queueing_model(qm, trace, "the fastest of 3 direct forwards per length")
    finally:
        server.stop()
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
