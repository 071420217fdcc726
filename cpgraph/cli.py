"""The ``cpgraph`` command.

Subcommands are thin: they parse, call the public API, and print.  Input
errors become one-line messages and exit status 2, never tracebacks.
"""

from __future__ import annotations

import argparse
import json
import sys


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _cmd_plan(args: argparse.Namespace) -> int:
    from cpgraph.plan import plan_prefill
    from cpgraph.plan.render import render_plan

    prefix = args.prefix if args.prefix is not None else [0] * len(args.extend)
    plan = plan_prefill(prefix, args.extend, cp_size=args.cp, page_size=args.page, row_align=args.row_align)
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        print(render_plan(plan))
    return 0


_BUILTIN_PROMPT_LENS = (96, 40, 17, 130)


def _builtin_prompts(vocab: int) -> list[list[int]]:
    """Deterministic demo prompts (token ids only: bundled models have no tokenizer)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in _BUILTIN_PROMPT_LENS]


def _read_prompts(path: str) -> list[list[int]]:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read prompts file {path!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"prompts file {path!r} is not valid JSON: {exc}") from None
    if not isinstance(data, list) or not data or not all(isinstance(p, list) for p in data):
        raise ValueError(f"prompts file {path!r} must hold a non-empty JSON list of token-id lists")
    return data


def _print_top(args, prompts, prefix, logits) -> list[list[int]]:
    """Print each prompt's top last-token ids; returns them."""
    top = logits.topk(min(args.top, logits.shape[1]), dim=-1).indices.tolist()
    for i, (p, ids) in enumerate(zip(prompts, top)):
        print(f"prompt {i}: {len(p)} tokens (prefix {prefix[i]}): top ids {ids}")
    return top


def _run_payload(args, prompts, prefix, logits, top, **extra) -> dict:
    """The ``--json`` document: the same keys with or without ``--cp``, plus run-specific extras."""
    return {"logits": logits.tolist(), "tokens": prompts, "top_ids": top, "model": str(args.model),
            "kv_format": args.kv_format, "prefix_lens": prefix, **extra}


def _cmd_run(args: argparse.Namespace) -> int:
    import time

    import torch

    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import DEFAULT_PAGE_SIZE, prefill

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[cpgraph run] {msg}", file=sys.stderr, flush=True)

    t_load = time.perf_counter()
    model = from_pretrained(args.model, dtype=args.dtype)
    progress(f"loaded {args.model} ({model.config.model_type}) in {time.perf_counter() - t_load:.2f} s")
    prompts = _read_prompts(args.prompts_file) if args.prompts_file else _builtin_prompts(model.config.vocab_size)
    prefix = args.prefix_lens if args.prefix_lens is not None else [0] * len(prompts)
    if len(prefix) != len(prompts):
        raise ValueError(f"--prefix-lens has {len(prefix)} entries for {len(prompts)} prompts")
    if args.evict and not args.cache:
        raise ValueError("--evict applies to --cache runs")
    if args.cache:
        if args.prefix_lens is not None:
            raise ValueError("--cache takes cached prefixes from the radix cache; drop --prefix-lens")
        if args.batch_size is not None:
            raise ValueError("--batch-size is not supported with --cache (each pass is one batch)")
    if args.cp is not None:
        return _run_cp(args, prompts, prefix, progress)
    if args.device != "cpu" or args.backend is not None:
        raise ValueError("--device and --backend apply to CP runs; add --cp N")
    if args.cache:
        return _run_cache(args, model, prompts, progress)
    bs = args.batch_size or len(prompts)
    if bs < 1:
        raise ValueError(f"--batch-size must be >= 1, got {bs}")
    logits, kv_bytes = [], 0
    t0 = time.perf_counter()
    batches = range(0, len(prompts), bs)
    for n, start in enumerate(batches):
        sl = slice(start, start + bs)
        if len(batches) > 1:
            progress(f"batch {n + 1}/{len(batches)}: prompts {start}..{min(start + bs, len(prompts)) - 1}")
        res = prefill(model, prompts[sl], prefix_lens=prefix[sl], kv_format=args.kv_format,
                      page_size=DEFAULT_PAGE_SIZE, progress=progress)
        logits.append(res.logits)
        kv_bytes = max(kv_bytes, res.kv_bytes)
    elapsed = time.perf_counter() - t0
    out = torch.cat(logits)
    top = _print_top(args, prompts, prefix, out)
    tokens = sum(len(p) for p in prompts)
    print(
        f"{len(prompts)} prompts, {tokens} tokens in {elapsed:.3f} s ({tokens / max(elapsed, 1e-9):.0f} tok/s); "
        f"KV cache {args.kv_format}: {kv_bytes} bytes used (largest batch)"
    )
    if args.json:
        payload = _run_payload(args, prompts, prefix, out, top, kv_bytes=kv_bytes, seconds=elapsed)
        with open(args.json, "w") as f:
            json.dump(payload, f)
        progress(f"wrote {args.json}")
    return 0


