"""The activation peak of one forward: the base every phase keeps live, and each phase's peak for its worst layer.

Why apart from the parts: this is the one place that walks the config's
layers (which have their own indexer, which are dense or MoE) and combines
the per-part replays into the phases the plan reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .attention import _attention_layer
from .expert_providers import _check_experts_provider
from .formats import DEFAULT_MAX_LOGITS_BYTES, _act_bytes
from .mlp import _mlp_layer
from .op_bookings import _split_fp32_products
from .tape import _block

if TYPE_CHECKING:  # pragma: no cover
    from cpgraph.models.config import DSAConfig


def activation_phases(cfg: "DSAConfig", rows: int, keys: int, *, dtype: str = "bf16", kv_format: str = "bf16",
                      index_format: str | None = None, ep: int = 1,
                      max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES,
                      deterministic: bool = False, experts_provider: str | None = None) -> tuple[int, dict[str, int]]:
    """``(base, {phase: bytes})`` of one eager forward of ``rows`` rows per rank against ``keys`` full-view keys.

    ``base`` is live through every phase: the residual rows ``x``, the RoPE
    tables and the batch metadata.  A phase's bytes are the most live on top
    of the base while it runs, for the worst layer of its kind, and include
    what earlier phases left live (the layer's normed input, the previous
    layer's top-k, the attention output and residual sums).  The replay
    follows cpgraph's eager GPU forward with the CUDA default providers
    (Triton indexer scores/top-k -- chunked in both index-K formats -- and
    sparse MLA, torch Hadamard and FP8 query quantisation) and the routed
    experts of ``experts_provider``; ``docs/launch.md`` lists what each phase
    holds and ``benchmarks/memory_check.py`` measures it.

    * ``attention``: MLA queries and the KV view, then the indexer up to its top-k;
    * ``sparse_mla``: the same locals plus the top-k, the latent output and the value projection;
    * ``dense_mlp`` / ``moe``: the MLP half of a dense / MoE layer (router,
      the routed experts' buffers; with ``ep > 1`` the static-capacity dispatch
      and combine buffers of ``ep * rows * min(top_k, E / ep)`` rows).

    ``experts_provider``: the ``cpgraph::moe_experts`` implementation booked,
    by its provider-report name (:data:`EXPERTS_PROVIDERS`; ``None``:
    :func:`default_experts_provider`): ``reference`` the dense form (every
    expert on every row), ``triton`` the grouped path (bf16
    ``torch._grouped_mm`` with the fused Triton SwiGLU, or the Triton FP8
    grouped GEMM), ``deep_gemm`` DeepGEMM's layout (each expert's rows padded
    to 128, FP8 codes and scales gathered into it); see :func:`_routed_experts`.

    ``deterministic``: the forward runs inside the deterministic mode
    (``CPConfig(deterministic=True)``).  What it changes here is the fp32
    products of the router and the indexer's ``weights_proj``: outside it,
    bf16 activations multiply as one bf16 split GEMM with no fp32 copy of
    ``x``; inside it (as with fp16 activations) ``x`` is upcast first
    (:func:`_fp32_product`), and its experts are ``cpgraph::invariant_moe_experts``'
    (bf16: the GEMM gathers the rows, an eager ``silu(gate) * up``).  The
    mode's other GEMMs are booked as the default providers'.
    """
    a = _act_bytes(dtype)
    split = _split_fp32_products(dtype, deterministic)
    provider = _check_experts_provider(cfg, experts_provider, dtype, deterministic)
    index_format = index_format or kv_format
    R, N = rows, keys
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    base = _block(R * H * a) + 2 * _block(R * (cfg.qk_rope_head_dim // 2) * a) + 7 * _block(8 * R)
    own = [t == "full" for t in cfg.indexer_types]
    kinds = {(i > 0, own[i]) for i in range(L)}
    att = [_attention_layer(cfg, R, N, a, kv_format, index_format, max_logits_bytes, prev, mine, split)
           for prev, mine in sorted(kinds)]
    phases = {"attention": max(p[0] for p in att), "sparse_mla": max(p[1] for p in att)}
    for kind, name in (("dense", "dense_mlp"), ("sparse", "moe")):
        live = {(i > 0) + own[i] for i in range(L) if cfg.mlp_layer_types[i] == kind}
        if live:
            phases[name] = max(_mlp_layer(cfg, R, a, kind == "sparse", n, ep, split, provider, dtype == "fp8",
                                          deterministic) for n in live)
    return base, phases
