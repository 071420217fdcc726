"""Past Dynamo's recompile limit a cpgraph compile fails with one clear line instead of running eagerly.

A tiny function compiled with static shapes recompiles once per input length;
with ``recompile_limit = 2`` its third length is one graph too many.  Plain
``torch.compile`` with ``fullgraph=False`` falls back to eager there (checked
below, so the test shows what cpgraph changes), and cpgraph's setting is scoped
to its own calls.
"""

from __future__ import annotations

import logging

import pytest
import torch

from cpgraph.passes import RecompileLimitError, compile
from cpgraph.passes import recompile_limit as rl

LIMIT = 2


def scale(x):
    return x * 2 + 1


@pytest.fixture
def small_limit():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=LIMIT, automatic_dynamic_shapes=False):
        yield
    torch._dynamo.reset()


def _lengths_until_failure(fn, count=LIMIT + 2):
    """Call ``fn`` on inputs of lengths 1, 2, ...; return the lengths that ran and the error (or None)."""
    ran = []
    for n in range(1, count + 1):
        x = torch.arange(n, dtype=torch.float32)
        try:
            out = fn(x)
        except RecompileLimitError as exc:
            return ran, exc
        assert torch.equal(out, x * 2 + 1)
        ran.append(n)
    return ran, None


@pytest.mark.parametrize("fullgraph", [False, True])
def test_past_the_limit_is_a_clear_error(small_limit, fullgraph):
    compiled = compile(scale, backend="aot_eager", dynamic=False, fullgraph=fullgraph)
    ran, exc = _lengths_until_failure(compiled)
    assert ran == [1, 2], "the first LIMIT shapes compile and run"
    msg = str(exc)
    assert "\n" not in msg
    assert f"torch._dynamo.config.recompile_limit = {LIMIT} reached: {LIMIT} graphs are already compiled" in msg
    assert "GraphRunner compiles one graph per bucket" in msg and "dynamic=True" in msg
    assert type(exc.__cause__).__name__ == "FailOnRecompileLimitHit"  # Dynamo's own error stays attached
    # Scoped to cpgraph's call: the process-wide flag is as it was.
    assert torch._dynamo.config.fail_on_recompile_limit_hit is False


def test_plain_torch_compile_still_falls_back(small_limit):
    """The behaviour cpgraph removes, and proof that its flag does not leak into other compiles."""
    compile(scale, backend="aot_eager", dynamic=False)(torch.ones(1))  # a cpgraph call first, in the same process
    plain = torch.compile(lambda x: x * 2 + 1, backend="aot_eager", dynamic=False, fullgraph=False)
    ran, exc = _lengths_until_failure(plain)
    assert exc is None and ran == [1, 2, 3, 4]  # lengths 3 and 4 ran eagerly, silently but for a Dynamo log line


def test_suppress_errors_falls_back_with_one_warning(small_limit, caplog, monkeypatch):
    """Dynamo refuses the fail-fast flag with ``suppress_errors``: cpgraph leaves it off and says so once."""
    monkeypatch.setattr(rl, "_warned_suppress", False)
    compiled = compile(scale, backend="aot_eager", dynamic=False, fullgraph=False)
    with torch._dynamo.config.patch(suppress_errors=True), caplog.at_level(logging.WARNING, logger=rl.__name__):
        ran, exc = _lengths_until_failure(compiled)
    assert exc is None and ran == [1, 2, 3, 4]
    warnings = [r for r in caplog.records if r.name == rl.__name__]
    assert len(warnings) == 1 and "suppress_errors is on" in warnings[0].getMessage()
    assert f"recompile_limit ({LIMIT})" in warnings[0].getMessage()