def _print_cache(hits, evicted, load_misses, second, first) -> bool:
    """Print hits per level of both passes and the warm-vs-cold logits comparison; True if they match."""
    import torch

    for n, h in enumerate(hits, start=1):
        print(f"pass {n}: L1 (device) hit {h['device']} token(s), L2 (host) hit {h['host']} token(s), "
              f"computed {h['computed']} token(s)")
    if evicted:
        print(f"between passes: evicted {evicted} page(s) from L1 to L2; load-backs degraded to a miss: {load_misses}")
    diff = (second - first).abs().max().item()
    same = torch.equal(second, first)
    ok = diff <= 1e-4 * max(first.abs().max().item(), 1e-30)
    print(f"second pass vs first pass: max |diff| {diff:.3e}{' - bit-identical' if same else ''}"
          f"{'' if ok else ' - MISMATCH'}")
    return ok


def _run_cache(args: argparse.Namespace, model, prompts, progress) -> int:
    """``cpgraph run --cache`` on one device: the prompts twice through the radix cache."""
    from cpgraph.models.prefill import DEFAULT_PAGE_SIZE, make_layout
    from cpgraph.runtime.cache_engine import CacheEngine, default_capacity, run_twice

    layout = make_layout(model, args.kv_format, DEFAULT_PAGE_SIZE)

    def forward(ids, meta, mla, index, **kw):
        return model(ids, meta, mla, index, layout, **kw)

    pages = default_capacity(prompts, DEFAULT_PAGE_SIZE)
    engine = CacheEngine(forward, model, num_pages=pages, kv_format=args.kv_format, page_size=DEFAULT_PAGE_SIZE,
                         host_pages=pages if args.evict else 0, host_layout=args.cache_layout,
                         write_policy=args.write_policy)
    out = run_twice(engine, prompts, evict=args.evict, progress=progress)
    top = out["first"].topk(min(args.top, out["first"].shape[1]), dim=-1).indices.tolist()
    for i, (p, ids) in enumerate(zip(prompts, top)):
        print(f"prompt {i}: {len(p)} tokens: top ids {ids}")
    ok = _print_cache(out["hits"], out["evicted_pages"], out["load_misses"], out["second"], out["first"])
    if args.json:
        payload = {"logits": out["first"].tolist(), "second_pass_logits": out["second"].tolist(), "tokens": prompts,
                   "top_ids": top, "model": str(args.model), "kv_format": args.kv_format, "hits": out["hits"],
                   "evicted_pages": out["evicted_pages"], "hicache": out["hicache"]}
        with open(args.json, "w") as f:
            json.dump(payload, f)
        progress(f"wrote {args.json}")
    return 0 if ok else 1


