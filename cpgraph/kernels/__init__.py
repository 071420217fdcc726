"""cpgraph's Triton kernels for CP data movement, bound as op providers.

Importing this package registers nothing and imports no kernel (nor
Triton).  :func:`bind` registers every kernel for a device through
:func:`cpgraph.ops.providers.register_provider`; the op registry runs it on
the device's first use or from :func:`cpgraph.ops.bind_providers`
(docs/ops.md, "Provider binding").  The custom ops stay the wrappers (their
metadata checks and fake rules are unchanged), and
``CPGRAPH_PROVIDERS=reference`` still forces the torch references.  On a
machine without Triton the binding logs why (WARNING, once) and registers
nothing, so the references keep working and the provider report says
``reference``.

Providers are plain functions that launch kernels (no ``triton_op``): the
same launchers then run on CPU tensors under ``TRITON_INTERPRET=1``, which
is how CI tests them (:func:`register_triton_providers` with ``("cpu",)``).
See ``docs/kernels.md``.
"""

from __future__ import annotations

import logging

from .provider_name import PROVIDER_NAME

log = logging.getLogger("cpgraph.kernels")

_TRITON_CHECKED = False
_IMPORT_ERROR: Exception | None = None


def triton_import_error() -> Exception | None:
    """Why Triton does not import (``None`` if it does); tried once per process."""
    global _TRITON_CHECKED, _IMPORT_ERROR
    if not _TRITON_CHECKED:
        _TRITON_CHECKED = True
        try:
            import triton  # noqa: F401
        except Exception as exc:  # pragma: no cover - triton is a dependency, but be explicit
            _IMPORT_ERROR = exc
    return _IMPORT_ERROR


def providers() -> dict:
    """Op name -> Triton launcher (each takes the op's arguments, returns what the reference returns)."""
    from . import codecs, materialize, move
    from . import moe
    from . import indexer
    from . import fp8_linear
    from . import norm_quant
    from . import moe_route
    from . import mla_query
    from . import index_quant
    from . import invariant_gemm

    return {
        "take_rows": move.take_rows,
        "compact_valid": move.compact_valid,
        "restore_compute": move.restore_compute,
        "compact_valid_static": move.compact_valid_static,
        "restore_compute_static": move.restore_compute_static,
        "paged_gather": move.paged_gather,
        "paged_store": move.paged_store,
        "index_k_gather": move.index_k_gather,
        "index_k_store": codecs.index_k_store,
        "index_k_page_pack": codecs.index_k_page_pack,
        "mla_fp8_pack": codecs.mla_fp8_pack,
        "mla_fp8_unpack": codecs.mla_fp8_unpack,
        "cp_materialize_kv_pack": materialize.pack_rows,
        "cp_materialize_kv_place": materialize.place_rows,
        "moe_experts": moe.moe_experts,
        "moe_route": moe_route.moe_route,
        **indexer.providers(),
        "fp8_block_linear": fp8_linear.fp8_block_linear,
        "fp8_quantize_activations": fp8_linear.fp8_quantize_activations,
        "fp8_linear_quantized": fp8_linear.fp8_linear_quantized,
        "fp8_rms_norm_quantize": norm_quant.rms_norm_quantize,
        "mla_query": mla_query.mla_query,
        "mla_output": mla_query.mla_output,
        "hadamard": index_quant.hadamard,
        "index_k_quant": index_quant.index_k_quant,
        "indexer_q_quant": index_quant.indexer_q_quant,
        "indexer_q_prepare": index_quant.indexer_q_prepare,
        **invariant_gemm.providers(),
    }


def bind(device_type: str) -> list[str]:
    """Register this package's providers for ``device_type``; returns the Triton op names registered.

    What :func:`cpgraph.ops.bind_providers` (and a device's first use) runs;
    call that, not this: the registry then knows the device is bound.
    """
    return register_triton_providers((device_type,))


def register_triton_providers(device_types=("cuda",)) -> list[str]:
    """Register every Triton kernel for ``device_types``; returns the op names registered.

    On ``"cuda"`` also the P2P block rerange (:func:`.p2p.register_block_provider`)
    and FlashMLA where it imports.  ``device_types=("cpu",)`` is only
    meaningful under ``TRITON_INTERPRET=1`` (tests use it to drive the ops
    end to end through the interpreter).
    """
    error = triton_import_error()
    if error is not None:
        log.warning("cpgraph.kernels: triton unavailable (%s); ops keep their torch references", error)
        return []
    from cpgraph.ops.providers import register_provider

    from . import p2p

    table = providers()
    for device_type in device_types:
        for op, fn in table.items():
            register_provider(op, device_type, PROVIDER_NAME, fn)
    register_rerange_p2p(device_types)
    register_sparse_mla(device_types)
    if "cuda" in device_types:
        p2p.register_block_provider(("cuda",))
    return list(table)


def register_rerange_p2p(device_types=("cuda",)) -> bool:
    """Register the folded P2P rerange as ``cp_rerange``'s provider iff ``CPGRAPH_RERANGE=p2p``.

    Explicit opt-in (it needs host runs attached per batch, see
    :mod:`cpgraph.kernels.p2p`); the registry logs the choice once.
    """
    from cpgraph.ops.providers import register_provider

    from . import p2p

    if not p2p.enabled():
        return False
    for device_type in device_types:
        register_provider("cp_rerange", device_type, p2p.PROVIDER_NAME, p2p.cp_rerange_p2p)
    log.info("cpgraph.kernels: %s=p2p, cp_rerange uses the folded point-to-point path where runs are attached", p2p.ENV)
    return True


def unregister_triton_providers(device_types=("cuda",)) -> None:
    """Undo :func:`register_triton_providers` (tests; bisecting a difference)."""
    from cpgraph.ops.providers import active_provider, unregister_provider

    for device_type in device_types:
        for op in providers():
            if active_provider(op, device_type) == PROVIDER_NAME:
                unregister_provider(op, device_type)
    unregister_sparse_mla(device_types)


def register_sparse_mla(device_types=("cuda",)) -> None:
    """Triton ``sparse_mla`` / ``sparse_mla_fp8``; on CUDA, FlashMLA then takes ``sparse_mla`` where it imports.

    Kept out of :func:`providers` because the CUDA provider of ``sparse_mla``
    may be FlashMLA (name ``"flash_mla"``, see :mod:`.flash_mla`), not Triton.
    """
    from cpgraph.ops.providers import register_provider

    from . import flash_mla, sparse_mla

    for device_type in device_types:
        register_provider("sparse_mla", device_type, PROVIDER_NAME, sparse_mla.sparse_mla)
        register_provider("sparse_mla_fp8", device_type, PROVIDER_NAME, sparse_mla.sparse_mla_fp8)
    flash_mla.register(device_types)


def unregister_sparse_mla(device_types=("cuda",)) -> None:
    from cpgraph.ops.providers import unregister_provider

    for device_type in device_types:
        unregister_provider("sparse_mla", device_type)
        unregister_provider("sparse_mla_fp8", device_type)


__all__ = ["bind", "register_sparse_mla", "unregister_sparse_mla", "register_triton_providers", "register_rerange_p2p",
           "unregister_triton_providers", "providers", "triton_import_error", "PROVIDER_NAME"]
