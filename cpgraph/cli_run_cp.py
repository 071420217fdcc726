"""``cpgraph run --cp N``: spawn a CP group, run the compiled CP prefill on it and compare with one device.

A module of its own because the ranks, not this process, load the model and run the forward
(:func:`cpgraph.runtime.cp_run.run_cp`); what comes back is reported here: the timing, the per-rank KV
and weight bytes, the difference from single-device eager, and with ``--cache`` the two passes.
"""

from __future__ import annotations

import argparse
import logging
import sys

from cpgraph.cli_run_cache import cache_kwargs
from cpgraph.cli_run_output import print_cache, print_providers, print_top, run_payload, top_ids, write_json


def cp_timing_line(cp: int, device: str, backend: str, res) -> str:
    """The CP run's timing: computed tokens (and, with ``--cache``, cached ones) of the timed pass."""
    if res.cache is not None:
        what = (f"timed warm pass computed {res.tokens_computed} token(s) and took {res.tokens_cached} from the "
                f"prefix cache in {res.seconds:.3f} s after a {res.compile_seconds:.1f} s cold pass (compile)")
    else:
        rate = res.tokens_computed / max(res.seconds, 1e-9)
        what = (f"{res.tokens_computed} tokens computed in {res.seconds:.3f} s ({rate:.0f} tok/s) after a "
                f"{res.compile_seconds:.1f} s first run (compile)")
    return f"CP={cp} on {device} ({backend}): {what}; every rank holds the same logits: {res.ranks_agree}"


def run_cp(args: argparse.Namespace, prompts, prefix, progress) -> int:
    """``cpgraph run --cp N``: plan, compile, run the CP prefill on N ranks, compare with one device."""
    import torch

    from cpgraph.models.prefill import DEFAULT_PAGE_SIZE
    from cpgraph.runtime.cp_run import CPRunSpec
    from cpgraph.runtime.cp_run import run_cp as spawn_cp

    backend = args.backend or "inductor"
    progress(f"spawning {args.cp} {'NCCL' if args.device == 'cuda' else 'gloo'} rank(s), backend {backend}")
    spec = CPRunSpec(model=str(args.model), prompts=prompts.ids, prefix_lens=prefix, cp=args.cp, device=args.device,
                     kv_format=args.kv_format, dtype=args.dtype, weights=args.weights, backend=backend,
                     page_size=DEFAULT_PAGE_SIZE,
                     cache=args.cache, evict=args.evict, log_level=logging.getLogger("cpgraph").level,
                     draft=args.draft, l3=args.l3, deterministic=args.deterministic, cuda_graphs=args.cuda_graphs,
                     **cache_kwargs(args))
    # On a terminal, a line every 10 s while a rank compiles; in a log, one line per phase.
    heartbeat = 10.0 if sys.stderr.isatty() and not args.quiet else None
    res = spawn_cp(spec, progress=None if args.quiet else progress, heartbeat=heartbeat)
    out = res.logits
    top = print_top(args, prompts, prefix, out, (res.sampled, res.draft_logits) if args.draft else None)
    diff = (out - res.reference).abs().max().item()
    rel = diff / max(res.reference.abs().max().item(), 1e-30)
    same = torch.equal(out, res.reference)
    print(cp_timing_line(args.cp, args.device, backend, res))
    print(f"vs single-device eager: max |diff| {diff:.3e} (relative {rel:.3e}){' - bit-identical' if same else ''}")
    draft_extra = {}
    if args.draft:
        ddiff = (res.draft_logits - res.draft_reference).abs().max().item()
        print(f"draft vs single-device eager draft: max |diff| {ddiff:.3e}")
        draft_extra = {"draft_logits": res.draft_logits.tolist(), "draft_top_ids": top_ids(args, res.draft_logits),
                       "draft_after": [int(t) for t in res.sampled], "draft_max_abs_diff_vs_single_device": ddiff}
    for r, (b, n, w) in enumerate(zip(res.kv_bytes_per_rank, res.pages_per_rank, res.weight_bytes_per_rank)):
        print(f"rank {r}: KV {b} bytes in {n} owned page(s) = {b / max(res.replicated_bytes, 1):.3f} of a replicated cache "
              f"({res.replicated_bytes} bytes); weights {w} bytes")
    replays = res.cache.get("graph_replays", 0) if res.cache is not None else 0
    print_providers(args.device, res.provider_calls, replays)
    if args.json:
        payload = run_payload(args, prompts, prefix, out, top, cp=args.cp, device=args.device, backend=backend,
                              max_abs_diff_vs_single_device=diff, kv_bytes_per_rank=res.kv_bytes_per_rank,
                              weight_bytes_per_rank=res.weight_bytes_per_rank, providers=res.providers,
                              provider_calls=res.provider_calls,
                              weights=args.weights or "dequantize",
                              replicated_kv_bytes=res.replicated_bytes, seconds=res.seconds,
                              computed_tokens=res.tokens_computed, cached_tokens=res.tokens_cached, **draft_extra)
        if res.cache is not None:
            payload.update(second_pass_logits=res.cache["second"].tolist(), hits=res.cache["hits"],
                           evicted_pages=res.cache["evicted_pages"], hicache=res.cache["hicache"],
                           l3=res.cache.get("l3"), cuda_graph_replays=replays)
        write_json(args.json, payload, progress)
    cache_ok = True
    if res.cache is not None:
        c = res.cache
        cache_ok = print_cache(c["hits"], c["evicted_pages"], c["load_misses"], c["second"], out)
    if not res.ranks_agree:
        print("error: ranks returned different logits", file=sys.stderr)
        return 1
    return 0 if cache_ok else 1
