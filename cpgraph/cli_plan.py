"""``cpgraph plan`` and ``cpgraph memory``: what a CP prefill would do, computed on the CPU before any GPU is rented.

Both only plan (the batch split over the ranks, the per-rank bytes) and print; no model is built and no
rank spawned, so they share a module apart from the commands that run one.
"""

from __future__ import annotations

import argparse
import json

from cpgraph.cli_common import int_list
from cpgraph.runtime.inputs import user_input


def add_plan_parser(sub) -> argparse.ArgumentParser:
    """Register ``plan``."""
    p = sub.add_parser("plan", help="show how a prefill batch is split over a CP group")
    p.add_argument("--prefix", type=int_list, default=None, help="cached prefix length per request (default 0)")
    p.add_argument("--extend", type=int_list, required=True, help="new tokens per request, e.g. 1000,37")
    p.add_argument("--cp", type=int, default=2, help="CP group size (default 2)")
    p.add_argument("--page", type=int, default=64, help="KV page size, a power of two (default 64)")
    p.add_argument("--row-align", type=int, default=1, help="round rows per rank up to this (default 1)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)
    return p


def add_memory_parser(sub) -> argparse.ArgumentParser:
    """Register ``memory``."""
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
    return m


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
