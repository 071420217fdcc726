"""Load benchmark of ``cpgraph serve``: Poisson arrivals with shared prefixes, over real HTTP on loopback.

Trace (``--seed``): ``--shared`` of the requests (default 70%) start with one of ``--systems`` system
prompts (default 8, lengths uniform in ``--system-len``, default 1K-4K tokens) followed by a suffix
(``--suffix-len``, default 64-2K); the others are unrelated prompts of the same length distribution.
Token ids are random (the bundled and kernel-shaped models have no tokenizer).

The server runs in this process (:class:`cpgraph.serve.app.PrefillServer`, its engine thread and
aiohttp loop), the client is aiohttp in the main thread.  Phases, each starting from an empty cache:

1. **idle overhead**: ``--idle`` pairs of requests one at a time: a direct ``PrefillEngine.submit``
   + ``handle.wait`` from this thread, then a ``POST /v1/completions``; each is timed against its
   own forward (``stats.step_seconds``) and the HTTP one also against the engine's own
   submit-to-result time: medians of HTTP overhead (client time - engine time), scheduling overhead
   (engine time - forward) and their sum, per request; and the unloaded TTFT (p50/p99 of the HTTP
   times; prompts of the trace's lengths, no cache hit);
2. **saturation**: all ``--requests`` at once (closed burst): requests/s and computed tokens/s;
3. **rates**: Poisson arrivals at ``--rates`` (fractions of the saturation rate, default 0.25 0.5
   0.8 1.0 1.2): TTFT p50/p99 (arrival -> response, client side), throughput, cache-hit ratio
   (cached / prompt tokens from the responses), graph-replay share (steps that replayed a captured
   CUDA graph, from ``/metrics``).

4. **queueing model** (~a second, plus 12 direct forwards): the step time is fitted as
   ``a + b * tokens`` from the fastest of three direct forwards at each of four prompt lengths (a busy
   machine only ever slows a forward down), and the same trace and Poisson arrivals (at 0.8 of the modelled saturation)
   are replayed through the real :class:`~cpgraph.runtime.scheduler.Scheduler` under that cost, and
   through an ideal FIFO server (no steps, no overhead).  What the model cannot reach no scheduling
   can on this hardware; what the run loses beyond the model is server overhead and contention.

Targets from the issue: overhead <= 1 ms per request at idle; at 0.8 of saturation p99 TTFT <= 3x
the unloaded TTFT; on a GPU with ``--cuda-graphs``, >= 90% of steady-state steps replay a graph.
Each phase prints the machine's load average: on a shared machine wall-clock figures include
waiting for a core.

    python benchmarks/serve_bench.py --device cpu --model tiny --system-len 64 256 --suffix-len 8 128 \\
        --requests 64 --token-budget 512                                      # CPU check (minutes)
    python benchmarks/serve_bench.py --device cuda --model kernel --backend inductor --cuda-graphs \\
        --page 64 --num-pages 8192 --token-budget 8192 --requests 256 --out serve_h200.json   # one H200
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
    else:
        from cuda_graph_bench import kernel_shaped_model

        model = kernel_shaped_model(args.device)
    model.kv_layout = make_layout(model, "bf16", args.page)
    spec = ServeSpec(model="bench", backend=args.backend, page_size=args.page, num_pages=args.num_pages,
                     token_budget=args.token_budget, max_batch_requests=args.max_batch_requests,
                     max_queue=max(1024, 2 * args.requests), cuda_graphs=args.cuda_graphs, request_timeout=None)
    engine = build_engine(model, make_forward(model, spec), spec)
    from dataclasses import replace

    engine.scheduler.config = replace(engine.scheduler.config, defer_shared_tokens=args.defer_tokens)
    assert isinstance(engine.scheduler.config, SchedulerConfig)
    server = PrefillServer(engine, served=("bench",)).start_background()
    server.wait_ready()
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


def start_echo_server() -> str:
    """A bare aiohttp app on a loop thread of its own, as the server's: its round trip is the HTTP floor."""
    import threading

    from aiohttp import web

    async def echo(request):
        body = await request.json()
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
    it = scheduling + the hand-off to and from the engine thread.  HTTP: the client's time minus the
    engine's own submit-to-result time of the request (its ``timings.total``) = HTTP, JSON and the
    event loop; plus that engine time minus the forward = scheduling.  The floor: the same body posted
    to a bare aiohttp handler (its own loop thread, as the server's) -- what the client and server
    stacks cost before cpgraph does anything.
    """
    import aiohttp

    from cpgraph.runtime.prefill_engine import engine_request

    eng = server.engine
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, eng.vocab, len(trace[i % len(trace)])).tolist() for i in range(2 * n)]
    direct_sched, http_only, http_sched, http_total, forward, floor = [], [], [], [], [], []
    echo = start_echo_server()
    # Each prompt length once first (compiles, CUDA-graph captures of its buckets), then an empty
    # cache: the phase measures the steady state, not the first use of a shape.
    for length in sorted({len(p) for p in prompts}):
        eng.submit(engine_request(rng.integers(0, eng.vocab, length).tolist())).wait()
    eng.reset_cache()

    async def run():
        async with aiohttp.ClientSession() as s:
            for i in range(n):  # distinct prompts: every request computes its whole prompt
                f0 = eng.stats.step_seconds
                t0 = time.perf_counter()
                eng.submit(engine_request(prompts[2 * i])).wait()
                direct_sched.append(time.perf_counter() - t0 - (eng.stats.step_seconds - f0))
                f0 = eng.stats.step_seconds
                dt, body = await _post(s, server.url, prompts[2 * i + 1])
                fwd = eng.stats.step_seconds - f0
                engine_s = body["choices"][0]["prefill"]["timings_ms"]["total"] / 1e3
                http_total.append(dt)
                forward.append(fwd)
                http_only.append(dt - engine_s)
                http_sched.append(engine_s - fwd)
                t0 = time.perf_counter()
                async with s.post(echo, json={"prompt": prompts[2 * i + 1], "max_tokens": 1}) as resp:
                    await resp.json()
                floor.append(time.perf_counter() - t0)

    asyncio.run(run())
    med = lambda v: 1e3 * statistics.median(v)  # noqa: E731
    return {"requests": n, "prompt_tokens": [len(prompts[2 * i + 1]) for i in range(n)],
            "forward_ms": [1e3 * f for f in forward], "forward_ms_p50": med(forward), "direct_scheduling_overhead_ms_p50": med(direct_sched),
            "http_overhead_ms_p50": med(http_only), "scheduling_overhead_ms_p50": med(http_sched),
            "http_floor_ms_p50": med(floor),
            "server_overhead_ms_p50": med([a + b for a, b in zip(http_only, http_sched)]),
            "unloaded_ttft_ms_p50": 1e3 * _pct(http_total, 50), "unloaded_ttft_ms_p99": 1e3 * _pct(http_total, 99)}


def load(server, trace, rate: float | None, seed: int) -> dict:
    """Send the trace (Poisson at ``rate`` req/s, or all at once when ``rate`` is None); TTFT and throughput."""
    import aiohttp

    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(trace)) if rate is None else rng.exponential(1.0 / rate, len(trace))
    arrivals = np.cumsum(gaps)
    ttft, bodies = [], []

    async def one(s, t_arrive, tokens, start):
        await asyncio.sleep(max(0.0, start + t_arrive - time.perf_counter()))
        t0 = time.perf_counter()
        dt, body = await _post(s, server.url, tokens)
        ttft.append(dt + (t0 - (start + t_arrive)))  # from the scheduled arrival (a late send counts)
        bodies.append(body)

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
            m0 = await _metrics(s, server.url)
            start = time.perf_counter()
            await asyncio.gather(*(one(s, t, p, start) for t, p in zip(arrivals, trace)))
            wall = time.perf_counter() - start
            m1 = await _metrics(s, server.url)
        return wall, m0, m1

    server.engine.reset_cache()
    wall, m0, m1 = asyncio.run(run())
    prompt = sum(b["usage"]["prompt_tokens"] for b in bodies)
    cached = sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)
    steps = {k: m1.get(k, 0) - m0.get(k, 0) for k in ("graph", "eager")}
    return {"rate_rps": rate, "requests": len(trace), "wall_s": wall, "throughput_rps": len(trace) / wall,
            "computed_tok_s": (prompt - cached) / wall, "prompt_tok_s": prompt / wall,
            "ttft_ms_p50": 1e3 * _pct(ttft, 50), "ttft_ms_p99": 1e3 * _pct(ttft, 99),
            "cache_hit_ratio": cached / max(prompt, 1), "steps": steps,
            "graph_replay_share": steps["graph"] / max(1, steps["graph"] + steps["eager"])}


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
    for budget in sorted({args.token_budget, 64, 128, 256, 512} - {0}):
        if budget < args.page:
            continue
        _, wall = scheduled(np.zeros(len(trace)), budget)
        rate = 0.8 * len(trace) / wall
        ratios = []
        for seed in range(seeds):
            gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(trace))
            ratios.append(float(np.percentile(scheduled(np.cumsum(gaps), budget)[0], 99)) / unloaded)
        out["budgets"][budget] = {"p99_over_unloaded_p50": float(np.median(ratios)),
                                  "p99_over_unloaded_p10": float(np.percentile(ratios, 10)),
                                  "p99_over_unloaded_p90": float(np.percentile(ratios, 90))}
    _, wall = scheduled(np.zeros(len(trace)), args.token_budget)
    rate = 0.8 * len(trace) / wall
    ideal = [float(np.percentile(fifo(np.cumsum(np.random.default_rng(s).exponential(1.0 / rate, len(trace)))), 99))
             / unloaded for s in range(seeds)]
    out["ideal_fifo_p99_over_unloaded_p50"] = float(np.median(ideal))
    return out


def _load() -> str:
    return "load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "kernel"), default="tiny")
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
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--system-len", type=int, nargs=2, default=(1024, 4096))
    ap.add_argument("--suffix-len", type=int, nargs=2, default=(64, 2048))
    ap.add_argument("--shared", type=float, default=0.7)
    ap.add_argument("--rates", type=float, nargs="+", default=(0.25, 0.5, 0.8, 1.0, 1.2),
                    help="arrival rates as fractions of the measured saturation rate")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the figures as JSON")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    server = build_server(args)
    report = {"args": vars(args), "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    try:
        trace = build_trace(args, server.engine.vocab)
        lens = [len(p) for p in trace]
        print(f"trace: {len(trace)} requests, prompt tokens p50 {int(np.median(lens))} max {max(lens)}; "
              f"{args.shared:.0%} share one of {args.systems} system prompts", flush=True)
        server.engine.reset_cache()
        print(f"[{_load()}]", flush=True)
        report["idle"] = idle = idle_overhead(server, trace, args.idle)
        print(f"idle: forward {idle['forward_ms_p50']:.2f} ms; overhead per request: HTTP "
              f"{idle['http_overhead_ms_p50']:.3f} ms + scheduling {idle['scheduling_overhead_ms_p50']:.3f} ms = "
              f"{idle['server_overhead_ms_p50']:.3f} ms (direct engine calls: scheduling "
              f"{idle['direct_scheduling_overhead_ms_p50']:.3f} ms; a bare aiohttp round trip of the same body: "
              f"{idle['http_floor_ms_p50']:.3f} ms); unloaded TTFT p50 "
              f"{idle['unloaded_ttft_ms_p50']:.1f} ms p99 {idle['unloaded_ttft_ms_p99']:.1f} ms", flush=True)
        print(f"[{_load()}]", flush=True)
        report["saturation"] = sat = load(server, trace, None, args.seed)
        print(f"saturation (burst): {sat['throughput_rps']:.2f} req/s, {sat['computed_tok_s']:.0f} computed tok/s, "
              f"cache hit {sat['cache_hit_ratio']:.2f}", flush=True)
        report["rates"] = []
        for frac in args.rates:
            print(f"[{_load()}]", flush=True)
            r = load(server, trace, frac * sat["throughput_rps"], args.seed + 1)
            r["fraction_of_saturation"] = frac
            report["rates"].append(r)
            print(f"rate {frac:.2f} x sat = {r['rate_rps']:.2f} req/s: TTFT p50 {r['ttft_ms_p50']:.1f} ms p99 "
                  f"{r['ttft_ms_p99']:.1f} ms; {r['throughput_rps']:.2f} req/s, {r['computed_tok_s']:.0f} computed "
                  f"tok/s; cache hit {r['cache_hit_ratio']:.2f}; graph replays {r['graph_replay_share']:.0%} of "
                  f"{int(sum(r['steps'].values()))} steps", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1))
        at80 = next((r for r in report["rates"] if abs(r["fraction_of_saturation"] - 0.8) < 1e-9), None)
        if at80 is not None:
            ratio = at80["ttft_ms_p99"] / idle["unloaded_ttft_ms_p99"]
            report["p99_at_0.8_over_unloaded_p99"] = ratio
            print(f"p99 TTFT at 0.8 x saturation / unloaded p99 TTFT: {ratio:.2f} (target <= 3)")
        server.engine.reset_cache()
        report["queueing_model"] = qm = queueing_model(trace, step_cost(server), args)
        per_budget = ", ".join(f"budget {k}: {v['p99_over_unloaded_p50']:.2f} ({v['p99_over_unloaded_p10']:.2f}-"
                               f"{v['p99_over_unloaded_p90']:.2f})" for k, v in qm["budgets"].items())
        print(f"queueing model (step = {qm['step_ms']['fixed']:.2f} ms + {qm['step_ms']['per_token']:.4f} ms/token, the "
              f"fastest of 3 direct forwards per length; p99 TTFT at 0.8 x saturation / unloaded p99, median of 20 arrival seeds (p10-p90)): "
              f"ideal FIFO server {qm['ideal_fifo_p99_over_unloaded_p50']:.2f}; this scheduler: {per_budget}")
    finally:
        server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
