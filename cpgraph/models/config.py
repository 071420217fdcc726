"""Model configuration: one dataclass for both DSA architectures.

``DSAConfig.from_hf_dict`` reads a Hugging Face ``config.json`` dict of
``model_type`` ``deepseek_v32`` (DeepSeek-V3.2) or ``glm_moe_dsa`` (GLM-5)
and resolves every derived field once (RoPE parameters, per-layer MLP kind,
per-layer indexer mode), so the forward never re-derives anything from
strings.  Field names follow the HF names so a config can be compared with
its source by eye.  The derivations mirror transformers 5.24.0's config
classes; the ones that matter for numerics are listed in ``docs/models.md``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")

# How the indexer applies RoPE to the first ``qk_rope_head_dim`` dims of its
# keys/queries: DeepSeek-V3.2 rotates half-split (NeoX) pairs, GLM-5 rotates
# interleaved pairs (transformers >= 5.13).  MLA itself is always interleaved.
INDEXER_ROPE_BY_TYPE = {"deepseek_v32": "neox", "glm_moe_dsa": "interleaved"}


@dataclass(frozen=True)
class RopeConfig:
    """Resolved RoPE parameters (``rope_type`` is ``"default"`` or ``"yarn"``)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class DSAConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    indexer_rope: str
    rope: RopeConfig = field(default_factory=RopeConfig)
    torch_dtype: str = "float32"

    # ------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_record_dim(self) -> int:
        """Width of a dense MLA cache record ``[latent | k_pe]``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """Layers that run their own indexer (and own index-K storage)."""
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        d["indexer_types"] = list(self.indexer_types)
        return d

    # ------------------------------------------------------------ parsing
    @classmethod
    def from_hf_dict(cls, d: dict) -> "DSAConfig":
        """Build from a HF ``config.json`` dict; raises ``ValueError`` on anything unsupported."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a dict, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}: cpgraph.models supports {', '.join(MODEL_TYPES)}"
            )
        get = d.get
        n_layers = int(get("num_hidden_layers", 61 if model_type == "deepseek_v32" else 78))
        act = get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        if get("q_lora_rank") is None:
            raise ValueError("q_lora_rank is null; DSA models always use a low-rank query (HF drops the other form)")
        if get("quantization_config") is not None:
            raise ValueError(
                "quantized checkpoints (quantization_config present) are not supported; "
                "convert the weights to bf16/fp32 first"
            )
        first_dense = int(get("first_k_dense_replace", 3))
        mlp_types = get("mlp_layer_types")
        if mlp_types is None:
            n_dense = min(first_dense, n_layers)
            mlp_types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
        mlp_types = tuple(mlp_types)
        if len(mlp_types) != n_layers or not set(mlp_types) <= {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must list 'dense'/'sparse' for {n_layers} layers, got {mlp_types!r}")
        indexer_types = _indexer_types(model_type, d, n_layers)
        n_experts = int(get("n_routed_experts", get("num_local_experts", 256)))
        n_group = int(get("n_group", 8 if model_type == "deepseek_v32" else 1))
        topk_group = int(get("topk_group", 4 if model_type == "deepseek_v32" else 1))
        if n_experts % n_group:
            raise ValueError(f"n_routed_experts={n_experts} is not divisible by n_group={n_group}")
        if "sparse" in mlp_types and n_experts // n_group < 2:
            raise ValueError("group-limited routing scores a group by its top-2 experts: need >= 2 experts per group")
        cfg = cls(
            model_type=model_type,
            vocab_size=int(get("vocab_size", 129280)),
            hidden_size=int(get("hidden_size", 7168)),
            intermediate_size=int(get("intermediate_size", 18432)),
            moe_intermediate_size=int(get("moe_intermediate_size", 2048)),
            num_hidden_layers=n_layers,
            num_attention_heads=int(get("num_attention_heads", 128)),
            q_lora_rank=int(get("q_lora_rank", 1536)),
            kv_lora_rank=int(get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(get("qk_rope_head_dim", 64)),
            v_head_dim=int(get("v_head_dim", 128)),
            n_routed_experts=n_experts,
            n_shared_experts=int(get("n_shared_experts", 1)),
            num_experts_per_tok=int(get("num_experts_per_tok", 8)),
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            routed_scaling_factor=float(get("routed_scaling_factor", 2.5)),
            index_topk=int(get("index_topk", 2048)),
            index_n_heads=int(get("index_n_heads", 64 if model_type == "deepseek_v32" else 32)),
            index_head_dim=int(get("index_head_dim", 128)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6 if model_type == "deepseek_v32" else 1e-5)),
            attention_bias=bool(get("attention_bias", False)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            max_position_embeddings=int(get("max_position_embeddings", 163840)),
            mlp_layer_types=mlp_types,
            indexer_types=indexer_types,
            indexer_rope=INDEXER_ROPE_BY_TYPE[model_type],
            rope=_rope_config(d),
            torch_dtype=str(get("torch_dtype", get("dtype", "bfloat16")) or "bfloat16"),
        )
        if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim > cfg.index_head_dim:
            raise ValueError("qk_rope_head_dim must be even and <= index_head_dim (the indexer ropes its first dims)")
        if cfg.index_topk < 1:
            raise ValueError(f"index_topk must be >= 1, got {cfg.index_topk}")
        return cfg

    @classmethod
    def from_json_file(cls, path) -> "DSAConfig":
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))


