"""CP (+EP) prefill on N GPUs: correctness against cp=1, throughput scaling, GPU-time shares, memory per rank.

For each cp in ``--cp`` (default: 1, 2, 4, 8 up to the visible GPU count), spawns cp ranks (one per
GPU, NCCL; or gloo CPU ranks with ``--device cpu``).  Every rank builds the same model (``--model
kernel``: the kernel-shaped DeepSeek-V3.2 of ``cuda_graph_bench.py``: 64 heads, kv_lora 512, rope 64,
indexer 64 x 128, top-k 2048, 4 layers, 8 routed experts, random weights, bf16 by default; ``--model
tiny``: the bundled tiny config, for checking the script on CPU), and, for each EP setting of
``--ep`` (``off``: ep = 1, ``on``: ep = cp, ``both``), compiles it once with ``cpgraph.compile`` and
runs, in this order:

1. correctness: two batches through ``run_prefill`` (prefix pass, then extend pass): 8 requests with
   tiny extends (1-3 tokens) and prefix-cache hits, and one request over a cached prefix; plus an
   extend-only batch returning all hidden states (the path through the CP rerange, which the
   lowering turns into ``cp_rerange_p2p`` on CUDA + NCCL).  The parent compares last-token logits
   and hidden states with the cp = 1 run (max |diff|, relative to the largest |logit|, argmax
   agreement);
2. scaling: extend-only prefill of each ``--tokens`` as 1 request and as ``--requests`` requests;
   median forward time (CUDA events, batch building excluded; the slowest rank bounds the step) ->
   tokens/s and speed-up over cp = 1 of the same run;
3. GPU-time shares of one forward (profiler; kernels attributed to the cpgraph op that launched
   them): EP dispatch/combine (its all-to-alls and local kernels), rerange, other NCCL all-gathers
   (KV materialisation and last tokens), materialisation placement (``take_rows`` /
   ``paged_gather``), MoE row compaction, the rest (compute).  Shares are of summed kernel time;
   NCCL kernel time includes waiting for the peer;
4. memory per rank: weight bytes, routed-expert bytes and KV bytes against the replicated case and
   against ``cpgraph.plan.memory`` (what ``cpgraph memory`` prints).

Results go to ``--out`` (JSON) after every cp, so a run that is cut short keeps what it measured.

    python benchmarks/cp_scaling.py [--cp 1 2] [--ep both] [--tokens 32768 131072] [--backend inductor]
    python benchmarks/cp_scaling.py --device cpu --model tiny --cp 1 2 --tokens 256 --page 16   # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------ timing and profile
def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _forward_time(fn, repeat, dev):
    for _ in range(2):
        fn()
    _sync(dev)
    out = []
    for _ in range(repeat):
        dist.barrier()
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(dev)
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


# cpgraph ops whose kernels (NCCL ones included) belong to one share, checked in this order.
_SCOPES = (
    ("ep", ("cpgraph::moe_dispatch", "cpgraph::moe_combine")),
    ("rerange", ("cpgraph::cp_rerange_p2p", "cpgraph::cp_rerange")),
    ("materialise", ("cpgraph::cp_materialize_kv", "cpgraph::take_rows", "cpgraph::paged_gather", "cpgraph::kv_compose")),
    ("compact", ("cpgraph::compact_valid", "cpgraph::restore_compute")),
)
SHARES = ("ep_comm", "ep_local", "rerange", "all_gather", "nccl_other", "materialise", "compact", "compute")


def _classify(trace: dict) -> dict[str, float]:
    """Kernel time (us) per share from a Chrome trace: each kernel's launch is matched to the cpgraph ops around it."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    launches, scopes = {}, {}
    for e in events:
        cat, args = e.get("cat", ""), e.get("args") or {}
        if cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            launches[args["correlation"]] = (e.get("tid"), e["ts"])
        elif cat == "cpu_op":
            for share, prefixes in _SCOPES:
                if e["name"].startswith(prefixes):
                    scopes.setdefault(share, []).append((e.get("tid"), e["ts"], e["ts"] + e.get("dur", 0)))
    out = dict.fromkeys(SHARES, 0.0)
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        name, dur = e["name"].lower(), float(e.get("dur", 0))
        where = launches.get((e.get("args") or {}).get("correlation"))
        share = None
        if where is not None:
            tid, ts = where
            share = next((s for s, _ in _SCOPES if any(t == tid and a <= ts <= b for t, a, b in scopes.get(s, ()))), None)
        nccl = "nccl" in name
        if share == "ep":
            share = "ep_comm" if nccl else "ep_local"
        elif share is None and nccl:
            share = "all_gather" if "allgather" in name else "nccl_other"
        elif share is None or (nccl and share in ("materialise", "compact")):
            share = ("all_gather" if "allgather" in name else "nccl_other") if nccl else "compute"
        out[share] += dur
    return out


