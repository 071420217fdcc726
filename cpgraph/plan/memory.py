"""Per-rank memory of a CP prefill, from a model config alone: weights, KV cache, activation peak.

Why a plan: the question "how many GPUs of which size does a 128K-token
prefill of this checkpoint need at CP 8 / EP 8" should be answered before
renting them, from ``config.json`` and arithmetic.  Everything here is a
pure function of a config object with the fields of
:class:`cpgraph.models.config.DSAConfig` (duck-typed: this package sits
below ``cpgraph.models`` and never imports it) and a few integers.

Three parts, each documented with its model in ``docs/launch.md``:

* **weights** by part, per rank: every rank of a CP group holds the whole
  model (CP splits tokens, not weights) except the routed experts, which
  expert parallelism splits ``E / ep`` per rank.  With the model dtype this
  is exactly what ``cpgraph.models.build_model`` allocates (tested against
  ``estimate_model_bytes``); ``fp8`` counts every projection matrix as e4m3
  plus one fp32 scale per 128x128 block (the DeepSeek checkpoint format).
* **KV**: MLA records (656 B/token FP8, ``(kv_lora + rope) x dtype`` dense)
  in every layer; index-K (132 B/token FP8 at D = 128, ``D x dtype`` dense)
  only in layers that run their own indexer (IndexCache).  Owner-sharded:
  a rank stores the pages it owns under the zigzag split, page-rounded.
* **activations**: the largest transient of one forward of ``rows`` rows
  per rank against ``keys`` full-view keys, as a set of phases (what is
  live at once in each), a model of cpgraph's GPU path -- an estimate to
  compare with a measurement (``benchmarks/memory_check.py``), not a bound.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .split import chunk_owner, split_requests

if TYPE_CHECKING:  # pragma: no cover
    from cpgraph.models.config import DSAConfig

# Byte facts of the cache formats (the codecs define them; tests check these against cpgraph.ops.codecs).
MLA_FP8_RECORD_BYTES = 656  # 512 e4m3 latent + 4 fp32 scales + 64 bf16 RoPE
FP8_SCALE_BLOCK = 128  # values per scale (index-K keys; weight blocks are 128 x 128)
DEFAULT_MAX_LOGITS_BYTES = 1 << 30  # KVLayout.max_logits_bytes' default: the dense indexer's score chunk budget
ALLOC_ROUND = 512  # the CUDA caching allocator books every block in multiples of 512 B

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}
KV_FORMATS = ("bf16", "dense", "fp8")
PARTS = ("attention", "indexer", "dense_mlp", "routed_experts", "shared_experts", "router", "embeddings", "norms")


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"plan_memory: argument '{name}' must be an int >= {minimum}, got {value!r}")
    return int(value)


def _act_bytes(dtype: str) -> int:
    """Bytes of one activation / dense-cache value: the model dtype; FP8 weights compute in bf16."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"plan_memory: argument 'dtype' must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return 2 if dtype == "fp8" else DTYPE_BYTES[dtype]


# ----------------------------------------------------------------------------- weights


def _matrix(out_f: int, in_f: int, dtype: str, count: int = 1) -> int:
    """Bytes of ``count`` projection matrices ``[out_f, in_f]``: model dtype, or e4m3 + a 128x128 block scale."""
    if dtype == "fp8":
        blocks = math.ceil(out_f / FP8_SCALE_BLOCK) * math.ceil(in_f / FP8_SCALE_BLOCK)
        return count * (out_f * in_f + 4 * blocks)
    return count * out_f * in_f * DTYPE_BYTES[dtype]


