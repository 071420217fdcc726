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
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")

# Keys that fix the architecture's tensor shapes.  transformers fills them
# with the full-size model's values when absent, which turns a truncated
# config.json into a 672B-parameter build; here their absence is an error.
# Everything else (routing groups, eps, top-k, RoPE, ...) keeps HF's default.
REQUIRED_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
)
DENSE_KEYS = ("intermediate_size",)  # needed when some layer has a dense MLP
MOE_KEYS = ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts")  # MoE layers

# Largest size any config key may give: kernels index rows and columns with int32.
MAX_SIZE = 2**31 - 1

_MISSING = object()


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Reader:
    """Typed access to a config dict: every error is one line naming the key."""

    def __init__(self, d: dict, prefix: str = ""):
        self.d, self.prefix = d, prefix

    def _value(self, key, default, what):
        v = self.d.get(key, _MISSING)
        if v is _MISSING:
            if default is _MISSING:
                raise ValueError(f"config is missing {self.prefix}{key} ({what})")
            return default
        if v is None:
            raise ValueError(f"config key {self.prefix}{key} is null; it must be {what}")
        return v

    def int(self, key, default=_MISSING, minimum: int = 1, maximum: int = MAX_SIZE) -> int:
        what = f"an integer in [{minimum}, {maximum}]"
        v = self._value(key, default, what)
        if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
            raise ValueError(f"config key {self.prefix}{key} must be {what}, got {_show(v)}")
        return v

    def float(self, key, default=_MISSING, minimum: float = 0.0, strict: bool = True) -> float:
        what = f"a number {'>' if strict else '>='} {minimum:g}"
        v = self._value(key, default, what)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or (v <= minimum if strict else v < minimum):
            raise ValueError(f"config key {self.prefix}{key} must be {what}, got {_show(v)}")
        return float(v)

    def opt_float(self, key) -> float | None:
        """A finite number, or ``None`` when absent or null."""
        v = self.d.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"config key {self.prefix}{key} must be a number, got {_show(v)}")
        return float(v)

    def bool(self, key, default=_MISSING) -> bool:
        v = self._value(key, default, "true or false")
        if not isinstance(v, bool):
            raise ValueError(f"config key {self.prefix}{key} must be true or false, got {_show(v)}")
        return v

    def list(self, key):
        """A JSON list (or tuple) or ``None`` when absent/null."""
        v = self.d.get(key)
        if v is not None and not isinstance(v, (list, tuple)):
            raise ValueError(f"config key {self.prefix}{key} must be a list, got {_show(v)}")
        return v

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
class FP8Quantization:
    """A block-quantized FP8 checkpoint, as its ``quantization_config`` describes it.

    DeepSeek-V3/V3.2 and GLM-5 FP8 releases store each quantized linear
    weight ``[out, in]`` as e4m3 plus one fp32 ``weight_scale_inv`` per
    ``block`` = ``(block_out, block_in)`` tile (dequantised weight =
    e4m3 * scale), and quantise activations on the fly per token per
    ``block_in`` values ("dynamic").  ``act_scale_pow2`` is the
    ``scale_fmt: ue8m0`` recipe: activation scales are rounded up to a power
    of two.  Which weights are quantized is read from the checkpoint itself
    (a weight with a ``weight_scale_inv`` sibling); ``modules_to_not_convert``
    names modules that must not be.  See docs/models.md#fp8-checkpoints.
    """

    block: tuple[int, int] = (128, 128)
    act_scale_pow2: bool = False
    modules_to_not_convert: tuple[str, ...] = ()

    def skips(self, module: str) -> bool:
        """Whether ``module`` (a dotted module name) is listed in ``modules_to_not_convert``.

        Matched the way transformers matches the list, so a checkpoint means
        the same thing to both: an entry matches from the start of the name
        up to a module boundary, also as a regular expression (``lm_head``,
        ``model.layers.*.mlp.gate``), or as a plain suffix
        (``self_attn.kv_b_proj`` for every layer's ``kv_b_proj``).
        """
        return any(
            re.match(rf"(?:{entry})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(entry)
            for entry in self.modules_to_not_convert
        )


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
    quantization: FP8Quantization | None = None
    # Multi-token-prediction (draft) layers the checkpoint carries after the
    # target stack, as ``model.layers.{num_hidden_layers + k}.*`` (docs/mtp.md).
    num_nextn_predict_layers: int = 0

    # ------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_record_dim(self) -> int:
        """Width of a dense MLA cache record ``[latent | k_pe]``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def draft_layer(self) -> int:
        """Logical layer id of the MTP draft layer (its checkpoint index and its KV pool layer)."""
        return self.num_hidden_layers

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
        r = _Reader(d)
        if "q_lora_rank" in d and d["q_lora_rank"] is None:
            raise ValueError("q_lora_rank is null; DSA models always use a low-rank query (HF drops the other form)")
        _check_required(d)
        n_layers = r.int("num_hidden_layers")
        act = get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {_show(act)} is not supported (only 'silu')")
        quantization = _quantization(d.get("quantization_config"))
        mlp_types = _mlp_layer_types(r, n_layers)
        indexer_types = _indexer_types(model_type, d, n_layers)
        sparse = "sparse" in mlp_types
        if sparse:
            experts_key = "n_routed_experts" if "n_routed_experts" in d else "num_local_experts"
            n_experts = r.int(experts_key)
            n_group = r.int("n_group", 8 if model_type == "deepseek_v32" else 1)
            topk_group = r.int("topk_group", 4 if model_type == "deepseek_v32" else 1)
            per_token = r.int("num_experts_per_tok")
            if n_experts % n_group:
                raise ValueError(f"n_routed_experts={n_experts} is not divisible by n_group={n_group}")
            if n_experts // n_group < 2:
                raise ValueError("group-limited routing scores a group by its top-2 experts: need >= 2 experts per group")
            if topk_group > n_group:
                raise ValueError(f"topk_group={topk_group} exceeds n_group={n_group}")
            if per_token > topk_group * (n_experts // n_group):
                raise ValueError(
                    f"num_experts_per_tok={per_token} exceeds the {topk_group * (n_experts // n_group)} experts "
                    f"of the topk_group={topk_group} selected group(s)"
                )
        else:  # all-dense stacks have no router: keep the (unused) routing fields at harmless values
            n_experts = r.int("n_routed_experts", 1) if "n_routed_experts" in d else r.int("num_local_experts", 1)
            n_group = r.int("n_group", 1)
            topk_group = r.int("topk_group", 1)
            per_token = r.int("num_experts_per_tok", 1)
        cfg = cls(
            model_type=model_type,
            vocab_size=r.int("vocab_size"),
            hidden_size=r.int("hidden_size"),
            intermediate_size=r.int("intermediate_size") if "dense" in mlp_types else r.int("intermediate_size", 1),
            moe_intermediate_size=r.int("moe_intermediate_size") if sparse else r.int("moe_intermediate_size", 1),
            num_hidden_layers=n_layers,
            num_attention_heads=r.int("num_attention_heads"),
            q_lora_rank=r.int("q_lora_rank"),
            kv_lora_rank=r.int("kv_lora_rank"),
            qk_nope_head_dim=r.int("qk_nope_head_dim"),
            qk_rope_head_dim=r.int("qk_rope_head_dim"),
            v_head_dim=r.int("v_head_dim"),
            n_routed_experts=n_experts,
            n_shared_experts=r.int("n_shared_experts", minimum=0) if sparse else r.int("n_shared_experts", 0, 0),
            num_experts_per_tok=per_token,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=r.bool("norm_topk_prob", True),
            routed_scaling_factor=r.float("routed_scaling_factor", 2.5),
            index_topk=r.int("index_topk", 2048),
            index_n_heads=r.int("index_n_heads"),
            index_head_dim=r.int("index_head_dim"),
            rms_norm_eps=r.float("rms_norm_eps", 1e-6 if model_type == "deepseek_v32" else 1e-5),
            attention_bias=r.bool("attention_bias", False),
            tie_word_embeddings=r.bool("tie_word_embeddings", False),
            max_position_embeddings=r.int("max_position_embeddings", 163840),
            mlp_layer_types=mlp_types,
            indexer_types=indexer_types,
            indexer_rope=INDEXER_ROPE_BY_TYPE[model_type],
            rope=_rope_config(d),
            torch_dtype=str(get("torch_dtype", get("dtype", "bfloat16")) or "bfloat16"),
            quantization=quantization,
            num_nextn_predict_layers=r.int("num_nextn_predict_layers", 0, minimum=0),
        )
        if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim > cfg.index_head_dim:
            raise ValueError("qk_rope_head_dim must be even and <= index_head_dim (the indexer ropes its first dims)")
        return cfg

    @classmethod
    def from_json_file(cls, path) -> "DSAConfig":
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))


def _check_required(d: dict) -> None:
    """Raise one error listing every architecture size the config lacks."""
    types = d.get("mlp_layer_types")
    if isinstance(types, (list, tuple)):
        need_dense, need_moe, layer_keys = "dense" in types, "sparse" in types, ()
    else:  # which layers are dense is itself unknown without first_k_dense_replace
        n, k = d.get("num_hidden_layers"), d.get("first_k_dense_replace")
        known = isinstance(n, int) and isinstance(k, int)
        need_dense = not known or min(k, n) > 0
        need_moe = not known or k < n
        layer_keys = ("first_k_dense_replace",)
    keys = REQUIRED_KEYS + layer_keys + (DENSE_KEYS if need_dense else ()) + (MOE_KEYS if need_moe else ())
    missing = [k for k in keys if k not in d]
    if "n_routed_experts" in missing and "num_local_experts" in d:
        missing.remove("n_routed_experts")
    if missing:
        raise ValueError(
            f"config is missing {', '.join(missing)}: architecture sizes have no default "
            "(copy them from the model's config.json)"
        )


def _mlp_layer_types(r: _Reader, n_layers: int) -> tuple[str, ...]:
    mlp_types = r.list("mlp_layer_types")
    if mlp_types is None:
        first_dense = r.int("first_k_dense_replace", minimum=0)
        n_dense = min(first_dense, n_layers)
        mlp_types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
    mlp_types = tuple(mlp_types)
    if len(mlp_types) != n_layers or not set(mlp_types) <= {"dense", "sparse"}:
        raise ValueError(
            f"mlp_layer_types must list 'dense'/'sparse' for {n_layers} layers, got {_show(list(mlp_types))}"
        )
    return mlp_types


def _indexer_types(model_type: str, d: dict, n_layers: int) -> tuple[str, ...]:
    """Per-layer ``"full"`` / ``"shared"`` (IndexCache), as transformers resolves it."""
    if model_type == "deepseek_v32":
        return ("full",) * n_layers
    r = _Reader(d)
    types = r.list("indexer_types")
    if types is None:
        pattern = d.get("index_topk_pattern")
        if pattern is not None:
            if isinstance(pattern, str):
                bad = set(pattern) - {"F", "S"}
                if bad:
                    raise ValueError(f"index_topk_pattern may contain only 'F'/'S', got {_show(pattern)}")
                types = [{"F": "full", "S": "shared"}[c] for c in pattern]
            else:
                types = list(r.list("index_topk_pattern"))
        else:
            # null or 0 mean "every layer" (transformers clamps the frequency to >= 1 the same way)
            freq = max(r.int("index_topk_freq", 1, minimum=-MAX_SIZE) if d.get("index_topk_freq") else 1, 1)
            offset = r.int("index_skip_topk_offset", 2, minimum=-MAX_SIZE)
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
    types = tuple(types)
    if len(types) != n_layers or not set(types) <= {"full", "shared"}:
        raise ValueError(f"indexer_types must list 'full'/'shared' for {n_layers} layers, got {_show(list(types))}")
    if types and types[0] != "full":
        raise ValueError("layer 0 must run its own indexer: a shared layer reuses the previous layer's top-k")
    return types


# Largest quantization block side accepted: the kernels tile K by the block.
MAX_QUANT_BLOCK = 4096


def _quantization(q) -> FP8Quantization | None:
    """Parse ``quantization_config``: only DeepSeek-style block-scaled FP8 (``quant_method: fp8``) exists here."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"config key quantization_config must be an object, got {_show(q)}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"quantization_config.quant_method {_show(method)} is not supported: only 'fp8' "
            "(block-scaled e4m3 weights with weight_scale_inv) loads; convert other formats to bf16 first"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt must be 'e4m3', got {_show(fmt)}")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"quantization_config.activation_scheme must be 'dynamic' (activations quantised per token), got {_show(scheme)}"
        )
    block = q.get("weight_block_size", [128, 128])
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_QUANT_BLOCK for b in block)
    ):
        raise ValueError(
            "quantization_config.weight_block_size must be two integers [out, in] in "
            f"[1, {MAX_QUANT_BLOCK}] (per-tensor FP8 is not supported), got {_show(block)}"
        )
    scale_fmt = q.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise ValueError(f"quantization_config.scale_fmt must be 'ue8m0' or 'float', got {_show(scale_fmt)}")
    skip = q.get("modules_to_not_convert", q.get("ignored_layers")) or []
    if not isinstance(skip, (list, tuple)) or not all(isinstance(m, str) and m for m in skip):
        raise ValueError(f"quantization_config.modules_to_not_convert must be a list of module names, got {_show(skip)}")
    for entry in skip:
        try:
            re.compile(entry)
        except re.error as exc:
            raise ValueError(f"quantization_config.modules_to_not_convert entry {_show(entry)} is not a valid pattern: {exc}") from None
    return FP8Quantization(block=(block[0], block[1]), act_scale_pow2=scale_fmt == "ue8m0",
                           modules_to_not_convert=tuple(skip))


