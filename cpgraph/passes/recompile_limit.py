"""Fail fast when a cpgraph compile runs past Dynamo's recompile limit.

Why: once a code object has ``torch._dynamo.config.recompile_limit`` graphs
(8 by default), Dynamo stops compiling it.  With ``fullgraph=False`` it then
runs the forward eagerly from then on, for every shape it has not seen: a
server that pads to more buckets than the limit quietly loses its compiled
kernels and its CP passes (an eager forward under CP is the single-device
model on a shard of the rows, not a CP forward).  With ``fullgraph=True``
Dynamo raises, but with a message that names neither the limit's value nor
what to change.

So every call of a ``cpgraph.compile`` result runs under
:func:`fail_on_recompile_limit`: Dynamo's ``fail_on_recompile_limit_hit``
is on for the duration of the call (not process-wide), and the hard failure
is re-raised as :class:`RecompileLimitError`, one line naming the limit,
its value (the number of graphs already compiled for the code object) and
the fix.  Dynamo refuses ``fail_on_recompile_limit_hit`` together with
``suppress_errors``; a caller who turned ``suppress_errors`` on asked for
eager fallbacks, so then the flag stays off and a WARNING says, once, that
the limit falls back to eager.
"""

from __future__ import annotations

import contextlib
import logging
import re

import torch

log = logging.getLogger(__name__)

_FLAG = "fail_on_recompile_limit_hit"
_warned_suppress = False


class RecompileLimitError(RuntimeError):
    """A cpgraph-compiled forward needed more graphs than Dynamo's recompile limit allows."""


def _limit_type(exc: BaseException) -> str:
    """Which Dynamo limit was hit (``recompile_limit`` or ``accumulated_recompile_limit``)."""
    cause = exc.__cause__ or exc.__context__
    found = re.search(r"Limit type: (\w+)", str(cause)) if cause is not None else None
    name = found.group(1) if found else "recompile_limit"
    return name if hasattr(torch._dynamo.config, name) else "recompile_limit"


def _message(exc: BaseException) -> str:
    name = _limit_type(exc)
    value = getattr(torch._dynamo.config, name)
    return (
        f"cpgraph.compile: torch._dynamo.config.{name} = {value} reached: {value} graphs are already compiled "
        f"for this forward and Dynamo would run the next shape eagerly; raise "
        f"torch._dynamo.config.{name} above the number of shapes you run (a GraphRunner compiles one graph per "
        f"bucket) or compile with dynamic=True (TORCH_LOGS=recompiles lists the reasons)"
    )


@contextlib.contextmanager
def fail_on_recompile_limit():
    """Turn Dynamo's recompile-limit fallback into :class:`RecompileLimitError` for the enclosed call."""
    global _warned_suppress
    from torch._dynamo.exc import FailOnRecompileLimitHit

    cfg = torch._dynamo.config
    with contextlib.ExitStack() as stack:
        if cfg.suppress_errors:
            if not _warned_suppress:
                _warned_suppress = True
                log.warning(
                    "cpgraph.compile: torch._dynamo.config.suppress_errors is on, so past "
                    "torch._dynamo.config.recompile_limit (%d) Dynamo runs the forward eagerly; cpgraph cannot fail "
                    "fast there", cfg.recompile_limit,
                )  # fmt: skip
        else:
            stack.enter_context(cfg.patch(**{_FLAG: True}))
        try:
            yield
        except FailOnRecompileLimitHit as exc:
            raise RecompileLimitError(_message(exc)) from exc
