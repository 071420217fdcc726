"""The ``cpgraph`` command: the parser and the entry point; each subcommand lives in its own module.

Subcommands are thin: they parse, validate, call the public API, and print.
A user error (a bad flag, prompt, checkpoint or output path) is one line on
stderr and exit status 2, never a traceback: it is caught while reading and
checking the input, before any rank is spawned or model compiled
(:mod:`cpgraph.runtime.inputs`).  An exception after that point is a bug and
keeps its traceback.  ``docs/cli.md`` is generated from :func:`build_parser`
(``python -m cpgraph.cli --dump-docs``).

The modules, each with its commands' flags (``add_*parser``) and code, so a
command is read and changed in one place: :mod:`cpgraph.cli_plan` (``plan``,
``memory``), :mod:`cpgraph.cli_run` (``run``, ``launch``),
:mod:`cpgraph.cli_pd` (``pd``), :mod:`cpgraph.cli_serve` (``serve``);
:mod:`cpgraph.cli_common` holds what they share and :mod:`cpgraph.cli_docs`
renders the docs.  They are imported inside :func:`build_parser`, so
importing this module stays cheap and none of them imports it back.
"""

from __future__ import annotations

import argparse
import sys

from cpgraph.cli_common import Parser, add_verbose, check_dash_values, configure_logging
from cpgraph.runtime.inputs import InputError, one_line


def build_parser() -> argparse.ArgumentParser:
    from cpgraph.cli_pd import add_parser as add_pd_parser
    from cpgraph.cli_plan import add_memory_parser, add_plan_parser
    from cpgraph.cli_run import add_launch_parser, add_run_parser
    from cpgraph.cli_serve import add_parser as add_serve_parser

    parser = Parser(prog="cpgraph", description="Context-parallel prefill for DSA models.")
    add_verbose(parser, 0)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    # The order of `cpgraph --help` and docs/cli.md.
    for add in (add_plan_parser, add_memory_parser, add_run_parser, add_pd_parser, add_launch_parser,
                add_serve_parser):
        add(sub)
    # -v also after the subcommand; SUPPRESS keeps a global -v
    for subparser in sub.choices.values():
        add_verbose(subparser, argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--dump-docs"]:
        from cpgraph.cli_docs import render_cli_docs

        sys.stdout.write(render_cli_docs(build_parser()))
        return 0
    parser = build_parser()
    try:
        check_dash_values(argv, parser)
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a one-line usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    configure_logging(args.verbose)
    try:
        return args.func(args)
    except InputError as exc:
        print(f"cpgraph {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
