"""Helpers every ``cpgraph`` subcommand module shares: the one-line-error parser, list flags, progress and logging.

One home for them so each command module (:mod:`cpgraph.cli_plan`, :mod:`cpgraph.cli_run`, ...) imports
them from here rather than from :mod:`cpgraph.cli`, which imports those modules: no import cycle.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys

from cpgraph.runtime.inputs import one_line


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (argparse's own print the usage block first)."""

    def error(self, message):  # noqa: D102
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see '{self.prog} --help')\n")


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


# Options whose value is a comma-separated list: "-16,0" after them reads as an option to argparse.
_LIST_FLAGS = ("--prefix", "--extend", "--prefix-lens")


def check_dash_values(argv: list[str], parser: argparse.ArgumentParser) -> None:
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


def progress_printer(args, command: str):
    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[cpgraph {command}] {msg}", file=sys.stderr, flush=True)

    return progress


def configure_logging(verbose: int) -> int:
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


DETERMINISTIC_HELP = ("every row's logits and KV bytes depend only on that request and the model, never on the batch, the cached prefix, the chunking or the CP size: row-invariant products in one fixed order (docs/deterministic.md; slower)")


def add_verbose(p: argparse.ArgumentParser, default) -> None:
    p.add_argument("-v", "--verbose", action="count", default=default,
                   help="log cpgraph's steps: -v INFO, -vv DEBUG (default: warnings only)")


WEIGHTS_HELP = ("FP8 checkpoints: dequantize to --dtype (the default) or keep the e4m3 projections with their block "
                "scales (fp8; on cpu the FP8 matmul is the slow torch reference)")


def add_model_format_flags(p: argparse.ArgumentParser, weights_help: str = WEIGHTS_HELP) -> None:
    """``--kv-format``, ``--dtype`` and ``--weights``: how a command that loads a model holds it (run, launch, serve)."""
    p.add_argument("--kv-format", choices=("bf16", "fp8"), default="bf16",
                   help="KV cache records: bf16 = dense in the model dtype, fp8 = 656-byte records (default bf16)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="model dtype (default: the checkpoint config's; float32 for bundled models)")
    p.add_argument("--weights", choices=("dequantize", "fp8"), default=None, help=weights_help)
