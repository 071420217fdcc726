"""Building models: an uninitialised model in a dtype, seeded random weights, bundled tiny models.

Every source of weights (a checkpoint, an in-memory transformers model, a
bundled tiny config) starts from the model :func:`build_model` allocates and
the same dtype rules (which tensors stay fp32), and the memory check
(:mod:`.memory_check`) prices exactly that allocation; so these live apart
from the code that fills the model (:mod:`.loading`).
"""

from __future__ import annotations

import re

import torch

from .config import DSAConfig, bundled_config_dict
from .layers import RotaryTable
from .model import DSAForCausalLM

# Tensors kept in fp32 whatever the requested dtype (transformers does the same).
_FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}")


def _keeps_fp32(name: str) -> bool:
    return name.endswith(_FP32_SUFFIXES)


def build_model(cfg: DSAConfig, dtype=torch.float32, device="cpu", *, draft: bool = False) -> DSAForCausalLM:
    """An uninitialised model in ``dtype`` (fp32-kept tensors stay fp32); ``draft``: with the MTP layer."""
    dtype = resolve_dtype(dtype)
    with torch.device(device):
        model = DSAForCausalLM(cfg, draft=draft)
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


def tiny_model(name: str, dtype=torch.float32, seed: int = 0, device="cpu", *, draft: bool = False) -> DSAForCausalLM:
    """A bundled tiny config (see :func:`bundled_names`) with seeded random weights.

    ``draft=True`` adds a random MTP draft layer; its tensors sort after the
    target's, so the target's weights are the same with or without it.
    """
    d = bundled_config_dict(name)
    cfg = DSAConfig.from_hf_dict(d)
    model = build_model(cfg, dtype, device, draft=draft)
    return init_random(model, seed=seed, std=float(d.get("initializer_range", 0.02)))


def _materialize(model: DSAForCausalLM, cfg: DSAConfig, device) -> DSAForCausalLM:
    """Allocate a meta-built model on ``device`` (uninitialised); recompute what loading does not fill.

    Every persistent tensor is then written by :func:`.loading.load_state`, which
    reports any the checkpoint lacks.  The only non-persistent buffer is the
    RoPE table, rebuilt here; a module that adds another one makes this
    raise rather than leave it uninitialised.
    """
    persistent = set(model.state_dict())
    derived = sorted(n for n, _ in model.named_buffers() if n not in persistent)
    if derived != ["model.rotary.inv_freq"]:
        raise RuntimeError(f"cannot rebuild non-persistent buffers {derived} of a meta-built model")
    model.to_empty(device=device)
    with torch.device(device):
        model.model.rotary = RotaryTable(cfg.rope, cfg.qk_rope_head_dim)
    return model
