"""The MTP draft layer through the radix cache and HiCache: one more logical layer in the same pages.

A cached page carries the draft's records (layer ``num_hidden_layers``); a
warm pass reads them from L1 or, after an eviction, from L2, and the draft's
logits stay those of the cold pass.  Eager forwards, one device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
import mtp_reference as ref  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    model = ref.build()

    def forward(ids, meta, mla, index, **kw):
        return model(ids, meta, mla, index, **kw)

    g = torch.Generator().manual_seed(7)
    # The prompts share 2 whole pages and 3 more tokens: every cached page a prompt hits is followed by
    # the same token in both, so hits are never backed off here.  Hits that end where prompts diverge
    # (the engine backs off one page) are in test_mtp_radix.py.
    shared = torch.randint(0, ref.CONFIG["vocab_size"], (35,), generator=g).tolist()
    prompts = [shared + torch.randint(0, ref.CONFIG["vocab_size"], (n,), generator=g).tolist() for n in (9, 14)]
    return model, forward, prompts


def _draft_pages(engine, model):
    """The draft layer's (MLA, index-K) rows of every cached L1 page, keyed by the tokens up to the page's end."""
    N = model.config.draft_layer
    mla, index = engine.pool.mla_pool(N), engine.pool.index_pool(N)
    ps = engine.page_size
    out = {}
    for node in engine.tree.nodes():
        if node.device_pages is None:
            continue
        before, up = b"", node.parent
        while up is not None:
            before, up = bytes(up.key) + before, up.parent
        per_page = len(node.key) // node.num_pages
        for k, page in enumerate(node.device_pages.tolist()):
            rows = slice(page * ps, (page + 1) * ps)
            out[before + bytes(node.key)[: (k + 1) * per_page]] = (mla[rows].clone(), index[rows].clone())
    return out


@pytest.mark.parametrize("layout", ["layer_page_first", "page_first"])
def test_draft_pages_survive_the_cache_and_l2(tiny, layout):
    from cpgraph.runtime.cache_engine import CacheEngine
    from cpgraph.runtime.engine import run_prefill

    model, forward, prompts = tiny
    draft = model.draft_module()
    cold = run_prefill(forward, model, prompts, page_size=ref.PAGE, draft=draft)
    eng = CacheEngine(forward, model, num_pages=24, page_size=ref.PAGE, host_pages=24, host_layout=layout,
                      draft=draft)
    assert eng.pool.config.num_layers == model.config.num_hidden_layers + 1
    assert ("mla", model.config.draft_layer) in eng.hicache.host.payload_ids
    assert ("index", model.config.draft_layer) in eng.hicache.host.payload_ids
    first = eng.prefill(prompts)
    torch.testing.assert_close(first.draft_logits, cold.draft_logits, rtol=0, atol=1e-6)
    second = eng.prefill(prompts)  # the shared 2 pages (and each prompt's whole pages) from L1
    assert second.totals()["device"] > 0
    pages_before = _draft_pages(eng, model)
    assert eng.evict_device() > 0
    third = eng.prefill(prompts)  # loaded back from L2: the draft's pages with them
    assert third.totals()["host"] > 0
    for res in (second, third):
        torch.testing.assert_close(res.draft_logits, first.draft_logits, rtol=0, atol=1e-6)
        assert torch.equal(res.logits, first.logits) or torch.allclose(res.logits, first.logits, rtol=0, atol=1e-6)
    pages_after = _draft_pages(eng, model)
    common = set(pages_before) & set(pages_after)
    assert common
    for key in common:  # the draft layer's bytes came back from L2 unchanged
        assert torch.equal(pages_after[key][0], pages_before[key][0])
        assert torch.equal(pages_after[key][1], pages_before[key][1])
    assert np.count_nonzero(eng.pool.mla_pool(model.config.draft_layer).abs().sum(-1).numpy()) > 0
