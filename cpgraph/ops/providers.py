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

Binding.  ``import cpgraph.ops`` registers the ops and their fake rules and
nothing else: no Triton, no kernel module.  A device's providers are bound
the first time its registry is used -- :func:`select` (an op runs on a
tensor of that device), :func:`active_provider`, or a (un)registration for
it -- or when :func:`bind_providers` is called, and then never again in the
process.  Why first use and not import: the op library is imported by
every process that builds a graph or a plan (the CLI, gloo ranks, CPU
tests), most of which never run a CUDA kernel, and importing the kernels
from ``cpgraph.ops`` made ``ops`` and ``kernels`` import each other.  Why
bind before a registration too: a provider registered by hand (a test, a
bisection) is then never overwritten by a later first-use binding.  Only
``"cuda"`` has providers to bind (:mod:`cpgraph.kernels`); other devices
keep the references unless providers are registered for them.  Binding
imports modules and registers functions: no device work, so a first use
inside a compiled forward or a CUDA-graph warm-up adds no host sync (the
CUDA-graph runner binds before it warms up anyway).  See ``docs/ops.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Callable, Iterator

from . import ledger

log = logging.getLogger("cpgraph.ops")

REFERENCE = "reference"

# op name -> device type -> (provider name, implementation)
_PROVIDERS: dict[str, dict[str, tuple[str, Callable]]] = {}
_LOGGED: set[tuple[str, str]] = set()
# (op, device type) -> the counted wrapper select last handed out (rebuilt when the choice changes)
_BOUND: dict[tuple[str, str], ledger.Counted] = {}

# Device types whose providers :mod:`cpgraph.kernels` binds on first use.
BINDABLE = ("cuda",)
_BOUND_DEVICES: set[str] = set()  # devices whose binding finished (or that have nothing to bind)
_BINDING: set[str] = set()  # devices whose binder is running (its own registrations must not re-enter it)
_BIND_LOCK = threading.RLock()
# (op, device type) -> the recording that keeps its next calls' arguments (recording_calls)
_RECORDINGS: dict[tuple[str, str], "Recording"] = {}


def _ensure_bound(device_type: str) -> None:
    """Run ``device_type``'s binder once per process (the fast path is one set lookup)."""
    if device_type in _BOUND_DEVICES:
        return
    if device_type not in BINDABLE:
        _BOUND_DEVICES.add(device_type)
        return
    with _BIND_LOCK:  # another thread's first use waits for the binding, never sees half of it
        if device_type in _BOUND_DEVICES or device_type in _BINDING:
            return
        _BINDING.add(device_type)
        try:
            # The one import from ops up to kernels, made at first use (tests/test_imports.py names it).
            from cpgraph import kernels

            kernels.bind(device_type)
        finally:
            _BINDING.discard(device_type)
        _BOUND_DEVICES.add(device_type)  # not reached if the binder raised: the next use raises again
        log.info("cpgraph.ops: %s providers bound", device_type)


def bind_providers(device_type: str = "cuda") -> dict[str, str]:
    """Bind ``device_type``'s providers now (idempotent); returns ``{op: provider}`` registered for it.

    The explicit form of the first-use binding: call it before anything
    that must not import or register code on its first op call (a CUDA-graph
    capture, a timed region).  The result is the registry (what *may*
    run); :func:`calls` and :func:`selected` say what computed.  A device
    without a binder returns what was registered for it by hand.
    """
    _ensure_bound(device_type)
    return {op: by_dev[device_type][0] for op, by_dev in sorted(_PROVIDERS.items()) if device_type in by_dev}


def register_provider(op: str, device_type: str, name: str, fn: Callable) -> None:
    """Bind ``fn`` as the implementation of cpgraph op ``op`` on ``device_type``.

    ``fn`` takes the op's arguments and returns exactly what the reference
    returns (bit-exact where the op's docstring says so).  The device's
    providers are bound first, so a first-use binding never overwrites it.
    """
    _ensure_bound(device_type)
    _PROVIDERS.setdefault(op, {})[device_type] = (name, fn)
    _LOGGED.discard((op, device_type))
    ledger.forget(op, device_type)


def unregister_provider(op: str, device_type: str) -> None:
    """Give ``op`` on ``device_type`` back to its reference (the device is bound first, as for registration)."""
    _ensure_bound(device_type)
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
    The first call for a device binds its providers (unless the op is
    forced to the reference, which needs no kernel).
    """
    if _forced_reference(op):
        entry = None
    else:
        if device_type not in _BOUND_DEVICES:
            _ensure_bound(device_type)
        entry = _PROVIDERS.get(op, {}).get(device_type)
    name, fn = entry if entry is not None else (REFERENCE, reference)
    key = (op, device_type)
    bound = _BOUND.get(key)
    if bound is None or bound.fn is not fn or bound.name != name:
        bound = _BOUND[key] = ledger.Counted(op, device_type, name, fn)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("cpgraph::%s on %s uses provider %r", op, device_type, name)
    if _RECORDINGS:
        rec = _RECORDINGS.get(key)
        if rec is not None:
            return rec.wrap(bound)
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
    _ensure_bound(device_type)
    entry = _PROVIDERS.get(op, {}).get(device_type)
    return entry[0] if entry else REFERENCE


class Recording:
    """The arguments of an op's next calls on one device, and the implementation those calls ran.

    ``calls``: ``(args, kwargs)`` of up to ``limit`` calls, the tensors
    themselves (kept alive while the recording is held, so the caller
    chooses how many); ``fn``: the provider's implementation, uncounted, to
    replay them with; ``name``: its registered name.
    """

    def __init__(self, op: str, device_type: str, limit: int):
        self.op, self.device_type, self.limit = op, device_type, limit
        self.calls: list[tuple[tuple, dict]] = []
        self.fn: Callable | None = None
        self.name: str | None = None

    def wrap(self, bound: ledger.Counted) -> Callable:
        def call(*args, **kwargs):
            if len(self.calls) < self.limit:
                self.calls.append((args, kwargs))
                self.fn, self.name = bound.fn, bound.name
            return bound(*args, **kwargs)

        return call


@contextlib.contextmanager
def recording_calls(op: str, device_type: str, limit: int = 1) -> Iterator[Recording]:
    """Inside the block, keep the arguments of ``op``'s first ``limit`` calls on ``device_type``.

    Why: a kernel timed alone and the same kernel inside the forward can run
    at different rates (other inputs, other clocks, other work before it).
    Replaying the recorded implementation on the forward's own arguments
    (``benchmarks/op_replay.py``) tells those apart.  A diagnostic: the calls
    still compute and are counted as usual; outside a recording ``select``
    pays one test of an empty dict.  Eager and compiled forwards call the op
    body and are recorded; a CUDA-graph replay runs no Python and is not.
    """
    key = (op, device_type)
    if key in _RECORDINGS:
        raise RuntimeError(f"cpgraph::{op} on {device_type} is already being recorded")
    rec = _RECORDINGS[key] = Recording(op, device_type, limit)
    try:
        yield rec
    finally:
        del _RECORDINGS[key]