def _gpu_shares(fn, dev):
    """Shares of one forward's summed kernel time, and the top kernels (for explaining a miss)."""
    if dev.type != "cuda":
        return None, []
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(dev)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        us = _classify(json.loads(Path(path).read_text()))
    total = sum(us.values())
    shares = {k: v / total for k, v in us.items()} if total else None
    top = []
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            top.append((t, e.key[:90], e.count))
    top.sort(reverse=True)
    return (dict(shares, total_kernel_ms=total / 1e3) if shares else None), [
        {"kernel": k, "ms": t / 1e3, "calls": c} for t, k, c in top[:8]
    ]


# ------------------------------------------------------------------ model and memory
def _build_model(args, dev, ep: int, rank: int):
    from cpgraph.models import DSAConfig, build_model, init_random
    from cpgraph.models.config import bundled_config_dict
    from cpgraph.models.moe import local_expert_range, shard_experts
    from cpgraph.models.prefill import make_layout

    dtype = getattr(torch, args.dtype)
    if args.model == "kernel":
        from cuda_graph_bench import kernel_shaped_model

        model = kernel_shaped_model(dev, dtype)
    else:
        d = bundled_config_dict("tiny-deepseek-v32")
        model = init_random(build_model(DSAConfig.from_hf_dict(d)), seed=0, std=0.1).to(device=dev, dtype=dtype).eval()
    if ep > 1:
        shard_experts(model, local_expert_range(model.config.n_routed_experts, rank, ep))
    model.kv_layout = make_layout(model, "bf16", args.page)
    return model


def _weight_report(model, args, ep: int) -> dict:
    from cpgraph.models.moe import Experts
    from cpgraph.plan.memory import weight_bytes
    from cpgraph.runtime.engine import weight_bytes_per_rank

    dt = {"bfloat16": "bf16", "float32": "fp32"}[args.dtype]
    experts = sum(
        p.numel() * p.element_size() for m in model.modules() if isinstance(m, Experts) for p in m.parameters()
    )
    pred, repl = weight_bytes(model.config, dt, ep), weight_bytes(model.config, dt, 1)
    return {
        "weight_bytes": weight_bytes_per_rank(model),
        "weight_bytes_predicted": sum(pred.values()),
        "weight_bytes_replicated": sum(repl.values()),
        "expert_bytes": experts,
        "expert_bytes_predicted": pred["routed_experts"],
        "expert_bytes_replicated": repl["routed_experts"],
    }


def _kv_predicted(cfg, extend, cp, page, dtype_name) -> int:
    from cpgraph.plan.memory import kv_bytes_per_token, owned_pages

    dt = {"bfloat16": "bf16", "float32": "fp32"}[dtype_name]
    per_tok = sum(kv_bytes_per_token(cfg, "bf16", dtype=dt).values())
    return sum(owned_pages(n, cp, page)[0] for n in extend) * page * per_tok


# ------------------------------------------------------------------ rank worker
def _check_batches(page: int):
    """(name, extend lengths, prefix lengths): tiny extends + prefix hits (8 requests), one request."""
    return [
        ("8 requests, tiny extends + prefix hits", [40, 65, 300, 1, 3, 2, 257, 500], [0, page, 4 * page, 2 * page, 0,
                                                                                    page, 4 * page, 16 * page]),
        ("1 request over a prefix", [333], [4 * page]),
    ]


def _pass_counts(compiled) -> dict:
    """Op counts after the last ``lower_cp_collectives`` run: which rerange form the graph uses."""
    for name, _, after in reversed(compiled.cpgraph_passes.history):
        if name == "lower_cp_collectives":
            return {k: after.get(k, 0) for k in ("cpgraph.cp_rerange_p2p", "cpgraph.cp_rerange",
                                                  "_c10d_functional.all_gather_into_tensor")}
    return {}


