"""Run a CP prefill on N ranks and compare it with the single-device reference.

``run_cp(spec)`` spawns ``spec.cp`` processes (gloo on CPU, NCCL with one rank
per GPU for ``device="cuda"``).  Every rank loads the same model, compiles it
once with the CP passes (:func:`cpgraph.passes.compile`), and runs the
prefill engine as its rank; rank 0 also runs the single-device eager
reference.  The result holds the CP logits (checked identical on every
rank), the reference logits, and each rank's KV bytes.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class CPRunSpec:
    model: str
    prompts: list
    prefix_lens: list
    cp: int = 2
    device: str = "cpu"
    kv_format: str = "bf16"
    dtype: str | None = None
    backend: str = "inductor"
    page_size: int = 16
    cache: bool = False  # run the prompts twice through the radix cache (CacheEngine)
    evict: bool = False  # with cache: evict L1 to the L2 host pool between the passes
    host_layout: str = "layer_page_first"
    write_policy: str = "write_through"


@dataclass
class CPRunResult:
    logits: torch.Tensor  # fp32 [B, vocab] from the CP run
    reference: torch.Tensor  # fp32 [B, vocab] single-device eager run
    kv_bytes_per_rank: list[int]
    pages_per_rank: list[int]
    replicated_bytes: int  # what each rank would hold with a replicated cache
    seconds: float  # CP extend+prefix time on rank 0, compile excluded (second run)
    compile_seconds: float
    ranks_agree: bool
    notes: list[str] = field(default_factory=list)
    cache: dict | None = None  # with spec.cache: run_twice's summary (second-pass logits, hits per level)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, spec: CPRunSpec, port: int, queue) -> None:
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        cuda = spec.device == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=spec.cp)
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // spec.cp))
        from cpgraph.models import from_pretrained
        from cpgraph.models.prefill import make_layout
        from cpgraph.passes import CPConfig, compile
        from cpgraph.runtime.engine import run_prefill

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}[spec.dtype]
        model = from_pretrained(spec.model, dtype=dtype)
        if cuda:
            model = model.to(f"cuda:{rank}")
        model.eval()
        model.kv_layout = make_layout(model, spec.kv_format, spec.page_size)
        compiled = compile(model, CPConfig(group=dist.group.WORLD, cp_size=spec.cp), backend=spec.backend, dynamic=True)

        def forward(ids, meta, mla, index, **kw):
            return compiled(ids, meta, mla, index, **kw)

        kw = dict(prefix_lens=spec.prefix_lens, kv_format=spec.kv_format, page_size=spec.page_size,
                  rank=rank, cp_size=spec.cp)
        cache = None
        if spec.cache:
            cache, res, compile_s, seconds = _cached_runs(spec, forward, model, rank, cuda)
        else:
            t0 = time.perf_counter()
            res = run_prefill(forward, model, spec.prompts, **kw)  # first run compiles
            compile_s = time.perf_counter() - t0
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = run_prefill(forward, model, spec.prompts, **kw)
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        logits = res.logits.float().cpu()
        # Every rank must hold the same logits (the narrow gather hands every rank the owner's row).
        gathered = [torch.empty_like(logits) for _ in range(spec.cp)]
        dist.all_gather_object(gathered, logits)
        stats = [None] * spec.cp
        dist.all_gather_object(stats, (res.kv_bytes, res.pages_owned))
        payload = None
        if rank == 0:
            from cpgraph.runtime.engine import run_prefill as reference_run

            def eager(ids, meta, mla, index, **k):
                return model(ids, meta, mla, index, **k)

            ref = reference_run(eager, model, spec.prompts, prefix_lens=spec.prefix_lens, kv_format=spec.kv_format,
                                page_size=spec.page_size)
            payload = CPRunResult(
                logits=logits,
                reference=ref.logits.float().cpu(),
                kv_bytes_per_rank=[s[0] for s in stats],
                pages_per_rank=[s[1] for s in stats],
                replicated_bytes=res.total_pages * res.bytes_per_page,
                seconds=seconds,
                compile_seconds=compile_s,
                ranks_agree=all(torch.equal(g, logits) for g in gathered),
                cache=cache,
            )
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            # Tensors would travel as shared-memory handles that die with this
            # process: send plain arrays.
            payload.logits, payload.reference = payload.logits.numpy(), payload.reference.numpy()
            if payload.cache is not None:
                payload.cache["second"] = payload.cache["second"].numpy()
            queue.put(("ok", payload))
    except BaseException as exc:  # noqa: BLE001  (report, never hang the parent)
        queue.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise


def _cached_runs(spec: CPRunSpec, forward, model, rank: int, cuda: bool):
    """``--cache``: the prompts twice through one CacheEngine (optionally evicting to L2 in between).

    Returns ``(summary, first-pass result, first-pass seconds, second-pass seconds)``;
    the first pass includes compilation.
    """
    from cpgraph.runtime.cache_engine import CacheEngine, default_capacity
    from cpgraph.runtime.engine import EngineResult

    pages = default_capacity(spec.prompts, spec.page_size)
    engine = CacheEngine(forward, model, num_pages=pages, kv_format=spec.kv_format, page_size=spec.page_size,
                         rank=rank, cp_size=spec.cp, host_pages=pages if spec.evict else 0,
                         host_layout=spec.host_layout, write_policy=spec.write_policy)
    t0 = time.perf_counter()
    first = engine.prefill(spec.prompts)
    if cuda:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    evicted = engine.evict_device() if spec.evict else 0
    t0 = time.perf_counter()
    second = engine.prefill(spec.prompts)
    if cuda:
        torch.cuda.synchronize()
    second_s = time.perf_counter() - t0
    summary = {
        "second": second.logits.float().cpu(),
        "hits": [first.totals(), second.totals()],
        "evicted_pages": evicted,
        "load_misses": second.load_misses,
        "hicache": dict(engine.hicache.stats) if engine.hicache is not None else None,
        "first_seconds": first_s,
        "second_seconds": second_s,
    }
    bpp = engine.pool.bytes_per_page()
    owned = int(engine.device.ledger.used[rank])
    total = int(engine.device.ledger.used.sum())
    res = EngineResult(logits=first.logits, kv_bytes=owned * bpp, pages_owned=owned, total_pages=total,
                       bytes_per_page=bpp, pool_bytes=engine.pool.total_bytes())
    return summary, res, first_s, second_s


def run_cp(spec: CPRunSpec, timeout: float = 900.0) -> CPRunResult:
    """Spawn ``spec.cp`` ranks, run the CP prefill, return rank 0's comparison."""
    if spec.cp < 1:
        raise ValueError(f"--cp must be >= 1, got {spec.cp}")
    if spec.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible")
        if torch.cuda.device_count() < spec.cp:
            raise ValueError(f"--cp {spec.cp} needs {spec.cp} GPUs (one rank per GPU); {torch.cuda.device_count()} visible")
    elif spec.device != "cpu":
        raise ValueError(f"--device must be 'cpu' or 'cuda', got {spec.device!r}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, spec, port, queue), daemon=True) for r in range(spec.cp)]
    for p in procs:
        p.start()
    try:
        kind, payload = queue.get(timeout=timeout)
    except Exception as exc:  # noqa: BLE001  (empty queue after the timeout, or a broken pipe)
        kind, payload = "error", f"no result within {timeout:.0f} s ({type(exc).__name__}: {exc})"
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if kind != "ok":
        raise RuntimeError(f"CP run failed: {payload}")
    payload.logits = torch.from_numpy(payload.logits)
    if payload.cache is not None:
        payload.cache["second"] = torch.from_numpy(payload.cache["second"])
    payload.reference = torch.from_numpy(payload.reference)
    return payload
