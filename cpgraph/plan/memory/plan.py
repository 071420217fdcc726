"""The memory plan of one request on one CP group: ``MemoryPlan`` and ``plan_memory``, which builds it.

Why apart from the arithmetic: ``plan_memory`` checks the arguments,
derives the rows and keys of the forward from the zigzag split, and puts
weights, KV and activations together; ``MemoryPlan`` is what
``cpgraph memory`` prints (as a table or JSON) and what tests compare.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..split import split_requests
from .activations import activation_phases
from .expert_providers import _check_experts_provider
from .formats import DEFAULT_MAX_LOGITS_BYTES, _act_bytes, _check_int
from .kv import kv_bytes_per_token, owned_pages
from .weights import weight_bytes

if TYPE_CHECKING:  # pragma: no cover
    from cpgraph.models.config import DSAConfig


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank bytes of a CP prefill of one ``tokens``-long request (see ``cpgraph.plan.memory``'s docstring)."""

    model_type: str
    cp: int
    ep: int
    tokens: int
    rows: int  # rows per rank in the forward the activations describe
    keys: int  # full-view keys of that forward (the whole context, page-rounded)
    page_size: int
    dtype: str
    kv_format: str
    index_format: str
    weights: dict[str, int]
    kv_per_token: dict[str, int]  # all layers, one token
    pages_per_rank: int
    pages_total: int
    activation_base: int
    activation_phases: dict[str, int] = field(default_factory=dict)
    deterministic: bool = False  # the activations are those of a forward in the deterministic mode
    experts_provider: str = "triton"  # the cpgraph::moe_experts implementation booked (EXPERTS_PROVIDERS)

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def kv_bytes(self) -> int:
        """KV this rank stores for the context (the pages it owns)."""
        return self.pages_per_rank * self.page_size * sum(self.kv_per_token.values())

    @property
    def kv_replicated_bytes(self) -> int:
        """What each rank would store without owner sharding."""
        return self.pages_total * self.page_size * sum(self.kv_per_token.values())

    @property
    def peak_phase(self) -> str:
        return max(self.activation_phases, key=self.activation_phases.get)

    @property
    def activation_peak(self) -> int:
        return self.activation_base + self.activation_phases[self.peak_phase]

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.activation_peak

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(weight_bytes=self.weight_bytes, kv_bytes=self.kv_bytes, kv_replicated_bytes=self.kv_replicated_bytes,
                 peak_phase=self.peak_phase, activation_peak=self.activation_peak, total_bytes=self.total_bytes)
        return d


def plan_memory(cfg: "DSAConfig", *, tokens: int, cp: int = 1, ep: int = 1, row_bucket: int | None = None,
                dtype: str = "bf16", kv_format: str = "bf16", index_format: str | None = None, page_size: int = 64,
                max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES, deterministic: bool = False,
                experts_provider: str | None = None) -> MemoryPlan:
    """The per-rank memory plan of prefilling one request of ``tokens`` tokens on a CP group of ``cp`` ranks.

    ``row_bucket``: rows per rank of one forward (a chunked prefill, or the
    capture bucket rows are padded to); default: the rows the largest rank
    computes when the whole request is one forward.  The activations are
    those of the last such forward, which sees every key of the context.
    ``deterministic``: that forward runs in the deterministic mode (see
    :func:`activation_phases`: the fp32 products then copy ``x`` to fp32).
    ``experts_provider``: the routed experts' implementation, ``reference``,
    ``triton`` or ``deep_gemm`` (default: what runs on an SM90 GPU with
    DeepGEMM installed, :func:`default_experts_provider`).
    Raises ``ValueError`` (one line, naming the argument) on bad input.
    """
    tokens = _check_int("tokens", tokens)
    cp = _check_int("cp", cp)
    page_size = _check_int("page_size", page_size)
    if page_size & (page_size - 1):
        raise ValueError(f"plan_memory: argument 'page_size' must be a power of two, got {page_size}")
    _check_int("max_logits_bytes", max_logits_bytes)
    pages_rank, pages_total = owned_pages(tokens, cp, page_size)
    if row_bucket is None:
        split = split_requests(np.array([tokens]), cp_size=cp, page_size=page_size)
        rows = int(split.valid_rows_per_rank().max())
    else:
        rows = _check_int("row_bucket", row_bucket)
    keys = pages_total * page_size
    kv_tok = kv_bytes_per_token(cfg, kv_format, index_format, dtype)
    ep = _check_int("ep", ep)
    _act_bytes(dtype)  # a bad dtype is named before the provider is checked against it
    provider = _check_experts_provider(cfg, experts_provider, dtype, bool(deterministic))
    base, phases = activation_phases(cfg, rows, keys, dtype=dtype, kv_format=kv_format, index_format=index_format,
                                     ep=ep, max_logits_bytes=max_logits_bytes, deterministic=bool(deterministic),
                                     experts_provider=provider)
    return MemoryPlan(
        model_type=cfg.model_type, cp=cp, ep=ep, tokens=tokens, rows=rows, keys=keys, page_size=page_size,
        dtype=dtype, kv_format=kv_format, index_format=index_format or kv_format,
        weights=weight_bytes(cfg, dtype, ep), kv_per_token=kv_tok, pages_per_rank=pages_rank,
        pages_total=pages_total, activation_base=base, activation_phases=phases, deterministic=bool(deterministic),
        experts_provider=provider,
    )