def _rope_config(d: dict) -> RopeConfig:
    """Resolve ``rope_parameters`` (transformers 5 form) or legacy ``rope_scaling`` + ``rope_theta``."""
    key = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    params = d.get(key) or {}
    if not isinstance(params, dict):
        raise ValueError(f"config key {key} must be an object, got {_show(params)}")
    r = _Reader(params, prefix=f"{key}.")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if "rope_theta" in params and params["rope_theta"] is not None:
        theta = r.float("rope_theta", minimum=1.0)
    elif d.get("rope_theta") is not None:
        theta = _Reader(d).float("rope_theta", minimum=1.0)
    else:
        theta = 10000.0
    if rope_type == "default":
        return RopeConfig(rope_type="default", theta=theta)
    if rope_type != "yarn":
        raise ValueError(f"rope type {_show(rope_type)} is not supported (only 'default' and 'yarn')")
    max_pos = _Reader(d).int("max_position_embeddings", 163840)
    if d.get("original_max_position_embeddings") is not None:
        orig = _Reader(d).int("original_max_position_embeddings")
    else:
        orig = r.int("original_max_position_embeddings", max_pos)
    # yarn interpolates by 1/factor and takes log(factor): transformers requires factor >= 1.
    factor = r.float("factor", minimum=1.0, strict=False) if params.get("factor") is not None else max_pos / orig
    if factor < 1.0:
        raise ValueError(
            f"yarn factor max_position_embeddings / original_max_position_embeddings = {max_pos}/{orig} is below 1"
        )
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"config key {key}.truncate must be true or false, got {_show(truncate)}")
    attention_factor = r.opt_float("attention_factor")
    if attention_factor is not None and attention_factor <= 0:
        raise ValueError(f"config key {key}.attention_factor must be a number > 0, got {attention_factor:g}")
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=r.float("beta_fast") if params.get("beta_fast") is not None else 32.0,
        beta_slow=r.float("beta_slow") if params.get("beta_slow") is not None else 1.0,
        mscale=r.opt_float("mscale"),
        mscale_all_dim=r.opt_float("mscale_all_dim"),
        attention_factor=attention_factor,
        truncate=truncate,
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
