"""Eager vs compiled vs CUDA-graphed latency of a tiny-extend batch on a kernel-shaped model (one GPU).

Model: DeepSeek-V3.2 architecture with production-shaped attention (64 heads, kv_lora 512, rope 64,
indexer 64 x 128, top-k 2048), 4 layers (1 dense + 3 MoE), random bf16 weights, compiled with
``cpgraph.passes.compile`` and CP size 1.  Batch: 8 requests x 32 new tokens over an 8K cached
prefix each (the cache is filled by an eager prefix pass first).  Reports median latency of the
extend forward for each mode, ratios against eager in the same run, and checks that the compiled
and graphed logits match eager.

    python benchmarks/cuda_graph_bench.py [--prefix 8192] [--extend 32] [--requests 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

KERNEL_SHAPED = dict(
    hidden_size=2048,
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=512,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=2048,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    moe_intermediate_size=512,
    intermediate_size=2048,
    vocab_size=4096,
)


def kernel_shaped_model(device, dtype=torch.bfloat16):
    from cpgraph.models import DSAConfig, build_model, init_random
    from cpgraph.models.config import bundled_config_dict

    d = dict(bundled_config_dict("tiny-deepseek-v32"), **KERNEL_SHAPED)
    model = init_random(build_model(DSAConfig.from_hf_dict(d)), seed=0, std=0.02)
    return model.to(device=device, dtype=dtype).eval()


def _time(fn, repeat):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        samples.append(a.elapsed_time(b))
    return statistics.median(samples)


@torch.no_grad()
def bucket_sweep(model, mla, index, prompts, tables, B, P, ps, sweep, args) -> None:
    """Eager vs graph replay for several extend sizes: one GraphRunner (one shared pool), a bucket each."""
    from cpgraph.models import build_batch
    from cpgraph.plan import plan_prefill
    from cpgraph.runtime.graph_runner import GraphRunner

    dev = model.device
    runner = GraphRunner(lambda i, m: model(i, m, mla, index).logits, max_requests=B)
    rows = []
    base = torch.cuda.memory_reserved()
    for E in sweep:
        ext = [p[P:P + E] for p in prompts]
        ids, meta = build_batch(plan_prefill([P] * B, [E] * B, cp_size=1, page_size=ps), ext, tables, dev)
        gids, gmeta = build_batch(runner.plan([P] * B, [E] * B, ps), ext, tables, dev)
        eager = lambda: model(ids, meta, mla, index).logits  # noqa: E731
        graphed = lambda: runner(gids, gmeta)  # noqa: E731
        ref, got = eager().float(), graphed().float()
        cap = runner.stats[runner.bucket_for(gids, gmeta)]
        r = {"new_tokens": E, "rows": int(gids.shape[0]), "kv_rows": cap.bucket.kv_rows,
             "eager_ms": _time(eager, args.repeat), "graphed_ms": _time(graphed, args.repeat),
             "capture_s": cap.capture_s, "warmup_s": cap.warmup_s, "pool_mib": cap.pool_bytes / 2**20,
             "pool_total_mib": (torch.cuda.memory_reserved() - base) / 2**20,
             "max_abs_diff_vs_eager": (got - ref).abs().max().item()}  # fmt: skip
        r["x_eager"] = r["eager_ms"] / r["graphed_ms"]
        rows.append(r)
        print(json.dumps(r), flush=True)
    name = torch.cuda.get_device_name()
    print(f"\nGraphRunner bucket sweep on {name}: {B} requests x E new tokens over a {P}-token prefix, page {ps}")
    print(f"{'E':>6}{'rows':>7}{'kv rows':>9}{'eager ms':>10}{'graph ms':>10}{'x eager':>9}{'capture s':>11}{'pool MiB':>10}{'|d|':>9}")
    for r in rows:
        print(f"{r['new_tokens']:>6}{r['rows']:>7}{r['kv_rows']:>9}{r['eager_ms']:>10.2f}{r['graphed_ms']:>10.2f}"
              f"{r['x_eager']:>9.2f}{r['capture_s']:>11.3f}{r['pool_mib']:>10.1f}{r['max_abs_diff_vs_eager']:>9.3g}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": name, "args": vars(args), "sweep": rows}, indent=2))


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--extend", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--profile", action="store_true", help="print where the eager forward spends its GPU time")
    ap.add_argument("--sweep", default="",
                    help="comma list of new tokens per request: eager vs GraphRunner replay per row bucket, "
                         "with capture time and graph-pool growth (one runner, one shared pool)")
    ap.add_argument("--modes", default="eager,compiled,inductor-graphs,graphed,compiled-graphed",
                    help="comma list; eager always runs (the reference)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cuda_graph_bench.json"))
    args = ap.parse_args()
    import cpgraph.ops  # noqa: F401
    from cpgraph.models import build_batch
    from cpgraph.models.prefill import make_layout
    from cpgraph.passes import CPConfig, compile
    from cpgraph.plan import plan_prefill
    from cpgraph.runtime.engine import pool_config
    from cpgraph.runtime.kv_pool import KVPool

    dev = torch.device("cuda")
    model = kernel_shaped_model(dev, getattr(torch, args.dtype))
    model.kv_layout = make_layout(model, "bf16", args.page)
    B, P, E, ps = args.requests, args.prefix, args.extend, args.page
    sweep = [int(x) for x in args.sweep.split(",") if x.strip()]
    pages = [(P + max([E] + sweep) + ps - 1) // ps] * B
    pool = KVPool(pool_config(model, "bf16", ps, sum(pages)))
    tables = [pool.alloc_pages_with_owners([0] * n) for n in pages]
    mla = [pool.mla_pool(i) for i in range(model.config.num_hidden_layers)]
    index = [pool.index_pool(i) for i in model.config.indexer_layers]
    for t in mla + index:
        torch._dynamo.mark_static_address(t)  # pools are mutated in place: static addresses keep CUDA graphs
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (P + max([E] + sweep),), generator=g).tolist() for _ in range(B)]

    # Fill the cache: one request at a time keeps the eager prefix pass's memory small.
    for i in range(B):
        pre = plan_prefill([0], [P], cp_size=1, page_size=ps)
        ids, meta = build_batch(pre, [prompts[i][:P]], [tables[i][: P // ps]], dev, prefix_page_owners=[[]])
        model(ids, meta, mla, index)
    from cpgraph.runtime.graph_runner import GraphRunner

    modes = ["eager"] + [m.strip() for m in args.modes.split(",") if m.strip() and m.strip() != "eager"]
    known = ("compiled", "inductor-graphs", "graphed", "compiled-graphed")
    if any(m not in known for m in modes[1:]):
        raise SystemExit(f"cuda_graph_bench: unknown mode in {modes}; known: eager, {', '.join(known)}")
    if sweep:
        bucket_sweep(model, mla, index, prompts, tables, B, P, ps, sweep, args)
        return
    plan = plan_prefill([P] * B, [E] * B, cp_size=1, page_size=ps)
    ids, meta = build_batch(plan, [p[P:P + E] for p in prompts], tables, dev)
    fns = {"eager": lambda: model(ids, meta, mla, index).logits}
    compiled_fn = compile(model, CPConfig()) if {"compiled", "compiled-graphed"} & set(modes) else None
    if "compiled" in modes:
        fns["compiled"] = lambda: compiled_fn(ids, meta, mla, index).logits
    if "inductor-graphs" in modes:
        inductor_graphs = compile(model, CPConfig(), mode="reduce-overhead")
        # CUDA-graph outputs live in the graph's memory pool and are overwritten by the next replay.
        fns["inductor-graphs"] = lambda: inductor_graphs(ids, meta, mla, index).logits.clone()
    runners = {}
    for name, f in (("graphed", model), ("compiled-graphed", compiled_fn)):
        if name in modes:
            gr = runners[name] = GraphRunner(lambda i, m, f=f: f(i, m, mla, index).logits, max_requests=B)
            gplan = gr.plan([P] * B, [E] * B, ps)
            gids, gmeta = build_batch(gplan, [p[P:P + E] for p in prompts], tables, dev)
            fns[name] = lambda gr=gr, gids=gids, gmeta=gmeta: gr(gids, gmeta)

    rows, outs = {}, {}
    for name in modes:
        outs[name] = fns[name]().float()
        outs[name] = fns[name]().float()  # a replay, not the recording run
    ref = outs["eager"]
    scale = ref.abs().max().item()
    for name in modes:
        rows[name] = {"ms": _time(fns[name], args.repeat), "max_abs_diff_vs_eager": (outs[name] - ref).abs().max().item()}
        if name in runners:
            rows[name]["capture"] = runners[name].capture_report()
    for r in rows.values():
        r["speedup_vs_eager"] = rows["eager"]["ms"] / r["ms"]
    from torch._dynamo.utils import counters

    skips = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
    name = torch.cuda.get_device_name(dev)
    print(f"inductor cudagraph counters: {skips or 'none (graphs captured, nothing skipped)'}")
    print(f"cuda_graph_bench on {name}: kernel-shaped DSA (64 heads, kv_lora 512, indexer 64x128, top-k 2048, 4 layers),")
    print(f"  {B} requests x {E} new tokens over a {P}-token cached prefix each, {args.dtype}, page {ps}")
    print(f"{'mode':<18}{'ms':>10}{'x eager':>10}{'max |diff| vs eager':>22}  (logit scale {scale:.3g})")
    for k, r in rows.items():
        cap = "".join(f"  capture {c['capture_s']:.2f} s (+{c['warmup_s']:.1f} s warm-up), pool {c['pool_mib']:.0f} MiB, "
                      f"bucket rows {c['rows']} kv {c['kv_rows']} prefix {c['prefix_rows']}" for c in r.get("capture", []))
        print(f"{k:<18}{r['ms']:>10.3f}{r['speedup_vs_eager']:>10.2f}{r['max_abs_diff_vs_eager']:>22.3e}{cap}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("eager_forward"):
                fns["eager"]()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": name, "args": vars(args), "rows": rows, "logit_scale": scale}, indent=2))


if __name__ == "__main__":
    main()
