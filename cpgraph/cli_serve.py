"""``cpgraph serve``: its flags, their checks and the dispatch to one device, a local CP group or torchrun.

Kept out of :mod:`cpgraph.cli` (which only registers it) so the serving
command's flags and rules live in one place.  Flags are checked before any
model is loaded, each bad one reported as one line (exit status 2); see
docs/serve.md for the API the server speaks.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import logging
import os

from cpgraph.cli_common import add_model_format_flags
from cpgraph.runtime.inputs import InputError, check_l3, user_input

# A worked example per flag for docs/cli.md (cpgraph.cli_docs); every line must parse.
EXAMPLES: dict[str | None, str] = {
    None: "cpgraph serve --model tiny-glm5 --port 8000",
    "--model": "cpgraph serve --model ./GLM-5",
    "--served-model-name": "cpgraph serve --model ./GLM-5 --served-model-name glm-5",
    "--host": "cpgraph serve --model tiny-glm5 --host 127.0.0.1",
    "--port": "cpgraph serve --model tiny-glm5 --port 0",
    "--cp": "cpgraph serve --model tiny-glm5 --cp 2 --backend aot_eager",
    "--ep": "cpgraph serve --model ./DeepSeek-V3.2 --cp 8 --ep 8 --device cuda --weights fp8",
    "--device": "cpgraph serve --model ./GLM-5 --device cuda",
    "--backend": "cpgraph serve --model tiny-glm5 --backend inductor",
    "--kv-format": "cpgraph serve --model tiny-deepseek-v32-fp8 --kv-format fp8",
    "--dtype": "cpgraph serve --model ./GLM-5 --dtype bfloat16",
    "--weights": "cpgraph serve --model ./DeepSeek-V3.2 --device cuda --dtype bfloat16 --weights fp8",
    "--page": "cpgraph serve --model ./GLM-5 --page 64",
    "--num-pages": "cpgraph serve --model tiny-glm5 --num-pages 8192",
    "--kv-memory-fraction": "cpgraph serve --model ./GLM-5 --device cuda --num-pages auto --kv-memory-fraction 0.85",
    "--host-pages": "cpgraph serve --model tiny-glm5 --host-pages 16384",
    "--l3": "cpgraph serve --model tiny-glm5 --host-pages 4096 --l3 file:/var/cache/cpgraph",
    "--token-budget": "cpgraph serve --model tiny-glm5 --token-budget 4096",
    "--chunk-tokens": "cpgraph serve --model tiny-glm5 --token-budget 4096 --chunk-tokens 1024",
    "--max-batch-requests": "cpgraph serve --model tiny-glm5 --max-batch-requests 16",
    "--max-queue": "cpgraph serve --model tiny-glm5 --max-queue 256",
    "--max-prompt-tokens": "cpgraph serve --model tiny-glm5 --max-prompt-tokens 32768",
    "--request-timeout": "cpgraph serve --model tiny-glm5 --request-timeout 120",
    "--cuda-graphs": "cpgraph serve --model ./GLM-5 --device cuda --backend inductor --cuda-graphs",
    "--kv-transfer": "cpgraph serve --model tiny-glm5 --kv-transfer",
    "--warmup-tokens": "cpgraph serve --model tiny-glm5 --warmup-tokens 0",
    "--warmup-prefix-tokens": "cpgraph serve --model ./GLM-5 --device cuda --backend inductor --cuda-graphs "
                              "--warmup-prefix-tokens 1024",
    "--own-kv-buckets": "cpgraph serve --model ./GLM-5 --device cuda --backend inductor --cuda-graphs "
                        "--own-kv-buckets --warmup-prefix-tokens 0",
    "--engine-thread-only": "cpgraph serve --model tiny-glm5 --engine-thread-only",
    "--timeout": "cpgraph serve --model tiny-glm5 --cp 2 --backend aot_eager --timeout 1800",
    "--quiet": "cpgraph serve --model tiny-glm5 --quiet",
    "--deterministic": "cpgraph serve --model ./GLM-5 --device cuda --backend inductor --deterministic",
    "--draft": "cpgraph serve --model ./DeepSeek-V3.2 --device cuda --backend inductor --draft --kv-transfer",
}


def add_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="a long-running CP prefill node: OpenAI-compatible completions over HTTP, "
                                     "continuous scheduling, radix cache, KV handoff to decode (see docs/serve.md)")
    s.add_argument("--model", required=True, help="bundled tiny model name or a local HF checkpoint dir")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name requests give and responses report (default: the --model name or "
                        "directory name)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1, loopback only; give another address to expose it)")
    s.add_argument("--port", type=int, default=8000,
                   help="TCP port (default 8000; 0 = any free port, printed at start); under torchrun CP group g "
                        "serves on port + g")
    s.add_argument("--cp", type=int, default=1,
                   help="CP group size: without torchrun, spawns N ranks on this machine (gloo on cpu, one GPU per "
                        "rank on cuda); under torchrun WORLD_SIZE / cp data-parallel groups (default 1)")
    s.add_argument("--ep", type=int, default=1,
                   help="expert parallelism over each CP group: 1, or equal to --cp (each rank holds and computes "
                        "1/ep of the routed experts; how V3.2 and GLM-5 fit on 8 GPUs; docs/expert_parallel.md) "
                        "(default 1)")
    s.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cpu, or cuda (a CP rank on cuda:LOCAL_RANK) (default auto: cuda when visible)")
    s.add_argument("--backend", choices=("eager", "aot_eager", "inductor"), default=None,
                   help="forward: eager model (one device only), or cpgraph.compile with aot_eager or inductor "
                        "(default: eager on one device, inductor with --cp)")
    add_model_format_flags(s, "FP8 checkpoints: dequantize to --dtype (the default) or keep the e4m3 projections (fp8)")
    s.add_argument("--page", type=int, default=16, help="KV page size, a power of two (default 16; 64 for the "
                                                        "production kernels)")
    s.add_argument("--num-pages", type=_pages, default=4096, metavar="N|auto",
                   help="KV pages per rank (L1, the device pool), or auto: what the device has left after the weights "
                        "and one step's planned activations, within --kv-memory-fraction (under CP the smallest over "
                        "the ranks) (default 4096)")
    s.add_argument("--kv-memory-fraction", type=float, default=None, metavar="F",
                   help="with --num-pages auto: the share of the device (CUDA) or of the available host memory "
                        "(CPU) the rank may fill, weights included; the rest is headroom (default 0.9)")
    s.add_argument("--host-pages", type=int, default=0,
                   help="L2 host pages per rank for HiCache (default 0: no L2)")
    s.add_argument("--l3", default=None, metavar="SPEC",
                   help="with --host-pages: a persistent page store behind L2, shared by every server and run with "
                        "the same model and KV layout: file:DIR[,max_bytes=SIZE] or mooncake:HOST:PORT[,metadata=URL] "
                        "(docs/cache.md); a restarted server serves the prefixes an earlier one stored")
    s.add_argument("--token-budget", type=int, default=2048,
                   help="prompt tokens computed per step, all requests together (default 2048)")
    s.add_argument("--chunk-tokens", type=int, default=None,
                   help="chunked prefill: tokens per chunk after a request's first, a page multiple <= the budget "
                        "(default: the budget in whole pages)")
    s.add_argument("--max-batch-requests", type=int, default=64, help="requests per step (default 64)")
    s.add_argument("--max-queue", type=int, default=1024,
                   help="requests waiting for admission before new ones get HTTP 429 (default 1024)")
    s.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longer prompts get HTTP 413 (default: the longest prompt the pool can hold)")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take from arrival before it is cancelled (HTTP 504) (default 600; "
                        "0 = no limit)")
    s.add_argument("--cuda-graphs", action="store_true",
                   help="on cuda (one device or each rank of --cp): replay the forward from CUDA graphs, one per "
                        "bucket (docs/cuda_graphs.md)")
    s.add_argument("--kv-transfer", action="store_true",
                   help="accept decode rooms (Mooncake, TCP): every rank runs a prefill peer; GET /v1/kv_transfer "
                        "names their addresses, a request's kv_transfer.room sends its KV there")
    s.add_argument("--warmup-tokens", type=int, default=64,
                   help="tokens of the warm-up request run before /health turns 200 (default 64; 0 = none)")
    s.add_argument("--warmup-prefix-tokens", type=int, default=None, metavar="N",
                   help="with --cuda-graphs: the warm-up prepares the buckets of steps with up to N cached-prefix "
                        "rows; a step past it captures its bucket under load (default: the token budget; 0 = only "
                        "the no-prefix buckets)")
    s.add_argument("--own-kv-buckets", action="store_true",
                   help="with --cuda-graphs: KV-view rows bucketed on their own (less padding, several buckets per "
                        "row and prefix bucket: many more to warm, so pair it with a small --warmup-prefix-tokens) "
                        "instead of derived from the row and prefix buckets")
    s.add_argument("--engine-thread-only", action="store_true",
                   help="every step on the engine thread: no idle fast path (a request that finds the engine idle "
                        "for longer than its last step took otherwise has its first step run on the event loop, "
                        "saving two thread wake-ups; the loop then answers nothing else for that step) "
                        "(docs/serve.md)")
    s.add_argument("--timeout", type=float, default=600.0,
                   help="with --cp: seconds the rendezvous and each collective may wait (default 600)")
    s.add_argument("--quiet", action="store_true",
                   help="no lifecycle lines (warm-up, ready, draining) on stderr; the listening address is always "
                        "printed")
    s.add_argument("--deterministic", action="store_true",
                   help="every request's logits and KV bytes depend only on that request and the model, never on "
                        "the batch, the cached prefix, the chunking or the CP size: row-invariant products "
                        "(docs/deterministic.md; slower)")
    s.add_argument("--draft", action="store_true",
                   help="also prefill the MTP draft layer (model.layers.{num_hidden_layers}; bundled models: a random "
                        "one) after the target on every step: its KV is cached and sent with the target's, and each "
                        "choice reports draft_token_ids, the draft's guess after the first token (docs/mtp.md); with "
                        "--cuda-graphs the draft replays a graph of its own per bucket")
    s.set_defaults(func=main)
    return s


def _pages(text: str):
    """``--num-pages``: a page count, or ``auto`` (``None``: sized from the memory left, cpgraph.runtime.kv_budget)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a page count or auto, got {text!r}") from None


