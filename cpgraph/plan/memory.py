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
DEFAULT_MAX_LOGITS_BYTES = 64 << 20  # KVLayout.max_logits_bytes: the dense indexer's score chunk budget
SELECT_SCRATCH_BYTES = 64 << 20  # the FP8 path's top-k candidate scratch per chunk of rows

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


def activation_phases(cfg: "DSAConfig", rows: int, keys: int, *, dtype: str = "bf16", kv_format: str = "bf16",
                      index_format: str | None = None,
                      max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES) -> tuple[int, dict[str, int]]:
    """``(base, {phase: bytes})`` of one forward of ``rows`` rows per rank against ``keys`` full-view keys.

    ``base`` is live through every phase (residual and normed rows, RoPE
    tables, batch metadata); a phase adds what one step of a layer holds at
    its widest point.  The model (cpgraph's GPU path, eager):

    * ``attention``: the absorbed queries ``[rows, H, kv_lora + rope]``, the
      full KV view ``[keys, kv_lora + rope]`` (plus its FP8 records and the
      all-gathered rows it is composed from), the indexer's queries, keys
      view and its scores -- a chunk ``[rows_c, keys]`` fp32 with an int32
      scratch of the same size for the dense path (``rows_c`` from the
      ``max_logits_bytes`` budget), ALL rows ``[rows, keys]`` fp32 for the
      FP8 path (its logits op scores every row at once);
    * ``sparse_mla``: queries, KV view, top-k ids, latent output and LSE,
      and the per-head value projection;
    * ``dense_mlp``: gate, up and their product ``[rows, intermediate]``;
    * ``moe``: router scores ``[rows, E]`` fp32, the dispatch buffer
      ``[rows * top_k, hidden]``, gate/up ``[rows * top_k, 2 I]``, the
      activation, the expert outputs ``[rows * top_k, hidden]``.
    """
    a = _act_bytes(dtype)
    index_format = index_format or kv_format
    H, heads = cfg.hidden_size, cfg.num_attention_heads
    rec = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    hi, di, topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    R, N = rows, keys
    base = 2 * R * H * a + R * cfg.qk_rope_head_dim * a + 8 * 8 * R  # x, normed x, cos+sin, 8 int64 metadata rows

    q_full = R * heads * rec * a
    q_proj = R * cfg.q_lora_rank * a + R * heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) * a
    kv_view = N * rec * a
    if kv_format == "fp8":
        kv_view += 2 * N * MLA_FP8_RECORD_BYTES  # composed FP8 records + the gathered rows they come from
    else:
        kv_view += N * rec * a  # the gathered rows the view is composed from
    iq = R * hi * di * a
    w_idx = 4 * R * hi
    if index_format == "fp8":
        k_view = 2 * N * (di + 4)  # composed e4m3 keys + scales, and the gathered rows
        iq += R * hi * di  # e4m3 query bytes beside the Hadamard-rotated queries
        scratch_rows = min(R, max(1, SELECT_SCRATCH_BYTES // (4 * max(N, 1))))
        scores = 4 * R * N + 4 * scratch_rows * N
    else:
        k_view = 2 * N * di * a
        chunk = min(R, max(1, max_logits_bytes // (4 * max(N, 1))))
        scores = 4 * chunk * N * 2  # fp32 scores + int32 selection scratch
    attention = q_proj + q_full + kv_view + iq + w_idx + k_view + scores + 4 * R * topk

    out_lat = R * heads * cfg.kv_lora_rank * a + 4 * R * heads
    sparse_mla = q_full + kv_view + 4 * R * topk + out_lat + R * heads * cfg.v_head_dim * a

    phases = {"attention": attention, "sparse_mla": sparse_mla}
    if "dense" in cfg.mlp_layer_types:
        phases["dense_mlp"] = 3 * R * cfg.intermediate_size * a
    if "sparse" in cfg.mlp_layer_types:
        k, im, E = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.n_routed_experts
        pairs = R * k
        router = 3 * 4 * R * E + R * k * (8 + 4)
        dispatch = pairs * H * a + pairs * 2 * im * a + 2 * pairs * im * a + pairs * H * a + 3 * 8 * pairs
        phases["moe"] = router + dispatch + R * H * a
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
                max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES) -> MemoryPlan:
    """The per-rank memory plan of prefilling one request of ``tokens`` tokens on a CP group of ``cp`` ranks.

    ``row_bucket``: rows per rank of one forward (a chunked prefill, or the
    capture bucket rows are padded to); default: the rows the largest rank
    computes when the whole request is one forward.  The activations are
    those of the last such forward, which sees every key of the context.
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
    base, phases = activation_phases(cfg, rows, keys, dtype=dtype, kv_format=kv_format, index_format=index_format,
                                     max_logits_bytes=max_logits_bytes)
    return MemoryPlan(
        model_type=cfg.model_type, cp=cp, ep=ep, tokens=tokens, rows=rows, keys=keys, page_size=page_size,
        dtype=dtype, kv_format=kv_format, index_format=index_format or kv_format,
        weights=weight_bytes(cfg, dtype, ep), kv_per_token=kv_tok, pages_per_rank=pages_rank,
        pages_total=pages_total, activation_base=base, activation_phases=phases,
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
              "", f"activations: one forward of {p.rows} rows per rank against {p.keys} keys"]
    lines.append(row("base", p.activation_base))
    for name, b in p.activation_phases.items():
        lines.append(row("+ " + name, b, "  <- peak" if name == p.peak_phase else ""))
    lines.append(row("peak", p.activation_peak))
    lines += ["", row("total", p.total_bytes)]
    return "\n".join(lines)
