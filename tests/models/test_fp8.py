"""The FP8 cache path (656-B MLA records + FP8 index-K pages) against the dense path.

Bounds are the ones measured and documented in docs/models.md ("FP8 cache
bound"), with ~25 % headroom: measured over 8 seeds x 3 prompts x 2 model
types, max relative L2 logit error 0.062 when every key is attended (prompts
no longer than top-k: only the record quantisation differs) and 0.55 when
the FP8 indexer picks the keys (selection flips dominate); layer-0 top-k
overlap >= 0.81 per row, 0.98 on average.
"""

from __future__ import annotations

import pytest
import torch

from cpgraph.models import DSAConfig, build_model, init_random, prefill, prefill_logits
from cpgraph.models.config import bundled_config_dict


def fp8_config(model_type: str) -> dict:
    d = bundled_config_dict("tiny-deepseek-v32-fp8")  # kv_lora 512, rope 64, index dim 128, top-k 16
    if model_type == "glm_moe_dsa":
        d = dict(d, model_type="glm_moe_dsa", num_hidden_layers=3, index_topk_freq=2, index_skip_topk_offset=1,
                 n_group=1, topk_group=1)
    return d


def rel_l2(a, b):
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def _model(model_type: str, seed: int):
    return init_random(build_model(DSAConfig.from_hf_dict(fp8_config(model_type))), seed=seed, std=0.02)


def _prompts(lens, seed):
    g = torch.Generator().manual_seed(100 + seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_fp8_records_within_bound_when_every_key_is_attended(model_type):
    for seed in range(2):
        model = _model(model_type, seed)
        ps = _prompts([9, 12, 16], seed)
        dense = prefill_logits(model, ps)
        fp8 = prefill_logits(model, ps, kv_format="fp8")
        err = rel_l2(fp8, dense)
        assert err.max() <= 0.08, err
        assert err.min() > 0  # the FP8 path really quantised something


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_fp8_sparse_selection_within_bound(model_type):
    model = _model(model_type, 0)
    ps = _prompts([40, 64, 100], 0)
    a = prefill(model, ps, return_topk=True)
    b = prefill(model, ps, kv_format="fp8", return_topk=True)
    assert rel_l2(b.logits, a.logits).max() <= 0.7
    x, y = a.topk[0], b.topk[0]
    overlap = torch.tensor(
        [len(set(x[r].tolist()) & set(y[r].tolist()) - {-1}) / len(set(x[r].tolist()) - {-1}) for r in range(x.shape[0])]
    )
    assert overlap.min() >= 0.75 and overlap.mean() >= 0.95, (overlap.min(), overlap.mean())


def test_fp8_uses_fewer_kv_bytes():
    model = _model("deepseek_v32", 0)
    ps = _prompts([20, 33], 0)
    dense, fp8 = prefill(model, ps), prefill(model, ps, kv_format="fp8")
    cfg = model.config
    pages = 2 + 3  # page size 16
    assert dense.kv_bytes == pages * 16 * cfg.num_hidden_layers * (576 * 4 + cfg.index_head_dim * 4)
    assert fp8.kv_bytes == pages * 16 * cfg.num_hidden_layers * (656 + cfg.index_head_dim + 4)


def test_fp8_needs_the_656_byte_geometry():
    model = build_model(DSAConfig.from_hf_dict(bundled_config_dict("tiny-glm5")))
    with pytest.raises(ValueError, match="kv_lora_rank=512"):
        prefill_logits(model, [[1, 2, 3]], kv_format="fp8")
    with pytest.raises(ValueError, match="kv_format"):
        prefill_logits(model, [[1, 2, 3]], kv_format="int4")
