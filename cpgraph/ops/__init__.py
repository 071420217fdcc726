"""Semantic ops ``torch.ops.cpgraph.*``.

Importing this package registers every op (the "custom-op library import").
Each op: a pure-shape fake rule, a torch reference that runs on CPU and CUDA,
a contract docstring, and an entry in ``docs/ops.md``.
"""

from . import codecs, collectives, indexer, layer_events, materialize, paged, rows, sparse_mla  # noqa: F401
from . import expert_parallel, moe  # noqa: F401
from . import fp8_linear, mla_query, row_scope  # noqa: F401
from .providers import active_provider, register_provider, select, unregister_provider

__all__ = ["register_provider", "unregister_provider", "select", "active_provider"]

# Register the Triton providers for "cuda" (a warning, not an error, without Triton).
from .. import kernels as _kernels  # noqa: E402,F401
