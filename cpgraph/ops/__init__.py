"""Semantic ops ``torch.ops.cpgraph.*``.

Importing this package registers every op (the "custom-op library import")
and nothing else: no provider is bound and no kernel module (nor Triton) is
imported.  A device's providers bind on its first use, or through
:func:`bind_providers` (see :mod:`cpgraph.ops.providers`).
Each op: a pure-shape fake rule, a torch reference that runs on CPU and CUDA,
a contract docstring, and an entry in ``docs/ops.md``.
"""

from . import codecs, collectives, indexer, layer_events, materialize, paged, rows, sparse_mla  # noqa: F401
from . import expert_parallel, moe, moe_route  # noqa: F401
from . import fp8_linear, mla_output, mla_query, norm_quant, row_scope  # noqa: F401
from . import eager_numerics, invariant, invariant_mode  # noqa: F401
from .providers import active_provider, bind_providers, register_provider, select, unregister_provider

__all__ = ["bind_providers", "register_provider", "unregister_provider", "select", "active_provider"]
