"""Optional FP8 indexer provider: DeepGEMM's ``fp8_mqa_logits`` (``fp8_fp4_mqa_logits`` in sgl-deep-gemm 0.2.5).

DeepGEMM's kernel computes exactly the ``cpgraph::indexer_logits_fp8``
contract: ``sum_h w[s,h] * relu(q[s,h] . k[t] * k_scale[t])`` for e4m3
``q [M, H, D]``, e4m3 ``k [N, D]`` with one fp32 scale per key, fp32
weights ``[M, H]`` and int32 windows ``[ks, ke)``.  Bound here:

* ``indexer_logits_fp8``: the kernel's ``[M, N]`` logits (columns past
  ``N`` of a padded result dropped, ``-inf`` written outside every window
  so the op's contract holds whatever the kernel leaves there);
* the FP8 form of ``indexer_topk`` (``k_scale`` given): the kernel scores a
  byte-budgeted chunk of rows, cpgraph's Triton selection picks its top-k
  (the tie rule lives in the selection, so ids follow it exactly on the
  kernel's scores).  The bf16 form keeps the Triton provider.

Selection is explicit, never automatic: :func:`register` binds the two ops
(logged by the provider registry once per op), and fails with the import
error when the package does not load.  Packaging: the ``sgl-deep-gemm``
wheels declare their own torch; install with ``--no-deps`` into a directory
on ``PYTHONPATH``.

Versions: DeepGEMM 2.x (``deepinfer-gemm`` 2.8.2, built from source against
the installed torch: docs/ops/fp8_linear.md) names the kernel
``fp8_fp4_mqa_logits``, takes ``q`` as ``(codes, None)`` and returns
*compressed* rows: column ``j`` of row ``s`` is key ``ks[s] + j``.  The
binding shifts them back to key columns for ``indexer_logits_fp8`` and,
for ``indexer_topk``, selects on the relative windows ``[0, ke - ks)`` and
adds ``ks`` to the ids (the tie rule prefers the lower key id, which a shift
by one row's constant keeps).  Older wheels (``fp8_mqa_logits``, and
sgl-deep-gemm 0.2.5's ``fp8_fp4_mqa_logits``) return key columns.  The
sgl-deep-gemm wheels do not load with torch 2.11 (their ``_C.so`` needs
``c10::cuda::CUDAErrorLogCapture``).  ``docs/ops/indexer.md`` has the details.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("cpgraph.kernels")

PROVIDER_NAME = "deep_gemm"
_NAMES = ("fp8_mqa_logits", "fp8_fp4_mqa_logits")  # older wheels / sgl-deep-gemm 0.2.5

_fn = None
_fn_name: str | None = None
_compressed = False  # DeepGEMM 2.x: rows relative to each row's window start
_IMPORT_ERROR: str | None = None


def load() -> bool:
    """Import ``deep_gemm`` once; ``True`` iff it loads and has an mqa-logits kernel."""
    global _fn, _fn_name, _IMPORT_ERROR, _compressed
    if _fn is not None:
        return True
    if _IMPORT_ERROR is not None:
        return False
    try:
        import deep_gemm

        for name in _NAMES:
            if hasattr(deep_gemm, name):
                _fn, _fn_name = getattr(deep_gemm, name), name
                break
        else:
            raise ImportError(f"deep_gemm {getattr(deep_gemm, '__version__', '?')} has none of {_NAMES}")
        major = str(getattr(deep_gemm, "__version__", "0")).split(".")[0]
        _compressed = _fn_name == "fp8_fp4_mqa_logits" and major.isdigit() and int(major) >= 2
    except Exception as exc:  # noqa: BLE001 - any failure to load means "not available"
        _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
        return False
    return True


def import_error() -> str | None:
    return _IMPORT_ERROR


def kernel_name() -> str | None:
    return _fn_name


def _window_mask(ks, ke, n):
    cols = torch.arange(n, device=ks.device)
    return (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])


def _logits(q_bytes, k_bytes, k_scale, weights, ks, ke):
    """DeepGEMM's fp32 logits ``[M, >= N]`` of one call (windows as int32); compressed rows with DeepGEMM 2.x."""
    if not load():
        raise RuntimeError(f"cpgraph.kernels.deep_gemm_indexer: deep_gemm does not load: {_IMPORT_ERROR}")
    f8 = torch.float8_e4m3fn
    q = q_bytes.view(f8).contiguous()
    kv = (k_bytes.view(f8).contiguous(), k_scale.float().contiguous())
    ks32, ke32 = ks.to(torch.int32).contiguous(), ke.to(torch.int32).contiguous()
    if _compressed:
        return _fn((q, None), kv, weights.contiguous(), ks32, ke32, max(1, k_bytes.shape[0]))
    if _fn_name == "fp8_mqa_logits":
        return _fn(q, kv, weights.contiguous(), ks32, ke32, clean_logits=True)
    return _fn(q, kv, weights.contiguous(), ks32, ke32, 0)  # 0.2.5: max_seqlen_k positional, 0 = all N


