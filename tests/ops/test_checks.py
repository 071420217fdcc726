"""``CPGRAPH_DEBUG``: one parser for the whole package, and every reader uses it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import cpgraph
import cpgraph.ops  # noqa: F401  (registers the ops)
from cpgraph.ops.checks import DEBUG_ENV, debug_enabled

ops = torch.ops.cpgraph


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "True", "on", "ON", " on ", "\ttrue\n", " 1"])
def test_on_spellings(monkeypatch, value):
    monkeypatch.setenv("CPGRAPH_DEBUG", value)
    assert debug_enabled()
    with pytest.raises(ValueError, match="outside"):  # the range checks follow the parser
        ops.take_rows(torch.randn(3, 2), torch.tensor([3]))


@pytest.mark.parametrize("value", [None, "", "0", "false", "off", "no", "yes", "2", "enable", "o n", "-1", "1 1"])
def test_off_spellings(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CPGRAPH_DEBUG", raising=False)
    else:
        monkeypatch.setenv("CPGRAPH_DEBUG", value)
    assert not debug_enabled()
    assert torch.equal(ops.take_rows(torch.ones(3, 2), torch.tensor([3])), torch.zeros(1, 2))


def test_only_the_parser_reads_the_variable():
    """No module reads ``CPGRAPH_DEBUG`` from the environment except ``cpgraph/ops/checks.py``."""
    root = Path(cpgraph.__file__).parent
    readers = []
    for path in root.rglob("*.py"):
        if path == root / "ops" / "checks.py":
            continue
        if re.search(r"(os\.environ|getenv)[^\n]*CPGRAPH_DEBUG", path.read_text()):
            readers.append(str(path.relative_to(root)))
    assert readers == [], f"read CPGRAPH_DEBUG through cpgraph.ops.checks.debug_enabled(): {readers}"
    assert DEBUG_ENV == "CPGRAPH_DEBUG"


def test_radix_consistency_check_follows_the_parser(monkeypatch):
    """``check_consistent`` runs when the flag is spelled ``true`` and not when it is ``off``."""
    import torch.distributed as dist

    from cpgraph.runtime import radix

    fingerprints = []

    class Tree:
        def fingerprint(self):
            fingerprints.append(1)
            return "00"

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather", lambda out, t, group=None: [o.copy_(t) for o in out])
    monkeypatch.setenv("CPGRAPH_DEBUG", "off")
    radix.check_consistent(Tree())
    assert fingerprints == []
    monkeypatch.setenv("CPGRAPH_DEBUG", " True ")
    radix.check_consistent(Tree())
    assert fingerprints == [1]
