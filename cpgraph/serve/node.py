"""Build the prefill node a command line asks for: one device, a local CP group, or a torchrun job.

* **One device** (``cp == 1``, no torchrun): load the model, build the forward
  (eager, or compiled by ``cpgraph.compile``; on CUDA optionally replayed from
  CUDA graphs), the :class:`PrefillEngine` and the :class:`PrefillServer`.
* **Under torchrun**: the world is ``dp`` CP groups of ``cp`` ranks
  (:func:`cpgraph.runtime.launch.rank_layout`); every rank builds its engine
  over the CP-compiled forward of its group; each group's rank 0 serves HTTP
  on ``port + group`` and the other ranks follow its ops
  (:meth:`PrefillEngine.follow`).  The leader's ops travel over a gloo group
  of their own (cheap CPU objects; on CUDA the forward's collectives use
  NCCL).
* **``--cp N`` without torchrun**: spawns the N ranks on this machine (gloo on
  CPU, one GPU per rank on CUDA) with the torchrun environment filled in, and
  forwards SIGTERM/SIGINT to the leader, which drains and stops the others.

Followers ignore SIGTERM and SIGINT: torchrun and a terminal signal every
rank, but only the leader can drain; it tells them to stop when it is done.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, replace

import torch

log = logging.getLogger("cpgraph.serve")


@dataclass
class ServeSpec:
    model: str
    served_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    cp: int = 1
    ep: int = 1  # expert parallelism over the CP group: 1 or cp (docs/expert_parallel.md)
    device: str = "auto"
    backend: str = "eager"  # eager (one device only), aot_eager, inductor
    kv_format: str = "bf16"
    dtype: str | None = None
    weights: str | None = None
    page_size: int = 16
    num_pages: int | None = 4096  # None: sized from the memory left (--num-pages auto, cpgraph.runtime.kv_budget)
    kv_memory_fraction: float = 0.9  # with num_pages None: the share of the device the rank may fill
    host_pages: int = 0
    l3: str | None = None  # an L3 page store spec (cpgraph.runtime.storage.parse_spec)
    token_budget: int = 2048
    chunk_tokens: int | None = None
    max_batch_requests: int = 64
    max_queue: int = 1024
    max_prompt_tokens: int | None = None
    request_timeout: float | None = 600.0
    cuda_graphs: bool = False
    kv_transfer: bool = False
    warmup_tokens: int = 64
    warmup_prefix_tokens: int | None = None  # --cuda-graphs: warm buckets up to this many cached-prefix rows (None:
    # the token budget); a step past it captures its bucket under load (counted in cpgraph_cold_steps_total)
    derive_kv_bucket: bool = True  # --cuda-graphs: the KV-view bucket follows from the row and prefix buckets
    timeout: float = 600.0  # seconds a CP collective may wait
    log_level: int | None = None
    deterministic: bool = False  # row-invariant products, eager or compiled (docs/deterministic.md)
    draft: bool = False  # also prefill the MTP draft layer after the target (docs/mtp.md)
    idle_steps_on_loop: bool = True  # the idle fast path (cpgraph/serve/app.py); --engine-thread-only turns it off


def served_names(spec: ServeSpec) -> tuple[str, ...]:
    """Names a request's ``model`` may give: ``--served-model-name`` (or the model's name), then ``--model``."""
    base = spec.served_name or os.path.basename(os.path.normpath(str(spec.model))) or str(spec.model)
    return tuple(dict.fromkeys([base, str(spec.model)]))


def _dtype(name):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}[name]


def make_forward(model, spec: ServeSpec, cp_config=None):
    """The forward ``(ids, meta, mla, index, **kw)`` the engine calls: eager, or cpgraph-compiled."""
    if spec.backend == "eager":
        if cp_config is not None and cp_config.cp_size > 1:
            raise ValueError("a CP group needs a compiled forward (--backend aot_eager or inductor)")

        def forward(ids, meta, mla, index, **kw):
            return model(ids, meta, mla, index, **kw)

        if spec.deterministic:
            from cpgraph.ops.invariant_mode import deterministic_forward

            return deterministic_forward(forward)
        return forward
    from cpgraph.passes import CPConfig, compile

    compiled = compile(model, cp_config or CPConfig(deterministic=spec.deterministic), backend=spec.backend,
                       dynamic=True)

    def forward(ids, meta, mla, index, **kw):
        return compiled(ids, meta, mla, index, **kw)

    forward.compiled = compiled  # its pass history says what the CP passes inserted (the EP check)
    return forward


def make_draft(model, spec: ServeSpec, cp_config=None):
    """The MTP draft forward (``None`` without ``spec.draft``): a second graph over the target's shared modules,
    compiled with the same passes and backend as the target (docs/mtp.md)."""
    if not spec.draft:
        return None
    draft = model.draft_module()
    if spec.backend == "eager":
        if spec.deterministic:
            from cpgraph.ops.invariant_mode import deterministic_forward

            return deterministic_forward(draft)
        return draft
    from cpgraph.passes import CPConfig, compile

    return compile(draft, cp_config or CPConfig(deterministic=spec.deterministic), backend=spec.backend, dynamic=True)


def build_engine(model, forward, spec: ServeSpec, *, rank: int = 0, group=None, control_group=None, src: int = 0,
                 transfer=None, draft=None):
    from cpgraph.runtime.prefill_engine import PrefillEngine
    from cpgraph.runtime.scheduler import SchedulerConfig

    sched = SchedulerConfig(token_budget=spec.token_budget, chunk_tokens=spec.chunk_tokens,
                            max_batch_requests=spec.max_batch_requests, max_waiting=spec.max_queue)
    if spec.cuda_graphs:
        from cpgraph.runtime.graph_runner import DEFAULT_MAX_ROWS, graphed_forward

        if spec.token_budget > DEFAULT_MAX_ROWS:
            raise ValueError(f"--token-budget {spec.token_budget} exceeds the largest row bucket {DEFAULT_MAX_ROWS}")
        # The KV-view bucket follows from the row and prefix buckets: few enough buckets to warm them all.
        forward = graphed_forward(forward, max_requests=spec.max_batch_requests, cp_size=spec.cp,
                                  page_size=spec.page_size if spec.derive_kv_bucket else None)
        if draft is not None:  # the draft replays its own graph of each bucket, after the host chose the token
            from cpgraph.runtime.draft_graphs import graphed_draft

            draft = graphed_draft(draft, forward)
    engine = PrefillEngine(forward, model, num_pages=spec.num_pages, page_size=spec.page_size,
                           kv_format=spec.kv_format, rank=rank, cp_size=spec.cp, host_pages=spec.host_pages,
                           group=group, control_group=control_group, src=src, scheduler=sched,
                           request_timeout=spec.request_timeout, max_prompt_tokens=spec.max_prompt_tokens,
                           l3=spec.l3, draft=draft)
    if spec.cuda_graphs and spec.backend != "eager":
        from cpgraph.runtime.graph_runner import bind_pool_addresses

        bind_pool_addresses(engine.cache.pools[0] + engine.cache.pools[1])
        if draft is not None:  # the draft's graphs bind its layer's pools too
            bind_pool_addresses(engine._draft_pools)
    if transfer is not None:
        engine.transfer = transfer(engine)
    return engine


def warm_up(engine, tokens: int, prefix_tokens: int | None = None) -> None:
    """Leader, engine thread: every shape a step can take, compiled -- and, with CUDA graphs, every bucket the
    token budget can form, captured -- before ``/health`` turns 200; then an empty cache and fresh counters.

    Why more than one request: a compiled forward specialises on sizes 0 and 1 (one request or several, no
    cached prefix or some, a one-token extend) and on sizes that happened to be equal, so each of those
    classes compiles a graph of its own the first time a step has it.  The warm-up runs each once (a few
    short requests, sizes chosen not to coincide).  A ``graphed_forward``
    then prepares every bucket of :meth:`GraphRunner.reachable_buckets` for the scheduler's token budget
    and ``prefix_tokens`` cached-prefix rows per step (default: the budget) on padding rows, which touch
    no cache state.  ``engine.cold_steps`` (``cpgraph_cold_steps_total``) counts the steps that still
    compiled or captured after this.
    """
    if tokens <= 0:
        return
    from cpgraph.runtime.prefill_engine import engine_request

    g = torch.Generator().manual_seed(0)
    ps, cfg = engine.page_size, engine.scheduler.config
    n = min(tokens, engine.max_prompt_tokens)

    def rand(k: int) -> list[int]:
        return torch.randint(0, engine.vocab, (k,), generator=g).tolist()

    def run(*prompts) -> None:  # submitted together: one step when they fit the budget
        handles = [engine.submit(engine_request(p)) for p in prompts]
        engine.run_until_idle()
        for h in handles:
            if h.result.status != "finished":
                raise RuntimeError(f"warm-up request {h.result.status}: {h.result.error}")

    t0 = time.perf_counter()
    # Each class once, with sizes that do not coincide (rows M, KV-view rows N, prefix rows P, requests B):
    # a compiled forward also guards on sizes that were equal when it was traced.
    if n >= 2:
        run(rand(n if n % ps else n - 1))  # one request, no cached prefix (N, whole pages, differs from M)
    run(rand(1))  # a one-token step
    if cfg.max_batch_requests >= 2 and cfg.token_budget >= 8:
        run(rand(3), rand(5))  # several requests (B 2, M 8, N 2 pages)
    if engine.max_prompt_tokens >= 3 * ps and cfg.token_budget >= ps + 3:
        base = rand(2 * ps)
        run(base + rand(1))  # its two pages go to the cache
        run(base + rand(1))  # a cached prefix and a one-token extend
        run(base + rand(ps + 3))  # a cached prefix and a longer extend (as every chunk after a first)
        if cfg.max_batch_requests >= 2:
            run(base + rand(5), base + rand(7))  # several requests over a cached prefix (P 4 pages, M 12)
    prepared, where = engine.warm_graphs(prefix_tokens)  # every rank of a CP group: an op they follow
    log.info("cpgraph serve: warm-up ran in %.1f s (%d CUDA-graph bucket(s) prepared on padding rows%s)",
             time.perf_counter() - t0, prepared, "".join(f"; {w}" for w in where))
    engine.reset_cache()


def _tokenizer(spec: ServeSpec, vocab: int):
    """``(encode, decode)`` from the checkpoint's own tokenizer, or ``(None, None)`` when it has none."""
    from cpgraph.models.config import bundled_names

    if str(spec.model) in bundled_names():
        return None, None
    from cpgraph.models.tokenizer import TOKENIZER_FILES, encode_prompts, load_tokenizer

    if not any(os.path.isfile(os.path.join(spec.model, f)) for f in TOKENIZER_FILES):
        return None, None
    tok = load_tokenizer(spec.model)
    return (lambda text: encode_prompts(tok, [text], vocab_size=vocab)[0]), (lambda t: tok.decode([t]))


