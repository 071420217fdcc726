"""Loading: local HF directories, in-memory HF models, bundled tiny models, and every kind of mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cpgraph.models import DSAConfig, WeightLoadError, build_model, from_hf, from_pretrained, prefill_logits, tiny_model
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


# ---------------------------------------------------------------- config validation
FULL_SIZE = dict(  # DeepSeek-V3.2's sizes: about 672B parameters
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
    index_n_heads=64, index_head_dim=128, first_k_dense_replace=3,
)


def test_missing_architecture_sizes_are_named():
    with pytest.raises(ValueError) as err:
        DSAConfig.from_hf_dict({"model_type": "deepseek_v32", "q_lora_rank": 1536})
    msg = str(err.value)
    assert msg.startswith("config is missing vocab_size, hidden_size, num_hidden_layers,") and "\n" not in msg
    for key in ("kv_lora_rank", "first_k_dense_replace", "intermediate_size", "n_routed_experts", "n_shared_experts"):
        assert key in msg
    assert "q_lora_rank" not in msg.split(":")[0]
    d = bundled_config_dict("tiny-glm5")
    for key in ("hidden_size", "index_head_dim", "moe_intermediate_size"):
        with pytest.raises(ValueError, match=f"^config is missing {key}: architecture sizes have no default"):
            DSAConfig.from_hf_dict({k: v for k, v in d.items() if k != key})


def test_optional_keys_keep_hf_defaults():
    d = bundled_config_dict("tiny-glm5")
    for key in ("index_topk", "n_group", "topk_group", "rms_norm_eps", "max_position_embeddings", "routed_scaling_factor",
                "norm_topk_prob", "attention_bias", "tie_word_embeddings", "rope_parameters", "torch_dtype"):
        DSAConfig.from_hf_dict({k: v for k, v in d.items() if k != key})
    # An all-dense stack needs no MoE sizes; mlp_layer_types replaces first_k_dense_replace.
    dense = {k: v for k, v in d.items() if k not in ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                                                     "n_shared_experts", "first_k_dense_replace")}
    cfg = DSAConfig.from_hf_dict(dict(dense, mlp_layer_types=["dense"] * 4))
    assert cfg.mlp_layer_types == ("dense",) * 4
    model = build_model(cfg)
    assert not any("experts" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(hidden_size=None), "config key hidden_size is null; it must be an integer in [1, 2147483647]"),
        (dict(hidden_size=[64]), "config key hidden_size must be an integer in [1, 2147483647], got [64]"),
        (dict(num_attention_heads=-4), "config key num_attention_heads must be an integer in [1, 2147483647], got -4"),
        (dict(vocab_size=512.0), "config key vocab_size must be an integer in [1, 2147483647], got 512.0"),
        (dict(kv_lora_rank=2**40), "config key kv_lora_rank must be an integer in [1, 2147483647], got 1099511627776"),
        (dict(n_shared_experts=-1), "config key n_shared_experts must be an integer in [0, 2147483647], got -1"),
        (dict(num_hidden_layers=None), "config key num_hidden_layers is null"),
        (dict(first_k_dense_replace=[1]), "config key first_k_dense_replace must be an integer in [0, 2147483647]"),
        (dict(mlp_layer_types=5), "config key mlp_layer_types must be a list, got 5"),
        (dict(indexer_types="full"), "config key indexer_types must be a list, got 'full'"),
        (dict(attention_bias="false"), "config key attention_bias must be true or false, got 'false'"),
        (dict(rms_norm_eps=0), "config key rms_norm_eps must be a number > 0, got 0"),
        (dict(routed_scaling_factor=None), "config key routed_scaling_factor is null; it must be a number > 0"),
        (dict(index_topk=0), "config key index_topk must be an integer in [1, 2147483647], got 0"),
        (dict(rope_parameters=[1, 2]), "config key rope_parameters must be an object, got [1, 2]"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": -1}),
         "config key rope_parameters.rope_theta must be a number > 1, got -1"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok=9 exceeds the 8 experts of the topk_group=1 selected group(s)"),
        (dict(topk_group=2), "topk_group=2 exceeds n_group=1"),
    ],
)
def test_bad_config_values_name_the_key(change, message):
    with pytest.raises(ValueError) as err:
        DSAConfig.from_hf_dict(dict(bundled_config_dict("tiny-glm5"), **change))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(factor=0), "config key rope_parameters.factor must be a number >= 1, got 0"),
        (dict(factor=None, original_max_position_embeddings=0),
         "config key rope_parameters.original_max_position_embeddings must be an integer in [1, 2147483647], got 0"),
        (dict(factor=None, original_max_position_embeddings=2048),
         "yarn factor max_position_embeddings / original_max_position_embeddings = 1024/2048 is below 1"),
        (dict(beta_fast=0), "config key rope_parameters.beta_fast must be a number > 0, got 0"),
        (dict(beta_slow=-1), "config key rope_parameters.beta_slow must be a number > 0, got -1"),
        (dict(mscale="1"), "config key rope_parameters.mscale must be a number, got '1'"),
        (dict(truncate=1), "config key rope_parameters.truncate must be true or false, got 1"),
        (dict(attention_factor=0), "config key rope_parameters.attention_factor must be a number > 0, got 0"),
    ],
)
def test_bad_yarn_parameters_name_the_key(change, message):
    d = bundled_config_dict("tiny-deepseek-v32")
    rope = dict(d["rope_parameters"], **change)
    with pytest.raises(ValueError) as err:
        DSAConfig.from_hf_dict(dict(d, rope_parameters=rope))
    assert message in str(err.value)


def test_bundled_configs_still_load():
    for name in bundled_names():
        cfg = DSAConfig.from_hf_dict(bundled_config_dict(name))
        assert cfg.num_hidden_layers >= 2


# ---------------------------------------------------------------- memory estimate
def test_estimate_matches_the_built_model():
    from cpgraph.models.loading import estimate_model_bytes

    for name, d in list(config_variants().items()) + [("tied", dict(bundled_config_dict("tiny-glm5"), tie_word_embeddings=True))]:
        cfg = DSAConfig.from_hf_dict(d)
        for dtype in (torch.float32, torch.bfloat16):
            model = build_model(cfg, dtype)
            real = sum(p.numel() * p.element_size() for p in model.parameters())
            real += sum(b.numel() * b.element_size() for b in model.buffers())
            assert estimate_model_bytes(cfg, dtype) == real, (name, dtype)
    full = DSAConfig.from_hf_dict(dict(FULL_SIZE, model_type="deepseek_v32"))
    assert 1.2e12 < estimate_model_bytes(full, torch.bfloat16) < 1.4e12  # ~672B parameters, mostly 2 bytes


def _full_size_checkpoint(tmp_path):
    cfg = dict(FULL_SIZE, model_type="deepseek_v32", torch_dtype="bfloat16")
    _write_checkpoint(tmp_path, cfg, {"model.norm.weight": torch.ones(4)})
    return tmp_path


def test_from_pretrained_refuses_before_allocating(tmp_path, monkeypatch):
    import cpgraph.models.loading as loading
    import cpgraph.models.memory_check as memory_check

    def no_alloc(*a, **k):
        raise AssertionError("build_model ran: the model would have been allocated")

    root = _full_size_checkpoint(tmp_path)
    monkeypatch.setattr(loading, "build_model", no_alloc)
    monkeypatch.setattr(memory_check, "_host_available", lambda: 64 * 2**30)
    monkeypatch.delenv("CPGRAPH_MEMORY_LIMIT", raising=False)
    with pytest.raises(ValueError) as err:
        from_pretrained(root)
    msg = str(err.value)
    assert f"checkpoint {root} needs about 1251.72 GiB" in msg and "of host RAM" in msg and "\n" not in msg
    assert "but 64.00 GiB (68719476736 bytes) is available" in msg and "CPGRAPH_MEMORY_LIMIT" in msg
    with pytest.raises(ValueError, match=r"but 0.00 GiB \(1000 bytes\) is available"):
        from_pretrained(root, memory_limit=1000)
    monkeypatch.setenv("CPGRAPH_MEMORY_LIMIT", "2000")
    with pytest.raises(ValueError, match=r"\(2000 bytes\) is available"):
        from_pretrained(root)
    monkeypatch.setenv("CPGRAPH_MEMORY_LIMIT", "lots")
    with pytest.raises(ValueError, match="CPGRAPH_MEMORY_LIMIT must be a positive number of bytes or 'off', got 'lots'"):
        from_pretrained(root)
    monkeypatch.setenv("CPGRAPH_MEMORY_LIMIT", "off")  # the check is skipped: we reach the (patched) allocation
    with pytest.raises(AssertionError, match="build_model ran"):
        from_pretrained(root)


def test_memory_check_on_cuda_uses_device_free_memory(monkeypatch):
    import cpgraph.models.loading as loading
    import cpgraph.models.memory_check as memory_check

    cfg = DSAConfig.from_hf_dict(bundled_config_dict("tiny-glm5"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (1000, 2000))
    monkeypatch.setattr(memory_check, "_host_available", lambda: 2**40)
    with pytest.raises(ValueError, match=r"of device memory on cuda:0 .* but 0.00 GiB \(1000 bytes\) is available"):
        loading.check_memory(cfg, torch.float32, "cuda:0")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (2**40, 2**41))
    assert loading.check_memory(cfg, torch.float32, "cuda:0", staged_bytes=10) == 1480832


def test_bundled_models_pass_the_memory_check():
    assert from_pretrained("tiny-glm5", memory_limit=2 * 1480832) is not None
    with pytest.raises(ValueError, match="bundled model 'tiny-glm5' needs about"):
        from_pretrained("tiny-glm5", memory_limit=1480831)


# ---------------------------------------------------------------- corrupt checkpoints
def _tiny_checkpoint(tmp_path, sharded=False):
    hf, model = cached_pair("ds-a")
    root = tmp_path / "ckpt"
    if sharded:
        hf.save_pretrained(root, max_shard_size="100KB")
    else:
        _write_checkpoint(root, bundled_config_dict("tiny-deepseek-v32"), dict(model.state_dict()))
    return root


@pytest.mark.parametrize("damage", ["truncate", "header", "empty"])
def test_corrupt_safetensors_is_one_line_error_naming_the_file(tmp_path, damage):
    root = _tiny_checkpoint(tmp_path)
    shard = root / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes({"truncate": data[: len(data) // 2], "header": b"\xff" * 8 + data[8:], "empty": b""}[damage])
    with pytest.raises(ValueError) as err:
        from_pretrained(root)
    msg = str(err.value)
    assert msg.startswith(f"{shard}: not a valid safetensors file") and "\n" not in msg


def test_corrupt_shard_of_a_sharded_checkpoint(tmp_path):
    root = _tiny_checkpoint(tmp_path, sharded=True)
    shards = sorted(root.glob("*.safetensors"))
    shards[-1].write_bytes(shards[-1].read_bytes()[:-10])
    with pytest.raises(ValueError, match=f"^{shards[-1]}: not a valid safetensors file"):
        from_pretrained(root)


@pytest.mark.parametrize("weight_map", [["model.safetensors"], "model.safetensors", None, {}, 3])
def test_index_weight_map_must_be_a_mapping(tmp_path, weight_map):
    root = _tiny_checkpoint(tmp_path)
    index = root / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ValueError) as err:
        from_pretrained(root)
    assert str(err.value) == f"{index}: weight_map must be a non-empty object mapping tensor names to shard files"


def test_index_that_is_not_json(tmp_path):
    root = _tiny_checkpoint(tmp_path)
    (root / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="model.safetensors.index.json is not valid JSON"):
        from_pretrained(root)
    (root / "model.safetensors.index.json").unlink()
    (root / "config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        from_pretrained(root)


def test_index_cannot_name_shards_outside_the_checkpoint(tmp_path):
    root = _tiny_checkpoint(tmp_path)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((root / "model.safetensors").read_bytes())
    index = root / "model.safetensors.index.json"

    def use(name):
        index.write_text(json.dumps({"weight_map": {"model.norm.weight": name}}))
        with pytest.raises(ValueError) as err:
            from_pretrained(root)
        return str(err.value)

    assert use(str(outside)) == f"{index} names shard {str(outside)!r} by an absolute path; shards must lie inside {root}"
    assert use("../outside.safetensors") == (
        f"{index} names shard '../outside.safetensors', which resolves outside the checkpoint directory {root}")
    assert "not a file name: 7" in use(7)


def test_symlinked_shards_load_like_a_hub_snapshot(tmp_path):
    # A hub cache snapshot links each file to ../../blobs: the directory owner's links are followed.
    root = _tiny_checkpoint(tmp_path)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (root / "model.safetensors").rename(blobs / "abc123")
    (root / "model.safetensors").symlink_to(Path("..") / "blobs" / "abc123")
    loaded = from_pretrained(root).state_dict()
    _, model = cached_pair("ds-a")
    expected = model.state_dict()
    assert loaded.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k  # the bytes behind the link, not a default init


def test_shards_inside_the_checkpoint_still_load(tmp_path):
    root = _tiny_checkpoint(tmp_path)
    (root / "sub").mkdir()
    (root / "model.safetensors").rename(root / "sub" / "weights.safetensors")
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "sub/../sub/weights.safetensors"}}))
    loaded = from_pretrained(root)
    _, model = cached_pair("ds-a")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
