"""``cpgraph run --cache`` on one device: the prompts twice through the radix prefix cache, warm checked against cold.

A module of its own because it drives the cache engine (L1 pages, the L2 host pool, the L3 store) and
reports per-level hits rather than a plain prefill; :func:`cache_kwargs` is also what the ``--cp`` run
passes to its ranks, so the L2 settings are read from the flags in one place.
"""

from __future__ import annotations

import argparse

from cpgraph.cli_run_output import (cuda_graph_replays, print_cache, print_cache_compare, print_providers,
                                    print_top, text_payload, top_ids, write_json)


def cache_kwargs(args) -> dict:
    """L2 settings (only given with ``--cache --evict``; the library defaults otherwise)."""
    return dict(host_layout=args.cache_layout or "layer_page_first", write_policy=args.write_policy or "write_through")


def run_cache(args: argparse.Namespace, model, prompts, progress) -> int:
    """``cpgraph run --cache`` on one device: the prompts twice through the radix cache."""
    from cpgraph.models.prefill import DEFAULT_PAGE_SIZE, make_layout
    from cpgraph.ops.providers import calls, reset_calls, selected
    from cpgraph.runtime.cache_engine import CacheEngine, default_capacity, run_twice
    from cpgraph.runtime.engine import weight_bytes_per_rank

    reset_calls()  # the report covers this run's calls only
    layout = make_layout(model, args.kv_format, DEFAULT_PAGE_SIZE)

    def forward(ids, meta, mla, index, **kw):
        return model(ids, meta, mla, index, layout, **kw)

    if args.cuda_graphs:
        from cpgraph.runtime.graph_runner import graphed_forward

        forward = graphed_forward(forward, max_requests=len(prompts.ids))
    pages = default_capacity(prompts.ids, DEFAULT_PAGE_SIZE)
    # --draft: the MTP draft after the target in both passes; its records are cached and backed off where the
    # token after a cached page differs (docs/mtp.md, prefix caching), so the warm draft must equal the cold one.
    draft = model.draft_module() if args.draft else None
    engine = CacheEngine(forward, model, num_pages=pages, kv_format=args.kv_format, page_size=DEFAULT_PAGE_SIZE,
                         host_pages=pages if args.evict or args.l3 else 0, l3=args.l3, draft=draft,
                         **cache_kwargs(args))
    out = run_twice(engine, prompts.ids, evict=args.evict, progress=progress)
    l3 = None
    if engine.l3 is not None:
        engine.flush_l3()
        l3 = {"store": engine.l3.store.name, "policy": engine.l3.write_policy, **engine.l3.stats,
              "store_stats": dict(engine.l3.store.stats)}
        engine.close()
    first, second = out["first"].float().cpu(), out["second"].float().cpu()
    drafts, draft_extra = None, {}
    if draft is not None:  # each draft read the target's greedy token (the CacheEngine's default)
        drafts = (first.argmax(-1).tolist(), out["first_draft"].float().cpu())
        draft_extra = {"draft_logits": drafts[1].tolist(), "draft_top_ids": top_ids(args, drafts[1]),
                       "draft_after": drafts[0],
                       "second_pass_draft_logits": out["second_draft"].float().cpu().tolist()}
    top = print_top(args, prompts, None, first, drafts)
    ok = print_cache(out["hits"], out["evicted_pages"], out["load_misses"], second, first)
    if draft is not None:
        ok &= print_cache_compare("draft (MTP)", out["second_draft"].float().cpu(), drafts[1])
    if l3 is not None:
        print(f"L3 {l3['store']} ({l3['policy']}): fetched {l3['fetched_pages']} page(s), stored {l3['stored_pages']}")
    weight_bytes = weight_bytes_per_rank(model)
    print(f"KV cache {args.kv_format}: {engine.pool.total_bytes()} bytes allocated; weights: {weight_bytes} bytes")
    providers, op_calls = selected(model.device.type), calls(model.device.type)
    replays = cuda_graph_replays(forward)
    print_providers(model.device.type, op_calls, replays)
    if args.json:
        payload = {"logits": first.tolist(), "second_pass_logits": second.tolist(), "tokens": prompts.ids,
                   "top_ids": top, "model": str(args.model), "kv_format": args.kv_format, "hits": out["hits"],
                   "evicted_pages": out["evicted_pages"], "hicache": out["hicache"], "l3": l3,
                   "weight_bytes": weight_bytes,
                   "kv_pool_bytes": engine.pool.total_bytes(), "weights": args.weights or "dequantize",
                   "device": args.device, "providers": providers, "provider_calls": op_calls,
                   "cuda_graph_replays": replays, **text_payload(prompts, top), **draft_extra}
        write_json(args.json, payload, progress)
    return 0 if ok else 1
