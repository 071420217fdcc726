"""Per-device providers for cpgraph ops.

Every op has a torch reference implementation that runs on any device.  A
faster implementation (a Triton kernel, an optional DeepGEMM/FlashMLA
binding) is registered here per ``(op, device_type)`` and chosen when the op
runs.  The choice is explicit and logged once per op and device, so a run's
log says exactly which code computed each op; nothing falls back silently.

``CPGRAPH_PROVIDERS=reference`` forces the reference everywhere (useful when
bisecting a numerical difference); ``CPGRAPH_PROVIDERS=op_a:reference,...``
forces it for the named ops only.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

log = logging.getLogger("cpgraph.ops")

REFERENCE = "reference"

# op name -> device type -> (provider name, implementation)
_PROVIDERS: dict[str, dict[str, tuple[str, Callable]]] = {}
_LOGGED: set[tuple[str, str]] = set()


def register_provider(op: str, device_type: str, name: str, fn: Callable) -> None:
    """Bind ``fn`` as the implementation of cpgraph op ``op`` on ``device_type``.

    ``fn`` takes the op's arguments and returns exactly what the reference
    returns (bit-exact where the op's docstring says so).
    """
    _PROVIDERS.setdefault(op, {})[device_type] = (name, fn)
    _LOGGED.discard((op, device_type))


def unregister_provider(op: str, device_type: str) -> None:
    _PROVIDERS.get(op, {}).pop(device_type, None)
    _LOGGED.discard((op, device_type))


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
    """Return the implementation of ``op`` for ``device_type`` (logged once)."""
    entry = None if _forced_reference(op) else _PROVIDERS.get(op, {}).get(device_type)
    name, fn = entry if entry is not None else (REFERENCE, reference)
    key = (op, device_type)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("cpgraph::%s on %s uses provider %r", op, device_type, name)
    return fn


def selected(device_type: str) -> dict[str, str]:
    """``{op: provider}`` for every op that has chosen its implementation on ``device_type`` in this process.

    Why: a run's report should name the ops that actually computed (each
    op calls :func:`select` when it runs, compiled or eager), not every op
    that exists.  Ops a (un)registration touched since they last ran drop
    out until they run again.
    """
    return {op: active_provider(op, device_type) for op, dev in sorted(_LOGGED) if dev == device_type}


def active_provider(op: str, device_type: str) -> str:
    """Name of the provider ``select`` would pick (for reports and tests)."""
    if _forced_reference(op):
        return REFERENCE
    entry = _PROVIDERS.get(op, {}).get(device_type)
    return entry[0] if entry else REFERENCE
