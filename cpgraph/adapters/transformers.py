"""transformers' DSA models under ``cpgraph.compile``, by module swap.

:func:`adapt` takes a transformers 5.24 ``DeepseekV32ForCausalLM`` or
``GlmMoeDsaForCausalLM`` and replaces, in place, the only modules that break
the model contract (``docs/model_contract.md``):

* every attention module (``model.layers[i].self_attn``) becomes
  :class:`SparseMLAttention`: absorbed MLA over the paged KV pool with
  ``kv_compose`` / ``sparse_mla``, instead of transformers' dense
  ``[S, S]`` mask attention with a key cache object;
* its indexer becomes :class:`LightningIndexer` (``indexer_topk`` over the
  index-K pool);
* every MoE block becomes :class:`RoutedMoE`: transformers' own router and
  shared experts, routed experts through ``moe_experts`` instead of a
  per-expert Python loop (``nonzero`` per expert: a host sync and a
  data-dependent shape, which the contract forbids).

Each adapter holds the original submodules -- the very ``nn.Linear``,
norm, router and expert objects, so the same ``Parameter`` objects under the
same names (``model.layers.1.mlp.experts.gate_up_proj``): nothing is copied
or converted, and a checkpoint loads into the adapted model as into the
original.  Everything else (embedding, decoder layers with their norms and
residuals, dense MLPs, the rotary table, the final norm, ``lm_head``) runs
transformers' own code, unmodified.

:func:`adapt` returns :class:`AdaptedCausalLM`, the forward cpgraph's engine
calls: ``(input_ids [M], meta, mla_pools, index_pools) -> ForwardOutput``.
It runs ``model.model`` with the compute rows as the *batch* dimension
(``input_ids [M, 1]``: each row is a sequence of one token), so every
transformers module outside attention sees ``[rows, ...]`` tensors, which
is what the MoE pass compacts; the attention adapters find the batch
metadata and the pools in the keyword arguments transformers threads to
every attention module.  The wrapper then selects each request's last row
(``take_rows``), applies ``lm_head`` and states the logits ``"global"``.

Limits: dense KV records only (the pool holds ``[latent | k_pe]`` in the
model's dtype; no 656-byte FP8 records), no MTP draft layer, logits only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

import cpgraph.ops.codecs  # noqa: F401  (mla_dense_pack)
import cpgraph.ops.indexer  # noqa: F401  (indexer_topk)
import cpgraph.ops.layer_events  # noqa: F401  (kv_layer_ready / kv_layer_written)
import cpgraph.ops.materialize  # noqa: F401  (kv_compose)
import cpgraph.ops.moe  # noqa: F401  (moe_experts)
import cpgraph.ops.paged  # noqa: F401  (paged_store / paged_gather)
import cpgraph.ops.row_scope  # noqa: F401
import cpgraph.ops.rows  # noqa: F401  (take_rows)
import cpgraph.ops.sparse_mla  # noqa: F401
from cpgraph.models.batch import BatchMeta, KVLayout
from cpgraph.models.layers import rope_neox
from cpgraph.models.model import ForwardOutput
from cpgraph.ops.mla_query import rope_interleaved

_ops = torch.ops.cpgraph

# The class names of the MoE adapter: pass them as ``CPConfig(moe_modules=MOE_MODULES)``
# so the MoE pass finds the regions it compacts (it matches module class names).
MOE_MODULES = ("RoutedMoE",)

# The indexer's RoPE on its first ``qk_rope_head_dim`` dims, per model type: DeepSeek-V3.2 rotates
# half-split pairs (transformers' ``apply_rotary_pos_emb``), GLM-5 interleaved pairs.
INDEXER_ROPE = {"deepseek_v32": rope_neox, "glm_moe_dsa": rope_interleaved}

# Bytes of fp32 indexer logits one ``indexer_topk`` chunk may hold: cpgraph's own model's default.
MAX_LOGITS_BYTES = KVLayout().max_logits_bytes

# The keyword under which the wrapper hands the batch to the attention adapters.
BATCH_KWARG = "cpgraph_batch"


@dataclass
class PagedBatch:
    """What every attention adapter reads: the batch metadata and the per-layer KV pools."""

    meta: BatchMeta
    mla_pools: Sequence[Tensor]
    index_pools: Sequence[Tensor]


@dataclass(frozen=True)
class PoolLayout:
    """The config fields cpgraph's engine reads to size the KV pool (``runtime.engine.pool_config``)."""

    vocab_size: int
    num_hidden_layers: int
    indexer_layers: tuple[int, ...]  # layers that run their own indexer (and own index-K pages)
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int


def _rows(t: Tensor, width: int) -> Tensor:
    """``[M, 1, ...]`` (rows as transformers' batch, sequences of one) -> ``[M, width]``."""
    return t.reshape(t.shape[0], width)


