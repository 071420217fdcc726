"""The forward compiles as ONE graph (no host syncs, no data-dependent shapes) and matches eager."""

from __future__ import annotations

import pytest
import torch

from cpgraph.models import KVLayout, build_batch, tiny_model
from cpgraph.models.prefill import make_layout
from cpgraph.plan import plan_prefill
from cpgraph.runtime.kv_pool import KVPool, KVPoolConfig


def _inputs(model, layout: KVLayout, lens):
    cfg = model.config
    pool = KVPool(
        KVPoolConfig(cfg.num_hidden_layers, layout.page_size, 16, layout.kv_format, cfg.kv_lora_rank,
                     cfg.qk_rope_head_dim, cfg.index_head_dim, cfg.indexer_layers, torch.float32)
    )
    tables = [pool.alloc_pages_with_owners([0] * -(-n // layout.page_size)) for n in lens]
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    plan = plan_prefill([0] * len(lens), lens, cp_size=1, page_size=layout.page_size, row_align=8)
    ids, meta = build_batch(plan, toks, tables)
    mla = [pool.mla_pool(i) for i in range(cfg.num_hidden_layers)]
    idx = [pool.index_pool(i) for i in cfg.indexer_layers]
    return ids, meta, mla, idx


@pytest.mark.slow
@pytest.mark.parametrize("name,fmt", [("tiny-glm5", "bf16"), ("tiny-deepseek-v32-fp8", "fp8")])
def test_forward_compiles_fullgraph_and_matches_eager(name, fmt):
    torch._dynamo.reset()
    model = tiny_model(name)
    model.kv_layout = make_layout(model, fmt, 16)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        ids, meta, mla, idx = _inputs(model, model.kv_layout, [21, 6])
        got = compiled(ids, meta, mla, idx, return_topk=True)
        ids2, meta2, mla2, idx2 = _inputs(model, model.kv_layout, [21, 6])
        ref = model(ids2, meta2, mla2, idx2, return_topk=True)
    assert torch.equal(got.logits, ref.logits)
    for a, b in zip(got.topk, ref.topk):
        assert torch.equal(a, b)
    for a, b in zip(mla, mla2):  # the compiled graph wrote the cache exactly like eager
        assert torch.equal(a, b)