def _make_peer(rank: int, overlap: bool = True):
    """The engine's KV sink for this rank.  ``overlap``: each layer's pages go out while later layers compute
    (per-layer hooks on the model); off under CUDA graphs, whose replays run no Python per layer."""
    def attach(engine):
        from cpgraph.transfer.prefill import PrefillPeer

        from .transfer import RoomSender

        sender = RoomSender(PrefillPeer(engine.cache.pool, rank))
        if overlap:
            sender.attach(engine.model)
        return sender

    return attach


def _server(engine, spec: ServeSpec, port: int, transfer_info=None, forward=None):
    from .app import PrefillServer

    encode, decode = _tokenizer(spec, engine.vocab)

    def warmup() -> None:
        warm_up(engine, spec.warmup_tokens, spec.warmup_prefix_tokens)
        if spec.ep > 1:  # the warm-up compiled the forward: each rank holds 1/ep of the experts, so the graph
            from cpgraph.runtime.launch import check_expert_parallel_graph  # must route rows to their ranks

            check_expert_parallel_graph(getattr(getattr(forward, "compiled", None), "cpgraph_passes", None), spec.ep)

    return PrefillServer(engine, served=served_names(spec), host=spec.host, port=port, encode=encode, decode=decode,
                         warmup=warmup, transfer_info=transfer_info, idle_steps_on_loop=spec.idle_steps_on_loop)