def _run_config(rank, cp, ep, args, dev, queue):
    import cpgraph
    from cpgraph.models import build_batch
    from cpgraph.plan import plan_prefill
    from cpgraph.runtime.engine import pool_config, run_prefill
    from cpgraph.runtime.kv_pool import KVPool

    tag = f"cp={cp} ep={ep} rank {rank}"
    t0 = time.time()
    model = _build_model(args, dev, ep, rank)
    cfg = model.config
    compiled = cpgraph.compile(
        model, cpgraph.CPConfig(group=dist.group.WORLD if cp > 1 else None, cp_size=cp, ep=ep),
        backend=args.backend, dynamic=True,
    )

    def fwd(ids, meta, mla, index, **kw):
        return compiled(ids, meta, mla, index, **kw)

    result = {"rank": rank, "cp": cp, "ep": ep, "memory": _weight_report(model, args, ep), "checks": [], "runs": []}
    vocab = cfg.vocab_size
    g = torch.Generator().manual_seed(7)
    if not args.skip_check:
        for name, extend, prefix in _check_batches(args.page)[: 1 if args.check == "batch8" else None]:
            prompts = [torch.randint(0, vocab, (p + n,), generator=g).tolist() for p, n in zip(prefix, extend)]
            res = run_prefill(fwd, model, prompts, prefix_lens=prefix, page_size=args.page, rank=rank, cp_size=cp)
            result["checks"].append({"name": name, "logits": res.logits.float().cpu().numpy()})  # no shared fds
            if rank == 0:
                _say(f"{tag}: check '{name}' done ({time.time() - t0:.0f} s since start)")
        # all hidden states (the rerange): extend-only, hidden_tokens split over 8 requests.
        extend = [args.hidden_tokens // 8] * 8
        plan = plan_prefill([0] * 8, extend, cp_size=cp, page_size=args.page)
        owners = [plan.page_owners(i) for i in range(8)]
        pool = KVPool(pool_config(model, "bf16", args.page, sum(o.count(rank) for o in owners), rank))
        tables = [pool.alloc_pages_with_owners(o) for o in owners]
        mla = [pool.mla_pool(i) for i in range(cfg.num_hidden_layers)]
        index = [pool.index_pool(i) for i in cfg.indexer_layers]
        toks = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in extend]
        ids, meta = build_batch(plan, toks, tables, dev, rank=rank)
        with torch.no_grad():
            out = fwd(ids, meta, mla, index, return_hidden=True)
        result["hidden"] = out.hidden.float().cpu().numpy()
        result["rerange_ops"] = _pass_counts(compiled)
        del pool, mla, index, out
        if rank == 0:
            _say(f"{tag}: hidden-state check done, lowered rerange ops {result['rerange_ops']}")
    for T in args.tokens:
        for reqs in sorted({1, args.requests}):
            extend = [T // reqs] * reqs
            plan = plan_prefill([0] * reqs, extend, cp_size=cp, page_size=args.page)
            owners = [plan.page_owners(i) for i in range(reqs)]
            owned = sum(o.count(rank) for o in owners)
            pool = KVPool(pool_config(model, "bf16", args.page, owned, rank))
            tables = [pool.alloc_pages_with_owners(o) for o in owners]
            mla = [pool.mla_pool(i) for i in range(cfg.num_hidden_layers)]
            index = [pool.index_pool(i) for i in cfg.indexer_layers]
            toks = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in extend]
            ids, meta = build_batch(plan, toks, tables, dev, rank=rank)
            with torch.no_grad():
                call = lambda: fwd(ids, meta, mla, index)  # noqa: E731
                ms = _forward_time(call, args.repeat, dev)
                try:
                    shares, top = _gpu_shares(call, dev) if args.profile else (None, [])
                except Exception as exc:  # a profiler problem must not cost the timings
                    shares, top = None, [{"error": f"{type(exc).__name__}: {exc}"[:300]}]
            total_pages = sum(len(o) for o in owners)
            result["runs"].append({
                "case": f"{reqs} request" + ("s" if reqs > 1 else ""), "tokens": T, "requests": reqs, "ms": ms,
                "shares": shares, "top_kernels": top, "rows_per_rank": plan.num_rows,
                "kv_bytes": owned * pool.bytes_per_page(), "replicated_bytes": total_pages * pool.bytes_per_page(),
                "kv_bytes_predicted": _kv_predicted(cfg, extend, cp, args.page, args.dtype),
                "peak_allocated": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
            })
            if rank == 0:
                _say(f"{tag}: {T} tokens x {reqs} request(s): {ms:.1f} ms  shares {shares}")
            del pool, mla, index, ids, meta
    dist.barrier()
    queue.put(result)
    del compiled, model
    torch._dynamo.reset()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _worker(rank, cp, eps, args, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=cp, device_id=dev)
    else:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=cp)
    # Compile settings of the CP numerics tests (tests/cp_model.py): float constants stay constants
    # (no Dynamo restart per graph) and no duck sizing (no pool-size specializations).
    from torch.fx.experimental import _config as fx_config

    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.specialize_float = True
    fx_config.use_duck_shape = False
    try:
        for ep in eps:
            _run_config(rank, cp, ep, args, dev, queue)
    except Exception as exc:  # report, so the parent does not wait for the timeout
        import traceback

        traceback.print_exc()
        queue.put({"rank": rank, "cp": cp, "error": f"{type(exc).__name__}: {exc}"})
    dist.destroy_process_group()


