"""Argument validation shared by the ops.

Eager-mode checks are cheap metadata checks (dtype, rank, shape, device) that
raise a ``ValueError`` naming the argument.  Checks that read index *values*
(range checks) would force a host sync, so they run only when the
environment variable ``CPGRAPH_DEBUG`` is on (:func:`debug_enabled`, the one
parser of that variable in the package).  Without the flag nothing is lost
in safety: every op defines what an out-of-range index does (it behaves like
``-1``, see ``docs/ops/paged.md``) and no kernel touches memory outside its
tensors; the flag only turns such an index into an error.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch


DEBUG_ENV = "CPGRAPH_DEBUG"
_DEBUG_ON = frozenset({"1", "true", "on"})


def debug_enabled() -> bool:
    """Whether ``CPGRAPH_DEBUG`` is on: ``1``, ``true`` or ``on`` (any case, surrounding spaces ignored).

    Anything else, including unset, ``0``, ``yes`` or an empty string, is
    off.  One closed list of "on" spellings, so a typo never turns host-
    syncing checks on in production by accident.  Read at every call (tests
    and operators flip it at run time).
    """
    return os.environ.get(DEBUG_ENV, "").strip().lower() in _DEBUG_ON


def _fmt_dtypes(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    op: str,
    name: str,
    t,
    *,
    dtype=None,
    ndim: int | None = None,
    shape: Iterable | None = None,
) -> None:
    """Raise ``ValueError`` if ``t`` is not a tensor of the given dtype(s)/rank/shape.

    ``shape`` entries may be ``None`` (any size).  Sizes are compared only
    when both are concrete ints, so the check is a no-op on symbolic sizes.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"cpgraph.{op}: argument '{name}' must be a tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, (tuple, list, set, frozenset)) else (dtype,)
        if t.dtype not in allowed:
            raise ValueError(f"cpgraph.{op}: argument '{name}' must have dtype {_fmt_dtypes(allowed)}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"cpgraph.{op}: argument '{name}' must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        shape = tuple(shape)
        if t.dim() != len(shape):
            raise ValueError(f"cpgraph.{op}: argument '{name}' must have shape {shape}, got {tuple(t.shape)}")
        for want, got in zip(shape, t.shape):
            if isinstance(want, int) and isinstance(got, int) and want != got:
                raise ValueError(
                    f"cpgraph.{op}: argument '{name}' must have shape {shape} (None = any), got {tuple(t.shape)}"
                )


def check_same_device(op: str, **tensors) -> None:
    """All named tensors must live on one device."""
    devs = {n: t.device for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devs.values())) > 1:
        desc = ", ".join(f"{n} on {d}" for n, d in devs.items())
        raise ValueError(f"cpgraph.{op}: arguments must be on one device, got {desc}")


def check_index_range(op: str, name: str, idx: torch.Tensor, lo: int, hi: int) -> None:
    """Debug-only: every entry of ``idx`` lies in ``[lo, hi)``.  Reads data (host sync)."""
    if not debug_enabled() or idx.numel() == 0:
        return
    mn, mx = int(idx.min()), int(idx.max())  # sync-ok: debug flag only
    if mn < lo or mx >= hi:
        raise ValueError(f"cpgraph.{op}: '{name}' has values in [{mn}, {mx}], outside [{lo}, {hi})")
