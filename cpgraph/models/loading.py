"""Building models: bundled tiny configs, local HF checkpoints, in-memory transformers models.

Nothing here touches the network: ``from_pretrained`` reads a local directory
(``config.json`` + ``*.safetensors`` shards, with or without
``model.safetensors.index.json``) or a bundled tiny model name.

Names map one to one with transformers 5.24 except routed experts, which
checkpoints store per expert (``mlp.experts.<j>.{gate,up,down}_proj.weight``)
and transformers/cpgraph store stacked (``mlp.experts.gate_up_proj [E, 2I,
H]``, ``mlp.experts.down_proj [E, H, I]``); both layouts are accepted.
Multi-token-prediction layers (index >= ``num_hidden_layers``) are skipped,
as transformers does, unless the model was built with ``draft=True``: then
layer ``num_hidden_layers`` loads into the draft (:mod:`.mtp`, names mapped
by :func:`.mtp.checkpoint_name`) and its absence is an error.  Any mismatch raises a single :class:`WeightLoadError`
listing every missing, unexpected and mis-shaped tensor.

Checkpoint files are untrusted input: an index may only name shards inside
the checkpoint directory, and every shard's header is read and checked
before any tensor is.  ``from_pretrained`` estimates the model's bytes
before allocating anything and refuses when they exceed the memory
available (``memory_limit`` / ``CPGRAPH_MEMORY_LIMIT`` override the
detected amount; see ``docs/models.md``).

FP8 block-quantized checkpoints (``quantization_config`` with
``quant_method: fp8``) are checked against their config before any tensor
is read and loaded dequantized or with e4m3 weights kept
(``weights="fp8"``); the rules live in :mod:`.fp8`.

The pieces live in their own modules: :mod:`.build` (building and random
initialisation), :mod:`.checkpoint_files` (reading safetensors shards),
:mod:`.local_experts` (expert-parallel reads), :mod:`.memory_check`
(the memory estimate and check).  Their public names stay importable from
here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import Tensor

from .config import DSAConfig, bundled_config_dict, bundled_names
from . import fp8 as fp8ckpt
from .build import _keeps_fp32, _materialize, build_model, init_random, resolve_dtype, tiny_model
from .checkpoint_files import (_catalog, _read_json, _read_tensors, _safetensors_entries, _safetensors_files,
                               _staged_bytes)
from .local_experts import _EXPERT_RE, _PER_EXPERT_RE, _expert_range, _local_experts
from .memory_check import MEMORY_LIMIT_ENV, check_memory, estimate_model_bytes
from .model import DSAForCausalLM
from .moe import expert_shard, shard_experts
from .mtp import checkpoint_name as draft_checkpoint_name
from .mtp import draft_layer_config

# The public names: some defined in the modules above, all importable from here as before.
__all__ = [
    "MEMORY_LIMIT_ENV",
    "WeightLoadError",
    "build_model",
    "check_memory",
    "estimate_model_bytes",
    "from_hf",
    "from_pretrained",
    "init_random",
    "load_state",
    "resolve_dtype",
    "tiny_model",
]

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class WeightLoadError(ValueError):
    """The checkpoint does not match the model; the message lists every problem."""

    def __init__(self, missing: list[str], unexpected: list[str], mis_shaped: list[str]):
        self.missing, self.unexpected, self.mis_shaped = missing, unexpected, mis_shaped
        parts = []
        for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", mis_shaped)):
            if items:
                parts.append(f"{len(items)} {title}:\n  " + "\n  ".join(items))
        super().__init__("checkpoint does not match the model config:\n" + "\n".join(parts))


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
    draft = getattr(model, "has_draft", False)
    draft_seen = False
    for name, t in _stack_experts(named, cfg):
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            mapped = draft_checkpoint_name(cfg, name) if draft else None
            if mapped is None:
                continue  # multi-token-prediction layers the model does not hold
            draft_seen = True
            if not mapped:
                continue  # the draft's copy of the shared embedding / head: the target's is used
            name = mapped
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
    if draft and not draft_seen:
        raise ValueError(
            f"draft=True but the checkpoint has no MTP layer (no model.layers.{cfg.draft_layer}.* tensors)"
        )
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
def from_hf(hf_model, dtype=None, device="cpu", *, ep_rank: int = 0, ep_size: int = 1,
            draft: bool = False) -> DSAForCausalLM:
    """Convert an in-memory ``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM``.

    ``ep_rank`` / ``ep_size``: keep only this expert-parallel rank's routed
    experts (``docs/expert_parallel.md``).  ``draft=True`` raises: transformers
    drops the MTP layer, so an in-memory model never holds one.
    """
    config = getattr(hf_model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"from_hf expects a transformers model with a .config, got {type(hf_model).__name__}")
    cfg = DSAConfig.from_hf_dict(config.to_dict())
    if draft:
        raise ValueError("draft=True: transformers models drop the MTP layer; load the checkpoint with from_pretrained")
    if dtype is None:
        dtype = next(p.dtype for n, p in hf_model.named_parameters() if not _keeps_fp32(n))
    experts = _expert_range(cfg, ep_rank, ep_size)
    with expert_shard(experts):
        model = build_model(cfg, dtype, device)
    named = hf_model.state_dict().items()
    if experts is not None:
        named = _local_experts(((n, lambda rows, t=t: t if rows is None else t[rows]) for n, t in named), experts)
    return load_state(model, named)


def from_pretrained(path, dtype=None, device="cpu", seed: int = 0, *, memory_limit=None, ep_rank: int = 0,
                    ep_size: int = 1, weights: str | None = None, draft: bool = False) -> DSAForCausalLM:
    """Load a local HF checkpoint directory, or build a bundled tiny model by name.

    ``dtype``: ``None`` keeps the config's ``torch_dtype`` (float32 for the
    bundled models); ``torch.bfloat16`` etc. converts.  Never downloads.
    Before allocating, the model's bytes are estimated and compared with the
    free memory of ``device`` (host RAM for ``cpu``); ``memory_limit`` (bytes,
    or ``"off"``; default: ``$CPGRAPH_MEMORY_LIMIT``, else detected) overrides.
    ``ep_rank`` / ``ep_size``: build and read only this expert-parallel
    rank's routed experts (:func:`_local_experts`); the memory check counts
    that share only.
    ``weights`` (FP8 block-quantized checkpoints, :mod:`.fp8`):
    ``"dequantize"`` (the default) gives ``dtype`` weights; ``"fp8"`` keeps
    the e4m3 weights and block scales in :class:`~.fp8.FP8Linear` modules
    (``kv_b_proj`` stays dequantized; routed experts become ``FP8Experts``).  ``"fp8"`` on a
    checkpoint without FP8 weights raises.
    ``draft=True`` also loads the MTP draft layer (``model.layers.{N}.*``,
    docs/mtp.md); a checkpoint without one raises.  Bundled models get a
    seeded random draft layer.
    """
    if weights not in (None,) + fp8ckpt.WEIGHTS_MODES:
        raise ValueError(f"weights must be one of {', '.join(fp8ckpt.WEIGHTS_MODES)}, got {weights!r}")
    root = Path(path)
    if not root.is_dir():
        if weights == "fp8" and str(path) in bundled_names():
            raise ValueError(f"weights='fp8' needs an FP8 checkpoint; bundled model {str(path)!r} has random dense weights")
        if str(path) in bundled_names():
            dt = resolve_dtype(dtype or "float32")
            cfg = DSAConfig.from_hf_dict(bundled_config_dict(str(path)))
            experts = _expert_range(cfg, ep_rank, ep_size)
            with expert_shard(experts):
                # The draft's decoder layer counted as one more layer (its norms and eh_proj are small).
                check_memory(draft_layer_config(cfg) if draft else cfg, dt, device, memory_limit=memory_limit,
                             what=f"bundled model {path!r}")
            # Drawn whole (same seed -> same weights as the unsharded model), then cut.
            model = tiny_model(str(path), dtype=dt, seed=seed, device=device, draft=draft)
            return model if experts is None else shard_experts(model, experts)
        raise ValueError(
            f"{path!r} is neither a local checkpoint directory nor a bundled model "
            f"({', '.join(bundled_names())}); cpgraph never downloads weights"
        )
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{root} has no config.json")
    cfg = DSAConfig.from_hf_dict(_read_json(cfg_path))
    if draft and cfg.num_nextn_predict_layers < 1:
        raise ValueError(f"draft=True but {cfg_path} declares no MTP layer (num_nextn_predict_layers is 0 or absent)")
    dt = resolve_dtype(dtype or cfg.torch_dtype)
    files = _safetensors_files(root)
    catalog = _catalog(files)
    plan = fp8ckpt.plan_checkpoint(cfg, catalog)
    if weights == "fp8" and not (plan and plan.scales):
        raise ValueError(f"weights='fp8' needs an FP8 checkpoint (float8_e4m3fn weights with weight_scale_inv); {root} has none")
    experts = _expert_range(cfg, ep_rank, ep_size)

    def wanted(name: str) -> bool:  # tensors this rank reads (MTP layers and other ranks' experts are skipped)
        layer = _LAYER_RE.match(name)
        if layer and int(layer.group(1)) >= cfg.num_hidden_layers:
            if not (draft and int(layer.group(1)) == cfg.draft_layer):
                return False
        m = _PER_EXPERT_RE.match(name)
        return experts is None or m is None or experts[0] <= int(m.group(1)) < experts[1]

    fp8_modules = plan.fp8_modules(cfg) if weights == "fp8" else []
    keep_fp8 = {m + ".weight" for m in fp8_modules}
    staged = _staged_bytes(files, experts, cfg.n_routed_experts)
    saved = 0
    if plan is not None:
        staged += fp8ckpt.dequantized_extra_bytes(plan, catalog, keep_fp8, dt, wanted)
        # Only the tensors this rank reads save bytes (an EP rank reads its own experts).
        saved = fp8ckpt.fp8_saved_bytes(plan, catalog, [m for m in fp8_modules if wanted(m + ".weight")], dt)
    with expert_shard(experts):
        check_memory(draft_layer_config(cfg) if draft else cfg, dt, device, staged_bytes=staged,
                     memory_limit=memory_limit, what=f"checkpoint {root}",
                     saved_bytes=saved)
        # FP8 modules replace dense ones: build on meta first so the dense weights are never allocated.
        model = build_model(cfg, dt, "meta" if fp8_modules else device, draft=draft)
    if fp8_modules:
        keep_fp8 = fp8ckpt.swap_fp8_linears(model, fp8_modules, plan.quant)
        model = _materialize(model, cfg, device)
    entries = _safetensors_entries(files)
    if plan is not None:
        scales = _read_tensors(files, set(fp8ckpt.scale_names_to_read(plan, keep_fp8, wanted)))
        entries = fp8ckpt.dequantized_entries(entries, plan, scales, dt, keep_fp8)
    if experts is None:
        return load_state(model, ((name, read(None)) for name, read in entries))
    return load_state(model, _local_experts(entries, experts))