def _positive(name: str, value, minimum: int = 1) -> None:
    if value < minimum:
        raise InputError(f"{name} must be >= {minimum}, got {value}")


def spec_from_args(args):
    """Check the flags (no model is loaded) and return the :class:`~cpgraph.serve.node.ServeSpec`."""
    from cpgraph.models.config import bundled_names
    from cpgraph.runtime.inputs import check_mooncake, check_parallel, check_weights, model_config

    missing = [m for m in ("aiohttp", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise InputError(f"cpgraph serve needs {' and '.join(missing)}: pip install 'cpgraph[serve]'")
    _positive("--cp", args.cp)
    if not 0 <= args.port < 65536:
        raise InputError(f"--port must be in [0, 65535], got {args.port}")
    try:
        ipaddress.ip_address(args.host)
    except ValueError:
        if args.host != "localhost":
            raise InputError(f"--host must be an IP address (or localhost), got {args.host!r}") from None
    _positive("--page", args.page)
    if args.page & (args.page - 1):
        raise InputError(f"--page must be a power of two, got {args.page}")
    for flag, v in (("--max-batch-requests", args.max_batch_requests), ("--max-queue", args.max_queue)):
        _positive(flag, v)
    if args.num_pages is not None:
        _positive("--num-pages", args.num_pages)
    if args.kv_memory_fraction is not None:
        if args.num_pages is not None:
            raise InputError("--kv-memory-fraction applies to --num-pages auto")
        if not 0.0 < args.kv_memory_fraction <= 1.0:
            raise InputError(f"--kv-memory-fraction must be in (0, 1], got {args.kv_memory_fraction}")
    _positive("--host-pages", args.host_pages, 0)
    _positive("--warmup-tokens", args.warmup_tokens, 0)
    if args.warmup_prefix_tokens is not None:
        _positive("--warmup-prefix-tokens", args.warmup_prefix_tokens, 0)
    for flag, given in (("--warmup-prefix-tokens", args.warmup_prefix_tokens is not None),
                        ("--own-kv-buckets", args.own_kv_buckets)):
        if given and not args.cuda_graphs:
            raise InputError(f"{flag} applies to the --cuda-graphs buckets; add --cuda-graphs")
    if args.token_budget < args.page:
        raise InputError(f"--token-budget must be at least a page ({args.page}), got {args.token_budget}")
    if args.chunk_tokens is not None and (args.chunk_tokens < args.page or args.chunk_tokens % args.page
                                          or args.chunk_tokens > args.token_budget):
        raise InputError(f"--chunk-tokens must be a multiple of the page size {args.page} and at most "
                         f"--token-budget {args.token_budget}, got {args.chunk_tokens}")
    if args.max_prompt_tokens is not None:
        _positive("--max-prompt-tokens", args.max_prompt_tokens)
    if args.request_timeout < 0 or args.timeout <= 0:
        raise InputError("--request-timeout must be >= 0 and --timeout > 0 seconds")
    backend = args.backend or ("eager" if args.cp == 1 and "RANK" not in os.environ else "inductor")
    if backend == "eager" and args.cp > 1:
        raise InputError("--backend eager runs one device; a CP group needs aot_eager or inductor")
    if args.cuda_graphs:
        if args.device == "cpu":
            raise InputError("--cuda-graphs captures on cuda (--device cuda or auto on a GPU machine)")
        if args.host_pages:
            raise InputError("--cuda-graphs does not take --host-pages (HiCache load-back waits on the host)")
    if args.l3 is not None:
        if not args.host_pages:
            raise InputError("--l3 needs --host-pages N (the L3 sits behind the L2 host pool)")
        check_l3(args.l3, cuda_graphs=args.cuda_graphs)
    cfg = model_config(args.model)  # config.json only: bad names fail before any weight is read
    check_parallel(cp=args.cp, ep=args.ep,
                   num_experts=cfg.n_routed_experts if "sparse" in cfg.mlp_layer_types else None)
    check_weights(args.model, args.weights, cfg)
    if args.draft and cfg.num_nextn_predict_layers < 1 and str(args.model) not in bundled_names():
        raise InputError(f"--draft: {args.model} declares no MTP layer (num_nextn_predict_layers is 0 or absent)")
    if args.kv_transfer:
        check_mooncake()
    from cpgraph.serve.node import ServeSpec

    return ServeSpec(model=str(args.model), served_name=args.served_model_name, host=args.host, port=args.port,
                     cp=args.cp, ep=args.ep, device=args.device, backend=backend, kv_format=args.kv_format, dtype=args.dtype,
                     weights=args.weights, page_size=args.page, num_pages=args.num_pages,
                     kv_memory_fraction=args.kv_memory_fraction or 0.9, host_pages=args.host_pages,
                     l3=args.l3, token_budget=args.token_budget, chunk_tokens=args.chunk_tokens,
                     max_batch_requests=args.max_batch_requests, max_queue=args.max_queue,
                     max_prompt_tokens=args.max_prompt_tokens, request_timeout=args.request_timeout or None,
                     cuda_graphs=args.cuda_graphs, kv_transfer=args.kv_transfer, warmup_tokens=args.warmup_tokens,
                     warmup_prefix_tokens=args.warmup_prefix_tokens, derive_kv_bucket=not args.own_kv_buckets,
                     timeout=args.timeout, log_level=logging.getLogger("cpgraph").level,
                     deterministic=args.deterministic, draft=args.draft,
                     idle_steps_on_loop=not args.engine_thread_only)


def main(args: argparse.Namespace) -> int:
    from cpgraph.runtime.launch import RENDEZVOUS_VARS

    with user_input():
        spec = spec_from_args(args)
    if not args.quiet and not logging.getLogger("cpgraph.serve").isEnabledFor(logging.INFO):
        logging.getLogger("cpgraph.serve").setLevel(logging.INFO)  # the lifecycle lines (ready, draining)
    from cpgraph.serve import node

    if any(v in os.environ for v in RENDEZVOUS_VARS):
        return node.serve_rank(spec)
    if spec.cp > 1:
        return node.serve_local_cp(spec)
    return node.serve_single(spec)
