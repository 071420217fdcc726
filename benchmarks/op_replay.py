"""Replay one op's provider on the arguments the forward gave it: is it the inputs or the GPU's state?

Why: a kernel can run slower inside the forward than in its own benchmark.
The FP8 index scoring measured 1.45x the bf16 keys alone and 1.18-1.26x in
the two-layer V3.2 forward (docs/performance.md), while the bf16 kernel kept
95 % of its own rate.  Two explanations predict different things:

* **the inputs** (the forward's keys, windows or chunking differ from the
  benchmark's): the replay on the forward's own arguments is slow even on a
  rested GPU (``rested``);
* **the GPU's state** (clocks held down by the power drawn by the GEMMs
  before it): the replay is fast when rested and slow right after a
  forward (``after_forward``).

:func:`replay_op` records the first call of ``op`` in one forward
(:func:`cpgraph.ops.providers.recording_calls`), then times the recorded
implementation on those arguments two ways: ``repeat`` calls back to back
after ``rest_s`` idle seconds, and one right after each of ``repeat``
forwards (enqueued behind it, so the GPU goes from the forward straight into
the replay).  With a
:class:`gpu_state.GpuState` each timing carries the clocks of its window.  The
replay is a diagnostic: it runs outside the forward and is not counted.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from cpgraph.ops.providers import recording_calls


def _elapsed_ms(fn: Callable[[], object], cuda: bool) -> float:
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def replay_op(forward: Callable[[], object], op: str, device_type: str, *, repeat: int = 3, rest_s: float = 2.0,
              state=None) -> dict:
    """Time ``op``'s recorded first call in ``forward``: rested and right after a forward (module docstring)."""
    cuda = device_type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with recording_calls(op, device_type, limit=1) as rec:
        forward()
        sync()
    if not rec.calls:
        return {"op": op, "recorded": 0, "why": f"the forward made no {op} call on {device_type}"}
    (args, kwargs), fn = rec.calls[0], rec.fn
    call = lambda: fn(*args, **kwargs)  # noqa: E731
    call()  # the first call of these shapes outside the forward (a Triton launch may compile)
    sync()

    def timed(run: Callable[[], list[float]]) -> dict:
        t0 = time.perf_counter()
        samples = run()
        out = {"ms": statistics.median(samples), "samples": [round(s, 4) for s in samples]}
        if state is not None and state.available:
            out["gpu"] = state.window(t0, time.perf_counter())
        return out

    result = {"op": op, "implementation": rec.name, "recorded": 1}
    time.sleep(rest_s)  # the GEMMs' heat and power drawn off; the first sample also shows the clock's ramp from idle
    result["rested"] = timed(lambda: [_elapsed_ms(call, cuda) for _ in range(repeat)])

    def after_forward() -> list[float]:
        got = []
        for _ in range(repeat):
            forward()  # enqueued; the replay's start event follows its last kernel on the stream
            got.append(_elapsed_ms(call, cuda))
        return got

    result["after_forward"] = timed(after_forward)
    return result


def describe(r: dict, state_describe: Callable[[dict | None], str] | None = None) -> str:
    """One log line per replay: both timings, with each window's clocks when sampled."""
    if not r.get("recorded"):
        return f"{r['op']}: not replayed ({r.get('why')})"
    parts = []
    for phase in ("rested", "after_forward"):
        p = r[phase]
        clock = f" [{state_describe(p.get('gpu'))}]" if state_describe is not None and "gpu" in p else ""
        parts.append(f"{phase.replace('_', ' ')} {p['ms']:.2f} ms{clock}")
    return f"{r['op']} ({r['implementation']}) replayed on the forward's first call: " + "; ".join(parts)