class LightningIndexer(nn.Module):
    """transformers' indexer weights, scored by ``indexer_topk`` over the composed index-K view."""

    def __init__(self, original: nn.Module, rope):
        super().__init__()
        self.wq_b = original.wq_b
        self.wk = original.wk
        self.k_norm = original.k_norm
        self.weights_proj = original.weights_proj
        self.n_heads = original.n_heads
        self.head_dim = original.head_dim
        self.rope_dim = original.qk_rope_head_dim
        self.topk = original.index_topk
        self.rope = rope
        # transformers scales each head's ReLU'd dot product by head_dim^-0.5 and the head weights by
        # n_heads^-0.5; both are positive, so they fold into the weights (ReLU commutes with them).
        self.weight_scale = original.softmax_scale * original.n_heads**-0.5

    def _rope_first(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((self.rope(rot, cos, sin), rest), dim=-1)

    def forward(self, x: Tensor, q_lat: Tensor, cos: Tensor, sin: Tensor, meta: BatchMeta, pool: Tensor) -> Tensor:
        """RAGGED top-k ids ``int32 [M, topk]`` into the full view; this forward's keys go to ``pool``."""
        M = x.shape[0]
        q = self._rope_first(self.wq_b(q_lat).view(M, self.n_heads, self.head_dim), cos, sin)
        k = self._rope_first(self.k_norm(self.wk(x)), cos, sin).to(pool.dtype)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.weight_scale
        _ops.paged_store(pool, k, meta.row_slots)
        (k_full,) = _ops.kv_compose([_ops.paged_gather(pool, meta.prefix_slots)], [k], meta.kv_source)
        return _ops.indexer_topk(q, k_full, w, meta.ks, meta.ke, self.topk, MAX_LOGITS_BYTES)


class SparseMLAttention(nn.Module):
    """transformers' MLA weights, computed in absorbed form over the paged pool (docs/models.md).

    Takes the attention module's call as transformers' decoder layer makes
    it (``hidden_states [M, 1, hidden]``, ``position_embeddings``, and the
    keyword arguments it threads through), and returns what the original
    returns: ``(out, None)``, plus the top-k ids for GLM-5's attention, whose
    decoder layer hands them to the next (IndexCache) layer.
    """

    def __init__(self, original: nn.Module, index_pool: int | None, rope):
        super().__init__()
        for name in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                     "o_proj"):
            setattr(self, name, getattr(original, name))
        self.layer_idx = original.layer_idx
        self.num_heads = original.num_heads
        self.nope = original.qk_nope_head_dim
        self.rope_dim = original.qk_rope_head_dim
        self.kv_lora = original.kv_lora_rank
        self.v_dim = original.v_head_dim
        self.sm_scale = original.scaling
        indexer = getattr(original, "indexer", None)
        self.indexer = LightningIndexer(indexer, rope) if indexer is not None else None
        self.index_pool = index_pool
        # GLM-5's attention takes the previous layer's top-k and returns its own (DeepSeek's does neither).
        self.returns_topk = hasattr(original, "skip_topk")

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor], attention_mask=None,
                cache=None, position_ids=None, prev_topk_indices: Tensor | None = None, **kwargs):
        batch = kwargs.get(BATCH_KWARG)
        if not isinstance(batch, PagedBatch):
            raise RuntimeError(
                f"SparseMLAttention (layer {self.layer_idx}) runs only inside AdaptedCausalLM's forward, which passes "
                f"the batch as {BATCH_KWARG}=PagedBatch(...)"
            )
        meta = batch.meta
        mla_pool = batch.mla_pools[self.layer_idx]
        M = hidden_states.shape[0]
        H = self.num_heads
        x = _rows(hidden_states, hidden_states.shape[-1])
        # transformers' tables are cat(freqs, freqs) per row: the first half holds each pair's angle.
        cos, sin = (_rows(t, self.rope_dim)[:, : self.rope_dim // 2] for t in position_embeddings)
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.kv_lora)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]

        q_lat = self.q_a_layernorm(self.q_a_proj(x))
        q = _ops.mla_query(self.q_b_proj(q_lat).view(M, H, self.nope + self.rope_dim), w_uk, cos, sin)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        k_pe = rope_interleaved(k_pe, cos, sin)

        _ops.kv_layer_ready(mla_pool, self.layer_idx)
        record = _ops.mla_dense_pack(c, k_pe.to(c.dtype))
        _ops.paged_store(mla_pool, record, meta.row_slots)
        (kv,) = _ops.kv_compose([_ops.paged_gather(mla_pool, meta.prefix_slots)], [record], meta.kv_source)
        if self.indexer is not None:
            topk = self.indexer(x, q_lat, cos, sin, meta, batch.index_pools[self.index_pool])
        elif prev_topk_indices is not None:
            topk = prev_topk_indices
        else:
            raise ValueError(f"layer {self.layer_idx} shares the top-k of an earlier layer but none ran an indexer")
        _ops.kv_layer_written(mla_pool, self.layer_idx)
        out_lat, _ = _ops.sparse_mla(q, kv, topk, self.sm_scale, self.kv_lora)
        out = torch.einsum("mhl,hvl->mhv", out_lat, w_uv).reshape(M, 1, H * self.v_dim)
        out = self.o_proj(out)
        return (out, None, topk) if self.returns_topk else (out, None)


