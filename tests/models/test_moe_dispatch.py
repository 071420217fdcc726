"""The model's MoE hands the experts only real rows, and the grouped dispatch gives the model's logits.

Runs on CPU: the grouped provider goes through ``torch._grouped_mm``'s CPU
kernel (fp32), registered for ``"cpu"`` for the duration of a test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from cpgraph.models import KVLayout, build_batch, prefill_logits
from cpgraph.ops.moe import moe_experts_grouped, moe_experts_reference
from cpgraph.ops.providers import register_provider, unregister_provider
from cpgraph.plan import plan_prefill
from cpgraph.runtime.kv_pool import KVPool, KVPoolConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_oracle import cached_pair, prompts  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm missing")


class Spy:
    """A provider that records what the experts were given, then runs ``impl``."""

    def __init__(self, impl):
        self.impl = impl
        self.calls = []

    def __call__(self, x, ids, w, gu, d, num_valid=None):
        out = self.impl(x, ids, w, gu, d, num_valid)
        self.calls.append((x.shape[0], None if num_valid is None else int(num_valid), out.clone()))
        return out


@pytest.fixture
def provider():
    installed = []

    def install(fn):
        register_provider("moe_experts", "cpu", "test", fn)
        installed.append(fn)
        return fn

    yield install
    unregister_provider("moe_experts", "cpu")


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("name", ["ds-a", "glm-a"])
def test_grouped_dispatch_gives_the_same_logits(provider, name):
    hf, model = cached_pair(name)
    ps = prompts(model.config.vocab_size, [23, 5, 41], seed=11)
    ref = prefill_logits(model, ps)
    spy = provider(Spy(moe_experts_grouped))
    got = prefill_logits(model, ps)
    assert spy.calls, "the grouped provider was not used"
    assert rel_err(got, ref) <= 1e-5
    with torch.no_grad():  # and transformers agrees, prompt by prompt
        for i, p in enumerate(ps):
            hf_logits = hf(torch.tensor([p])).logits[0, -1]
            assert rel_err(got[i], hf_logits) <= 1e-4


def _padded_forward(model, lens, align):
    cfg = model.config
    ps = prompts(cfg.vocab_size, lens, seed=6)
    pool = KVPool(
        KVPoolConfig(cfg.num_hidden_layers, 16, 8, "dense", cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                     cfg.index_head_dim, cfg.indexer_layers, torch.float32)
    )  # fmt: skip
    tables = [pool.alloc_pages_with_owners([0] * (-(-n // 16))) for n in lens]
    plan = plan_prefill([0] * len(lens), lens, cp_size=1, page_size=16, row_align=align)
    ids, meta = build_batch(plan, ps, tables)
    mla = [pool.mla_pool(i) for i in range(cfg.num_hidden_layers)]
    idx = [pool.index_pool(i) for i in cfg.indexer_layers]
    with torch.no_grad():
        logits = model(ids, meta, mla, idx, KVLayout("dense", 16)).logits
    return plan, logits


def test_padding_rows_never_reach_an_expert(provider):
    _, model = cached_pair("glm-a")
    spy = provider(Spy(moe_experts_grouped))
    lens = [7, 19]
    plan, padded = _padded_forward(model, lens, align=64)
    moe_layers = sum(t == "sparse" for t in model.config.mlp_layer_types)
    assert plan.num_rows == 64 and len(spy.calls) == moe_layers
    for rows, num_valid, out in spy.calls:
        assert (rows, num_valid) == (64, sum(lens))
        assert torch.equal(out[sum(lens):], torch.zeros_like(out[sum(lens):]))  # dummies: exact zeros
    spy.calls.clear()
    _, unpadded = _padded_forward(model, lens, align=1)
    assert [c[:2] for c in spy.calls] == [(sum(lens), sum(lens))] * moe_layers
    assert rel_err(padded, unpadded) <= 1e-6


def test_moe_module_counts_real_rows_from_the_windows(provider):
    """Rows are counted, not located: a compacted batch (real rows first) gets the same bound."""
    _, model = cached_pair("ds-a")
    moe = next(layer.mlp for layer in model.model.layers if layer.is_moe)
    spy = provider(Spy(moe_experts_reference))
    x = torch.randn(10, model.config.hidden_size)
    ks = torch.tensor([0, 0, 5, 5, 9, 0, 0, 0, 0, 0])
    ke = torch.tensor([1, 3, 6, 8, 12, 0, 0, 0, 0, 0])
    with torch.no_grad():
        bounded = moe(x, (ks, ke))
        full = moe(x)
    assert [c[1] for c in spy.calls] == [5, None]
    assert torch.equal(bounded[:5], full[:5])
    # rows past the count keep only the shared experts' term
    shared = moe.shared_experts(x[5:])
    assert torch.allclose(bounded[5:], shared, atol=1e-6)


# ------------------------------------------------------- bf16 dtype discipline
def test_bf16_moe_keeps_fp32_only_in_the_router():
    """Router scores/weights fp32 (the model defines them so); expert and block outputs stay bf16."""
    from cpgraph.models import tiny_model

    model = tiny_model("tiny-deepseek-v32", dtype=torch.bfloat16)
    moe = next(layer.mlp for layer in model.model.layers if layer.is_moe)
    assert moe.gate.weight.dtype == torch.float32 and moe.experts.gate_up_proj.dtype == torch.bfloat16
    x = torch.randn(6, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        ids, w = moe.gate(x)
        out = moe(x)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert out.dtype == torch.bfloat16


def test_rmsnorm_bf16_rounds_once():
    """bf16 RMSNorm = the fp32 formula rounded once (statistics and weight product in fp32)."""
    from cpgraph.models.layers import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(256).bfloat16()
    with torch.no_grad():
        norm.weight.copy_((1 + 0.3 * torch.randn(256, generator=g)).bfloat16())
    x = (3 * torch.randn(64, 256, generator=g)).bfloat16()
    xf = x.float()
    expect = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()).bfloat16()
    with torch.no_grad():
        got = norm(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expect)