def run(cp, eps, args, on_result):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, cp, eps, args, port, q)) for r in range(cp)]
    for p in procs:
        p.start()
    for ep in eps:
        res = sorted((q.get(timeout=args.timeout) for _ in range(cp)), key=lambda r: r["rank"])
        errors = [r["error"] for r in res if "error" in r]
        if errors:
            _say(f"cp={cp}: FAILED: {errors[0]}")
            break
        on_result(cp, ep, res)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()


# ------------------------------------------------------------------ comparison and report
def _diff(a, b) -> dict:
    a, b = torch.from_numpy(a), torch.from_numpy(b)
    scale = float(b.abs().max()) or 1.0
    d = float((a - b).abs().max())
    out = {"max_abs_diff": d, "rel_to_max": d / scale}
    if a.dim() == 2 and a.shape[-1] > 1:
        out["argmax_agree"] = f"{int((a.argmax(-1) == b.argmax(-1)).sum())}/{a.shape[0]}"
    return out


def memory_only(args, cps) -> list[dict]:
    """Item 4 without GPUs: every rank's weight, routed-expert and KV-pool bytes as allocated (host tensors).

    The same code as the GPU run (model shard per EP rank, ``KVPool`` sized by
    the plan's page owners), so any cp can be checked on one machine; the
    forward is not run.  Max over ranks against replicated and the memory plan.
    """
    import copy

    from cpgraph.models.moe import local_expert_range, shard_experts
    from cpgraph.plan import plan_prefill
    from cpgraph.runtime.engine import pool_config
    from cpgraph.runtime.kv_pool import KVPool

    dev = torch.device("cpu")
    full = _build_model(args, dev, 1, 0)
    cfg = full.config
    rows = []
    for cp in cps:
        for ep in [1] if cp == 1 else {"off": [1], "on": [cp], "both": [1, cp]}[args.ep]:
            mems = []
            for rank in range(cp):
                model = full
                if ep > 1:
                    model = copy.deepcopy(full)
                    shard_experts(model, local_expert_range(cfg.n_routed_experts, rank, ep))
                mems.append(_weight_report(model, args, ep))
                del model
            for T in args.tokens:
                for reqs in sorted({1, args.requests}):
                    extend = [T // reqs] * reqs
                    plan = plan_prefill([0] * reqs, extend, cp_size=cp, page_size=args.page)
                    owners = [plan.page_owners(i) for i in range(reqs)]
                    kv = []
                    for rank in range(cp):
                        pool = KVPool(pool_config(full, "bf16", args.page, sum(o.count(rank) for o in owners), rank))
                        kv.append(pool.total_bytes())
                        bpp = pool.bytes_per_page()
                        del pool
                    repl = sum(len(o) for o in owners) * bpp
                    m0 = mems[0]
                    rows.append({
                        "cp": cp, "ep": ep, "tokens": T, "requests": reqs,
                        "kv_bytes_max": max(kv), "kv_fraction": max(kv) / repl, "kv_target": 1 / cp,
                        "kv_bytes_predicted": _kv_predicted(cfg, extend, cp, args.page, args.dtype),
                        "weight_bytes_max": max(m["weight_bytes"] for m in mems),
                        "weight_bytes_predicted": m0["weight_bytes_predicted"],
                        "weight_bytes_replicated": m0["weight_bytes_replicated"],
                        "expert_bytes_max": max(m["expert_bytes"] for m in mems),
                        "expert_fraction": max(m["expert_bytes"] for m in mems) / m0["expert_bytes_replicated"],
                        "expert_bytes_predicted": m0["expert_bytes_predicted"], "expert_target": 1 / ep,
                    })
    print(f"memory per rank ({args.model} model, {args.dtype}, page {args.page}; host allocations, no forward)")
    print(f"{'cp':>3} {'ep':>3} {'tokens':>7} {'reqs':>4} {'KV MiB':>9} {'KV/repl':>8} {'1/cp':>6} {'KV/plan':>8} "
          f"{'W MiB':>8} {'W/plan':>7} {'W/repl':>7} {'exp MiB':>8} {'exp/repl':>8} {'1/ep':>6} {'exp/plan':>8}")
    for r in rows:
        print(f"{r['cp']:>3} {r['ep']:>3} {r['tokens']:>7} {r['requests']:>4} {r['kv_bytes_max'] / 2**20:>9.1f} "
              f"{r['kv_fraction']:>8.4f} {r['kv_target']:>6.3f} {r['kv_bytes_max'] / r['kv_bytes_predicted']:>8.4f} "
              f"{r['weight_bytes_max'] / 2**20:>8.1f} {r['weight_bytes_max'] / r['weight_bytes_predicted']:>7.4f} "
              f"{r['weight_bytes_max'] / r['weight_bytes_replicated']:>7.4f} {r['expert_bytes_max'] / 2**20:>8.1f} "
              f"{r['expert_fraction']:>8.4f} {r['expert_target']:>6.3f} "
              f"{r['expert_bytes_max'] / r['expert_bytes_predicted']:>8.4f}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", choices=("kernel", "tiny"), default="kernel")
    ap.add_argument("--cp", type=int, nargs="+", default=None)
    ap.add_argument("--ep", choices=("off", "on", "both"), default="both", help="ep = 1, ep = cp, or both (cp > 1)")
    ap.add_argument("--tokens", type=int, nargs="*", default=[32768])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--hidden-tokens", type=int, default=8192, help="extend-only batch returning all hidden states")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--check", choices=("all", "batch8"), default="all",
                    help="batch8: only the 8-request check batch (saves the one-request graphs' compiles)")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cp_scaling.json"))
    ap.add_argument("--memory-only", action="store_true",
                    help="item 4 only, on the host: per-rank weight/expert/KV bytes for every --cp (no GPU needed)")
    args = ap.parse_args()
    if args.memory_only:
        rows = memory_only(args, args.cp or [1, 2, 4, 8])
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": "host", "args": vars(args), "memory": rows}, indent=2))
        return
    n = torch.cuda.device_count() if args.device == "cuda" else 8
    if args.device == "cuda" and not n:
        raise SystemExit("cp_scaling: needs CUDA GPUs (or --device cpu)")
    cps = args.cp or [c for c in (1, 2, 4, 8) if c <= n]
    if any(c > n for c in cps):
        raise SystemExit(f"cp_scaling: cp {max(cps)} needs {max(cps)} GPUs, {n} visible")
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (gloo)"
    rows, checks, base, ref = [], [], {}, {}
    out_path = Path(args.out)

    def on_result(cp, ep, res):
        r0 = res[0]
        if "checks" in r0 and r0["checks"]:
            if not ref:
                ref.update(checks=[c["logits"] for c in r0["checks"]], hidden=r0.get("hidden"))
            for k, c in enumerate(r0["checks"]):
                same = all((r["checks"][k]["logits"] == c["logits"]).all() for r in res)
                checks.append({"cp": cp, "ep": ep, "batch": c["name"], "ranks_agree": bool(same),
                               **_diff(c["logits"], ref["checks"][k])})
            if r0.get("hidden") is not None:
                same = all((r["hidden"] == r0["hidden"]).all() for r in res)
                checks.append({"cp": cp, "ep": ep, "batch": f"all hidden states ({args.hidden_tokens} tokens)",
                               "ranks_agree": bool(same), "lowered_ops": r0.get("rerange_ops"),
                               **_diff(r0["hidden"], ref["hidden"])})
        mem = [r["memory"] for r in res]
        for k, case in enumerate(r0["runs"]):
            ms = max(r["runs"][k]["ms"] for r in res)  # the slowest rank bounds the step
            tps = case["tokens"] / (ms / 1e3)
            key = (case["tokens"], case["requests"])
            base.setdefault(key, tps)
            shares = [r["runs"][k]["shares"] for r in res if r["runs"][k]["shares"]]
            rows.append({
                "cp": cp, "ep": ep, "case": case["case"], "tokens": case["tokens"], "ms": ms, "tokens_per_s": tps,
                "speedup": tps / base[key], "rows_per_rank": case["rows_per_rank"],
                "shares_rank0": shares[0] if shares else None,
                "shares_max": {s: max(x[s] for x in shares) for s in shares[0]} if shares else None,
                "top_kernels_rank0": r0["runs"][k]["top_kernels"],
                "kv_bytes_per_rank": [r["runs"][k]["kv_bytes"] for r in res],
                "kv_fraction": max(r["runs"][k]["kv_bytes"] for r in res) / case["replicated_bytes"],
                "kv_bytes_predicted": case["kv_bytes_predicted"],
                "weight_bytes_per_rank": [m["weight_bytes"] for m in mem],
                "weight_bytes_predicted": mem[0]["weight_bytes_predicted"],
                "weight_bytes_replicated": mem[0]["weight_bytes_replicated"],
                "expert_bytes_per_rank": [m["expert_bytes"] for m in mem],
                "expert_fraction": max(m["expert_bytes"] for m in mem) / mem[0]["expert_bytes_replicated"],
                "expert_bytes_predicted": mem[0]["expert_bytes_predicted"],
                "peak_allocated_per_rank": [r["runs"][k]["peak_allocated"] for r in res],
            })
        report()

    def report():
        print(f"\ncp_scaling on {n if args.device == 'cuda' else 'CPU'} x {name} ({args.backend}); {args.model} model, "
              f"{args.dtype}, page {args.page}", flush=True)
        for c in checks:
            print(f"  check cp={c['cp']} ep={c['ep']} {c['batch']}: max|diff| vs cp1 {c['max_abs_diff']:.3e} "
                  f"(rel {c['rel_to_max']:.2e}) argmax {c.get('argmax_agree', '-')} ranks agree {c['ranks_agree']}"
                  + (f" ops {c['lowered_ops']}" if c.get("lowered_ops") else ""), flush=True)
        print(f"{'cp':>3} {'ep':>3} {'case':<11} {'tokens':>7} {'ms':>9} {'tok/s':>10} {'speedup':>8} {'ep a2a':>7} "
              f"{'ep loc':>7} {'rerng':>6} {'allgth':>7} {'mater':>6} {'cmpct':>6} {'KV/repl':>8} {'exp/repl':>9} "
              f"{'W GiB':>7}", flush=True)
        for r in rows:
            s = r["shares_max"] or dict.fromkeys(SHARES, float("nan"))
            print(f"{r['cp']:>3} {r['ep']:>3} {r['case']:<11} {r['tokens']:>7} {r['ms']:>9.1f} {r['tokens_per_s']:>10.0f} "
                  f"{r['speedup']:>7.2f}x {s['ep_comm']:>7.1%} {s['ep_local']:>7.1%} {s['rerange']:>6.1%} "
                  f"{s['all_gather']:>7.1%} {s['materialise']:>6.1%} {s['compact']:>6.1%} {r['kv_fraction']:>8.4f} "
                  f"{r['expert_fraction']:>9.4f} {max(r['weight_bytes_per_rank']) / 2**30:>7.3f}", flush=True)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"device": name, "gpus": n, "args": vars(args), "checks": checks,
                                        "rows": rows}, indent=2, default=str))

    for cp in cps:
        eps = [1] if cp == 1 else {"off": [1], "on": [cp], "both": [1, cp]}[args.ep]
        _say(f"cp={cp}: ep {eps}")
        run(cp, eps, args, on_result)
    _say(f"wrote {out_path}")


if __name__ == "__main__":
    main()
