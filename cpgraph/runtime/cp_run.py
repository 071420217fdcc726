"""Run a CP prefill on N ranks and compare it with the single-device reference.

``run_cp(spec)`` validates the request in the calling process
(:func:`cpgraph.runtime.inputs.check_request`), then spawns ``spec.cp``
processes (gloo on CPU, NCCL with one rank per GPU for ``device="cuda"``).
Every rank loads the same model, compiles it once with the CP passes
(:func:`cpgraph.passes.compile`), and runs the prefill engine as its rank;
rank 0 also runs the single-device eager reference.  The result holds the CP
logits (checked identical on every rank), the reference logits, each rank's
KV and weight bytes, and which provider computed each cpgraph op of the CP
forward.  Text prompts are encoded here, in the parent
(:func:`~cpgraph.runtime.inputs.resolve_prompts`); ranks are handed ids.

Ranks report their phases (loading, compiling, timed run, reference,
comparing) through the result queue as they enter them, so a caller can show
progress during a compile that takes minutes.  A failure while a rank reads
its input (the checkpoint, the KV layout it asks for) comes back as an
:class:`~cpgraph.runtime.inputs.InputError`; any later failure is a
``RuntimeError`` carrying the rank's traceback.
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_mod
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .inputs import InputError, check_request, check_weights, model_config, one_line, resolve_prompts


@dataclass
class CPRunSpec:
    model: str
    prompts: list
    prefix_lens: list
    cp: int = 2
    device: str = "cpu"
    kv_format: str = "bf16"
    dtype: str | None = None
    weights: str | None = None  # from_pretrained's weights: None / "dequantize", or "fp8" (FP8 checkpoints)
    backend: str = "inductor"
    page_size: int = 16
    cache: bool = False  # run the prompts twice through the radix cache (CacheEngine)
    evict: bool = False  # with cache: evict L1 to the L2 host pool between the passes
    host_layout: str = "layer_page_first"
    write_policy: str = "write_through"
    l3: str | None = None  # with cache: the L3 page store spec (every rank opens its own; docs/cache.md)
    log_level: int | None = None  # logging level for the cpgraph logger in each rank (None: leave as is)
    draft: bool = False  # also run the MTP draft layer (a second compiled graph) after the target
    deterministic: bool = False  # CPConfig(deterministic=True); the eager reference runs in the mode too
    cuda_graphs: bool = False  # with cache: each pass in a graph bucket (CUDA: captured and replayed; CPU: padded)


@dataclass
class CPRunResult:
    logits: torch.Tensor  # fp32 [B, vocab] from the CP run
    reference: torch.Tensor  # fp32 [B, vocab] single-device eager run
    kv_bytes_per_rank: list[int]
    pages_per_rank: list[int]
    replicated_bytes: int  # what each rank would hold with a replicated cache
    seconds: float  # the timed run on rank 0 (compile excluded: the second run, or the warm cache pass)
    compile_seconds: float
    ranks_agree: bool
    tokens_computed: int = 0  # tokens the timed run computed (prefix + extend passes, or the cache misses)
    tokens_cached: int = 0  # tokens the timed run took from the prefix cache (only with spec.cache)
    notes: list[str] = field(default_factory=list)
    cache: dict | None = None  # with spec.cache: run_twice's summary (second-pass logits, hits per level)
    weight_bytes_per_rank: list[int] = field(default_factory=list)  # parameters + buffers each rank's model holds
    providers: dict[str, str] = field(default_factory=dict)  # op -> what computed it in rank 0's CP forward
    # op -> [{"implementation", "calls", "reason"}]: rank 0's compile run and timed run (cpgraph.ops.ledger)
    provider_calls: dict[str, list] = field(default_factory=dict)
    draft_logits: torch.Tensor | None = None  # fp32 [B, vocab]: the CP draft's (with spec.draft)
    draft_reference: torch.Tensor | None = None  # fp32 [B, vocab]: the single-device eager draft's
    sampled: list[int] | None = None  # the target token each draft was given (the CP target's greedy token)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, spec: CPRunSpec, port: int, queue) -> None:
    def report(msg: str, every_rank: bool = False) -> None:
        if rank == 0 or every_rank:
            queue.put(("phase", rank, msg))

    reading_input = False  # True while the rank reads what the user named (checkpoint, KV format)
    try:
        if spec.log_level is not None:  # a spawned process starts with logging unconfigured
            import logging

            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(f"%(name)s (rank {rank}): %(levelname)s: %(message)s"))
            logging.getLogger("cpgraph").addHandler(handler)
            logging.getLogger("cpgraph").setLevel(spec.log_level)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        cuda = spec.device == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        report(f"started; joining the {'NCCL' if cuda else 'gloo'} group", every_rank=True)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=spec.cp)
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // spec.cp))
        from cpgraph.models import from_pretrained
        from cpgraph.models.prefill import make_layout
        from cpgraph.passes import CPConfig, compile
        from cpgraph.runtime.engine import run_prefill

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}[spec.dtype]
        t0 = time.perf_counter()
        report(f"loading {spec.model}")
        reading_input = True
        model = from_pretrained(spec.model, dtype=dtype, weights=spec.weights, draft=spec.draft)
        layout = make_layout(model, spec.kv_format, spec.page_size)
        reading_input = False
        report(f"loaded in {time.perf_counter() - t0:.1f} s")
        if cuda:
            model = model.to(f"cuda:{rank}")
        model.eval()
        model.kv_layout = layout
        cp_cfg = CPConfig(group=dist.group.WORLD, cp_size=spec.cp, deterministic=spec.deterministic)
        compiled = compile(model, cp_cfg, backend=spec.backend, dynamic=True)

        def forward(ids, meta, mla, index, **kw):
            return compiled(ids, meta, mla, index, **kw)

        kw = dict(prefix_lens=spec.prefix_lens, kv_format=spec.kv_format, page_size=spec.page_size,
                  rank=rank, cp_size=spec.cp)
        if spec.draft:  # the draft is a graph of its own (docs/mtp.md), compiled with the same passes
            kw["draft"] = compile(model.draft_module(), cp_cfg, backend=spec.backend, dynamic=True)
        cache = None
        if spec.cache:
            cache, res, compile_s, seconds = _cached_runs(spec, forward, model, rank, cuda, report)
            computed = cache["hits"][1]["computed"]
            cached = cache["hits"][1]["device"] + cache["hits"][1]["host"] + cache["hits"][1].get("l3", 0)
        else:
            report(f"compiling ({spec.backend}) in the first run", every_rank=True)
            t0 = time.perf_counter()
            res = run_prefill(forward, model, spec.prompts, progress=lambda m: report(f"first run: {m}"), **kw)
            compile_s = time.perf_counter() - t0
            report(f"compiled and ran in {compile_s:.1f} s", every_rank=True)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = run_prefill(forward, model, spec.prompts, progress=lambda m: report(f"timed run: {m}"), **kw)
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            computed, cached = sum(len(p) for p in spec.prompts), 0
        logits = res.logits.float().cpu()
        from cpgraph.ops.providers import calls, selected
        from cpgraph.runtime.engine import weight_bytes_per_rank

        # Before the eager reference: the CP forward's calls only.
        providers, provider_calls = selected(model.device.type), calls(model.device.type)
        report("comparing logits across ranks")
        # Every rank must hold the same logits (the narrow gather hands every rank the owner's row).
        gathered = [torch.empty_like(logits) for _ in range(spec.cp)]
        dist.all_gather_object(gathered, logits)
        stats = [None] * spec.cp
        dist.all_gather_object(stats, (res.kv_bytes, res.pages_owned, weight_bytes_per_rank(model)))
        payload = None
        if rank == 0:
            from cpgraph.runtime.engine import run_prefill as reference_run

            def eager(ids, meta, mla, index, **k):
                return model(ids, meta, mla, index, **k)

            report("single-device eager reference")
            dkw = {}
            if spec.draft:  # the same target tokens as the CP run, so the drafts see the same inputs
                dkw = dict(draft=model.draft_module(), draft_tokens=res.sampled.tolist())
            from cpgraph.ops.invariant_mode import deterministic

            with deterministic() if spec.deterministic else contextlib.nullcontext():  # the draft's products too
                ref = reference_run(eager, model, spec.prompts, prefix_lens=spec.prefix_lens,
                                    kv_format=spec.kv_format, page_size=spec.page_size, **dkw)
            payload = CPRunResult(
                logits=logits,
                reference=ref.logits.float().cpu(),
                kv_bytes_per_rank=[s[0] for s in stats],
                pages_per_rank=[s[1] for s in stats],
                replicated_bytes=res.total_pages * res.bytes_per_page,
                seconds=seconds,
                compile_seconds=compile_s,
                ranks_agree=all(torch.equal(g, logits) for g in gathered),
                tokens_computed=computed,
                tokens_cached=cached,
                cache=cache,
                weight_bytes_per_rank=[s[2] for s in stats],
                providers=providers,
                provider_calls=provider_calls,
            )
            if spec.draft:
                payload.draft_logits = res.draft_logits.float().cpu().numpy()
                payload.draft_reference = ref.draft_logits.float().cpu().numpy()
                payload.sampled = res.sampled.tolist()
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            # Tensors would travel as shared-memory handles that die with this
            # process: send plain arrays.
            payload.logits, payload.reference = payload.logits.numpy(), payload.reference.numpy()
            if payload.cache is not None:
                payload.cache["second"] = payload.cache["second"].numpy()
            queue.put(("ok", rank, payload))
    except BaseException as exc:  # noqa: BLE001  (report, never hang the parent)
        user = reading_input and isinstance(exc, (ValueError, TypeError, OSError))
        queue.put(("error", rank, dict(type=type(exc).__name__, message=str(exc), user=user,
                                       traceback=traceback.format_exc())))
        if user:
            sys.exit(2)  # the parent prints the one-line message; no traceback from every rank
        raise


def _cached_runs(spec: CPRunSpec, forward, model, rank: int, cuda: bool, report: Callable[..., None]):
    """``--cache``: the prompts twice through one CacheEngine (optionally evicting to L2 in between).

    Returns ``(summary, first-pass result, first-pass seconds, second-pass seconds)``;
    the first pass includes compilation.
    """
    from cpgraph.runtime.cache_engine import CacheEngine, default_capacity
    from cpgraph.runtime.engine import EngineResult

    pages = default_capacity(spec.prompts, spec.page_size)
    if spec.cuda_graphs:  # every rank pads to the same bucket (the plan's lengths pick it) and replays its graph
        from cpgraph.runtime.graph_runner import graphed_forward

        forward = graphed_forward(forward, max_requests=len(spec.prompts), cp_size=spec.cp)
    engine = CacheEngine(forward, model, num_pages=pages, kv_format=spec.kv_format, page_size=spec.page_size,
                         rank=rank, cp_size=spec.cp, host_pages=pages if spec.evict or spec.l3 else 0,
                         host_layout=spec.host_layout, write_policy=spec.write_policy, group=dist.group.WORLD,
                         l3=spec.l3)
    if spec.cuda_graphs:
        from cpgraph.runtime.graph_runner import bind_pool_addresses

        bind_pool_addresses(engine.pools[0] + engine.pools[1])
    report(f"compiling ({spec.backend}) in the first (cold) cache pass", every_rank=True)
    t0 = time.perf_counter()
    first = engine.prefill(spec.prompts, progress=lambda m: report(f"cold pass: {m}"))
    if cuda:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    report(f"compiled and ran the cold pass in {first_s:.1f} s", every_rank=True)
    if spec.evict:
        report("evicting the device cache (L1) to the host pool (L2)")
    evicted = engine.evict_device() if spec.evict else 0
    report("second (warm) cache pass, timed (new shapes may recompile)")
    t0 = time.perf_counter()
    second = engine.prefill(spec.prompts, progress=lambda m: report(f"warm pass: {m}"))
    if cuda:
        torch.cuda.synchronize()
    second_s = time.perf_counter() - t0
    l3 = None
    if engine.l3 is not None:  # every rank stores its own pages; rank 0's figures are reported
        engine.flush_l3()
        l3 = {"store": engine.l3.store.name, "policy": engine.l3.write_policy, **engine.l3.stats,
              "store_stats": dict(engine.l3.store.stats)}
        engine.close()
    summary = {
        "second": second.logits.float().cpu(),
        "hits": [first.totals(), second.totals()],
        "evicted_pages": evicted,
        "load_misses": second.load_misses,
        "hicache": dict(engine.hicache.stats) if engine.hicache is not None else None,
        "l3": l3,
        "first_seconds": first_s,
        "second_seconds": second_s,
    }
    if spec.cuda_graphs:
        from cpgraph.runtime.graph_runner import graph_counts

        summary["graph_replays"], summary["graph_buckets"] = graph_counts(forward)
    bpp = engine.pool.bytes_per_page()
    owned = int(engine.device.ledger.used[rank])
    total = int(engine.device.ledger.used.sum())
    res = EngineResult(logits=first.logits, kv_bytes=owned * bpp, pages_owned=owned, total_pages=total,
                       bytes_per_page=bpp, pool_bytes=engine.pool.total_bytes())
    return summary, res, first_s, second_s


def _collect(procs, queue, timeout: float, progress, heartbeat: float | None):
    """Wait for rank 0's result, forwarding phase reports; returns ``(kind, rank, body)``.

    ``heartbeat``: seconds between "still waiting" lines naming each rank's
    current phase (for a terminal); ``None`` prints only phase changes.
    """
    start = time.monotonic()
    last_line = start
    phase = {r: "starting" for r in range(len(procs))}
    poll = min(1.0, heartbeat or 1.0)
    while True:
        try:
            kind, rank, body = queue.get(timeout=poll)
        except queue_mod.Empty:
            now = time.monotonic()
            if now - start > timeout:
                return "error", -1, dict(type="TimeoutError", message=f"no result within {timeout:.0f} s", user=False,
                                         traceback="")
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                try:  # a dying rank's last report may still be in flight
                    return queue.get(timeout=2.0)
                except queue_mod.Empty:
                    r, code = dead[0]
                    return "error", r, dict(type="ProcessExit", message=f"exited with status {code} without a report",
                                            user=False, traceback="")
            if heartbeat is not None and progress is not None and now - last_line >= heartbeat:
                progress(f"{now - start:5.0f} s  waiting: " + ", ".join(f"rank {r} {m}" for r, m in phase.items()))
                last_line = now
            continue
        if kind != "phase":
            return kind, rank, body
        phase[rank] = body
        if progress is not None:
            progress(f"{time.monotonic() - start:5.1f} s  rank {rank}: {body}")
            last_line = time.monotonic()


def _failure(rank: int, body: dict) -> Exception:
    """The exception for a rank's error report: InputError while it read its input, else RuntimeError."""
    if body["user"]:
        return InputError(one_line(body["message"]) or body["type"])
    return RuntimeError(f"CP run failed: rank {rank}: {body['type']}: {body['message']}\n{body['traceback']}")


