"""The ``cpgraph`` command.

Subcommands are thin: they parse, validate, call the public API, and print.
A user error (a bad flag, prompt, checkpoint or output path) is one line on
stderr and exit status 2, never a traceback: it is caught while reading and
checking the input, before any rank is spawned or model compiled
(:mod:`cpgraph.runtime.inputs`).  An exception after that point is a bug and
keeps its traceback.  ``docs/cli.md`` is generated from :func:`build_parser`
(``python -m cpgraph.cli --dump-docs``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import sys

from cpgraph.runtime.inputs import InputError, check_l3, one_line, user_input
from cpgraph.runtime.inputs import builtin_prompts as _builtin_prompts
from cpgraph.runtime.inputs import read_prompts as _read_prompts


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (argparse's own print the usage block first)."""

    def error(self, message):  # noqa: D102
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see '{self.prog} --help')\n")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


# Options whose value is a comma-separated list: "-16,0" after them reads as an option to argparse.
_LIST_FLAGS = ("--prefix", "--extend", "--prefix-lens")


def _check_dash_values(argv: list[str], parser: argparse.ArgumentParser) -> None:
    """Say how to pass a list that starts with '-' (argparse would report a missing value)."""
    subs = _subparsers(parser)
    command = next((a for a in argv if a in subs), None)
    for flag, value in zip(argv, argv[1:]):
        if command and flag in _LIST_FLAGS and re.fullmatch(r"-\d[\d,]*", value):
            subs[command].error(f"argument {flag}: {value!r} starts with '-' and reads as an option; "
                                f"write {flag}={value}")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _progress(args, command: str):
    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[cpgraph {command}] {msg}", file=sys.stderr, flush=True)

    return progress