class RoutedMoE(nn.Module):
    """transformers' router and shared experts; the routed experts' stacks through ``moe_experts``.

    ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` are
    transformers 5's stacked layout, the one ``moe_experts`` takes.  The op
    gets no real-row count: the MoE pass compacts the real rows to the front
    of this module's input and hands the op their count (docs/model_contract.md).
    """

    def __init__(self, original: nn.Module):
        super().__init__()
        self.experts = original.experts  # transformers' order, so parameters() lists them as the original does
        self.gate = original.gate
        self.shared_experts = original.shared_experts

    def forward(self, hidden_states: Tensor) -> Tensor:
        _, topk_w, topk_ids = self.gate(hidden_states)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        routed = _ops.moe_experts(x, topk_ids, topk_w.float(), self.experts.gate_up_proj, self.experts.down_proj)
        return routed.view(hidden_states.shape) + self.shared_experts(hidden_states)


class AdaptedCausalLM(nn.Module):
    """The forward cpgraph's engine calls, around a transformers causal LM whose modules :func:`adapt` swapped."""

    def __init__(self, hf: nn.Module, layout: PoolLayout):
        super().__init__()
        self.hf = hf
        self.config = layout

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.hf.lm_head.weight.device

    def forward(self, input_ids: Tensor, meta: BatchMeta, mla_pools: Sequence[Tensor],
                index_pools: Sequence[Tensor]) -> ForwardOutput:
        """``input_ids [M]`` compute rows (the plan's layout) -> fp32 last-token logits ``[B, vocab]``.

        ``mla_pools[layer]`` and ``index_pools[j]`` (the j-th indexer layer)
        are written in place.  ``attention_mask`` is given as transformers'
        precomputed mask mapping, empty: the attention adapters take their
        key windows from ``meta``, so no ``[M, M]`` mask is ever built.
        """
        out = self.hf.model(
            input_ids=input_ids[:, None],
            position_ids=meta.positions[:, None],
            attention_mask={"indexed_attention": None},
            use_cache=False,
            **{BATCH_KWARG: PagedBatch(meta, mla_pools, index_pools)},
        )
        h = out.last_hidden_state
        last = _ops.take_rows(h.reshape(h.shape[0], h.shape[-1]), meta.last_token_index)
        logits = _ops.row_scope(self.hf.lm_head(last).float(), "global")
        return ForwardOutput(logits, None, None)


def _is_mla(module: nn.Module) -> bool:
    return all(hasattr(module, n) for n in ("kv_a_proj_with_mqa", "kv_b_proj", "q_b_proj", "o_proj"))


def _is_routed_moe(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return (hasattr(module, "gate") and hasattr(module, "shared_experts")
            and hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"))


def adapt(hf: nn.Module) -> AdaptedCausalLM:
    """Swap ``hf``'s attention, indexer and MoE modules for cpgraph adapters (in place); wrap it for the engine.

    ``hf``: a transformers ``DeepseekV32ForCausalLM`` or
    ``GlmMoeDsaForCausalLM``.  After the swap ``hf`` itself no longer runs
    transformers' own forward (its attention needs the paged batch); every
    parameter is still the object it was.  Raises ``ValueError`` for another
    model type or a layer whose modules do not look like DSA's.
    """
    model_type = getattr(hf.config, "model_type", None)
    if model_type not in INDEXER_ROPE:
        raise ValueError(
            f"cpgraph.adapters.transformers: model type {model_type!r} is not one of {sorted(INDEXER_ROPE)}")
    if getattr(hf.config, "hidden_act", "silu") != "silu":
        raise ValueError(f"cpgraph.adapters.transformers: moe_experts computes SwiGLU experts, the model's "
                         f"hidden_act is {hf.config.hidden_act!r}")
    rope = INDEXER_ROPE[model_type]
    indexer_layers = []
    for i, layer in enumerate(hf.model.layers):
        attn = layer.self_attn
        if isinstance(attn, SparseMLAttention):
            raise ValueError("cpgraph.adapters.transformers: this model is adapted already")
        if not _is_mla(attn):
            raise ValueError(f"layer {i}: {type(attn).__name__} is not an MLA attention module")
        has_indexer = getattr(attn, "indexer", None) is not None
        layer.self_attn = SparseMLAttention(attn, len(indexer_layers) if has_indexer else None, rope)
        if has_indexer:
            indexer_layers.append(i)
        if _is_routed_moe(layer.mlp):
            layer.mlp = RoutedMoE(layer.mlp)
    c = hf.config
    layout = PoolLayout(c.vocab_size, c.num_hidden_layers, tuple(indexer_layers), c.kv_lora_rank, c.qk_rope_head_dim,
                        c.index_head_dim)
    return AdaptedCausalLM(hf, layout)
