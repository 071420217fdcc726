"""Loading DeepGEMM once, and whether this machine can run its SM90 kernels.

A module of its own that imports no other kernel module: the FP8 linear
(:mod:`.fp8_linear`) and the FP8 experts (:mod:`.deep_gemm_experts`) both ask
it, and the experts import the linear's quantiser, so neither may import the
other for this.  Installing DeepGEMM: docs/ops/fp8_linear.md#deepgemm-sm90.
"""

from __future__ import annotations

import torch
from torch import Tensor

_module = None
_import_error: str | None = None


def load():
    """``deep_gemm`` imported once, or ``None`` (the reason in :func:`import_error`)."""
    global _module, _import_error
    if _module is not None or _import_error is not None:
        return _module
    try:
        import deep_gemm

        if not hasattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous"):
            raise ImportError(f"deep_gemm {getattr(deep_gemm, '__version__', '?')} has no "
                              "m_grouped_fp8_gemm_nt_contiguous")
        _module = deep_gemm
    except Exception as exc:  # noqa: BLE001 - any failure to load means "not available", with the reason
        _import_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return _module


def import_error() -> str | None:
    return _import_error


def machine_reason(x: Tensor) -> str | None:
    """Why this machine cannot run DeepGEMM's SM90 kernels (``None`` if it can); ``x`` is a CUDA tensor."""
    if torch.cuda.get_device_capability(x.device)[0] != 9:
        return "DeepGEMM's fp32-scale FP8 GEMMs are its SM90 kernels, this GPU is not SM90"
    if load() is None:
        return f"deep_gemm does not load ({_import_error}); docs/ops/fp8_linear.md says how to install it"
    return None


__all__ = ["import_error", "load", "machine_reason"]