def _announce(url: str) -> None:
    # One write of the whole line: the ranks of a torchrun job share one stderr pipe, and print()'s separate
    # write of the newline let another rank's line land in between (a reader then saw two addresses on one line).
    sys.stderr.write(f"cpgraph serve: listening on {url}\n")
    sys.stderr.flush()


def serve_single(spec: ServeSpec) -> int:
    """One device: load, build, serve until SIGTERM; returns the exit status."""
    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout

    device = "cuda" if spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available()) else "cpu"
    model = from_pretrained(spec.model, dtype=_dtype(spec.dtype), device=device, weights=spec.weights,
                            draft=spec.draft).eval()
    model.kv_layout = make_layout(model, spec.kv_format, spec.page_size)
    if spec.num_pages is None:
        spec = replace(spec, num_pages=auto_pages(model, spec))
    engine = build_engine(model, make_forward(model, spec), spec,
                          transfer=_make_peer(0, not spec.cuda_graphs) if spec.kv_transfer else None,
                          draft=make_draft(model, spec))
    info = _transfer_info(engine, [engine.transfer.address] if spec.kv_transfer else None)
    server = _server(engine, spec, spec.port, info)
    try:
        return server.serve_forever(on_listening=_announce)
    finally:
        if engine.transfer is not None:
            engine.transfer.close()


