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
