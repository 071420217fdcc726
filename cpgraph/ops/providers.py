"""Per-device providers for cpgraph ops.

Every op has a torch reference implementation that runs on any device.  A
faster implementation (a Triton kernel, an optional DeepGEMM/FlashMLA
binding) is registered here per ``(op, device_type)`` and chosen when the op
runs.  The choice is logged once per op and device.  What *computed* each
call is counted by :mod:`cpgraph.ops.ledger`: a provider that hands a call on
(a shape its kernel does not take) records the implementation that ran and
why, with a WARNING once per reason; :func:`selected` and :func:`calls`
report those counts, not the registry.

``CPGRAPH_PROVIDERS=reference`` forces the reference everywhere (useful when
bisecting a numerical difference); ``CPGRAPH_PROVIDERS=op_a:reference,...``
forces it for the named ops only.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from . import ledger

log = logging.getLogger("cpgraph.ops")

REFERENCE = "reference"

# op name -> device type -> (provider name, implementation)
_PROVIDERS: dict[str, dict[str, tuple[str, Callable]]] = {}
_LOGGED: set[tuple[str, str]] = set()
# (op, device type) -> the counted wrapper select last handed out (rebuilt when the choice changes)
_BOUND: dict[tuple[str, str], ledger.Counted] = {}


def register_provider(op: str, device_type: str, name: str, fn: Callable) -> None:
    """Bind ``fn`` as the implementation of cpgraph op ``op`` on ``device_type``.

    ``fn`` takes the op's arguments and returns exactly what the reference
    returns (bit-exact where the op's docstring says so).
    """
    _PROVIDERS.setdefault(op, {})[device_type] = (name, fn)
    _LOGGED.discard((op, device_type))
    ledger.forget(op, device_type)


def unregister_provider(op: str, device_type: str) -> None:
    _PROVIDERS.get(op, {}).pop(device_type, None)
    _LOGGED.discard((op, device_type))
    ledger.forget(op, device_type)


def _forced_reference(op: str) -> bool:
    spec = os.environ.get("CPGRAPH_PROVIDERS", "").strip()
    if not spec:
        return False
    if spec == REFERENCE:
        return True
    for item in spec.split(","):
        name, _, choice = item.partition(":")
        if name.strip() == op and choice.strip() == REFERENCE:
            return True
    return False


def select(op: str, device_type: str, reference: Callable) -> Callable:
    """The implementation of ``op`` for ``device_type`` (logged once), wrapped so that its calls are counted.

    Call the result at once, inside the op body: the count goes to the
    implementation that computed the call (:mod:`cpgraph.ops.ledger`).
    """
    entry = None if _forced_reference(op) else _PROVIDERS.get(op, {}).get(device_type)
    name, fn = entry if entry is not None else (REFERENCE, reference)
    key = (op, device_type)
    bound = _BOUND.get(key)
    if bound is None or bound.fn is not fn or bound.name != name:
        bound = _BOUND[key] = ledger.Counted(op, device_type, name, fn)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("cpgraph::%s on %s uses provider %r", op, device_type, name)
    return bound


def calls(device_type: str) -> dict[str, list[dict]]:
    """``{op: [{"implementation", "calls", "reason"}, ...]}``: what computed each op's calls on ``device_type``.

    Counts since the process started, the last :func:`reset_calls`, or the
    op's last (un)registration on that device.  CUDA-graph replays are not
    counted (no Python runs on a replay; see :mod:`cpgraph.ops.ledger`).
    """
    return ledger.calls(device_type)


def selected(device_type: str) -> dict[str, str]:
    """``{op: implementation}`` for every op that computed on ``device_type``, from the call counts.

    Why: a run's report should name the code that computed, not the
    provider that was registered: a provider that hands some calls on
    (FlashMLA refusing a shape) shows both, most calls first, joined by
    ``+`` (``"flash_mla+triton"``); :func:`calls` has the counts and reasons.
    """
    return {op: "+".join(dict.fromkeys(r["implementation"] for r in rows)) for op, rows in calls(device_type).items()}


def reset_calls() -> None:
    """Forget every call count (a run's report then covers that run only)."""
    ledger.reset()


def active_provider(op: str, device_type: str) -> str:
    """Name of the provider ``select`` would hand out now (registration; :func:`calls` says what computed)."""
    if _forced_reference(op):
        return REFERENCE
    entry = _PROVIDERS.get(op, {}).get(device_type)
    return entry[0] if entry else REFERENCE