def _run_cp(args: argparse.Namespace, prompts, prefix, progress) -> int:
    """``cpgraph run --cp N``: plan, compile, run the CP prefill on N ranks, compare with one device."""
    import torch

    from cpgraph.models.prefill import DEFAULT_PAGE_SIZE
    from cpgraph.runtime.cp_run import CPRunSpec, run_cp

    if args.batch_size is not None:
        raise ValueError("--batch-size is not supported with --cp (the whole batch is one CP prefill)")
    backend = args.backend or "inductor"
    progress(f"spawning {args.cp} {'NCCL' if args.device == 'cuda' else 'gloo'} rank(s), backend {backend}")
    spec = CPRunSpec(model=str(args.model), prompts=prompts, prefix_lens=prefix, cp=args.cp, device=args.device,
                     kv_format=args.kv_format, dtype=args.dtype, backend=backend, page_size=DEFAULT_PAGE_SIZE,
                     cache=args.cache, evict=args.evict, host_layout=args.cache_layout,
                     write_policy=args.write_policy)
    res = run_cp(spec)
    out = res.logits
    top = _print_top(args, prompts, prefix, out)
    diff = (out - res.reference).abs().max().item()
    rel = diff / max(res.reference.abs().max().item(), 1e-30)
    same = torch.equal(out, res.reference)
    tokens = sum(len(p) for p in prompts)
    print(f"CP={args.cp} on {args.device} ({backend}): {tokens} tokens in {res.seconds:.3f} s after a "
          f"{res.compile_seconds:.1f} s first run (compile); every rank holds the same logits: {res.ranks_agree}")
    print(f"vs single-device eager: max |diff| {diff:.3e} (relative {rel:.3e}){' - bit-identical' if same else ''}")
    for r, (b, n) in enumerate(zip(res.kv_bytes_per_rank, res.pages_per_rank)):
        print(f"rank {r}: KV {b} bytes in {n} owned page(s) = {b / max(res.replicated_bytes, 1):.3f} of a replicated cache "
              f"({res.replicated_bytes} bytes)")
    if args.json:
        payload = _run_payload(args, prompts, prefix, out, top, cp=args.cp, device=args.device, backend=backend,
                               max_abs_diff_vs_single_device=diff, kv_bytes_per_rank=res.kv_bytes_per_rank,
                               replicated_kv_bytes=res.replicated_bytes, seconds=res.seconds)
        if res.cache is not None:
            payload.update(second_pass_logits=res.cache["second"].tolist(), hits=res.cache["hits"],
                           evicted_pages=res.cache["evicted_pages"], hicache=res.cache["hicache"])
        with open(args.json, "w") as f:
            json.dump(payload, f)
        progress(f"wrote {args.json}")
    cache_ok = True
    if res.cache is not None:
        c = res.cache
        cache_ok = _print_cache(c["hits"], c["evicted_pages"], c["load_misses"], c["second"], out)
    if not res.ranks_agree:
        print("error: ranks returned different logits", file=sys.stderr)
        return 1
    return 0 if cache_ok else 1


