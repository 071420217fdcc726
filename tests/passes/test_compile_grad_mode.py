"""``cpgraph.compile``'s forward is an inference forward: it runs with grad enabled, as it does under no_grad.

Before, a call outside ``torch.no_grad()`` made AOT autograd trace a joint forward/backward graph (the
model's parameters require grad) and compiling failed with ``BackendCompilerFailed: Trying to backward
through cpgraph.row_scope.default``.  AOT autograd is the step both backends share, so ``aot_eager``
(no code generation) is enough to test it.  One compile: the second call reuses the graph.
"""

from __future__ import annotations

import pytest
import torch

import cpgraph
from cpgraph.models import build_batch, tiny_model
from cpgraph.models.prefill import make_layout
from cpgraph.plan import plan_prefill
from cpgraph.runtime.kv_pool import KVPool, KVPoolConfig


def _inputs(model, lens=(21, 6)):
    """Token ids, batch metadata and fresh KV pools of one tiny batch (the same values every call)."""
    cfg, layout = model.config, model.kv_layout
    pool = KVPool(KVPoolConfig(cfg.num_hidden_layers, layout.page_size, 16, layout.kv_format, cfg.kv_lora_rank,
                               cfg.qk_rope_head_dim, cfg.index_head_dim, cfg.indexer_layers, torch.float32))
    tables = [pool.alloc_pages_with_owners([0] * -(-n // layout.page_size)) for n in lens]
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    plan = plan_prefill([0] * len(lens), list(lens), cp_size=1, page_size=layout.page_size, row_align=8)
    ids, meta = build_batch(plan, toks, tables)
    mla = [pool.mla_pool(i) for i in range(cfg.num_hidden_layers)]
    index = [pool.index_pool(i) for i in cfg.indexer_layers]
    return ids, meta, mla, index


@pytest.mark.slow
def test_compiled_forward_runs_with_grad_enabled_and_matches_no_grad():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny_model("tiny-glm5")
    model.kv_layout = make_layout(model, "bf16", 16)
    assert torch.is_grad_enabled() and all(p.requires_grad for p in model.parameters())
    compiled = cpgraph.compile(model, cpgraph.CPConfig(), backend="aot_eager", dynamic=False)

    with_grad = compiled(*_inputs(model))  # grad enabled here: this call compiles
    assert not with_grad.logits.requires_grad and torch.is_grad_enabled()  # the caller's mode is restored
    with torch.no_grad():
        without = compiled(*_inputs(model))
    # Same graph, same inputs: the logits are the same bits by construction.
    assert torch.equal(with_grad.logits, without.logits)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # compiled once, reused under no_grad
    torch._dynamo.reset()
