"""The MTP draft layer travels prefill -> decode as one more logical layer (id ``num_hidden_layers``).

Mooncake loopback, one device: the prefill pool and the decode pool both
hold the draft layer; after the transfer every decode page (target layers
and the draft's MLA records and index-K) equals the prefill page, and the
draft pages equal those of a plain single-device ``run_prefill`` with the
draft, byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from cpgraph.transfer.engine import mooncake_available

if not mooncake_available():
    pytest.skip("the Mooncake transfer engine is not installed", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
import mtp_reference as ref  # noqa: E402

from cpgraph.runtime.engine import pool_config, run_prefill  # noqa: E402
from cpgraph.runtime.kv_pool import KVPool  # noqa: E402
from cpgraph.transfer import DecodeSide, PrefillPeer, RoomStatus, attach_layer_hooks, make_pool, prefill_and_send  # noqa: E402

PS = ref.PAGE


@pytest.fixture(scope="module")
def model():
    return ref.build()


def _prompts(lens, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, ref.CONFIG["vocab_size"], (n,), generator=g).tolist() for n in lens]


def _page(pool, layer, page, index=False):
    t = pool.index_pool(layer) if index else pool.mla_pool(layer)
    return t.view(-1, PS, t.shape[-1])[page]


@pytest.mark.parametrize("prefix,overlap", [([0, 0], True), ([16, 0], False)])
def test_draft_pages_reach_decode(model, prefix, overlap):
    prompts = _prompts((40, 23))
    N = model.config.draft_layer
    fwd = lambda ids, meta, mla, index, **kw: model(ids, meta, mla, index, **kw)  # noqa: E731
    single = run_prefill(fwd, model, prompts, prefix_lens=prefix, page_size=PS, draft=model.draft_module())
    dec = DecodeSide(KVPool(pool_config(model, "bf16", PS, 8, 0, draft=True)))
    pool = make_pool(model, prompts, prefix_lens=prefix, page_size=PS, draft=True)
    peer = PrefillPeer(pool, 0, group=2)
    hooks = attach_layer_hooks(model, peer.manager, pool) if overlap else []
    try:
        tabs = [dec.open_room(r, len(p), [peer.address]) for r, p in enumerate(prompts)]
        res = prefill_and_send(fwd, model, prompts, prefix_lens=prefix, page_size=PS, pool=pool, peer=peer,
                               rooms=[0, 1], overlap=overlap, draft=model.draft_module())
        assert [dec.wait(r, 10) for r in range(2)] == [RoomStatus.SUCCESS] * 2
        for i, p in enumerate(prompts):
            torch.testing.assert_close(res.draft_logits[i], single.draft_logits[i], rtol=0, atol=0)
            for k in range(-(-len(p) // PS)):
                src, dst, ref_page = res.tables[i][k], tabs[i][k], single.tables[i][k]
                for layer in range(N + 1):  # every logical layer, the draft's included
                    assert torch.equal(_page(dec.pool, layer, dst), _page(pool, layer, src)), (i, k, layer)
                for layer in list(model.config.indexer_layers) + [N]:
                    assert torch.equal(_page(dec.pool, layer, dst, True), _page(pool, layer, src, True))
                # The decode side's draft pages are those of a plain single-device prefill with the draft.
                assert torch.equal(_page(dec.pool, N, dst), _page(single.pool, N, ref_page)), (i, k)
                assert torch.equal(_page(dec.pool, N, dst, True), _page(single.pool, N, ref_page, True)), (i, k)
        assert dec.first_token(0) == int(res.logits[0].argmax())
    finally:
        for h in hooks:
            h.remove()
        peer.close(), dec.close()


def test_draft_needs_a_pool_with_the_draft_layer(model):
    prompts = _prompts((20,))
    fwd = lambda ids, meta, mla, index, **kw: model(ids, meta, mla, index, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="needs a pool with the draft layer"):
        prefill_and_send(fwd, model, prompts, page_size=PS, pool=make_pool(model, prompts, page_size=PS),
                         draft=model.draft_module())