def run_cp(spec: CPRunSpec, timeout: float = 900.0, progress: Callable[[str], None] | None = None,
           heartbeat: float | None = None) -> CPRunResult:
    """Spawn ``spec.cp`` ranks, run the CP prefill, return rank 0's comparison.

    The request is validated here first (no rank is spawned for a bad one).
    ``progress`` receives one line per rank phase; with ``heartbeat`` also a
    line every ``heartbeat`` seconds while no phase changes.
    """
    cfg = model_config(spec.model)
    check_weights(spec.model, spec.weights, cfg)
    if spec.draft and spec.cache:
        raise InputError("the MTP draft is not supported with the cache run")
    prompts, _ = resolve_prompts(spec.prompts, spec.model, cfg.vocab_size)
    req = check_request(prompts, spec.prefix_lens, vocab=cfg.vocab_size, page_size=spec.page_size,
                        cp=spec.cp, device=spec.device)
    spec.prompts, spec.prefix_lens = req.prompts, req.prefix_lens
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, spec, port, queue), daemon=True) for r in range(spec.cp)]
    for p in procs:
        p.start()
    kind = "error"
    try:
        kind, rank, body = _collect(procs, queue, timeout, progress, heartbeat)
    finally:
        for p in procs:
            if kind != "ok":
                p.terminate()  # a failed rank leaves the others blocked in a collective
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if kind != "ok":
        raise _failure(rank, body)
    payload = body
    payload.logits = torch.from_numpy(payload.logits)
    if payload.cache is not None:
        payload.cache["second"] = torch.from_numpy(payload.cache["second"])
    payload.reference = torch.from_numpy(payload.reference)
    if payload.draft_logits is not None:
        payload.draft_logits = torch.from_numpy(payload.draft_logits)
        payload.draft_reference = torch.from_numpy(payload.draft_reference)
    return payload