def _transfer_info(engine, peers) -> dict | None:
    if peers is None:
        return None
    return {"peers": peers, "page_size": engine.page_size, "cp_size": engine.cp_size,
            "protocol": "mooncake-tcp", "fingerprint": engine.transfer.peer.layout.fingerprint}


# ----------------------------------------------------------------------------- CP groups


def serve_rank(spec: ServeSpec, environ=None) -> int:
    """This process's rank of a CP serving job (torchrun's environment); the leader serves until SIGTERM."""
    from datetime import timedelta

    import torch.distributed as dist

    from cpgraph.runtime.launch import LaunchSpec, load_rank_model, rank_layout, read_env, resolve_device

    env = read_env(environ)
    lay = rank_layout(env.world_size, spec.cp, spec.ep)
    device = resolve_device(spec.device, env.local_rank)
    gid, grank = lay.group_of(env.rank), lay.group_rank(env.rank)
    leader = grank == 0
    if not leader:  # only the leader drains; it stops the followers when done
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    cuda = device.type == "cuda"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if cuda:
        torch.cuda.set_device(device)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = env.master_addr, str(env.master_port)
    timeout = timedelta(seconds=spec.timeout)
    dist.init_process_group("nccl" if cuda else "gloo", rank=env.rank, world_size=env.world_size, timeout=timeout)
    try:
        groups = [dist.new_group(lay.group_ranks(g), timeout=timeout) for g in range(lay.dp)] \
            if lay.dp > 1 else [dist.group.WORLD]
        control = [dist.new_group(lay.group_ranks(g), backend="gloo", timeout=timeout) for g in range(lay.dp)] \
            if cuda or lay.dp > 1 else [dist.group.WORLD]
        group, ctl = groups[gid], control[gid]
        from cpgraph.runtime.launch import compiler_config

        launch = LaunchSpec(model=spec.model, cp=spec.cp, device=str(device.type), kv_format=spec.kv_format,
                            dtype=spec.dtype, weights=spec.weights, page_size=spec.page_size)
        model, layout = load_rank_model(launch, lay, grank, draft=spec.draft)
        model = model.to(device).eval()
        model.kv_layout = layout
        _report_weights(model, lay, env.rank, gid)
        if spec.num_pages is None:  # every rank of the group must hold the same capacity: the smallest
            from cpgraph.runtime.kv_budget import agree_pages

            from cpgraph.runtime.inputs import InputError

            try:
                mine, error = auto_pages(model, spec, rank=env.rank), None
            except InputError as exc:  # still join the agreement: the others must not wait for this rank
                mine, error = 0, exc
            pages = agree_pages(mine, group=ctl)
            if pages < 1:
                raise error or InputError("another rank of the CP group has no room for a KV pool (its log says why)")
            spec = replace(spec, num_pages=pages)
            log.info("cpgraph serve: CP group %d: %d KV pages per rank (the smallest over its ranks)", gid,
                     spec.num_pages)
        cp_config = compiler_config(lay, group, spec.deterministic)  # with ep > 1: the expert-parallel dispatch
        forward = make_forward(model, spec, cp_config)
        if not cuda:  # the ranks share this machine's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // spec.cp))
        engine = build_engine(model, forward, spec, rank=grank, group=group, control_group=ctl, src=gid * spec.cp,
                              transfer=_make_peer(grank, not spec.cuda_graphs) if spec.kv_transfer else None,
                              draft=make_draft(model, spec, cp_config))
        peers = None
        if spec.kv_transfer:
            peers = [None] * spec.cp
            dist.all_gather_object(peers, engine.transfer.address, group=ctl)
        if leader:
            server = _server(engine, spec, spec.port + gid if spec.port else 0, _transfer_info(engine, peers), forward)
            return server.serve_forever(on_listening=lambda url: _announce(f"{url} (CP group {gid}, ranks "
                                                                           f"{lay.group_ranks(gid)})"))
        engine.follow()
        engine.close()  # the leader's engine thread does the same after stopping the followers
        return 0
    finally:
        dist.destroy_process_group()


