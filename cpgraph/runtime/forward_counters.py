"""Process-wide counters read around each step's forward, to tell a cold step from a warm one.

Why they must be cheap: they are read twice per step, right after the
forward, where every Python call costs several times its warm price
(docs/serve.md, the idle path); a step that compiled a graph or prepared a
new CUDA-graph bucket counts as cold (``PrefillEngine.cold_steps``).
"""

from __future__ import annotations

from .graph_runner import graph_counts


def _graph_replays(forward) -> int:
    """Replays of captured CUDA graphs so far, for a ``graphed_forward`` (0 for any other forward)."""
    return graph_counts(forward)[0]


_DYNAMO_COUNTERS = None  # torch._dynamo.utils.counters, imported at the first step (importing dynamo is slow)


def _compiles() -> int:
    """Graphs TorchDynamo compiled so far in this process (a dict read: cheap enough for every step).

    The counters object is looked up once: an ``import`` statement inside the function ran the import
    machinery twice per step, around every forward."""
    global _DYNAMO_COUNTERS
    if _DYNAMO_COUNTERS is None:
        from torch._dynamo.utils import counters

        _DYNAMO_COUNTERS = counters
    return _DYNAMO_COUNTERS["stats"]["unique_graphs"]
