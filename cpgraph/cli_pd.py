"""``cpgraph pd``: CP prefill on CPU ranks, Mooncake KV transfer to a decode process, one decode step checked.

A module of its own because it drives the transfer path (:mod:`cpgraph.transfer.pd`) and prints transfer
figures, which no other command shares.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from cpgraph.cli_common import int_list, progress_printer
from cpgraph.runtime.inputs import InputError, user_input
from cpgraph.runtime.inputs import builtin_prompts as _builtin_prompts
from cpgraph.runtime.inputs import read_prompts as _read_prompts


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``pd``."""
    d = sub.add_parser("pd", help="prefill on N CP ranks, send the KV to a decode process (Mooncake), decode a token")
    d.add_argument("--model", default="tiny-glm5",
                   help="bundled tiny model name (default tiny-glm5) or a local checkpoint dir of a tiny model "
                        "(the decode side checks against transformers built from its config.json)")
    d.add_argument("--cp", type=int, default=2, help="prefill CP ranks (default 2)")
    d.add_argument("--prompts-file", default=None, help="JSON list of token-id lists (default: built-in prompts)")
    d.add_argument("--prefix-lens", type=int_list, default=None, help="cached prefix per prompt (page multiples)")
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
    return d


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
    progress_printer(args, "pd")(f"{args.cp} prefill rank(s) + 1 decode process on 127.0.0.1 (Mooncake TCP)")
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