def auto_pages(model, spec: ServeSpec, rank: int = 0) -> int:
    """``--num-pages auto``: this rank's pool size from the memory left (:mod:`cpgraph.runtime.kv_budget`)."""
    from cpgraph.runtime.inputs import user_input
    from cpgraph.runtime.kv_budget import pool_budget

    with user_input("--num-pages auto"):
        budget = pool_budget(model, page_size=spec.page_size, kv_format=spec.kv_format,
                             token_budget=spec.token_budget,
                             max_context=spec.max_prompt_tokens or model.config.max_position_embeddings, cp=spec.cp,
                             ep=spec.ep, fraction=spec.kv_memory_fraction, cuda_graphs=spec.cuda_graphs,
                             draft=spec.draft, deterministic=spec.deterministic, weights=spec.weights)
    log.info("cpgraph serve: rank %d: KV pool auto: %s", rank, budget.line())
    return budget.pages


def _report_weights(model, lay, rank: int, group: int) -> None:
    """One line per rank: the weight bytes it holds and, under EP, which routed experts (an operator sees the
    shards; a test checks them)."""
    from cpgraph.runtime.engine import weight_bytes_per_rank

    cfg = model.config
    experts = ""
    if lay.ep > 1:
        first, end = lay.expert_range(rank, cfg.n_routed_experts)
        experts = f", routed experts [{first}, {end}) of {cfg.n_routed_experts}"
    log.info("cpgraph serve: rank %d (CP group %d) holds %.3f GiB of weights%s", rank, group,
             weight_bytes_per_rank(model) / 2**30, experts)


def _local_rank(rank: int, spec: ServeSpec, port: int) -> None:
    env = dict(RANK=str(rank), WORLD_SIZE=str(spec.cp), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    os.environ.update(env)
    if spec.log_level is not None:
        logger = logging.getLogger("cpgraph")
        logger.setLevel(spec.log_level)
        if not logger.handlers:
            h = logging.StreamHandler()
            h.setFormatter(logging.Formatter(f"%(name)s (rank {rank}): %(levelname)s: %(message)s"))
            logger.addHandler(h)
        if spec.log_level > logging.INFO:
            logging.getLogger("cpgraph.serve").setLevel(logging.INFO)  # the lifecycle lines, as in one process
    sys.exit(serve_rank(spec))


def serve_local_cp(spec: ServeSpec) -> int:
    """``--cp N`` on this machine without torchrun: spawn the N ranks; SIGTERM/SIGINT go to the leader."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_local_rank, args=(r, replace(spec, log_level=logging.getLogger("cpgraph").level),
                                                   port)) for r in range(spec.cp)]
    for p in procs:
        p.start()

    def forward_signal(sig, _frame):
        if procs[0].pid is not None and procs[0].is_alive():
            os.kill(procs[0].pid, sig)

    old = {sig: signal.signal(sig, forward_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for p in procs:
            p.join()
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    codes = [p.exitcode for p in procs]
    return 0 if all(c == 0 for c in codes) else max(abs(c or 1) for c in codes)