def _indexer_types(model_type: str, d: dict, n_layers: int) -> tuple[str, ...]:
    """Per-layer ``"full"`` / ``"shared"`` (IndexCache), as transformers resolves it."""
    if model_type == "deepseek_v32":
        return ("full",) * n_layers
    types = d.get("indexer_types")
    if types is None:
        pattern = d.get("index_topk_pattern")
        if pattern is not None:
            if isinstance(pattern, str):
                bad = set(pattern) - {"F", "S"}
                if bad:
                    raise ValueError(f"index_topk_pattern may contain only 'F'/'S', got {pattern!r}")
                types = [{"F": "full", "S": "shared"}[c] for c in pattern]
            else:
                types = list(pattern)
        else:
            freq = max(int(d.get("index_topk_freq", 1) or 1), 1)
            offset = int(d.get("index_skip_topk_offset", 2))
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
    types = tuple(types)
    if len(types) != n_layers or not set(types) <= {"full", "shared"}:
        raise ValueError(f"indexer_types must list 'full'/'shared' for {n_layers} layers, got {types!r}")
    if types and types[0] != "full":
        raise ValueError("layer 0 must run its own indexer: a shared layer reuses the previous layer's top-k")
    return types


def _rope_config(d: dict) -> RopeConfig:
    """Resolve ``rope_parameters`` (transformers 5 form) or legacy ``rope_scaling`` + ``rope_theta``."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)) or 10000.0)
    if rope_type == "default":
        return RopeConfig(rope_type="default", theta=theta)
    if rope_type != "yarn":
        raise ValueError(f"rope type {rope_type!r} is not supported (only 'default' and 'yarn')")
    max_pos = int(d.get("max_position_embeddings", 163840))
    orig = int(d.get("original_max_position_embeddings", params.get("original_max_position_embeddings", max_pos)))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_pos / orig
    opt = lambda k: None if params.get(k) is None else float(params[k])  # noqa: E731
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        attention_factor=opt("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


BUNDLED_DIR = Path(__file__).parent / "configs"


def bundled_names() -> list[str]:
    """Names of the tiny configs shipped in the package (random weights, fixed seed)."""
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.json"))


def bundled_config_dict(name: str) -> dict:
    path = BUNDLED_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown bundled model {name!r}; available: {', '.join(bundled_names())}")
    with open(path) as f:
        return json.load(f)
