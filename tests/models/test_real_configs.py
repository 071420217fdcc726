"""The released DeepSeek-V3.2 and GLM-5 configs (no weights): parsing and every derived size.

``DEEPSEEK_V32`` is the public ``config.json`` of the DeepSeek-V3.2 release
(FP8, ``scale_fmt: ue8m0``).  ``GLM5`` is GLM-5's architecture as published
(transformers' ``GlmMoeDsaConfig`` defaults, documented for checkpoint
``zai-org/GLM-5``, and the model card's table), with ``rope_theta`` 1e6
and the token ids as a public derivative of its config.json lists them;
the FP8 release stores weights like DeepSeek's, so ``GLM5_FP8`` adds the
same ``quantization_config`` (an assumption: that file was not available
here).  ``GLM5_INDEXCACHE`` is GLM-5 with the IndexCache schedule
``index_topk_freq`` 4 / ``index_skip_topk_offset`` 3 (three full layers, then
one in four), as public planner code gives it for the GLM-5.x line.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from cpgraph.models.config import DSAConfig
from cpgraph.models.fp8 import FP8Linear
from cpgraph.models.layers import softmax_scale
from cpgraph.ops.codecs import MLA_FP8_RECORD_BYTES, index_k_page_bytes, index_k_token_bytes
from cpgraph.runtime.kv_pool import KVPoolConfig

FP8_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
             "weight_block_size": [128, 128]}

DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v32", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": FP8_QUANT, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.44.2",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": [154820, 154827, 154829], "pad_token_id": 154820, "dtype": "bfloat16",
    "first_k_dense_replace": 3, "hidden_act": "silu", "head_dim": 64, "hidden_size": 6144, "index_head_dim": 128,
    "index_n_heads": 32, "index_topk": 2048, "initializer_range": 0.02, "intermediate_size": 12288,
    "kv_lora_rank": 512, "max_position_embeddings": 202752, "model_type": "glm_moe_dsa",
    "moe_intermediate_size": 2048, "n_group": 1, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 78,
    "num_key_value_heads": 64, "num_nextn_predict_layers": 1, "q_lora_rank": 2048, "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "noaux_tc", "v_head_dim": 256, "vocab_size": 154880,
}
GLM5_FP8 = dict(GLM5, quantization_config=FP8_QUANT)
GLM5_INDEXCACHE = dict(GLM5, index_topk_freq=4, index_skip_topk_offset=3)


@pytest.fixture(scope="module")
def v32() -> DSAConfig:
    return DSAConfig.from_hf_dict(DEEPSEEK_V32)


def test_deepseek_v32_sizes(v32):
    c = v32
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.vocab_size) == (7168, 61, 128, 129280)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (1536, 512, 128, 64, 128)
    assert (c.qk_head_dim, c.kv_record_dim) == (192, 576)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts) == (256, 8, 1)
    assert (c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob) == (8, 4, 2.5, True)
    assert (c.moe_intermediate_size, c.intermediate_size) == (2048, 18432)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.indexer_rope) == (64, 128, 2048, "neox")
    assert c.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 58
    assert c.indexer_layers == tuple(range(61))  # DeepSeek: every layer runs its own indexer
    assert c.torch_dtype == "bfloat16" and c.max_position_embeddings == 163840
    r = c.rope
    assert (r.rope_type, r.factor, r.original_max_position_embeddings, r.theta) == ("yarn", 40.0, 4096, 10000.0)
    assert (r.mscale, r.mscale_all_dim, r.beta_fast, r.beta_slow) == (1.0, 1.0, 32.0, 1.0)
    # Softmax scale: the original head's 192^-0.5, times yarn mscale(40)^2 (not 576^-0.5).
    m = 0.1 * math.log(40) + 1
    assert softmax_scale(r, c.qk_head_dim) == pytest.approx(192**-0.5 * m * m, rel=1e-12)
    q = c.quantization
    assert q is not None and q.block == (128, 128) and q.act_scale_pow2 and q.modules_to_not_convert == ()


@pytest.mark.parametrize("d", [DEEPSEEK_V32, GLM5, GLM5_FP8])
def test_cache_record_and_page_bytes(d):
    c = DSAConfig.from_hf_dict(d)
    fp8 = KVPoolConfig(num_layers=c.num_hidden_layers, page_size=64, num_pages=1, kv_format="fp8",
                       kv_lora_rank=c.kv_lora_rank, qk_rope_dim=c.qk_rope_head_dim, index_head_dim=c.index_head_dim,
                       index_layers=c.indexer_layers)
    dense = KVPoolConfig(num_layers=c.num_hidden_layers, page_size=64, num_pages=1, kv_format="dense",
                         kv_lora_rank=c.kv_lora_rank, qk_rope_dim=c.qk_rope_head_dim, index_head_dim=c.index_head_dim,
                         index_layers=c.indexer_layers, dtype=torch.bfloat16)
    assert fp8.mla_record == (torch.uint8, 656) and MLA_FP8_RECORD_BYTES == 656
    dtype, width = dense.mla_record
    assert width * dtype.itemsize == 1152  # 576 bf16
    assert fp8.mla_bytes_per_page() == 64 * 656 and dense.mla_bytes_per_page() == 64 * 1152
    assert fp8.index_bytes_per_page() == 8448 == index_k_page_bytes(64, c.index_head_dim)
    assert index_k_token_bytes(c.index_head_dim) == 132


def test_glm5_sizes():
    c = DSAConfig.from_hf_dict(GLM5)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.vocab_size) == (6144, 78, 64, 154880)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (2048, 512, 192, 64, 256)
    assert (c.qk_head_dim, c.kv_record_dim) == (256, 576)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.n_group, c.topk_group) == (256, 8, 1, 1, 1)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.indexer_rope) == (32, 128, 2048, "interleaved")
    assert c.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 75
    assert c.indexer_layers == tuple(range(78))  # no IndexCache keys: transformers' default makes every layer full
    assert (c.rope.rope_type, c.rope.theta, c.rms_norm_eps, c.torch_dtype) == ("default", 1e6, 1e-5, "bfloat16")
    assert c.quantization is None and DSAConfig.from_hf_dict(GLM5_FP8).quantization.block == (128, 128)


def test_glm5_indexcache_layers_match_transformers():
    c = DSAConfig.from_hf_dict(GLM5_INDEXCACHE)
    full = (0, 1, 2) + tuple(range(6, 78, 4))
    assert c.indexer_layers == full and len(full) == 21
    kw = {k: v for k, v in GLM5_INDEXCACHE.items() if k not in ("model_type", "architectures", "dtype")}
    assert tuple(transformers.GlmMoeDsaConfig(**kw).indexer_types) == c.indexer_types
    # Only full layers own index-K pages: 21 of 78 layers' worth of 8448-byte pages.
    pool = KVPoolConfig(num_layers=78, page_size=64, num_pages=1, kv_format="fp8", index_layers=c.indexer_layers)
    assert pool.active_index_layers == full


@pytest.mark.parametrize("d,low,high", [(DEEPSEEK_V32, 671.0, 673.0), (GLM5, 743.5, 744.5)])
def test_parameter_count(d, low, high):
    """Parameters the prefill model builds (MTP layers excluded) against the published totals.

    DeepSeek-V3 is 671B without its MTP module; V3.2 adds ~0.9B of indexers
    (measured here: 671.88B).  GLM-5 is published as 744B (measured: 743.91B).
    """
    from cpgraph.models.loading import estimate_model_bytes

    c = DSAConfig.from_hf_dict(d)
    fp32_kept = c.num_hidden_layers * c.hidden_size * c.index_n_heads  # indexer weights_proj stays fp32
    fp32_kept += sum(t == "sparse" for t in c.mlp_layer_types) * (c.n_routed_experts * c.hidden_size + c.n_routed_experts)
    params = (estimate_model_bytes(c, torch.bfloat16) - 2 * fp32_kept) / 2
    assert low < params / 1e9 < high


def test_fp8_scale_grids_of_the_v32_projections(v32):
    """``weight_scale_inv`` is ceil(out/128) x ceil(in/128), also where a side is not a multiple of 128."""
    q = v32.quantization
    shapes = {
        "q_a_proj": (1536, 7168, (12, 56)),
        "q_b_proj": (128 * 192, 1536, (192, 12)),
        "kv_a_proj_with_mqa": (576, 7168, (5, 56)),  # 576 = 4.5 blocks
        "o_proj": (7168, 128 * 128, (56, 128)),
        "indexer.wq_b": (64 * 128, 1536, (64, 12)),
        "indexer.wk": (128, 7168, (1, 56)),
        "experts gate_proj": (2048, 7168, (16, 56)),
        "dense down_proj": (7168, 18432, (56, 144)),
    }
    for name, (out, inn, grid) in shapes.items():
        m = FP8Linear(inn, out, q, device="meta")
        assert tuple(m.weight.shape) == (out, inn) and m.weight.dtype == torch.float8_e4m3fn, name
        assert tuple(m.weight_scale_inv.shape) == grid, name
