"""cpgraph's Triton kernels for CP data movement, registered as op providers.

Importing this package registers every kernel for device ``"cuda"``
through :func:`cpgraph.ops.providers.register_provider`; the custom ops stay
the wrappers (their metadata checks and fake rules are unchanged), and
``CPGRAPH_PROVIDERS=reference`` still forces the torch references.  On a
machine without Triton the import logs why and registers nothing, so the
references keep working.

Providers are plain functions that launch kernels (no ``triton_op``): the
same launchers then run on CPU tensors under ``TRITON_INTERPRET=1``, which
is how CI tests them.  See ``docs/kernels.md``.
"""

from __future__ import annotations

import logging

log = logging.getLogger("cpgraph.kernels")

PROVIDER_NAME = "triton"

try:
    import triton  # noqa: F401
except Exception as exc:  # pragma: no cover - triton is a dependency, but be explicit
    triton = None
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None


def providers() -> dict:
    """Op name -> Triton launcher (each takes the op's arguments, returns what the reference returns)."""
    from . import codecs, materialize, move
    from . import moe
    from . import indexer
    from . import fp8_linear
    from . import mla_query
    from . import index_quant

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
        **indexer.providers(),
        "fp8_block_linear": fp8_linear.fp8_block_linear,
        "mla_query": mla_query.mla_query,
        "hadamard": index_quant.hadamard,
        "index_k_quant": index_quant.index_k_quant,
        "indexer_q_quant": index_quant.indexer_q_quant,
    }


def register_triton_providers(device_types=("cuda",)) -> list[str]:
    """Register every Triton kernel for ``device_types``; returns the op names registered.

    ``device_types=("cpu",)`` is only meaningful under ``TRITON_INTERPRET=1``
    (tests use it to drive the ops end to end through the interpreter).
    """
    if _IMPORT_ERROR is not None:
        log.warning("cpgraph.kernels: triton unavailable (%s); ops keep their torch references", _IMPORT_ERROR)
        return []
    import cpgraph.ops  # noqa: F401  (the ops must exist before their providers)
    from cpgraph.ops.providers import register_provider

    table = providers()
    for device_type in device_types:
        for op, fn in table.items():
            register_provider(op, device_type, PROVIDER_NAME, fn)
    register_rerange_p2p(device_types)
    register_sparse_mla(device_types)
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


REGISTERED = register_triton_providers()

__all__ = ["register_sparse_mla", "unregister_sparse_mla", "register_triton_providers", "register_rerange_p2p", "unregister_triton_providers", "providers", "PROVIDER_NAME", "REGISTERED"]
