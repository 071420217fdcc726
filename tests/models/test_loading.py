"""Loading: local HF directories, in-memory HF models, bundled tiny models, and every kind of mismatch."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from cpgraph.models import DSAConfig, WeightLoadError, from_hf, from_pretrained, prefill_logits, tiny_model
from cpgraph.models.config import bundled_config_dict, bundled_names

from hf_oracle import cached_pair, config_variants, prompts


def _write_checkpoint(root, cfg: dict, tensors: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))


def _per_expert_state(model) -> dict:
    """The model's tensors with routed experts split per expert, the on-disk checkpoint layout."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            gate, up = v.chunk(2, dim=1)
            for j in range(v.shape[0]):
                out[f"{base}{j}.gate_proj.weight"] = gate[j].clone()
                out[f"{base}{j}.up_proj.weight"] = up[j].clone()
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for j in range(v.shape[0]):
                out[f"{base}{j}.down_proj.weight"] = v[j].clone()
        else:
            out[k] = v.clone()
    return out


def test_from_pretrained_reads_sharded_hf_save(tmp_path):
    hf, model = cached_pair("glm-a")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded, with index json, per-expert names
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = from_pretrained(tmp_path)
    ps = prompts(model.config.vocab_size, [20, 7], seed=11)
    assert torch.equal(prefill_logits(loaded, ps), prefill_logits(model, ps))
    with torch.no_grad():
        ref = hf(torch.tensor([ps[0]])).logits[0, -1]
    assert float((prefill_logits(loaded, ps[:1])[0] - ref).abs().max() / ref.abs().max()) <= 1e-4


def test_from_pretrained_accepts_stacked_experts_and_skips_mtp_layers(tmp_path):
    _, model = cached_pair("ds-a")
    cfg = bundled_config_dict("tiny-deepseek-v32")
    state = dict(model.state_dict())
    n = model.config.num_hidden_layers
    state[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(4, 4)  # a multi-token-prediction layer
    _write_checkpoint(tmp_path, cfg, state)
    loaded = from_pretrained(tmp_path)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_dtype_conversion_keeps_router_and_indexer_weights_fp32(tmp_path):
    _, model = cached_pair("ds-b")
    _write_checkpoint(tmp_path, config_variants()["ds-b"], _per_expert_state(model))
    loaded = from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name, p in loaded.named_parameters():
        keep = name.endswith(("mlp.gate.weight", "indexer.weights_proj.weight"))
        assert p.dtype == (torch.float32 if keep else torch.bfloat16), name
    src = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p, src[name].to(p.dtype)), name
    out = prefill_logits(loaded, [[1, 2, 3, 4, 5]])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_one_error_lists_missing_unexpected_and_mis_shaped(tmp_path):
    _, model = cached_pair("glm-a")
    state = _per_expert_state(model)
    del state["model.layers.0.self_attn.kv_b_proj.weight"]
    del state["model.layers.2.mlp.experts.3.up_proj.weight"]  # an incomplete expert set
    state["model.layers.1.self_attn.indexer.wq_b.weight"] = torch.zeros(3, 3)  # layer 1 is shared: no indexer
    state["model.norm.weight"] = torch.ones(7)
    _write_checkpoint(tmp_path, bundled_config_dict("tiny-glm5"), state)
    with pytest.raises(WeightLoadError) as info:
        from_pretrained(tmp_path)
    err = info.value
    msg = str(err)
    assert any("model.layers.0.self_attn.kv_b_proj.weight" in m for m in err.missing)
    assert any("model.layers.2.mlp.experts.gate_up_proj" in m for m in err.missing)
    assert any("model.layers.1.self_attn.indexer.wq_b.weight" in u for u in err.unexpected)
    assert any("model.layers.2.mlp.experts.0.up_proj.weight" in u for u in err.unexpected)
    assert any("model.norm.weight" in s and "(7,)" in s for s in err.mis_shaped)
    for part in ("missing", "unexpected", "wrong shape", "kv_b_proj", "model.norm.weight"):
        assert part in msg


@pytest.mark.parametrize("kind", ["missing", "unexpected", "shape"])
def test_each_mismatch_alone_is_reported(tmp_path, kind):
    _, model = cached_pair("ds-a")
    state = dict(model.state_dict())
    if kind == "missing":
        del state["lm_head.weight"]
    elif kind == "unexpected":
        state["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    else:
        state["model.embed_tokens.weight"] = torch.zeros(3, 64)
    _write_checkpoint(tmp_path, bundled_config_dict("tiny-deepseek-v32"), state)
    with pytest.raises(WeightLoadError) as info:
        from_pretrained(tmp_path)
    counts = (len(info.value.missing), len(info.value.unexpected), len(info.value.mis_shaped))
    assert counts == {"missing": (1, 0, 0), "unexpected": (0, 1, 0), "shape": (0, 0, 1)}[kind]


def test_wrong_model_type_is_rejected(tmp_path):
    _write_checkpoint(tmp_path, dict(bundled_config_dict("tiny-glm5"), model_type="llama"), {})
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type"):
        DSAConfig.from_hf_dict({"hidden_size": 8})


def test_from_hf_rejects_other_models():
    import transformers

    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)
    )
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        from_hf(llama)
    with pytest.raises(ValueError, match="transformers model"):
        from_hf(object())


def test_bundled_models_are_named_and_deterministic(tmp_path):
    assert {"tiny-deepseek-v32", "tiny-glm5", "tiny-deepseek-v32-fp8"} <= set(bundled_names())
    a, b = from_pretrained("tiny-glm5"), tiny_model("tiny-glm5")
    for (k, v), (k2, v2) in zip(a.state_dict().items(), b.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    assert not torch.equal(tiny_model("tiny-glm5", seed=1).lm_head.weight, a.lm_head.weight)
    with pytest.raises(ValueError, match="never downloads"):
        from_pretrained("deepseek-ai/DeepSeek-V3.2")
    with pytest.raises(ValueError, match="no config.json"):
        from_pretrained(tmp_path)


def test_config_resolution_matches_transformers():
    import transformers

    for pattern, kw in [(None, {"index_topk_freq": 3, "index_skip_topk_offset": 2}), ("FSSFFS", {})]:
        d = dict(bundled_config_dict("tiny-glm5"), num_hidden_layers=6)
        d.pop("index_topk_freq"), d.pop("index_skip_topk_offset")
        d.update(kw)
        if pattern:
            d["index_topk_pattern"] = pattern
        ours = DSAConfig.from_hf_dict(d)
        theirs = transformers.GlmMoeDsaConfig(**{k: v for k, v in d.items() if k not in ("model_type", "architectures", "torch_dtype")})
        assert list(ours.indexer_types) == theirs.indexer_types
        assert list(ours.mlp_layer_types) == theirs.mlp_layer_types
    legacy = dict(bundled_config_dict("tiny-deepseek-v32"), rope_theta=5000.0)
    legacy["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                              "mscale": 1.0, "mscale_all_dim": 1.0}
    del legacy["rope_parameters"]
    r = DSAConfig.from_hf_dict(legacy).rope
    assert (r.rope_type, r.theta, r.factor, r.original_max_position_embeddings) == ("yarn", 5000.0, 4.0, 256)
    with pytest.raises(ValueError, match="rope type"):
        DSAConfig.from_hf_dict(dict(legacy, rope_scaling={"type": "longrope"}))
