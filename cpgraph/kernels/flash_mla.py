"""Optional ``cpgraph::sparse_mla`` provider: FlashMLA's SM90 sparse prefill kernel.

``flash_mla.flash_mla_sparse_fwd(q [s, h, 576] bf16, kv [n, 1, 576] bf16,
idx int32 [s, 1, topk], sm_scale, d_v=512, use_legacy=True)`` computes the
op's contract for the shapes it takes (the op's ``kv [N, D]`` and ``idx
[M, topk]`` are views of its operands).  On SM90 it is the fastest
implementation we have, so when the package imports it becomes the
``"cuda"`` provider, named ``"flash_mla"``; every call it refuses goes to
cpgraph's Triton kernel (:mod:`cpgraph.kernels.sparse_mla`), counted under
``triton`` with the reason in the provider report
(:mod:`cpgraph.ops.ledger`) and logged at WARNING once per reason:

* not bf16, ``D != 576``, ``d_v != 512``, ``H`` not 64 or 128;
* ``topk`` not a multiple of 128 (an SM90 requirement of the kernel);
* a device that is not SM90 (the legacy kernels are Hopper only).

An empty batch or key set also goes to the Triton kernel (it writes the
empty-row result without launching FlashMLA); that is counted, logged at
INFO only.

Where FlashMLA's contract differs from the op's, this module adapts it:

* ids: FlashMLA documents that it skips ``-1`` and ids ``>= n``; the op
  skips every negative id.  Negative ids are mapped to ``-1`` in the same
  elementwise pass that makes the int32 ``[M, 1, topk]`` list FlashMLA takes
  (see :func:`_flash_ids`; its cost is in the benchmark's provider overhead).
* a row with no valid entry: the op wants ``out = 0`` and ``lse = +inf``;
  the lse is rewritten where it is not finite (one tiny ``[M, H]``
  elementwise kernel).

Packaging: the PyPI wheel ``sgl-flash-mla==1.0.0`` (no extra: see docs/kernels.md)
declares ``torch>=2.14.1`` but its extensions use torch's stable ABI and
load on torch 2.11; install it with ``--no-deps`` so pip does not replace
torch.  Absent or unloadable, the Triton kernel is the provider; that is
logged once, never an error.
"""

from __future__ import annotations

import logging

import torch

from cpgraph.ops import ledger

from .provider_name import PROVIDER_NAME as TRITON  # the refused calls' implementation

log = logging.getLogger("cpgraph.kernels")

PROVIDER_NAME = "flash_mla"

_HEADS = (64, 128)
_TOPK_MULTIPLE = 128
_D = 576
_D_V = 512
EMPTY = "an empty batch or key set"

_flash = None
_IMPORT_ERROR: str | None = None
_LOGGED: set[str] = set()
_SM90: dict[int, bool] = {}


def _log_once(msg: str, *args) -> None:
    key = msg % args
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info(msg, *args)


def load() -> bool:
    """Import ``flash_mla`` once; ``True`` iff its legacy (SM90) kernels are available."""
    global _flash, _IMPORT_ERROR
    if _flash is not None:
        return True
    if _IMPORT_ERROR is not None:
        return False
    try:
        import flash_mla

        if not flash_mla.has_legacy():
            raise ImportError("the installed flash_mla has no legacy (SM90) kernels")
    except Exception as exc:  # noqa: BLE001 - any failure to load means "not available"
        _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
        return False
    _flash = flash_mla
    return True


def import_error() -> str | None:
    return _IMPORT_ERROR


def _is_sm90(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM90:
        _SM90[index] = torch.cuda.get_device_capability(index)[0] == 9
    return _SM90[index]


def refusal(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, d_v: int) -> str | None:
    """Why FlashMLA cannot take this call (``None`` if it can); shape/dtype facts only, no sync.

    The reasons name static facts (dtype, widths, top-k, the device), so a
    run has one report entry per reason, not one per batch.
    """
    if q.device.type != "cuda":
        return f"a {q.device.type} device (FlashMLA runs on CUDA)"
    if q.dtype != torch.bfloat16:
        return f"{q.dtype} operands (FlashMLA takes bf16)"
    if q.shape[2] != _D or d_v != _D_V:
        return f"D={q.shape[2]}, d_v={d_v} (FlashMLA takes 576 / 512)"
    if q.shape[1] not in _HEADS:
        return f"H={q.shape[1]} heads (FlashMLA takes 64 or 128)"
    topk = idx.shape[1]
    if topk == 0 or topk % _TOPK_MULTIPLE:
        return f"top-k {topk} is not a positive multiple of {_TOPK_MULTIPLE}"
    if q.shape[0] == 0 or kv.shape[0] == 0:
        return EMPTY
    if not _is_sm90(q.device):
        return "a non-SM90 GPU (FlashMLA's sparse prefill kernels are Hopper only)"
    return None


def _flash_ids(idx: torch.Tensor) -> torch.Tensor:
    """int32 ``[M, 1, topk]`` ids with every negative id as ``-1`` (FlashMLA skips ``-1`` and ids ``>= n``).

    int64 ids at or above 2**31 are clamped to ``2**31 - 1``, still ``>= n``
    for any pool that fits memory, so they stay skipped.
    """
    if idx.dtype == torch.int64:
        idx = idx.clamp(-1, torch.iinfo(torch.int32).max).to(torch.int32)
    else:
        idx = idx.clamp_min(-1)
    return idx.unsqueeze(1)


def sparse_mla(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sm_scale: float, d_v: int):
    """Provider of ``cpgraph::sparse_mla`` on CUDA: FlashMLA where it applies, else the Triton kernel."""
    from . import sparse_mla as triton_sparse_mla

    reason = refusal(q, kv, idx, d_v)
    if reason is not None:
        if reason == EMPTY:
            ledger.ran_as("sparse_mla", q.device.type, TRITON, reason)
        else:
            ledger.fell_back("sparse_mla", q.device.type, TRITON, reason, instead_of=PROVIDER_NAME)
        return triton_sparse_mla.sparse_mla(q, kv, idx, sm_scale, d_v)
    out, _, lse = _flash.flash_mla_sparse_fwd(
        q if q.stride(-1) == 1 else q.contiguous(),
        kv.contiguous().unsqueeze(1),
        _flash_ids(idx),
        float(sm_scale),
        d_v,
        use_legacy=True,
    )
    lse = torch.where(torch.isfinite(lse), lse, torch.full((), float("inf"), device=lse.device))
    return out, lse


def register(device_types=("cuda",)) -> bool:
    """Make FlashMLA the ``sparse_mla`` provider on ``"cuda"`` iff it imports (absence is logged once)."""
    if "cuda" not in device_types:
        return False
    from cpgraph.ops.providers import register_provider

    if not load():
        _log_once("cpgraph.kernels: FlashMLA not available (%s); sparse_mla uses the Triton kernel", _IMPORT_ERROR)
        return False
    register_provider("sparse_mla", "cuda", PROVIDER_NAME, sparse_mla)
    log.info("cpgraph.kernels: sparse_mla on cuda uses FlashMLA's SM90 kernel (Triton for shapes it refuses)")
    return True


__all__ = ["PROVIDER_NAME", "load", "import_error", "refusal", "register", "sparse_mla"]
