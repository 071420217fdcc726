"""docs/cli.md is generated from the parser: it must match, and its examples must parse."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from cpgraph.cli import build_parser, main
from cpgraph.cli_docs import EXAMPLES, render_cli_docs

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_docs_cli_md_is_in_sync_with_the_parser():
    assert DOC.read_text() == render_cli_docs(build_parser()), (
        "docs/cli.md is stale: python -m cpgraph.cli --dump-docs > docs/cli.md")


def test_dump_docs_prints_the_page(capsys):
    assert main(["--dump-docs"]) == 0
    assert capsys.readouterr().out == render_cli_docs(build_parser())


def test_a_flag_without_an_example_cannot_be_rendered():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    sub.choices["plan"].add_argument("--undocumented", action="store_true")
    with pytest.raises(KeyError, match="no example for --undocumented"):
        render_cli_docs(parser)


@pytest.mark.parametrize("example", sorted({e for per in EXAMPLES.values() for e in per.values()}))
def test_every_example_parses(example):
    words = shlex.split(example)
    assert words[0] == "cpgraph"
    build_parser().parse_args(words[1:])  # SystemExit (a failure) on an unknown flag or a bad value
