"""Low-overhead kernel launches: the compiled kernel is looked up once per specialisation.

Why: on the H200 machine a ``kernel[grid](...)`` call of the multi-segment
mover (44 parameters, most of them ``constexpr``) cost 30-50 us of host
time in Triton's generic path (binding every argument, building the cache
key from all of them), and the launchers around it another 50-100 us.  For
the narrow-row ops at 32K tokens the GPU work is 8-25 us, so eager calls were
bound by the host: measured 106 us per ``paged_gather`` call on the host
against 18.6 us of GPU time (CUDA-graph replay).

:class:`Launcher` keeps, per ``(constexpr values, num_warps, device,
Triton's specialisation of the runtime arguments)``, the compiled kernel
that Triton's own path returned the first time, and afterwards calls its
``run`` directly with the same arguments Triton would pass.  The
specialisation of a runtime argument is computed with Triton's own function
(``native_specialize_impl``: dtype and 16-byte alignment of a pointer,
width / divisibility / ``== 1`` of an integer), so the cache can never
hand out a kernel compiled for a different alignment.  Launch hooks
(profilers) are honoured.  Under ``TRITON_INTERPRET=1`` there is no
compiled kernel: the launcher simply calls ``kernel[grid](...)``.
Nothing here reads device memory, so launches stay CUDA-graph capturable.
"""

from __future__ import annotations

import os

import triton  # noqa: F401

try:  # Triton internals (3.x); if they move, fall back to the generic path
    from triton import knobs as _knobs
    from triton._C.libtriton import native_specialize_impl as _specialize
    from triton.runtime import driver as _driver
except Exception:  # pragma: no cover - depends on the Triton build
    _specialize = None


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (CPU tensors, no compiled kernels)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


class Launcher:
    """``Launcher(kernel)(grid, args, num_warps)``: ``args`` = every parameter in order, constexprs included."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._cache: dict = {}
        self._backend = None
        self._const_pos = None
        self._rt_pos = None

    def _positions(self):
        params = getattr(self.kernel, "params", None)
        if params is None:
            return None
        self._const_pos = tuple(p.num for p in params if p.is_constexpr)
        self._rt_pos = tuple(p.num for p in params if not p.is_constexpr)
        return self._rt_pos

    def __call__(self, grid: tuple, args: list, num_warps: int) -> None:
        if _specialize is None or interpreting():
            self.kernel[grid](*args, num_warps=num_warps)
            return
        if self._rt_pos is None and self._positions() is None:
            self.kernel[grid](*args, num_warps=num_warps)
            return
        device = _driver.active.get_current_device()
        stream = _driver.active.get_current_stream(device)
        if self._backend is None:
            from triton.compiler import make_backend

            self._backend = make_backend(_driver.active.get_current_target())
        backend = self._backend
        key = (
            device,
            num_warps,
            tuple([args[i] for i in self._const_pos]),
            tuple([_specialize(backend, args[i], False, True, True) for i in self._rt_pos]),
        )
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, num_warps=num_warps)  # Triton's path: compiles, launches
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            if compiled is not None and hasattr(compiled, "run"):
                self._cache[key] = compiled
            return
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        enter = _knobs.runtime.launch_enter_hook
        meta = compiled.launch_metadata(grid, stream, *args) if enter is not None else None
        compiled.run(
            g0, g1, g2, stream, compiled.function, compiled.packed_metadata, meta, enter,
            _knobs.runtime.launch_exit_hook, *args,
        )  # fmt: skip


__all__ = ["Launcher", "interpreting"]
