"""Which implementation computed each cpgraph op call: counts per ``(op, device, implementation, reason)``.

Why: registering a provider says what *may* run, not what ran.  A provider
can hand a call on (FlashMLA refuses a shape and the Triton kernel takes it;
the Triton kernel refuses fp32 and the torch reference takes it), decided
per call from shapes and dtypes.  A report built from the registry would
name the provider for calls it never computed.  So the ledger counts at the
call: :func:`cpgraph.ops.providers.select` hands out the provider wrapped in
a :class:`Counted`, which counts one call under the provider's name when it
returns, unless code inside the call said, through :func:`fell_back` or
:func:`ran_as`, that another implementation computed it and why.

What a count covers: every call of the op body, eager or from a compiled
graph (Inductor and ``aot_eager`` graphs call the op like eager code), and
the calls made while a CUDA graph is warmed up and captured.  A CUDA-graph
*replay* runs no Python: it re-launches the kernels the capture recorded
(the implementation counted at the capture: the branches decide from
shapes, dtypes, the device and settings, which a captured graph fixes), and
is not counted.  ``cpgraph run --cache
--cuda-graphs`` prints the number of replays next to the counts.

Cost per call: one small list on a thread-local stack and one dict
increment, no device access (CUDA-graph capturable, no host sync).

A fallback -- code the provider would not have chosen, run because the
preferred one cannot take the call -- is logged at WARNING once per
``(op, reason)``; a by-design variant (:func:`ran_as`: e.g. the FP8 linear's
Triton GEMM where torch's blockwise ``scaled_mm`` does not apply) at INFO
once.  Both are counted under their implementation and reason.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("cpgraph.ops")

# (op, device type, implementation, reason) -> calls.  reason "" = the provider's own path.
_CALLS: dict[tuple[str, str, str, str], int] = {}
_LOGGED: set[tuple] = set()  # (op, reason) of fallbacks and (op, implementation, reason) of variants logged
_STATE = threading.local()  # .frames: one [op, device type, override key] per op call in progress


def _frames() -> list:
    frames = getattr(_STATE, "frames", None)
    if frames is None:
        frames = _STATE.frames = []
    return frames


class Counted:
    """The implementation ``select`` chose for ``(op, device_type)``: calls it and counts the call.

    The count goes under ``name`` unless :func:`fell_back` / :func:`ran_as`
    named another implementation during the call.  A call that raises is
    not counted (it computed nothing).
    """

    __slots__ = ("op", "device_type", "name", "fn", "key")

    def __init__(self, op: str, device_type: str, name: str, fn: Callable):
        self.op, self.device_type, self.name, self.fn = op, device_type, name, fn
        self.key = (op, device_type, name, "")

    def __call__(self, *args, **kwargs):
        frames = _frames()
        frame = [self.op, self.device_type, None]
        frames.append(frame)
        try:
            out = self.fn(*args, **kwargs)
        finally:
            frames.pop()
        key = frame[2] or self.key
        _CALLS[key] = _CALLS.get(key, 0) + 1
        return out


def _record(op: str, device_type: str, implementation: str, reason: str) -> None:
    """Put the call in progress of ``op`` under ``implementation`` (a later record in the same call wins)."""
    key = (op, device_type, implementation, reason)
    frames = _frames()
    if frames and frames[-1][0] == op and frames[-1][1] == device_type:
        frames[-1][2] = key
        return
    _CALLS[key] = _CALLS.get(key, 0) + 1  # a kernel called directly, not through the op: count it here


def fell_back(op: str, device_type: str, implementation: str, reason: str, *, instead_of: str) -> None:
    """The current call of ``op`` runs ``implementation`` instead of ``instead_of`` because ``reason``.

    Counted under ``(op, device_type, implementation, reason)``; WARNING once
    per ``(op, reason)``.  ``reason`` names a static fact (dtype, a shape
    rule, the device), never a per-batch size, so it stays one entry.
    """
    _record(op, device_type, implementation, reason)
    if (op, reason) not in _LOGGED:
        _LOGGED.add((op, reason))
        log.warning("cpgraph::%s on %s: %s runs instead of %s: %s (logged once per reason; the provider "
                    "report counts the calls)", op, device_type, implementation, instead_of, reason)


def ran_as(op: str, device_type: str, implementation: str, reason: str = "") -> None:
    """The current call of ``op`` runs ``implementation``, a by-design variant of its provider (INFO once)."""
    _record(op, device_type, implementation, reason)
    if (op, implementation, reason) not in _LOGGED:
        _LOGGED.add((op, implementation, reason))
        log.info("cpgraph::%s on %s: %s%s", op, device_type, implementation, f" ({reason})" if reason else "")


def calls(device_type: str) -> dict[str, list[dict]]:
    """``{op: [{"implementation", "calls", "reason"}, ...]}`` on ``device_type``, most calls first.

    ``reason`` is ``None`` for the provider's own path, else why that
    implementation computed those calls.
    """
    out: dict[str, list[dict]] = {}
    for (op, dev, impl, reason), n in _CALLS.items():
        if dev == device_type and n:
            out.setdefault(op, []).append({"implementation": impl, "calls": n, "reason": reason or None})
    for rows in out.values():
        rows.sort(key=lambda r: (-r["calls"], r["implementation"], r["reason"] or ""))
    return dict(sorted(out.items()))


def forget(op: str, device_type: str) -> None:
    """Drop the counts of ``op`` on ``device_type`` (its provider changed: old counts name other code)."""
    for key in [k for k in _CALLS if k[0] == op and k[1] == device_type]:
        del _CALLS[key]


def reset() -> None:
    """Drop every count (a run's report then covers that run only)."""
    _CALLS.clear()


def describe(rows: list[dict]) -> str:
    """One op's counts as text: ``flash_mla 118 calls, triton 2 calls (topk=1000 ...)``."""
    parts = []
    for r in rows:
        n = r["calls"]
        parts.append(f"{r['implementation']} {n} call{'s' if n != 1 else ''}"
                     + (f" ({r['reason']})" if r["reason"] else ""))
    return ", ".join(parts)


__all__ = ["Counted", "calls", "describe", "fell_back", "forget", "ran_as", "reset"]
