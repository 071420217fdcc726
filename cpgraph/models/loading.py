"""Building models: bundled tiny configs, local HF checkpoints, in-memory transformers models.

Nothing here touches the network: ``from_pretrained`` reads a local directory
(``config.json`` + ``*.safetensors`` shards, with or without
``model.safetensors.index.json``) or a bundled tiny model name.

Names map one to one with transformers 5.24 except routed experts, which
checkpoints store per expert (``mlp.experts.<j>.{gate,up,down}_proj.weight``)
and transformers/cpgraph store stacked (``mlp.experts.gate_up_proj [E, 2I,
H]``, ``mlp.experts.down_proj [E, H, I]``); both layouts are accepted.
Multi-token-prediction layers (index >= ``num_hidden_layers``) are skipped,
as transformers does.  Any mismatch raises a single :class:`WeightLoadError`
listing every missing, unexpected and mis-shaped tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import Tensor

from .config import DSAConfig, bundled_config_dict, bundled_names
from .model import DSAForCausalLM

# Tensors kept in fp32 whatever the requested dtype (transformers does the same).
_FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")
_EXPERT_RE = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightLoadError(ValueError):
    """The checkpoint does not match the model; the message lists every problem."""

    def __init__(self, missing: list[str], unexpected: list[str], mis_shaped: list[str]):
        self.missing, self.unexpected, self.mis_shaped = missing, unexpected, mis_shaped
        parts = []
        for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", mis_shaped)):
            if items:
                parts.append(f"{len(items)} {title}:\n  " + "\n  ".join(items))
        super().__init__("checkpoint does not match the model config:\n" + "\n".join(parts))


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}")


def _keeps_fp32(name: str) -> bool:
    return name.endswith(_FP32_SUFFIXES)


def build_model(cfg: DSAConfig, dtype=torch.float32, device="cpu") -> DSAForCausalLM:
    """An uninitialised model in ``dtype`` (fp32-kept tensors stay fp32)."""
    dtype = resolve_dtype(dtype)
    with torch.device(device):
        model = DSAForCausalLM(cfg)
    for name, p in model.named_parameters():
        if not _keeps_fp32(name):
            p.data = p.data.to(dtype)
    return model.eval()


def init_random(model: DSAForCausalLM, seed: int = 0, std: float = 0.02) -> DSAForCausalLM:
    """Deterministic random weights (same seed -> same weights on any machine).

    Matrices ~ N(0, std); norm weights ~ 1 + N(0, 0.1) so that a wrong norm
    placement shows in the logits; biases and the router correction bias small
    random.  Drawn in fp32 on the CPU in sorted-name order, then cast.
    """
    g = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            if name.endswith("inv_freq"):
                continue
            if re.search(r"(norm|layernorm)\.weight$", name):
                v = 1 + 0.1 * torch.randn(t.shape, generator=g)
            elif name.endswith("bias"):
                v = 0.05 * torch.randn(t.shape, generator=g)
            else:
                v = std * torch.randn(t.shape, generator=g)
            t.copy_(v.to(t.dtype))
    return model


def tiny_model(name: str, dtype=torch.float32, seed: int = 0, device="cpu") -> DSAForCausalLM:
    """A bundled tiny config (see :func:`bundled_names`) with seeded random weights."""
    d = bundled_config_dict(name)
    cfg = DSAConfig.from_hf_dict(d)
    model = build_model(cfg, dtype, device)
    return init_random(model, seed=seed, std=float(d.get("initializer_range", 0.02)))


# ---------------------------------------------------------------- checking
def _expected(model: DSAForCausalLM) -> dict[str, Tensor]:
    out = dict(model.state_dict(keep_vars=True))
    for k in [k for k in out if k.endswith("inv_freq")]:
        del out[k]
    return out


def _stack_experts(named: Iterable[tuple[str, Tensor]], cfg: DSAConfig) -> Iterator[tuple[str, Tensor]]:
    """Yield tensors with per-expert weights folded into transformers' stacked layout.

    Incomplete expert sets are passed through under their own names so that
    the checker reports them (as unexpected names, plus the missing stack).
    """
    experts: dict[str, dict[tuple[int, str], Tensor]] = {}
    for name, t in named:
        m = _EXPERT_RE.match(name)
        if m is None:
            yield name, t
            continue
        experts.setdefault(m.group(1), {})[(int(m.group(3)), m.group(4))] = t
    E = cfg.n_routed_experts
    for prefix, parts in experts.items():
        complete = all((j, k) in parts for j in range(E) for k in ("gate_proj", "up_proj", "down_proj"))
        complete = complete and len(parts) == 3 * E
        shapes_ok = complete and all(
            parts[(j, "gate_proj")].shape == parts[(0, "gate_proj")].shape
            and parts[(j, "up_proj")].shape == parts[(0, "gate_proj")].shape
            and parts[(j, "down_proj")].shape == parts[(0, "down_proj")].shape
            for j in range(E)
        )
        if not shapes_ok:
            for (j, k), t in sorted(parts.items()):
                yield f"{prefix}.{j}.{k}.weight", t
            continue
        yield f"{prefix}.gate_up_proj", torch.stack(
            [torch.cat((parts[(j, "gate_proj")], parts[(j, "up_proj")]), 0) for j in range(E)]
        )
        yield f"{prefix}.down_proj", torch.stack([parts[(j, "down_proj")] for j in range(E)])


def load_state(model: DSAForCausalLM, named: Iterable[tuple[str, Tensor]]) -> DSAForCausalLM:
    """Copy checkpoint tensors into ``model`` (converting dtype) after checking names and shapes."""
    cfg = model.config
    expected = _expected(model)
    seen: dict[str, Tensor] = {}
    unexpected, mis_shaped, wrong = [], [], set()
    for name, t in _stack_experts(named, cfg):
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue  # multi-token-prediction layers: not part of the prefill model
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in expected:
            unexpected.append(f"{name} {tuple(t.shape)}")
            continue
        want = tuple(expected[name].shape)
        if tuple(t.shape) != want:
            mis_shaped.append(f"{name}: checkpoint {tuple(t.shape)}, model expects {want}")
            wrong.add(name)
            continue
        seen[name] = t
    missing = [n for n in expected if n not in seen and n not in wrong]
    if cfg.tie_word_embeddings and "lm_head.weight" in missing and "model.embed_tokens.weight" in seen:
        missing.remove("lm_head.weight")
    if missing or unexpected or mis_shaped:
        raise WeightLoadError(
            [f"{n} {tuple(expected[n].shape)}" for n in missing], sorted(unexpected), sorted(mis_shaped)
        )
    with torch.no_grad():
        for name, t in seen.items():
            dst = expected[name]
            dst.copy_(t.to(device=dst.device, dtype=dst.dtype))
    return model


# ---------------------------------------------------------------- sources
def from_hf(hf_model, dtype=None, device="cpu") -> DSAForCausalLM:
    """Convert an in-memory ``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM``."""
    config = getattr(hf_model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"from_hf expects a transformers model with a .config, got {type(hf_model).__name__}")
    cfg = DSAConfig.from_hf_dict(config.to_dict())
    if dtype is None:
        dtype = next(p.dtype for n, p in hf_model.named_parameters() if not _keeps_fp32(n))
    model = build_model(cfg, dtype, device)
    return load_state(model, hf_model.state_dict().items())


def _safetensors_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted({root / v for v in weight_map.values()})
        absent = [str(p.name) for p in files if not p.is_file()]
        if absent:
            raise ValueError(f"{index} names shard files that do not exist: {', '.join(absent)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root} holds no *.safetensors files")
    return files


def _read_safetensors(files: list[Path]) -> Iterator[tuple[str, Tensor]]:
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def from_pretrained(path, dtype=None, device="cpu", seed: int = 0) -> DSAForCausalLM:
    """Load a local HF checkpoint directory, or build a bundled tiny model by name.

    ``dtype``: ``None`` keeps the config's ``torch_dtype`` (float32 for the
    bundled models); ``torch.bfloat16`` etc. converts.  Never downloads.
    """
    root = Path(path)
    if not root.is_dir():
        if str(path) in bundled_names():
            return tiny_model(str(path), dtype=resolve_dtype(dtype or "float32"), seed=seed, device=device)
        raise ValueError(
            f"{path!r} is neither a local checkpoint directory nor a bundled model "
            f"({', '.join(bundled_names())}); cpgraph never downloads weights"
        )
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{root} has no config.json")
    with open(cfg_path) as f:
        cfg = DSAConfig.from_hf_dict(json.load(f))
    model = build_model(cfg, resolve_dtype(dtype or cfg.torch_dtype), device)
    return load_state(model, _read_safetensors(_safetensors_files(root)))
