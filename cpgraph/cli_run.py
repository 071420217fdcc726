"""``cpgraph run`` and ``cpgraph launch``: prefill prompts and print the top tokens, KV and weight bytes, providers.

Here: both commands' flags, the flag combinations ``run`` refuses, and ``run``'s reading and checking of
its input, which ends in one of three runs, each in its own module: one device
(:mod:`cpgraph.cli_run_single`), the radix cache (``--cache``, :mod:`cpgraph.cli_run_cache`) and a CP group
it spawns (``--cp``, :mod:`cpgraph.cli_run_cp`).  ``launch`` (one rank of a torchrun job) runs in
:mod:`cpgraph.cli_launch`; all of them print and write their results with the output helpers of
:mod:`cpgraph.cli_run_output`.
"""

from __future__ import annotations

import argparse
import contextlib

from cpgraph.cli_common import DETERMINISTIC_HELP, add_model_format_flags, int_list, progress_printer
from cpgraph.cli_launch import cmd_launch
from cpgraph.cli_run_cache import run_cache
from cpgraph.cli_run_cp import run_cp
from cpgraph.cli_run_output import Prompts
from cpgraph.cli_run_single import run_single
from cpgraph.runtime.inputs import InputError, check_l3, user_input
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
                        "predicts the token after the target's top-1 token (docs/mtp.md); with --cache (one device) "
                        "both passes run it and the warm draft is checked against the cold one")
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
    ln.set_defaults(func=cmd_launch)
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
    if args.draft and args.cache and args.cp is not None:
        raise InputError("--draft with --cache runs on one device; with --cp it is not supported yet (drop --cp "
                         "or --cache)")
    if args.draft and args.cuda_graphs:
        raise InputError("--draft is not run with --cuda-graphs here (cpgraph serve --cuda-graphs --draft replays "
                         "the draft's own graphs)")
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
    prompts, prefix = Prompts(raw, req.prompts, tokenizer), req.prefix_lens
    if args.cp is not None:
        return run_cp(args, prompts, prefix, progress)
    from cpgraph.ops.invariant_mode import deterministic

    with deterministic() if args.deterministic else contextlib.nullcontext():  # eager forwards: the mode's kernels
        if args.cache:
            return run_cache(args, model, prompts, progress)
        return run_single(args, model, prompts, prefix, progress)
