"""Helpers that build a transformers 5.24 oracle next to a cpgraph model.

The oracle is built from the *same* HF-style config dict, given seeded random
weights (cpgraph's ``init_random`` on an identically shaped model, copied in
by name), and the cpgraph model is then made with ``from_hf`` -- so the
loader is on the tested path too.
"""

from __future__ import annotations

import functools
import inspect

import torch
import transformers

from cpgraph.models import DSAConfig, build_model, from_hf, init_random
from cpgraph.models.config import bundled_config_dict

_HF = {
    "deepseek_v32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM),
    "glm_moe_dsa": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM),
}


def config_variants() -> dict[str, dict]:
    """Two configs per model type: different heads, top-k, RoPE, IndexCache pattern."""
    ds_a = bundled_config_dict("tiny-deepseek-v32")  # 4 heads, top-k 16, yarn RoPE, 4 index heads
    ds_b = dict(
        ds_a,
        num_attention_heads=2,
        num_key_value_heads=2,
        index_n_heads=16,
        index_topk=8,
        n_group=2,
        topk_group=1,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    glm_a = bundled_config_dict("tiny-glm5")  # 4 layers, freq 2 / offset 1 -> F S F S, top-k 16
    glm_b = dict(glm_a, num_attention_heads=2, num_key_value_heads=2, index_n_heads=16, index_topk=8, index_topk_pattern="FFSS")
    del glm_b["index_topk_freq"], glm_b["index_skip_topk_offset"]
    # One or two indexer heads: ReLU zeros (every head's dot negative) and negative head weights make
    # exact score ties common, so these pin the top-k tie rule end to end.
    ds_tie1 = dict(ds_a, index_n_heads=1)
    ds_tie2 = dict(ds_a, index_n_heads=2)
    glm_tie2 = dict(glm_a, index_n_heads=2)
    return {"ds-a": ds_a, "ds-b": ds_b, "glm-a": glm_a, "glm-b": glm_b, "ds-tie1": ds_tie1, "ds-tie2": ds_tie2,
            "glm-tie2": glm_tie2}


def hf_config(d: dict):
    cfg_cls, _ = _HF[d["model_type"]]
    kw = {k: v for k, v in d.items() if k not in ("model_type", "architectures", "torch_dtype", "dtype")}
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def make_pair(d: dict, seed: int = 0):
    """(hf_model, cpgraph_model) with identical fp32 weights."""
    _, model_cls = _HF[d["model_type"]]
    torch.manual_seed(seed)
    hf = model_cls(hf_config(d)).eval()
    donor = init_random(build_model(DSAConfig.from_hf_dict(d)), seed=seed, std=float(d.get("initializer_range", 0.02)))
    result = hf.load_state_dict(donor.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return hf, from_hf(hf)


@functools.lru_cache(maxsize=None)
def cached_pair(name: str):
    return make_pair(config_variants()[name])


def prompts(vocab: int, lens, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def tie_rule_topk(scores: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """``Tensor.topk`` under cpgraph's tie rule: higher score first, equal scores -> lower index first.

    A stable descending sort (comparisons treat ``-0.0 == 0.0`` and put NaN
    first), written independently of cpgraph's int64-key implementation.
    """
    assert largest, "the indexer only asks for the largest scores"
    order = torch.sort(scores, dim=dim, descending=True, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((scores.gather(dim, order), order))


class TopkCapture:
    """Run the HF model on one prompt and record, per layer, HF's top-k and the index scores it ranked.

    ``Tensor.topk`` is wrapped only while an indexer module runs, so the
    recorded scores are exactly the ones transformers selected from.  With
    ``tie_rule=True`` (the default) the indexer's selection itself follows
    cpgraph's tie rule (:func:`tie_rule_topk`); ``torch.topk`` would pick an
    arbitrary member of a tie, which on few-head indexers changes the logits
    by tens of percent.  Other ``topk`` calls (the MoE router) are untouched.  The
    attention modules' outputs give each layer's top-k as used (GLM returns
    it; for DeepSeek every layer runs its own indexer).
    """

    def __init__(self, hf, tie_rule: bool = True):
        self.hf = hf
        self.tie_rule = tie_rule

    @staticmethod
    def _after_indexer(used, current, i, module, args, output):
        used[i] = output.clone()
        current["layer"] = None

    @torch.no_grad()
    def run(self, tokens: list[int]):
        layers = self.hf.model.layers
        scores: dict[int, torch.Tensor] = {}
        used: dict[int, torch.Tensor] = {}
        hooks = []
        current = {"layer": None}
        orig_topk = torch.Tensor.topk

        def topk_spy(t, k, *a, **kw):
            if current["layer"] is None:
                return orig_topk(t, k, *a, **kw)
            scores[current["layer"]] = t.detach().clone()
            return (tie_rule_topk if self.tie_rule else orig_topk)(t, k, *a, **kw)

        for i, layer in enumerate(layers):
            ind = layer.self_attn.indexer
            if ind is not None:
                hooks.append(ind.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__("layer", i)))
                hooks.append(ind.register_forward_hook(functools.partial(self._after_indexer, used, current, i)))
            if "prev_topk_indices" in inspect.signature(layer.self_attn.forward).parameters:
                hooks.append(layer.self_attn.register_forward_hook(lambda m, a, o, i=i: used.__setitem__(i, o[2].clone())))
        torch.Tensor.topk = topk_spy
        try:
            logits = self.hf(torch.tensor([tokens])).logits[0, -1].float()
        finally:
            torch.Tensor.topk = orig_topk
            for h in hooks:
                h.remove()
        return logits, {i: s[0] for i, s in scores.items()}, {i: u[0] for i, u in used.items()}
