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
    if args.cp is not None:
        return _run_cp(args, prompts, prefix, progress)
    if args.device != "cpu" or args.backend is not None:
        raise ValueError("--device and --backend apply to CP runs; add --cp N")
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
    top = out.topk(min(args.top, out.shape[1]), dim=-1).indices.tolist()
    for i, (p, ids) in enumerate(zip(prompts, top)):
        print(f"prompt {i}: {len(p)} tokens (prefix {prefix[i]}): top ids {ids}")
    tokens = sum(len(p) for p in prompts)
    print(
        f"{len(prompts)} prompts, {tokens} tokens in {elapsed:.3f} s ({tokens / max(elapsed, 1e-9):.0f} tok/s); "
        f"KV cache {args.kv_format}: {kv_bytes} bytes used (largest batch)"
    )
    if args.json:
        payload = {
            "logits": out.tolist(),
            "tokens": prompts,
            "top_ids": top,
            "model": str(args.model),
            "kv_format": args.kv_format,
            "prefix_lens": prefix,
            "kv_bytes": kv_bytes,
            "seconds": elapsed,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f)
        progress(f"wrote {args.json}")
    return 0


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
                     kv_format=args.kv_format, dtype=args.dtype, backend=backend, page_size=DEFAULT_PAGE_SIZE)
    res = run_cp(spec)
    out = res.logits
    top = out.topk(min(args.top, out.shape[1]), dim=-1).indices.tolist()
    for i, (p, ids) in enumerate(zip(prompts, top)):
        print(f"prompt {i}: {len(p)} tokens (prefix {prefix[i]}): top ids {ids}")
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
        payload = {
            "logits": out.tolist(),
            "tokens": prompts,
            "top_ids": top,
            "model": str(args.model),
            "kv_format": args.kv_format,
            "prefix_lens": prefix,
            "cp": args.cp,
            "device": args.device,
            "backend": backend,
            "max_abs_diff_vs_single_device": diff,
            "kv_bytes_per_rank": res.kv_bytes_per_rank,
            "replicated_kv_bytes": res.replicated_bytes,
            "seconds": res.seconds,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f)
        progress(f"wrote {args.json}")
    if not res.ranks_agree:
        print("error: ranks returned different logits", file=sys.stderr)
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
    r.set_defaults(func=_cmd_run)
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