def _configure_logging(verbose: int) -> int:
    """``-v``: the cpgraph logger at INFO, ``-vv`` at DEBUG; default WARNING (quiet)."""
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    log = logging.getLogger("cpgraph")
    log.setLevel(level)
    if not any(getattr(h, "_cpgraph_cli", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
        handler._cpgraph_cli = True
        log.addHandler(handler)
    return level


# ----------------------------------------------------------------------------- plan


def _cmd_plan(args: argparse.Namespace) -> int:
    from cpgraph.plan import plan_prefill
    from cpgraph.plan.render import render_plan

    with user_input():
        prefix = args.prefix if args.prefix is not None else [0] * len(args.extend)
        plan = plan_prefill(prefix, args.extend, cp_size=args.cp, page_size=args.page, row_align=args.row_align)
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        print(render_plan(plan))
    return 0


# ----------------------------------------------------------------------------- memory


def _cmd_memory(args: argparse.Namespace) -> int:
    """``cpgraph memory``: per-rank weights, KV and activation peak of a CP prefill, from the config alone."""
    from cpgraph.plan.memory import plan_memory, render_memory
    from cpgraph.runtime.inputs import check_parallel, model_config

    with user_input():
        cfg = model_config(args.model_config, allow_file=True)
        moe = "sparse" in cfg.mlp_layer_types
        check_parallel(cp=args.cp, ep=args.ep, num_experts=cfg.n_routed_experts if moe else None)
        plan = plan_memory(cfg, tokens=args.tokens, cp=args.cp, ep=args.ep, row_bucket=args.row_bucket,
                           dtype=args.dtype, kv_format=args.kv_format, index_format=args.index_format,
                           page_size=args.page, deterministic=args.deterministic,
                           experts_provider=args.experts_provider)
    print(json.dumps(plan.to_dict()) if args.json else render_memory(plan))
    return 0


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
        if not args.cache or args.cp is not None or args.device != "cuda":
            raise InputError("--cuda-graphs applies to single-device --cache runs with --device cuda "
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

    progress = _progress(args, "run")
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
                     draft=args.draft, l3=args.l3, deterministic=args.deterministic, **_cache_kwargs(args))
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
    _print_providers(args.device, res.provider_calls)
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
                           l3=res.cache.get("l3"))
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
            res = run_launch(spec, progress=_progress(args, "launch"))
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
        _write_json(args.json, payload, _progress(args, "launch"))
    if not all(g.ranks_agree for g in res.groups):
        print("error: the ranks of a CP group returned different logits", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- pd


def _cmd_pd(args: argparse.Namespace) -> int:
    """``cpgraph pd --cp N``: prefill on N CPU ranks, Mooncake transfer over loopback, decode one token."""
    from cpgraph.runtime.inputs import check_batch_flags, check_mooncake, check_output_path, check_request, model_config

    with user_input():
        check_output_path(args.json)
        if args.timeout <= 0:
            raise InputError(f"--timeout must be > 0 seconds, got {args.timeout:g}")
        if not args.tol >= 0:
            raise InputError(f"--tol must be >= 0, got {args.tol:g}")
        check_batch_flags(page_size=args.page, cp=args.cp, chunk_tokens=args.chunk_tokens, group=args.group)
        vocab = model_config(args.model).vocab_size  # config.json only: checked before anything is spawned
        prompts = _read_prompts(args.prompts_file) if args.prompts_file else _builtin_prompts(vocab)
        req = check_request(prompts, args.prefix_lens, vocab=vocab, page_size=args.page, cp=args.cp,
                            chunk_tokens=args.chunk_tokens, group=args.group)
        check_mooncake()
    from cpgraph.transfer.engine import set_log_level
    from cpgraph.transfer.pd import PDSpec, run_pd

    set_log_level(logging.getLogger("cpgraph").getEffectiveLevel())  # Mooncake's own log follows -v (ranks inherit it)
    prompts = req.prompts
    spec = PDSpec(model=args.model, prompts=prompts, prefix_lens=args.prefix_lens, chunk_tokens=args.chunk_tokens,
                  cp=args.cp, page_size=args.page, backend=args.backend, group=args.group, timeout=args.timeout)
    _progress(args, "pd")(f"{args.cp} prefill rank(s) + 1 decode process on 127.0.0.1 (Mooncake TCP)")
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


# ----------------------------------------------------------------------------- parser


DETERMINISTIC_HELP = ("every row's logits and KV bytes depend only on that request and the model, never on the batch, the cached prefix, the chunking or the CP size: row-invariant products in one fixed order (docs/deterministic.md; slower)")


def _add_verbose(p: argparse.ArgumentParser, default) -> None:
    p.add_argument("-v", "--verbose", action="count", default=default,
                   help="log cpgraph's steps: -v INFO, -vv DEBUG (default: warnings only)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cpgraph", description="Context-parallel prefill for DSA models.")
    _add_verbose(parser, 0)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="show how a prefill batch is split over a CP group")
    p.add_argument("--prefix", type=_int_list, default=None, help="cached prefix length per request (default 0)")
    p.add_argument("--extend", type=_int_list, required=True, help="new tokens per request, e.g. 1000,37")
    p.add_argument("--cp", type=int, default=2, help="CP group size (default 2)")
    p.add_argument("--page", type=int, default=64, help="KV page size, a power of two (default 64)")
    p.add_argument("--row-align", type=int, default=1, help="round rows per rank up to this (default 1)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)

    m = sub.add_parser("memory", help="per-rank memory plan of a CP prefill (weights by part, KV, activation "
                                      "peak) from a model config, before renting GPUs")
    m.add_argument("--model-config", required=True, metavar="DIR_OR_NAME",
                   help="checkpoint dir, its config.json, or a bundled model name (no weights are read)")
    m.add_argument("--tokens", type=int, required=True, help="context length of the request to prefill")
    m.add_argument("--cp", type=int, default=1, help="CP group size (default 1)")
    m.add_argument("--ep", type=int, default=1, help="expert-parallel degree: 1 or equal to --cp (default 1)")
    m.add_argument("--row-bucket", type=int, default=None,
                   help="rows per rank of one forward (chunked prefill / capture bucket); default: the whole "
                        "request in one forward")
    m.add_argument("--dtype", choices=("bf16", "fp8", "fp32"), default="bf16",
                   help="weights: bf16, fp8 (e4m3 projections with 128x128 block scales) or fp32 (default bf16)")
    m.add_argument("--kv-format", choices=("bf16", "fp8"), default="bf16",
                   help="MLA cache records: bf16 = dense in the model dtype, fp8 = 656-byte records (default bf16)")
    m.add_argument("--index-format", choices=("bf16", "fp8"), default=None,
                   help="index-K cache: bf16 (dense) or fp8 (132 B/token at D=128) (default: as --kv-format)")
    m.add_argument("--page", type=int, default=64, help="KV page size, a power of two (default 64)")
    m.add_argument("--deterministic", action="store_true",
                   help="plan a forward in the deterministic mode (run --deterministic): its fp32 router and "
                        "indexer-weight products copy the activation to fp32")
    m.add_argument("--experts-provider", choices=("reference", "triton", "deep_gemm"), default=None,
                   help="the routed experts' implementation to plan, as the provider report names it: deep_gemm "
                        "(DeepGEMM's layout, 128 rows per expert at least), triton (grouped GEMMs), reference "
                        "(dense); default: what runs on an SM90 GPU with DeepGEMM (deep_gemm for fp8, triton for "
                        "bf16)")
    m.add_argument("--json", action="store_true", help="print the plan as JSON")
    m.set_defaults(func=_cmd_memory)

    r = sub.add_parser("run", help="prefill prompts on a DSA model (one device, or CP with --cp) and print top ids")
    r.add_argument("--model", required=True, help="bundled tiny model name (e.g. tiny-glm5) or a local HF checkpoint dir")
    r.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="a text prompt, encoded by the checkpoint's own tokenizer (repeatable; the top next tokens "
                        "are printed decoded beside their ids; bundled models have no tokenizer: give token ids)")
    r.add_argument("--prompts-file", default=None,
                   help="prompts as one JSON array or one per line (JSON Lines); a prompt is a JSON list of token ids "
                        "or a JSON string of text (text needs the checkpoint's tokenizer) (default: built-in prompts)")
    r.add_argument("--prefix-lens", type=_int_list, default=None,
                   help="tokens of each prompt to prefill and cache first (multiples of 16), e.g. 64,0")
    r.add_argument("--kv-format", choices=("bf16", "fp8"), default="bf16",
                   help="KV cache records: bf16 = dense in the model dtype, fp8 = 656-byte records (default bf16)")
    r.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="model dtype (default: the checkpoint config's; float32 for bundled models)")
    r.add_argument("--weights", choices=("dequantize", "fp8"), default=None,
                   help="FP8 checkpoints: dequantize to --dtype (the default) or keep the e4m3 projections with "
                        "their block scales (fp8; on cpu the FP8 matmul is the slow torch reference)")
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
                   help="with --cache --device cuda: replay the forward from CUDA graphs, one per row bucket "
                        "(docs/cuda_graphs.md)")
    r.add_argument("--draft", action="store_true",
                   help="also run the MTP draft layer (model.layers.{num_hidden_layers}; bundled models: a random one) "
                        "on the target's hidden states and print its top tokens beside the target's: the draft "
                        "predicts the token after the target's top-1 token (docs/mtp.md)")
    r.add_argument("--deterministic", action="store_true", help=DETERMINISTIC_HELP)
    r.set_defaults(func=_cmd_run)

    d = sub.add_parser("pd", help="prefill on N CP ranks, send the KV to a decode process (Mooncake), decode a token")
    d.add_argument("--model", default="tiny-glm5",
                   help="bundled tiny model name (default tiny-glm5) or a local checkpoint dir of a tiny model "
                        "(the decode side checks against transformers built from its config.json)")
    d.add_argument("--cp", type=int, default=2, help="prefill CP ranks (default 2)")
    d.add_argument("--prompts-file", default=None, help="JSON list of token-id lists (default: built-in prompts)")
    d.add_argument("--prefix-lens", type=_int_list, default=None, help="cached prefix per prompt (page multiples)")
    d.add_argument("--chunk-tokens", type=int, default=None, help="chunked prefill: tokens per chunk (page multiple)")
    d.add_argument("--page", type=int, default=16, help="KV page size, a power of two (default 16)")
    d.add_argument("--group", type=int, default=1, help="layers per transfer submit (default 1)")
    d.add_argument("--backend", choices=("inductor", "aot_eager"), default="aot_eager",
                   help="torch.compile backend of the CP ranks (default aot_eager)")
    d.add_argument("--tol", type=float, default=1e-4, help="max |logit diff| vs transformers (default 1e-4)")
    d.add_argument("--timeout", type=float, default=120.0, help="seconds per stage before failing (default 120)")
    d.add_argument("--json", default=None, metavar="OUT", help="write the figures to OUT")
    d.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    d.set_defaults(func=_cmd_pd)

    ln = sub.add_parser("launch", help="one rank of a torchrun job (torchrun ... -m cpgraph launch ...): CP prefill "
                                        "on data-parallel CP groups, one node or many (see docs/launch.md)")
    ln.add_argument("--model", required=True,
                    help="bundled tiny model name or a local HF checkpoint dir (the same path on every node)")
    ln.add_argument("--prompts-file", default=None,
                    help="JSON list of token-id lists, dealt round-robin to the CP groups; a name containing {group} "
                         "is one file per group (default: built-in prompts)")
    ln.add_argument("--prefix-lens", type=_int_list, default=None,
                    help="tokens of each prompt to prefill and cache first (multiples of 16), e.g. 64,0")
    ln.add_argument("--cp", type=int, default=None,
                    help="CP group size; WORLD_SIZE / cp data-parallel groups (default: the whole world)")
    ln.add_argument("--ep", type=int, default=1,
                    help="expert-parallel degree inside a CP group: 1 or equal to --cp (default 1)")
    ln.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="cuda = NCCL, rank on cuda:LOCAL_RANK; cpu = gloo (default auto: cuda when visible)")
    ln.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor",
                    help="torch.compile backend of the CP forward (default inductor)")
    ln.add_argument("--kv-format", choices=("bf16", "fp8"), default="bf16",
                    help="KV cache records: bf16 = dense in the model dtype, fp8 = 656-byte records (default bf16)")
    ln.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="model dtype (default: the checkpoint config's; float32 for bundled models)")
    ln.add_argument("--weights", choices=("dequantize", "fp8"), default=None,
                    help="FP8 checkpoints: dequantize to --dtype (the default) or keep the e4m3 projections with "
                         "their block scales (fp8; on cpu the FP8 matmul is the slow torch reference)")
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

    from cpgraph.cli_serve import add_parser as add_serve_parser

    add_serve_parser(sub)
    # -v also after the subcommand; SUPPRESS keeps a global -v
    for name in ("plan", "memory", "run", "pd", "launch", "serve"):
        _add_verbose(sub.choices[name], argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--dump-docs"]:
        from cpgraph.cli_docs import render_cli_docs

        sys.stdout.write(render_cli_docs(build_parser()))
        return 0
    parser = build_parser()
    try:
        _check_dash_values(argv, parser)
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a one-line usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    _configure_logging(args.verbose)
    try:
        return args.func(args)
    except InputError as exc:
        print(f"cpgraph {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
