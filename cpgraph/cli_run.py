"""``cpgraph run`` and ``cpgraph launch``: prefill prompts and print the top tokens, KV and weight bytes, providers.

Together because ``launch`` (one rank of a torchrun job) prints and writes its results with ``run``'s
output helpers (:class:`_Prompts`, :func:`_print_top`, :func:`_run_payload`); ``run`` itself covers one
device, the radix cache (``--cache``) and a CP group it spawns (``--cp``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys

from cpgraph.cli_common import DETERMINISTIC_HELP, add_model_format_flags, int_list, progress_printer
from cpgraph.runtime.inputs import InputError, check_l3, one_line, user_input
from cpgraph.runtime.inputs import builtin_prompts as _builtin_prompts
from cpgraph.runtime.inputs import read_prompts as _read_prompts


def add_run_parser(sub) -> argparse.ArgumentParser:
    """Register ``run``."""
    r = sub.add_parser("run", help="prefill prompts on a DSA model (one device, or CP with --cp) and print top ids")
    r.add_argument("--model", required=True, help="bundled tiny model name (e.g. tiny-glm5) or a local HF checkpoint dir")
    r.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="a text prompt, encoded by the checkpoint's own tokenizer (repeatable; the top next tokens "
                        "are printed decoded beside their ids; bundled models have no tokenizer: give token ids)")
    r.add_argument("--prompts-file", default=None,
                   help="prompts as one JSON array or one per line (JSON Lines); a prompt is a JSON list of token ids "
                        "or a JSON string of text (text needs the checkpoint's tokenizer) (default: built-in prompts)")
    r.add_argument("--prefix-lens", type=int_list, default=None,
                   help="tokens of each prompt to prefill and cache first (multiples of 16), e.g. 64,0")
    add_model_format_flags(r)
    r.add_argument("--batch-size", type=int, default=None, help="prompts per forward, >= 1 (default: all at once)")
    r.add_argument("--top", type=int, default=5, help="how many top token ids to print per prompt (default 5)")
    r.add_argument("--json", default=None, metavar="OUT",
                   help="write logits, tokens, top_ids, KV and weight bytes (per rank with --cp), providers "
                        "({op: implementations that computed it}) and provider_calls ({op: [{implementation, calls, "
                        "reason}]}) to OUT; text prompts add texts and top_text (the top ids decoded)")
    r.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    r.add_argument("--cp", type=int, default=None,
                   help="context-parallel run on N ranks (compiled with the CP passes), compared with one device")
    r.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu, or cuda: the model on a GPU, cpgraph ops on the CUDA providers (cpgraph.kernels, "
                        "bound on first use; the run prints, per op, which implementation computed how many calls and why); "
                        "with --cp: cpu = gloo ranks, cuda = NCCL with one rank per GPU (default cpu)")
    r.add_argument("--backend", choices=("inductor", "aot_eager"), default=None,
                   help="with --cp: torch.compile backend for the CP forward (default inductor; aot_eager skips "
                        "code generation and is the fast correctness check)")
    r.add_argument("--cache", action="store_true",
                   help="prefixes from the radix prefix cache: run the prompts twice, report hits per level, and "
                        "check that the second (warm) pass gives the first pass's logits")
    r.add_argument("--evict", action="store_true",
                   help="with --cache: evict the whole device cache to the L2 host pool between the passes, so "
                        "the second pass loads back from L2")
    r.add_argument("--cache-layout", choices=("layer_page_first", "page_first"), default=None,
                   help="with --cache --evict: L2 host pool layout (default layer_page_first)")
    r.add_argument("--write-policy", choices=("write_through", "write_back"), default=None,
                   help="with --cache --evict: back up new cache nodes at insert (write_through, the default) or "
                        "at eviction (write_back)")
    r.add_argument("--l3", default=None, metavar="SPEC",
                   help="with --cache: a persistent page store behind the L2 host pool, shared by every run with the "
                        "same model and KV layout: file:DIR[,max_bytes=SIZE] or mooncake:HOST:PORT[,metadata=URL] "
                        "(docs/cache.md); a later run serves the prefixes an earlier one stored")
    r.add_argument("--cuda-graphs", action="store_true",
                   help="with --cache --device cuda (one device or --cp N): replay the forward from CUDA graphs, one "
                        "per bucket (docs/cuda_graphs.md)")
    r.add_argument("--draft", action="store_true",
                   help="also run the MTP draft layer (model.layers.{num_hidden_layers}; bundled models: a random one) "
                        "on the target's hidden states and print its top tokens beside the target's: the draft "
                        "predicts the token after the target's top-1 token (docs/mtp.md)")
    r.add_argument("--deterministic", action="store_true", help=DETERMINISTIC_HELP)
    r.set_defaults(func=_cmd_run)
    return r


def add_launch_parser(sub) -> argparse.ArgumentParser:
    """Register ``launch``."""
    ln = sub.add_parser("launch", help="one rank of a torchrun job (torchrun ... -m cpgraph launch ...): CP prefill "
                                        "on data-parallel CP groups, one node or many (see docs/launch.md)")
    ln.add_argument("--model", required=True,
                    help="bundled tiny model name or a local HF checkpoint dir (the same path on every node)")
    ln.add_argument("--prompts-file", default=None,
                    help="JSON list of token-id lists, dealt round-robin to the CP groups; a name containing {group} "
                         "is one file per group (default: built-in prompts)")
    ln.add_argument("--prefix-lens", type=int_list, default=None,
                    help="tokens of each prompt to prefill and cache first (multiples of 16), e.g. 64,0")
    ln.add_argument("--cp", type=int, default=None,
                    help="CP group size; WORLD_SIZE / cp data-parallel groups (default: the whole world)")
    ln.add_argument("--ep", type=int, default=1,
                    help="expert-parallel degree inside a CP group: 1 or equal to --cp (default 1)")
    ln.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="cuda = NCCL, rank on cuda:LOCAL_RANK; cpu = gloo (default auto: cuda when visible)")
    ln.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor",
                    help="torch.compile backend of the CP forward (default inductor)")
    add_model_format_flags(ln)
    ln.add_argument("--repeat", type=int, default=1,
                    help="prefill runs; the first compiles, the last is the timed one (default 1)")
    ln.add_argument("--timeout", type=float, default=600.0,
                    help="seconds the rendezvous and each collective may wait (default 600)")
    ln.add_argument("--top", type=int, default=5, help="how many top token ids to print per prompt (default 5)")
    ln.add_argument("--json", default=None, metavar="OUT", help="global rank 0 writes logits, tokens and per-group "
                                                              "figures to OUT")
    ln.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ln.add_argument("--deterministic", action="store_true", help=DETERMINISTIC_HELP)
    ln.set_defaults(func=_cmd_launch)
    return ln


# ----------------------------------------------------------------------------- run


def _check_run_flags(args: argparse.Namespace) -> None:
    """Flag combinations ``run`` refuses (a flag that would be ignored is an error, not a no-op)."""
    from cpgraph.runtime.inputs import check_output_path

    if args.top < 1:
        raise InputError(f"--top must be >= 1, got {args.top}")
    check_output_path(args.json)
    if args.evict and not args.cache:
        raise InputError("--evict applies to --cache runs")
    for flag, value in (("--cache-layout", args.cache_layout), ("--write-policy", args.write_policy)):
        if value is not None and not (args.cache and (args.evict or args.l3)):
            raise InputError(f"{flag} applies to --cache --evict runs and --cache --l3 runs (it configures the L2 "
                             "host pool)")
    if args.l3 is not None:
        if not args.cache:
            raise InputError("--l3 applies to --cache runs (the L3 sits behind the L2 host pool)")
        check_l3(args.l3, cuda_graphs=args.cuda_graphs)
    if args.cache:
        if args.prefix_lens is not None:
            raise InputError("--cache takes cached prefixes from the radix cache; drop --prefix-lens")
        if args.batch_size is not None:
            raise InputError("--batch-size is not supported with --cache (each pass is one batch)")
    if args.prompt and args.prompts_file:
        raise InputError("give prompts with --prompt or with --prompts-file, not both")
    if args.draft and args.cache:
        raise InputError("--draft is not supported with --cache (run it without --cache)")
    if args.cuda_graphs:
        if not args.cache or args.device != "cuda":
            raise InputError("--cuda-graphs applies to --cache runs with --device cuda, one device or --cp N "
                             "(one KV pool across both passes; docs/cuda_graphs.md)")
        if args.evict:
            raise InputError("--cuda-graphs does not take --evict (HiCache load-back waits on the host between passes)")
    if args.cp is None:
        if args.backend is not None:
            raise InputError("--backend applies to CP runs (the single-device run is eager); add --cp N")
    elif args.batch_size is not None:
        raise InputError("--batch-size is not supported with --cp (the whole batch is one CP prefill)")


class _Prompts:
    """The run's prompts as token ids, with the texts they came from and the tokenizer that encoded them.

    ``texts[i]`` is ``None`` for a prompt given as ids; ``tokenizer`` is
    ``None`` when no prompt was text (the top tokens are then printed as
    ids only).
    """

    def __init__(self, raw: list, ids: list[list[int]], tokenizer) -> None:
        self.texts = [p if isinstance(p, str) else None for p in raw]
        self.ids = ids
        self.tokenizer = tokenizer

    def decode_each(self, ids: list[int]) -> list[str] | None:
        """Each id as its own text (``None`` without a tokenizer)."""
        if self.tokenizer is None:
            return None
        from cpgraph.models.tokenizer import decode_ids

        return decode_ids(self.tokenizer, [[t] for t in ids])

    def label(self, i: int) -> str:
        text = self.texts[i]
        if text is None:
            return f"prompt {i}"
        return f"prompt {i} {(text if len(text) <= 40 else text[:37] + '...')!r}"


def _top_ids(args, logits) -> list[list[int]]:
    return logits.topk(min(args.top, logits.shape[1]), dim=-1).indices.tolist()


def _print_top(args, prompts: _Prompts, prefix, logits, draft=None) -> list[list[int]]:
    """Print each prompt's top last-token ids (decoded beside them when the prompts were text); returns them.

    ``draft``: ``(sampled, draft_logits)``; each prompt's MTP draft line then follows its target line.
    """
    top = _top_ids(args, logits)
    draft_top = _top_ids(args, draft[1]) if draft is not None else None
    for i, (p, ids) in enumerate(zip(prompts.ids, top)):
        words = prompts.decode_each(ids)
        shown = f" = {words}" if words is not None else ""
        cached = f" (prefix {prefix[i]})" if prefix is not None else ""
        print(f"{prompts.label(i)}: {len(p)} tokens{cached}: top ids {ids}{shown}")
        if draft_top is not None:
            _print_draft_line(prompts, i, int(draft[0][i]), draft_top[i])
    return top


def _print_draft_line(prompts: _Prompts, i: int, sampled: int, ids: list[int]) -> None:
    """One prompt's MTP draft top ids: its guess for the token after the target's sampled token."""
    words = prompts.decode_each(ids)
    shown = f" = {words}" if words is not None else ""
    print(f"{prompts.label(i)}: draft (MTP) after target token {sampled}: top ids {ids}{shown}")


def _text_payload(prompts: _Prompts, top) -> dict:
    """``--json`` keys of a run with text prompts: the texts and each top id decoded."""
    if prompts.tokenizer is None:
        return {}
    return {"texts": prompts.texts, "top_text": [prompts.decode_each(ids) for ids in top]}


def _run_payload(args, prompts: _Prompts, prefix, logits, top, **extra) -> dict:
    """The ``--json`` document: the same keys with or without ``--cp``, plus run-specific extras."""
    return {"logits": logits.tolist(), "tokens": prompts.ids, "top_ids": top, "model": str(args.model),
            "kv_format": args.kv_format, "prefix_lens": prefix, **_text_payload(prompts, top), **extra}


def _print_providers(device_type: str, calls: dict[str, list[dict]], graph_replays: int = 0) -> None:
    """One block: per cpgraph op that ran, the implementations that computed its calls, with counts and reasons."""
    from cpgraph.ops.ledger import describe

    if not calls:
        print(f"op providers on {device_type}: no cpgraph op ran")
        return
    print(f"op providers on {device_type} ({len(calls)} cpgraph ops ran; calls per implementation that computed "
          f"them, eager and compiled; CPGRAPH_PROVIDERS=reference forces the torch references):")
    for op, rows in calls.items():
        print(f"  {op}: {describe(rows)}")
    if graph_replays:
        print(f"  + {graph_replays} CUDA-graph replay(s), not counted above: a replay runs no Python; it re-runs "
              f"the kernels its capture recorded (the warm-up and capture calls are counted)")


def _graph_replays(forward) -> int:
    """Replays of captured CUDA graphs behind a ``graphed_forward`` (no Python ran for them: not in the counts)."""
    return sum(s["replays"] for r in getattr(forward, "runners", {}).values() for s in r.capture_report()
               if s["captured"])


def _is_bundled(model) -> bool:
    from cpgraph.models.config import bundled_names

    return str(model) in bundled_names()


def _cmd_run(args: argparse.Namespace) -> int:
    import time

    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import DEFAULT_PAGE_SIZE, make_layout
    from cpgraph.runtime.inputs import (check_batch_flags, check_request, check_weights, model_config,
                                        resolve_prompts)

    progress = progress_printer(args, "run")
    cp = 1 if args.cp is None else args.cp
    with user_input():
        _check_run_flags(args)
        check_batch_flags(page_size=DEFAULT_PAGE_SIZE, cp=cp, device=args.device, batch_size=args.batch_size)
        cfg = model_config(args.model)  # config.json only: prompts and flags are checked before any weight is read
        check_weights(args.model, args.weights, cfg)
        if args.draft and cfg.num_nextn_predict_layers < 1 and not _is_bundled(args.model):
            raise InputError(f"--draft: {args.model} declares no MTP layer (num_nextn_predict_layers is 0 or absent)")
        if args.prompt:
            raw = list(args.prompt)
        elif args.prompts_file:
            raw = _read_prompts(args.prompts_file, allow_text=True)
        else:
            raw = _builtin_prompts(cfg.vocab_size)
        ids, tokenizer = resolve_prompts(raw, args.model, cfg.vocab_size)
        req = check_request(ids, args.prefix_lens, vocab=cfg.vocab_size, page_size=DEFAULT_PAGE_SIZE, cp=cp,
                            device=args.device, batch_size=args.batch_size)
        model = None
        if args.cp is None:  # the ranks load their own weights
            t_load = time.perf_counter()
            model = from_pretrained(args.model, dtype=args.dtype, device=args.device, weights=args.weights,
                                    draft=args.draft)
            make_layout(model, args.kv_format, DEFAULT_PAGE_SIZE)  # a KV format the model cannot store
            progress(f"loaded {args.model} ({model.config.model_type}) on {args.device} in "
                     f"{time.perf_counter() - t_load:.2f} s")
    if args.weights == "fp8" and args.device == "cpu":
        progress("--weights fp8 on cpu: the FP8 projections run fp8_block_linear's torch reference (slow; the fast "
                 "FP8 GEMM is CUDA-only)")
    prompts, prefix = _Prompts(raw, req.prompts, tokenizer), req.prefix_lens
    if args.cp is not None:
        return _run_cp(args, prompts, prefix, progress)
    from cpgraph.ops.invariant_mode import deterministic

    with deterministic() if args.deterministic else contextlib.nullcontext():  # eager forwards: the mode's kernels
        if args.cache:
            return _run_cache(args, model, prompts, progress)
        return _run_single(args, model, prompts, prefix, progress)


def _run_single(args, model, prompts: _Prompts, prefix, progress) -> int:
    import time

    import torch

    from cpgraph.models.prefill import DEFAULT_PAGE_SIZE, prefill
    from cpgraph.ops.providers import calls, reset_calls, selected
    from cpgraph.runtime.engine import weight_bytes_per_rank

    reset_calls()  # the report covers this run's calls only
    ids = prompts.ids
    bs = args.batch_size if args.batch_size is not None else len(ids)
    logits, kv_bytes, draft_logits, sampled = [], 0, [], []
    t0 = time.perf_counter()
    batches = range(0, len(ids), bs)
    for n, start in enumerate(batches):
        sl = slice(start, start + bs)
        if len(batches) > 1:
            progress(f"batch {n + 1}/{len(batches)}: prompts {start}..{min(start + bs, len(ids)) - 1}")
        if args.draft:
            res = _prefill_with_draft(model, ids[sl], prefix[sl], args.kv_format, progress)
            draft_logits.append(res.draft_logits.float().cpu())
            sampled += res.sampled.tolist()
        else:
            res = prefill(model, ids[sl], prefix_lens=prefix[sl], kv_format=args.kv_format,
                          page_size=DEFAULT_PAGE_SIZE, progress=progress)
        logits.append(res.logits.float().cpu())
        kv_bytes = max(kv_bytes, res.kv_bytes)
    elapsed = time.perf_counter() - t0
    out = torch.cat(logits)
    draft_extra, draft = {}, None
    if args.draft:
        draft_out = torch.cat(draft_logits)
        draft = (sampled, draft_out)
        draft_extra = {"draft_logits": draft_out.tolist(), "draft_top_ids": _top_ids(args, draft_out),
                       "draft_after": sampled}
    top = _print_top(args, prompts, prefix, out, draft)
    tokens = sum(len(p) for p in ids)
    weight_bytes = weight_bytes_per_rank(model)
    print(
        f"{len(ids)} prompts, {tokens} tokens in {elapsed:.3f} s ({tokens / max(elapsed, 1e-9):.0f} tok/s); "
        f"KV cache {args.kv_format}: {kv_bytes} bytes used (largest batch); weights: {weight_bytes} bytes"
    )
    providers, op_calls = selected(model.device.type), calls(model.device.type)
    _print_providers(model.device.type, op_calls)
    if args.json:
        payload = _run_payload(args, prompts, prefix, out, top, kv_bytes=kv_bytes, weight_bytes=weight_bytes,
                               weights=args.weights or "dequantize", device=args.device, providers=providers,
                               provider_calls=op_calls, seconds=elapsed, **draft_extra)
        _write_json(args.json, payload, progress)
    return 0


def _prefill_with_draft(model, ids, prefix, kv_format: str, progress):
    """One eager single-device batch with the MTP draft run after the target (``run_prefill(draft=...)``)."""
    from cpgraph.models.prefill import DEFAULT_PAGE_SIZE, make_layout
    from cpgraph.runtime.engine import run_prefill

    model.kv_layout = make_layout(model, kv_format, DEFAULT_PAGE_SIZE)

    def forward(i, meta, mla, index, **kw):
        return model(i, meta, mla, index, **kw)

    return run_prefill(forward, model, ids, prefix_lens=prefix, kv_format=kv_format, page_size=DEFAULT_PAGE_SIZE,
                       progress=progress, draft=model.draft_module())


def _write_json(path: str, payload: dict, progress) -> None:
    with open(path, "w") as f:
        json.dump(payload, f)
    progress(f"wrote {path}")


def _print_cache(hits, evicted, load_misses, second, first) -> bool:
    """Print hits per level of both passes and the warm-vs-cold logits comparison; True if they match."""
    import torch

    for n, h in enumerate(hits, start=1):
        l3 = f", L3 (store) hit {h['l3']} token(s)" if "l3" in h else ""
        print(f"pass {n}: L1 (device) hit {h['device']} token(s), L2 (host) hit {h['host']} token(s){l3}, "
              f"computed {h['computed']} token(s)")
    if evicted:
        print(f"between passes: evicted {evicted} page(s) from L1 to L2; load-backs degraded to a miss: {load_misses}")
    diff = (second - first).abs().max().item()
    same = torch.equal(second, first)
    ok = diff <= 1e-4 * max(first.abs().max().item(), 1e-30)
    print(f"second pass vs first pass: max |diff| {diff:.3e}{' - bit-identical' if same else ''}"
          f"{'' if ok else ' - MISMATCH'}")
    return ok


def _cache_kwargs(args) -> dict:
    """L2 settings (only given with ``--cache --evict``; the library defaults otherwise)."""
    return dict(host_layout=args.cache_layout or "layer_page_first", write_policy=args.write_policy or "write_through")


def _run_cache(args: argparse.Namespace, model, prompts, progress) -> int:
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
    engine = CacheEngine(forward, model, num_pages=pages, kv_format=args.kv_format, page_size=DEFAULT_PAGE_SIZE,
                         host_pages=pages if args.evict or args.l3 else 0, l3=args.l3, **_cache_kwargs(args))
    out = run_twice(engine, prompts.ids, evict=args.evict, progress=progress)
    l3 = None
    if engine.l3 is not None:
        engine.flush_l3()
        l3 = {"store": engine.l3.store.name, "policy": engine.l3.write_policy, **engine.l3.stats,
              "store_stats": dict(engine.l3.store.stats)}
        engine.close()
    first, second = out["first"].float().cpu(), out["second"].float().cpu()
    top = _print_top(args, prompts, None, first)
    ok = _print_cache(out["hits"], out["evicted_pages"], out["load_misses"], second, first)
    if l3 is not None:
        print(f"L3 {l3['store']} ({l3['policy']}): fetched {l3['fetched_pages']} page(s), stored {l3['stored_pages']}")
    weight_bytes = weight_bytes_per_rank(model)
    print(f"KV cache {args.kv_format}: {engine.pool.total_bytes()} bytes allocated; weights: {weight_bytes} bytes")
    providers, op_calls, replays = selected(model.device.type), calls(model.device.type), _graph_replays(forward)
    _print_providers(model.device.type, op_calls, replays)
    if args.json:
        payload = {"logits": first.tolist(), "second_pass_logits": second.tolist(), "tokens": prompts.ids,
                   "top_ids": top, "model": str(args.model), "kv_format": args.kv_format, "hits": out["hits"],
                   "evicted_pages": out["evicted_pages"], "hicache": out["hicache"], "l3": l3,
                   "weight_bytes": weight_bytes,
                   "kv_pool_bytes": engine.pool.total_bytes(), "weights": args.weights or "dequantize",
                   "device": args.device, "providers": providers, "provider_calls": op_calls,
                   "cuda_graph_replays": replays, **_text_payload(prompts, top)}
        _write_json(args.json, payload, progress)
    return 0 if ok else 1


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


def _run_cp(args: argparse.Namespace, prompts, prefix, progress) -> int:
    """``cpgraph run --cp N``: plan, compile, run the CP prefill on N ranks, compare with one device."""
    import torch

    from cpgraph.models.prefill import DEFAULT_PAGE_SIZE
    from cpgraph.runtime.cp_run import CPRunSpec, run_cp

    backend = args.backend or "inductor"
    progress(f"spawning {args.cp} {'NCCL' if args.device == 'cuda' else 'gloo'} rank(s), backend {backend}")
    spec = CPRunSpec(model=str(args.model), prompts=prompts.ids, prefix_lens=prefix, cp=args.cp, device=args.device,
                     kv_format=args.kv_format, dtype=args.dtype, weights=args.weights, backend=backend,
                     page_size=DEFAULT_PAGE_SIZE,
                     cache=args.cache, evict=args.evict, log_level=logging.getLogger("cpgraph").level,
                     draft=args.draft, l3=args.l3, deterministic=args.deterministic, cuda_graphs=args.cuda_graphs,
                     **_cache_kwargs(args))
    # On a terminal, a line every 10 s while a rank compiles; in a log, one line per phase.
    heartbeat = 10.0 if sys.stderr.isatty() and not args.quiet else None
    res = run_cp(spec, progress=None if args.quiet else progress, heartbeat=heartbeat)
    out = res.logits
    top = _print_top(args, prompts, prefix, out, (res.sampled, res.draft_logits) if args.draft else None)
    diff = (out - res.reference).abs().max().item()
    rel = diff / max(res.reference.abs().max().item(), 1e-30)
    same = torch.equal(out, res.reference)
    print(cp_timing_line(args.cp, args.device, backend, res))
    print(f"vs single-device eager: max |diff| {diff:.3e} (relative {rel:.3e}){' - bit-identical' if same else ''}")
    draft_extra = {}
    if args.draft:
        ddiff = (res.draft_logits - res.draft_reference).abs().max().item()
        print(f"draft vs single-device eager draft: max |diff| {ddiff:.3e}")
        draft_extra = {"draft_logits": res.draft_logits.tolist(), "draft_top_ids": _top_ids(args, res.draft_logits),
                       "draft_after": [int(t) for t in res.sampled], "draft_max_abs_diff_vs_single_device": ddiff}
    for r, (b, n, w) in enumerate(zip(res.kv_bytes_per_rank, res.pages_per_rank, res.weight_bytes_per_rank)):
        print(f"rank {r}: KV {b} bytes in {n} owned page(s) = {b / max(res.replicated_bytes, 1):.3f} of a replicated cache "
              f"({res.replicated_bytes} bytes); weights {w} bytes")
    replays = res.cache.get("graph_replays", 0) if res.cache is not None else 0
    _print_providers(args.device, res.provider_calls, replays)
    if args.json:
        payload = _run_payload(args, prompts, prefix, out, top, cp=args.cp, device=args.device, backend=backend,
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
        _write_json(args.json, payload, progress)
    cache_ok = True
    if res.cache is not None:
        c = res.cache
        cache_ok = _print_cache(c["hits"], c["evicted_pages"], c["load_misses"], c["second"], out)
    if not res.ranks_agree:
        print("error: ranks returned different logits", file=sys.stderr)
        return 1
    return 0 if cache_ok else 1


# ----------------------------------------------------------------------------- launch


def _cmd_launch(args: argparse.Namespace) -> int:
    """``torchrun ... cpgraph launch``: this process is one rank of a (multi-node) DP x CP job."""
    from cpgraph.models.prefill import DEFAULT_PAGE_SIZE
    from cpgraph.runtime.launch import LaunchSpec, reports_errors, run_launch

    spec = LaunchSpec(model=str(args.model), prompts_file=args.prompts_file, prefix_lens=args.prefix_lens, cp=args.cp,
                      ep=args.ep, device=args.device, backend=args.backend, kv_format=args.kv_format, dtype=args.dtype,
                      weights=args.weights, page_size=DEFAULT_PAGE_SIZE, timeout=args.timeout, repeat=args.repeat,
                      json_out=args.json, deterministic=args.deterministic)
    try:
        with user_input():
            if args.top < 1:
                raise InputError(f"--top must be >= 1, got {args.top}")
            if args.deterministic and args.ep > 1:
                raise InputError("--deterministic needs --ep 1 (the expert-parallel combine is not the one-device "
                                 "one; docs/deterministic.md)")
            res = run_launch(spec, progress=progress_printer(args, "launch"))
    except InputError as exc:
        if reports_errors():  # one line per node, not one per rank
            print(f"cpgraph launch: error: {one_line(exc)}", file=sys.stderr)
        return 2
    if res is None:  # not global rank 0: rank 0 prints the job's results
        return 0
    lay = res.layout
    launched = _Prompts(res.tokens, res.tokens, None)
    top = _print_top(args, launched, res.prefix_lens, res.logits)
    print(f"world {lay.world_size} = {lay.dp} data-parallel group(s) x CP {lay.cp} (EP {lay.ep}) on {res.device} "
          f"({res.backend})")
    for g in res.groups:
        tokens = sum(len(res.tokens[i]) for i in g.prompt_indices)
        runs = f"first run {g.seconds[0]:.3f} s (compile)"
        if len(g.seconds) > 1:
            runs += f", last run {g.seconds[-1]:.3f} s ({tokens / max(g.seconds[-1], 1e-9):.0f} tok/s)"
        print(f"group {g.group}: ranks {g.ranks}, prompts {g.prompt_indices}, {tokens} tokens: {runs}; "
              f"ranks agree: {g.ranks_agree}")
        for r, b, n, w in zip(g.ranks, g.kv_bytes_per_rank, g.pages_per_rank, g.weight_bytes_per_rank):
            print(f"rank {r}: KV {b} bytes in {n} owned page(s) = {b / max(g.replicated_bytes, 1):.3f} of a "
                  f"replicated cache ({g.replicated_bytes} bytes); weights {w} bytes")
    if args.json:
        import dataclasses

        payload = _run_payload(args, launched, res.prefix_lens, res.logits, top, world_size=lay.world_size,
                               cp=lay.cp, ep=lay.ep, dp=lay.dp, device=res.device, backend=res.backend,
                               weights=res.weights, groups=[dataclasses.asdict(g) for g in res.groups])
        _write_json(args.json, payload, progress_printer(args, "launch"))
    if not all(g.ranks_agree for g in res.groups):
        print("error: the ranks of a CP group returned different logits", file=sys.stderr)
        return 1
    return 0