def weight_bytes(cfg: "DSAConfig", dtype: str = "bf16", ep: int = 1) -> dict[str, int]:
    """Bytes per rank of each part of the model (see :data:`PARTS`).

    Tensors transformers keeps in fp32 (router weight and correction bias,
    indexer ``weights_proj``) are 4 bytes whatever ``dtype``; biases, norms
    and embeddings stay in the model dtype (bf16 when ``dtype == "fp8"``).
    The RoPE frequency table (an fp32 buffer) is counted with the norms.
    """
    a = _act_bytes(dtype)
    ep = _check_int("ep", ep)
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    heads, ql, kvl, rope = cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk = cfg.qk_nope_head_dim + rope
    bias = cfg.attention_bias
    attn = (_matrix(ql, H, dtype) + _matrix(heads * qk, ql, dtype) + _matrix(kvl + rope, H, dtype)
            + _matrix(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), kvl, dtype)
            + _matrix(H, heads * cfg.v_head_dim, dtype))
    attn += a * (ql + kvl + rope + H) if bias else 0
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    indexer = _matrix(hi * di, ql, dtype) + _matrix(di, H, dtype) + 4 * hi * H
    n_index = sum(1 for t in cfg.indexer_types if t == "full")
    n_dense = sum(1 for t in cfg.mlp_layer_types if t == "dense")
    n_moe = L - n_dense
    E, im = cfg.n_routed_experts, cfg.moe_intermediate_size
    local_experts = 0
    if n_moe:
        if E % ep:
            raise ValueError(f"plan_memory: argument 'ep' = {ep} does not divide the {E} routed experts")
        local_experts = E // ep
    layer_norms = a * (2 * H + ql + kvl)
    parts = {
        "attention": L * attn,
        "indexer": n_index * indexer,
        "dense_mlp": n_dense * _matrix(cfg.intermediate_size, H, dtype, 3),
        "routed_experts": n_moe * local_experts * (_matrix(2 * im, H, dtype) + _matrix(H, im, dtype)),
        "shared_experts": n_moe * _matrix(im * cfg.n_shared_experts, H, dtype, 3),
        "router": n_moe * 4 * (E * H + E),
        "embeddings": a * cfg.vocab_size * H * (1 if cfg.tie_word_embeddings else 2),
        "norms": L * layer_norms + n_index * a * 2 * di + a * H + 4 * (rope // 2),
    }
    return parts


def param_count(cfg: "DSAConfig") -> int:
    """Parameters of the prefill model (no MTP layers), buffers excluded, tied embeddings counted once."""
    w = weight_bytes(cfg, "fp32")
    n_moe = sum(1 for t in cfg.mlp_layer_types if t == "sparse")
    buffers = 4 * (cfg.qk_rope_head_dim // 2 + n_moe * cfg.n_routed_experts)  # RoPE table, correction biases
    return (sum(w.values()) - buffers) // 4


# ----------------------------------------------------------------------------- KV cache


def kv_bytes_per_token(cfg: "DSAConfig", kv_format: str = "bf16", index_format: str | None = None,
                       dtype: str = "bf16") -> dict[str, int]:
    """Bytes one token occupies in the cache, all layers: ``{"mla": ..., "index": ...}``.

    ``kv_format`` "bf16"/"dense" = records in the model dtype, "fp8" = the
    656-byte record; ``index_format`` defaults to ``kv_format`` (as cpgraph's
    engine allocates); index-K exists only for layers with their own indexer.
    """
    for name, fmt in (("kv_format", kv_format), ("index_format", index_format)):
        if fmt is not None and fmt not in KV_FORMATS:
            raise ValueError(f"plan_memory: argument '{name}' must be one of {', '.join(KV_FORMATS)}, got {fmt!r}")
    index_format = index_format or kv_format
    a = _act_bytes(dtype)
    if kv_format == "fp8":
        if (cfg.kv_lora_rank, cfg.qk_rope_head_dim) != (512, 64):
            raise ValueError("plan_memory: kv_format 'fp8' is the 656-byte record of kv_lora_rank 512 and rope 64")
        mla = MLA_FP8_RECORD_BYTES
    else:
        mla = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * a
    d = cfg.index_head_dim
    index = d + 4 * math.ceil(d / FP8_SCALE_BLOCK) if index_format == "fp8" else d * a
    n_index = sum(1 for t in cfg.indexer_types if t == "full")
    return {"mla": cfg.num_hidden_layers * mla, "index": n_index * index}


def owned_pages(tokens: int, cp: int, page_size: int) -> tuple[int, int]:
    """``(largest pages any rank owns, total pages)`` of one request of ``tokens`` under the zigzag split."""
    split = split_requests(np.array([tokens]), cp_size=cp, page_size=page_size)
    sizes = (split.page_end - split.page_start)[0]
    per_rank = np.bincount(chunk_owner(2 * cp), weights=sizes, minlength=cp)
    return int(per_rank.max()), int(split.num_pages[0])


# ----------------------------------------------------------------------------- activations


def _block(nbytes: int) -> int:
    """Bytes the CUDA caching allocator books for a tensor: rounded up to 512 B (``max_memory_allocated`` counts these)."""
    return 0 if nbytes <= 0 else -(-nbytes // ALLOC_ROUND) * ALLOC_ROUND


class _Tape:
    """Live bytes over one stretch of the forward, replayed allocation by allocation; ``peak`` = most ever live.

    Why a replay and not a sum: eager PyTorch frees a tensor when its last
    reference goes -- a module's locals when its ``forward`` returns, a
    temporary argument when the call returns -- so what is live at the
    peak depends on the order of the forward's statements.  Each phase
    below follows its module's code line by line (names are the locals).
    """

    def __init__(self) -> None:
        self.cur = 0
        self.peak = 0
        self._live: dict[str, int] = {}

    def alloc(self, name: str, nbytes: int) -> None:
        b = _block(int(nbytes))
        self._live[name] = self._live.get(name, 0) + b
        self.cur += b
        self.peak = max(self.peak, self.cur)

    def free(self, *names: str) -> None:
        for name in names:
            self.cur -= self._live.pop(name, 0)

    def new_phase(self) -> None:
        """Start measuring a new phase's peak from what is live now (its predecessors' outputs included)."""
        self.peak = self.cur


def _rope(t: _Tape, name: str, nbytes: int) -> None:
    """``rope_interleaved`` / ``rope_neox`` of a ``nbytes`` operand: the two rotated halves are live beside the output."""
    t.alloc(name + ".halves", nbytes)
    t.alloc(name, nbytes)
    t.free(name + ".halves")


def _compose(t: _Tape, name: str, rows: int, keys: int, row_bytes: int) -> None:
    """``kv_compose`` of the cached prefix (``keys - rows`` gathered rows) and this forward's rows into a view."""
    t.alloc(name + ".prefix", (keys - rows) * row_bytes)
    t.alloc(name + ".cat", keys * row_bytes)
    t.alloc(name, keys * row_bytes)
    t.free(name + ".cat", name + ".prefix")


def _hadamard(t: _Tape, name: str, n_values: int, a: int) -> None:
    """``hadamard_reference`` (the CUDA default): fp32 butterflies; after the loop the last two fp32
    buffers (``y`` and the one ``a``/``b`` still view), the scaled copy and the output are live at once."""
    f32 = 4 * n_values
    t.alloc(name + ".y_prev", f32)
    t.alloc(name + ".y", f32)
    t.alloc(name + ".scaled", f32)
    t.alloc(name, n_values * a)
    t.free(name + ".y_prev", name + ".y", name + ".scaled")


def _split_fp32_products(dtype: str, deterministic: bool) -> bool:
    """Whether ``models/fp32_linear.py`` computes the fp32 products as its bf16 split GEMM (``uses_split``).

    On CUDA it does for bf16 activations (bf16 or FP8 weights) outside the deterministic mode; with
    fp16 or fp32 activations, or in that mode, it upcasts ``x`` and runs the fp32 GEMM.
    """
    return dtype in ("bf16", "bfloat16", "fp8") and not deterministic


def _fp32_product(t: _Tape, name: str, R: int, K: int, N: int, a: int, split: bool) -> None:
    """``fp32_linear(x [R, K], w [N, K])`` of an fp32 weight; leaves ``name`` fp32 ``[R, N]`` live.

    Why two forms: on CUDA with bf16 activations (``split``) no fp32 copy of ``x`` exists -- the
    product is one bf16 GEMM against the weight's three bf16 parts (``bf16_parts``, rebuilt each
    call) with an fp32 ``[R, 3N]`` output, summed block by block; otherwise ``x.float()`` is a
    ``[R, K]`` fp32 copy beside the output (none when ``x`` is fp32 already: ``.float()`` returns it).
    """
    if not split:
        if a != 4:
            t.alloc(name + ".x32", 4 * R * K)
        t.alloc(name, 4 * R * N)
        t.free(name + ".x32")
        return
    nk = N * K  # bf16_parts(w), line by line; its locals go when it returns
    t.alloc(name + ".hi", 2 * nk)
    t.alloc(name + ".hi32", 4 * nk)  # hi.float()
    t.alloc(name + ".r", 4 * nk)
    t.free(name + ".hi32")
    t.alloc(name + ".mid", 2 * nk)
    t.alloc(name + ".mid32", 4 * nk)  # mid.float()
    t.alloc(name + ".r2", 4 * nk)  # r - mid.float()
    t.free(name + ".mid32")
    t.alloc(name + ".lo", 2 * nk)
    t.free(name + ".r2")
    t.alloc(name + ".parts", 3 * 2 * nk)  # cat((hi, mid, lo))
    t.free(name + ".hi", name + ".r", name + ".mid", name + ".lo")
    t.alloc(name + ".y", 4 * R * 3 * N)  # torch.mm(x, parts.t(), out_dtype=fp32)
    t.free(name + ".parts")  # a temporary argument of the mm
    t.alloc(name + ".sum", 4 * R * N)  # y[:, :n] + y[:, n:2n]
    t.alloc(name, 4 * R * N)  # ... + y[:, 2n:]
    t.free(name + ".sum", name + ".y")


def _indexer(t: _Tape, cfg, R: int, N: int, a: int, index_format: str, max_logits_bytes: int, split: bool) -> None:
    """``Indexer.forward``; leaves only its output ``topk`` int32 ``[R, topk]`` live."""
    H, hi, di, rope, topk = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim, cfg.index_topk
    iq = R * hi * di * a
    t.alloc("iq.proj", iq)  # wq_b(q_lat)
    _rope(t, "iq.rot", R * hi * rope * a)
    t.alloc("iq", iq)  # cat((rope(rot), rest))
    t.free("iq.proj", "iq.rot")
    t.alloc("ik.proj", R * di * a)
    t.alloc("ik.norm", R * di * a)
    t.free("ik.proj")
    _rope(t, "ik.rot", R * rope * a)
    t.alloc("ik", R * di * a)
    t.free("ik.norm", "ik.rot")
    _fp32_product(t, "w.proj", R, H, hi, a, split)  # fp32_linear(x, weights_proj.weight)
    t.alloc("w", 4 * R * hi)  # * weight_scale
    t.free("w.proj")
    if index_format == "fp8":
        _hadamard(t, "iq.h", R * hi * di, a)
        t.free("iq")
        _hadamard(t, "ik.h", R * di, a)
        t.free("ik")
        t.alloc("ik.quant_tmp", 2 * 4 * R * di)  # index_k_quant (reference): fp32 copies
        t.alloc("ik.bytes", R * di + 4 * R)
        t.free("ik.quant_tmp")
        _compose(t, "k_view", R, N, di + 4)  # e4m3 keys + fp32 scales
        t.alloc("qq.f32", 2 * 4 * R * hi * di)  # indexer_q_quant (reference): q.float(), .abs()
        t.free("qq.f32")
        t.alloc("qq.amax", 4 * R * hi)
        t.alloc("qq.f32", 2 * 4 * R * hi * di)  # e4m3_bytes: x.float() / scale
        t.alloc("q_bytes", R * hi * di)
        t.free("qq.f32")
        t.alloc("w_q", 4 * R * hi)
        t.free("qq.amax")
        t.alloc("k_scale", 4 * N)  # k_scale[:, 0].contiguous()
        _chunked_topk(t, R, N, topk, max_logits_bytes)  # indexer_topk's FP8 form: e4m3 operands, same chunks
        t.free("iq.h", "ik.h", "ik.bytes", "k_view", "q_bytes", "w_q", "k_scale", "w")
        return
    _compose(t, "k_view", R, N, di * a)
    _chunked_topk(t, R, N, topk, max_logits_bytes)
    t.free("iq", "ik", "w", "k_view")


def _select_scratch_columns(n_keys: int, topk: int) -> int:
    """Scratch columns per row of the Triton select kernel (``cpgraph.kernels.topk_select.scratch_columns``):
    its list's rank bits and positions."""
    return 2 * max(1, min(n_keys, topk + max(topk, n_keys // 8)))


def _chunked_topk(t: _Tape, R: int, N: int, topk: int, max_logits_bytes: int) -> None:
    """``indexer_topk``'s provider: its output, and one fp32 score chunk (scored, selected, next chunk).

    The select kernel's candidate scratch (int32, ``scratch_columns`` per row of the chunk) lives
    beside the chunk's scores.
    """
    t.alloc("topk", 4 * R * topk)
    chunk = min(R, max(1, max_logits_bytes // (4 * max(N, 1))))
    t.alloc("scores", 4 * chunk * N)
    t.alloc("select scratch", 4 * chunk * _select_scratch_columns(N, topk))
    t.free("scores", "select scratch")


def _attention_layer(cfg, R: int, N: int, a: int, kv_format: str, index_format: str, max_logits_bytes: int,
                     has_prev: bool, own_indexer: bool, split: bool) -> tuple[int, int]:
    """``(peak up to the top-k, peak from sparse MLA on)`` of one ``MLAttention`` call, above the base."""
    H, heads, ql, kvl, rope = (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                               cfg.qk_rope_head_dim)
    qk = cfg.qk_nope_head_dim + rope
    t = _Tape()
    t.alloc("x_normed", R * H * a)  # input_layernorm(x), the layer's argument
    if has_prev:
        t.alloc("topk_prev", 4 * R * cfg.index_topk)  # the previous layer's top-k, held by the model's loop
    t.alloc("q_a", R * ql * a)
    t.alloc("q_lat", R * ql * a)
    t.free("q_a")
    t.alloc("q", R * heads * qk * a)
    # cpgraph::mla_query's GPU provider: the W_UK GEMM and the RoPE lanes write straight into q_full (no
    # transients); q_b_proj's output dies when MLAttention.query returns.
    t.alloc("q_full", R * heads * (kvl + rope) * a)
    t.free("q")
    t.alloc("kv_a", R * (kvl + rope) * a)
    t.alloc("c.contiguous", R * kvl * a)  # rms_norm copies the strided latent first
    t.alloc("c", R * kvl * a)
    t.free("c.contiguous")
    _rope(t, "k_pe", R * rope * a)
    t.free("kv_a")
    fp8 = kv_format == "fp8"
    record = MLA_FP8_RECORD_BYTES if fp8 else (kvl + rope) * a
    t.alloc("record", R * record)
    _compose(t, "kv", R, N, record)
    if fp8:
        t.alloc("kv.bf16", N * (kvl + rope) * a)  # mla_fp8_unpack
        t.free("kv")
    if own_indexer:
        _indexer(t, cfg, R, N, a, index_format, max_logits_bytes, split)
    attention = t.peak
    t.new_phase()
    t.alloc("out_lat", R * heads * kvl * a)
    t.alloc("lse", 4 * R * heads)
    t.alloc("out.einsum", R * heads * cfg.v_head_dim * a)
    t.alloc("out", R * heads * cfg.v_head_dim * a)  # .reshape of the permuted einsum result copies
    t.free("out.einsum")
    t.alloc("o_proj", R * H * a)
    return attention, t.peak


def _swiglu(t: _Tape, R: int, hidden: int, inner: int, a: int, name: str) -> None:
    """``down(silu(gate(x)) * up(x))``; leaves ``name`` ``[R, hidden]`` live."""
    t.alloc("gate", R * inner * a)
    t.alloc("silu", R * inner * a)
    t.free("gate")
    t.alloc("up", R * inner * a)
    t.alloc("prod", R * inner * a)
    t.free("silu", "up")
    t.alloc(name, R * hidden * a)
    t.free("prod")


# ----------------------------------------------------------------------------- routed experts, per provider

# The implementations of ``cpgraph::moe_experts`` as its provider report names them (``cpgraph.ops.providers``):
# ``reference`` the dense torch form; ``triton`` the grouped path of ``kernels/moe.py`` (bf16 ``torch._grouped_mm``
# with the Triton SwiGLU, or FP8 ``kernels/fp8_grouped.py``; in the deterministic mode the Triton provider of
# ``cpgraph::invariant_moe_experts``); ``deep_gemm`` the padded layout of ``kernels/deep_gemm_experts.py``.
EXPERTS_PROVIDERS = ("reference", "triton", "deep_gemm")
DEEP_GEMM_ALIGN = 128  # kernels/deep_gemm_experts.ALIGN: every expert's rows start on a 128-row boundary (SM90)
TMA_ALIGN_FP32 = 4  # DeepGEMM's TMA-aligned MN extent of fp32 scales: 16 bytes


def default_experts_provider(cfg, dtype: str = "bf16", deterministic: bool = False) -> str:
    """The ``cpgraph::moe_experts`` implementation that computes by default on an SM90 GPU with DeepGEMM installed.

    As ``kernels/moe.py`` chooses per call: FP8 experts take DeepGEMM where its
    operand rules hold (``H`` and ``I`` multiples of 128; the plan's weight
    blocks are 128 x 128), else the Triton grouped FP8 GEMM; bf16 experts take
    ``torch._grouped_mm`` (``CPGRAPH_BF16_EXPERTS=auto``) where the rows are
    16-byte aligned, else the dense reference, as fp16 and fp32 experts do
    (``torch._grouped_mm`` takes bf16 on CUDA).  In the deterministic mode
    the experts are ``cpgraph::invariant_moe_experts``' Triton provider.
    A machine without DeepGEMM runs FP8 experts as ``triton``: pass it.
    """
    H, two_i = cfg.hidden_size, 2 * cfg.moe_intermediate_size
    if deterministic:
        return "triton"
    if dtype == "fp8":
        return "deep_gemm" if H % 128 == 0 and two_i % 256 == 0 else "triton"
    if dtype in ("bf16", "bfloat16") and H % 8 == 0 and two_i % 16 == 0:
        return "triton"
    return "reference"


def _check_experts_provider(cfg, provider: str | None, dtype: str, deterministic: bool) -> str:
    """``provider`` (``None``: the default) if that code can compute these experts; else ValueError."""
    if provider is None:
        return default_experts_provider(cfg, dtype, deterministic)
    if provider not in EXPERTS_PROVIDERS:
        raise ValueError(f"plan_memory: argument 'experts_provider' must be one of {', '.join(EXPERTS_PROVIDERS)}, "
                         f"got {provider!r}")
    H, two_i = cfg.hidden_size, 2 * cfg.moe_intermediate_size
    why = None
    if provider == "reference" and dtype == "fp8":
        why = "the dense FP8 reference (one expert at a time, fp32 copies) is not modelled"
    elif provider in ("reference", "deep_gemm") and deterministic:
        why = "the deterministic mode computes the experts as cpgraph::invariant_moe_experts (provider 'triton')"
    elif provider == "triton" and not deterministic and dtype not in ("bf16", "bfloat16", "fp8"):
        why = f"{dtype} experts run the reference on CUDA (torch._grouped_mm takes bf16)"
    elif provider == "deep_gemm" and (dtype not in ("bf16", "bfloat16", "fp8") or H % 128 or two_i % 256):
        why = f"DeepGEMM takes bf16 activations with H and I multiples of 128, not {dtype} H={H}, 2I={two_i}"
    if why is not None:
        raise ValueError(f"plan_memory: argument 'experts_provider' {provider!r} does not apply: {why}")
    return provider


def _dispatch_plan(t: _Tape, pairs: int, experts: int) -> None:
    """``dispatch_plan``'s outputs: ``order`` and ``slot_pos`` int64 ``[pairs]``, ``group_ends`` int32 ``[E]``.

    Its sort keys and masks (about 40 bytes a pair) die inside it, before the first row buffer.
    """
    t.alloc("experts.order", 8 * pairs)
    t.alloc("experts.group_ends", 4 * experts)
    t.alloc("experts.slot_pos", 8 * pairs)


def _routed_experts(t: _Tape, provider: str, rows: int, k: int, experts: int, H: int, im: int, a: int, fp8: bool,
                    deterministic: bool) -> None:
    """One ``cpgraph::moe_experts`` call of ``rows`` rows, ``k`` routes, ``experts`` local experts; leaves ``experts``.

    Each branch follows its implementation's body line by line (its locals
    live until it returns; ``C = rows * k`` is the static dispatch capacity,
    whatever the routing).  Its buffers are booked as ``experts.*``, apart
    from the layer's own names (the MLP's normed input ``h`` stays live).
    ``a``: bytes of an activation value (``x``'s dtype).
    """
    C = rows * k
    s_h, s_i = -(-H // FP8_SCALE_BLOCK), -(-im // FP8_SCALE_BLOCK)  # fp32 activation scales per row (block_k 128)
    if provider == "reference":  # ops/moe.py moe_experts_reference: every expert on every row
        t.alloc("experts.routed", C)  # bool [rows, k]
        t.alloc("experts.safe_ids", 8 * C)
        t.alloc("experts.w", 4 * C)
        t.alloc("experts.combine.zeros", 4 * rows * experts)
        t.alloc("experts.combine", 4 * rows * experts)  # .scatter_add (out of place)
        t.free("experts.combine.zeros")
        t.alloc("experts.h", experts * rows * 2 * im * a)  # einsum -> [E, rows, 2I]
        t.alloc("experts.silu", experts * rows * im * a)
        t.alloc("experts.act", experts * rows * im * a)
        t.free("experts.silu")
        t.alloc("experts.y", experts * rows * H * a)  # einsum -> [E, rows, H]
        t.free("experts.act")  # a temporary argument of the einsum
        if a != 4:
            t.alloc("experts.combine.cast", a * rows * experts)  # combine.to(y.dtype)
        t.alloc("experts", rows * H * a)
    elif provider == "deep_gemm":  # kernels/deep_gemm_experts.py: rows padded per expert to DEEP_GEMM_ALIGN
        P = C + DEEP_GEMM_ALIGN * experts  # padded_layout's size: covers every routing
        _dispatch_plan(t, C, experts)  # _padded_dispatch, line by line; its plan and positions die when it returns
        t.alloc("experts.psum", 4 * experts)  # padded_layout (its per-expert sums and per-row lookups die inside it)
        t.alloc("experts.pos", 8 * C)
        t.alloc("experts.token.src", 8 * C)  # plan.order // k, _inverse's argument
        t.alloc("experts.token", 8 * (P + 1))  # _inverse: torch.full((P + 1,), -1), viewed as [P]
        t.free("experts.token.src")
        t.alloc("experts.slot.used", C)  # torch.where(slot >= 0, pos[slot.clamp(min=0)], slot)
        t.alloc("experts.slot.clamp", 8 * C)
        t.alloc("experts.slot.pos", 8 * C)
        t.alloc("experts.slot_rows", 8 * C)
        t.free("experts.slot.used", "experts.slot.clamp", "experts.slot.pos")
        t.free("experts.order", "experts.group_ends", "experts.slot_pos", "experts.pos")  # _padded_dispatch returns
        if fp8:
            t.alloc("experts.xq", rows * H)  # quantize_activations: e4m3 + fp32 scales per 128
            t.alloc("experts.xs", 4 * rows * s_h)
            t.alloc("experts.a", P * H)  # take_rows into the padded layout (DeepGEMM's TMA reads rows in place)
            t.alloc("experts.a_s", 4 * P * s_h)
            t.alloc("experts.h", P * 2 * im * a)
            # DeepGEMM (SM90) copies the K-major activation scales into an MN-major, TMA-aligned tensor for
            # the call (transform_sf_into_required_layout); the 128 x 128 weight scales are used as they are.
            t.alloc("experts.sfa", 4 * s_h * -(-P // TMA_ALIGN_FP32) * TMA_ALIGN_FP32)
            t.free("experts.sfa")
            t.alloc("experts.aq", P * im)  # swiglu_quantize
            t.alloc("experts.aq_s", 4 * P * s_i)
            t.alloc("experts.y", P * H * a)
            t.alloc("experts.sfa", 4 * s_i * -(-P // TMA_ALIGN_FP32) * TMA_ALIGN_FP32)
            t.free("experts.sfa")
        else:
            t.alloc("experts.xs", P * H * a)  # take_rows
            t.alloc("experts.h", P * 2 * im * a)
            t.alloc("experts.act", P * im * a)  # Triton swiglu
            t.alloc("experts.y", P * H * a)
        t.alloc("experts", rows * H * a)  # Triton combine
    elif fp8:  # kernels/fp8_grouped.py (and invariant_gemm.py's FP8 form): the GEMM gathers rows itself
        _dispatch_plan(t, C, experts)
        if deterministic:
            t.alloc("experts.src", 8 * C)  # invariant_moe_experts takes order // k before it quantises
        t.alloc("experts.xq", rows * H)  # quantize_activations: e4m3 + fp32 scales per 128
        t.alloc("experts.xs", 4 * rows * s_h)
        if not deterministic:
            t.alloc("experts.src", 8 * C)  # order // k
        t.alloc("experts.h", C * 2 * im * a)
        t.alloc("experts.aq", C * im)  # swiglu_quantize: e4m3 + fp32 scales, one pass (no bf16 SwiGLU output)
        t.alloc("experts.aq_s", 4 * C * s_i)
        t.alloc("experts.y", C * H * a)
        t.alloc("experts", rows * H * a)
    elif deterministic:  # kernels/invariant_gemm.py invariant_moe_experts, bf16: eager silu(gate) * up
        _dispatch_plan(t, C, experts)
        t.alloc("experts.src", 8 * C)
        t.alloc("experts.h", C * 2 * im * a)  # grouped_matmul gathers x's rows itself
        t.alloc("experts.silu", C * im * a)
        t.alloc("experts.act", C * im * a)
        t.free("experts.silu")
        t.alloc("experts.y", C * H * a)
        t.free("experts.act")  # a temporary argument of grouped_matmul
        t.alloc("experts", rows * H * a)
    else:  # ops/moe.py moe_experts_grouped as kernels/moe.py calls it on CUDA
        _dispatch_plan(t, C, experts)
        t.alloc("experts.src", 8 * C)
        t.alloc("experts.xs", C * H * a)  # take_rows (Triton row mover)
        t.alloc("experts.h", C * 2 * im * a)  # torch._grouped_mm
        t.alloc("experts.act", C * im * a)  # Triton swiglu: one output, no silu copy
        t.alloc("experts.y", C * H * a)
        t.alloc("experts", rows * H * a)  # Triton combine
    t.free(*[name for name in t._live if name.startswith("experts.")])  # the call's locals die when it returns


def experts_bytes(provider: str, rows: int, top_k: int, experts: int, hidden: int, inner: int, *, dtype: str = "bf16",
                  deterministic: bool = False) -> int:
    """Most bytes one ``cpgraph::moe_experts`` call has live at once (its output included), as the plan books them.

    ``experts``: the experts the call holds (``E / ep``); ``inner``: ``moe_intermediate_size``.
    """
    t = _Tape()
    _routed_experts(t, provider, rows, top_k, experts, hidden, inner, _act_bytes(dtype), dtype == "fp8",
                    deterministic)
    return t.peak


def _mlp_layer(cfg, R: int, a: int, sparse: bool, topk_live: int, ep: int, split: bool, provider: str = "triton",
               fp8: bool = False, deterministic: bool = False) -> int:
    """Peak of a layer's MLP half above the base: ``attn``, ``x + attn``, its norm and the live top-k stay."""
    H, E, k, im = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    t = _Tape()
    t.alloc("topk", topk_live * 4 * R * cfg.index_topk)
    t.alloc("attn", R * H * a)
    t.alloc("x1", R * H * a)
    t.alloc("h", R * H * a)
    if not sparse:
        _swiglu(t, R, H, cfg.intermediate_size, a, "mlp")
    else:
        _fp32_product(t, "router.logits", R, H, E, a, split)  # fp32_linear(x, gate.weight)
        t.alloc("router.scores", 4 * R * E)
        t.free("router.logits")
        t.alloc("router.choice", 3 * 4 * R * E)  # choice, the expanded group mask, the masked choice
        t.alloc("topk_ids", 8 * R * k)
        t.alloc("topk_w", 4 * R * k)
        t.free("router.scores", "router.choice")
        if ep == 1:
            _routed_experts(t, provider, R, k, E, H, im, a, fp8, deterministic)
        else:
            # The expert-parallel reference (moe_dispatch / moe_combine decomposed): static capacity,
            # n = ep * R * min(k, E / ep) wire rows whatever the routing.
            n = ep * R * min(k, E // ep)
            t.alloc("ep.routes", 8 * (2 * n + R * k))
            t.alloc("ep.send", n * H * a)
            t.alloc("ep.wire", n * H * a)
            t.alloc("ep.recv", n * H * a)
            t.free("ep.send", "ep.wire")
            _routed_experts(t, provider, n, 1, E // ep, H, im, a, fp8, deterministic)  # the local experts
            t.free("ep.recv")
            t.alloc("ep.back_wire", n * H * a)
            t.alloc("ep.back", n * H * a)
            t.free("experts")
            t.alloc("ep.rows32", 2 * 4 * R * k * H)  # gathered fp32 rows, masked
            t.alloc("ep.sum32", 2 * 4 * R * H)
            t.alloc("experts", R * H * a)
            t.free("ep.back_wire", "ep.back", "ep.rows32", "ep.sum32", "ep.routes")
        _swiglu(t, R, H, im * cfg.n_shared_experts, a, "shared")
        t.alloc("mlp", R * H * a)
        t.free("experts", "shared", "topk_ids", "topk_w")
    t.alloc("x2", R * H * a)  # x + mlp
    return t.peak


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


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank bytes of a CP prefill of one ``tokens``-long request (see the module docstring)."""

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


# ----------------------------------------------------------------------------- text


_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))


def _unit(total: int) -> tuple[int, str]:
    """One unit for a whole table: the largest that keeps the total >= 1."""
    return next(((d, u) for d, u in _UNITS if total >= d), (1, "B"))


def render_memory(plan: MemoryPlan) -> str:
    """The plan as a table for a terminal (``cpgraph memory``); every figure also in bytes."""
    p = plan
    div, unit = _unit(p.total_bytes)

    def row(label: str, n: int, note: str = "") -> str:
        return f"  {label:<16}{n / div:12.2f} {unit:<3} {n:>18,} B{note}"

    lines = [f"{p.model_type}: {p.tokens} tokens on CP {p.cp} x EP {p.ep}, weights {p.dtype}, KV {p.kv_format} "
             f"(index-K {p.index_format}), page {p.page_size} -- bytes per rank", "", "weights"]
    lines += [row(name, p.weights[name]) for name in PARTS]
    lines.append(row("total", p.weight_bytes))
    per_tok = sum(p.kv_per_token.values())
    lines += ["", f"KV cache: {p.kv_per_token['mla']} B/token MLA + {p.kv_per_token['index']} B/token index-K "
                  f"= {per_tok} B/token (all layers); owner-sharded, {p.pages_per_rank} of {p.pages_total} pages",
              row("owned", p.kv_bytes), row("if replicated", p.kv_replicated_bytes),
              "", f"activations: one forward of {p.rows} rows per rank against {p.keys} keys, routed experts "
                  f"{p.experts_provider}" + (" (deterministic mode)" if p.deterministic else "")]
    lines.append(row("base", p.activation_base))
    for name, b in p.activation_phases.items():
        lines.append(row("+ " + name, b, "  <- peak" if name == p.peak_phase else ""))
    lines.append(row("peak", p.activation_peak))
    lines += ["", row("total", p.total_bytes)]
    return "\n".join(lines)