def _cmd_pd(args: argparse.Namespace) -> int:
    """``cpgraph pd --cp N``: prefill on N CPU ranks, Mooncake transfer over loopback, decode one token."""
    from cpgraph.models.config import bundled_config_dict
    from cpgraph.transfer.pd import PDSpec, run_pd

    vocab = bundled_config_dict(args.model)["vocab_size"]
    prompts = _read_prompts(args.prompts_file) if args.prompts_file else _builtin_prompts(vocab)
    spec = PDSpec(model=args.model, prompts=prompts, prefix_lens=args.prefix_lens, chunk_tokens=args.chunk_tokens,
                  cp=args.cp, page_size=args.page, backend=args.backend, group=args.group, timeout=args.timeout)
    if not args.quiet:
        print(f"[cpgraph pd] {args.cp} prefill rank(s) + 1 decode process on 127.0.0.1 (Mooncake TCP)",
              file=sys.stderr, flush=True)
    res = run_pd(spec)
    for i, (p, t) in enumerate(zip(prompts, res.first_tokens)):
        print(f"prompt {i}: {len(p)} tokens -> first token {t}; decode next-token argmax "
              f"{int(res.decode_logits[i].argmax())} (transformers {int(res.hf_logits[i].argmax())})")
    ok = res.max_abs_diff <= args.tol and all(s == 4 for s in res.statuses)
    print(f"decode vs transformers 5.24 next-token logits: max |diff| {res.max_abs_diff:.3e} (tol {args.tol:g})")
    print(f"transfer: {res.bytes_sent} bytes sent in {res.transfer_seconds * 1e3:.2f} ms = {res.gbps:.3f} GB/s; "
          f"hidden behind the forward: {100 * res.hidden_share:.1f}% (tail {res.tail_sequential * 1e3:.2f} ms "
          f"sequential -> {res.tail_overlap * 1e3:.2f} ms per-layer)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"first_tokens": res.first_tokens, "max_abs_diff": res.max_abs_diff, "bytes_sent": res.bytes_sent,
                       "gbps": res.gbps, "hidden_share": res.hidden_share, "statuses": res.statuses, "cp": args.cp}, f)
    if not ok:
        print("error: decode logits differ from transformers or a room failed", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpgraph", description="Context-parallel prefill for DSA models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="show how a prefill batch is split over a CP group")
    p.add_argument("--prefix", type=_int_list, default=None, help="cached prefix length per request (default 0)")
    p.add_argument("--extend", type=_int_list, required=True, help="new tokens per request, e.g. 1000,37")
    p.add_argument("--cp", type=int, default=2, help="CP group size (default 2)")
    p.add_argument("--page", type=int, default=64, help="KV page size, a power of two (default 64)")
    p.add_argument("--row-align", type=int, default=1, help="round rows per rank up to this (default 1)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)

    r = sub.add_parser("run", help="prefill prompts on a DSA model (one device, or CP with --cp) and print top ids")
    r.add_argument("--model", required=True, help="bundled tiny model name (e.g. tiny-glm5) or a local HF checkpoint dir")
    r.add_argument("--prompts-file", default=None, help="JSON list of token-id lists (default: built-in prompts)")
    r.add_argument("--prefix-lens", type=_int_list, default=None,
                   help="tokens of each prompt to prefill and cache first (multiples of 16), e.g. 64,0")
    r.add_argument("--kv-format", choices=("bf16", "fp8"), default="bf16",
                   help="KV cache records: bf16 = dense in the model dtype, fp8 = 656-byte records (default bf16)")
    r.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="model dtype (default: the checkpoint config's; float32 for bundled models)")
    r.add_argument("--batch-size", type=int, default=None, help="prompts per forward (default: all at once)")
    r.add_argument("--top", type=int, default=5, help="how many top token ids to print per prompt (default 5)")
    r.add_argument("--json", default=None, metavar="OUT", help='write {"logits": [...], "tokens": [...]} to OUT')
    r.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    r.add_argument("--cp", type=int, default=None,
                   help="context-parallel run on N ranks (compiled with the CP passes), compared with one device")
    r.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="with --cp: cpu = gloo ranks, cuda = NCCL with one rank per GPU (default cpu)")
    r.add_argument("--backend", choices=("inductor", "aot_eager"), default=None,
                   help="with --cp: torch.compile backend for the CP forward (default inductor)")
    r.add_argument("--cache", action="store_true",
                   help="prefixes from the radix prefix cache: run the prompts twice, report hits per level, and "
                        "check that the second (warm) pass gives the first pass's logits")
    r.add_argument("--evict", action="store_true",
                   help="with --cache: evict the whole device cache to the L2 host pool between the passes, so "
                        "the second pass loads back from L2")
    r.add_argument("--cache-layout", choices=("layer_page_first", "page_first"), default="layer_page_first",
                   help="with --evict: L2 host pool layout (default layer_page_first)")
    r.add_argument("--write-policy", choices=("write_through", "write_back"), default="write_through",
                   help="with --evict: back up new cache nodes at insert (write_through) or at eviction (write_back)")
    r.set_defaults(func=_cmd_run)

    d = sub.add_parser("pd", help="prefill on N CP ranks, send the KV to a decode process (Mooncake), decode a token")
    d.add_argument("--model", default="tiny-glm5", help="bundled tiny model name (default tiny-glm5)")
    d.add_argument("--cp", type=int, default=2, help="prefill CP ranks (default 2)")
    d.add_argument("--prompts-file", default=None, help="JSON list of token-id lists (default: built-in prompts)")
    d.add_argument("--prefix-lens", type=_int_list, default=None, help="cached prefix per prompt (page multiples)")
    d.add_argument("--chunk-tokens", type=int, default=None, help="chunked prefill: tokens per chunk (page multiple)")
    d.add_argument("--page", type=int, default=16, help="KV page size (default 16)")
    d.add_argument("--group", type=int, default=1, help="layers per transfer submit (default 1)")
    d.add_argument("--backend", choices=("inductor", "aot_eager"), default="aot_eager",
                   help="torch.compile backend of the CP ranks (default aot_eager)")
    d.add_argument("--tol", type=float, default=1e-4, help="max |logit diff| vs transformers (default 1e-4)")
    d.add_argument("--timeout", type=float, default=120.0, help="seconds per stage before failing (default 120)")
    d.add_argument("--json", default=None, metavar="OUT", help="write the figures to OUT")
    d.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    d.set_defaults(func=_cmd_pd)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"cpgraph {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