def indexer_logits_fp8(q_bytes, k_bytes, k_scale, weights, ks, ke):
    """Provider of ``cpgraph::indexer_logits_fp8`` through DeepGEMM."""
    M, N = q_bytes.shape[0], k_bytes.shape[0]
    if M == 0 or N == 0:
        return torch.full((M, N), float("-inf"), dtype=torch.float32, device=q_bytes.device)
    out = _logits(q_bytes, k_bytes, k_scale, weights, ks, ke)[:, :N]
    inside = _window_mask(ks, ke, N)
    if _compressed:  # column j holds key ks + j: move each row back to key columns
        cols = torch.arange(N, device=ks.device)[None, :] - ks.to(torch.int64)[:, None]
        out = out.gather(1, cols.clamp(0, N - 1))
    return out.masked_fill(~inside, float("-inf"))


def indexer_topk(q, k, weights, ks, ke, topk, max_logits_bytes, k_scale=None):
    """Provider of ``cpgraph::indexer_topk``: DeepGEMM scores FP8 chunks, Triton selects; bf16 form: Triton."""
    from . import indexer as triton_indexer
    from cpgraph.ops.indexer import logits_chunk_rows

    if k_scale is None:  # by design: DeepGEMM scores the FP8 form only
        from cpgraph.ops import ledger

        ledger.ran_as("indexer_topk", q.device.type, "triton", "the bf16 form (DeepGEMM scores FP8 only)")
        return triton_indexer.indexer_topk(q, k, weights, ks, ke, topk, max_logits_bytes)
    M, N = q.shape[0], k.shape[0]
    out = torch.empty((M, topk), dtype=torch.int32, device=q.device)
    if M == 0:
        return out
    if N == 0:
        return out.fill_(-1)
    rows = min(M, logits_chunk_rows(N, max_logits_bytes))
    load()
    # Compressed rows (DeepGEMM 2.x): select over the relative windows [0, ke - ks), then shift the ids.
    sel_ks, sel_ke = (torch.zeros_like(ks), ke - ks) if _compressed else (ks, ke)
    for a in range(0, M, rows):
        b = min(M, a + rows)
        logits = _logits(q[a:b], k, k_scale, weights[a:b], ks[a:b], ke[a:b])
        if logits.shape[1] > 1 and logits.stride(1) != 1:
            logits = logits.contiguous()
        triton_indexer.select_rows(logits, sel_ks, sel_ke, out, a, b - a, topk)
    if _compressed:
        out = torch.where(out >= 0, out + ks.to(torch.int32)[:, None], out)
    return out


def register(device_types=("cuda",)) -> None:
    """Bind DeepGEMM for ``indexer_logits_fp8`` and ``indexer_topk`` (FP8 form); raises if it does not load."""
    if not load():
        raise RuntimeError(f"cpgraph.kernels.deep_gemm_indexer: deep_gemm does not load: {_IMPORT_ERROR}")
    from cpgraph.ops.providers import register_provider

    for device_type in device_types:
        register_provider("indexer_logits_fp8", device_type, PROVIDER_NAME, indexer_logits_fp8)
        register_provider("indexer_topk", device_type, PROVIDER_NAME, indexer_topk)
    log.info("cpgraph.kernels: indexer_logits_fp8 and indexer_topk (FP8 form) use DeepGEMM %s", _fn_name)


def unregister(device_types=("cuda",)) -> None:
    """Give both ops back to the Triton providers."""
    from cpgraph.ops.providers import register_provider

    from . import indexer as triton_indexer

    for device_type in device_types:
        register_provider("indexer_logits_fp8", device_type, "triton", triton_indexer.indexer_logits_fp8)
        register_provider("indexer_topk", device_type, "triton", triton_indexer.indexer_topk)


__all__ = ["load", "import_error", "kernel_name", "indexer_logits_fp8", "indexer_topk", "register", "unregister",
           "PROVIDER_NAME"]
