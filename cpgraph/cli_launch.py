"""``cpgraph launch``: this process is one rank of a torchrun job, CP prefill on data-parallel CP groups.

A module of its own because torchrun, not this command, starts the ranks (:mod:`cpgraph.runtime.launch`):
every rank runs this code, only global rank 0 prints the job's results, and a user error is reported
once per node.  Its flags live with ``run``'s in :mod:`cpgraph.cli_run`; it prints and writes its results
with ``run``'s output helpers (:mod:`cpgraph.cli_run_output`), so the two commands' reports read alike.
"""

from __future__ import annotations

import argparse
import sys

from cpgraph.cli_common import progress_printer
from cpgraph.cli_run_output import Prompts, print_top, run_payload, write_json
from cpgraph.runtime.inputs import InputError, one_line, user_input


def cmd_launch(args: argparse.Namespace) -> int:
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
    launched = Prompts(res.tokens, res.tokens, None)
    top = print_top(args, launched, res.prefix_lens, res.logits)
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

        payload = run_payload(args, launched, res.prefix_lens, res.logits, top, world_size=lay.world_size,
                              cp=lay.cp, ep=lay.ep, dp=lay.dp, device=res.device, backend=res.backend,
                              weights=res.weights, groups=[dataclasses.asdict(g) for g in res.groups])
        write_json(args.json, payload, progress_printer(args, "launch"))
    if not all(g.ranks_agree for g in res.groups):
        print("error: the ranks of a CP group returned different logits", file=sys.stderr)
        return 1
    return 0
