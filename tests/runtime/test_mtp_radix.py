"""The MTP draft through radix-cache hits that end where prompts diverge: the draft stays a cold run's.

The draft's record at row ``i`` encodes token ``i + 1``, so a cached page's
last row is only valid for a request whose token after that page is the one
the page was computed with (``RadixNode.next_token``).  These tests make a
request share whole pages with a cached one and continue differently right
at a page boundary: the engine backs off one page and recomputes it into the
request's own pages; the draft logits and every draft KV record equal a cold
run of that request alone, byte for byte, and the cached pages the other
request still uses keep their bytes.  Eager forwards, one device, tiny model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
import mtp_reference as ref  # noqa: E402

# A cache hit computes fewer rows per GEMM than the cold run it is compared with: the bitexact marker
# runs these tests with fixed-order matrix products (tests/conftest.py, docs/bitwise.md).
pytestmark = pytest.mark.bitexact

PS = ref.PAGE
VOCAB = ref.CONFIG["vocab_size"]


class _SeenDraft:
    """The draft forward, recording the draft KV records of every position the pass attended over.

    One request on one device: the cached-prefix slots (``prefix_slots``,
    positions ``0..P-1``) then the extend rows' slots in position order.
    These are the records the draft's attention read in that pass, wherever
    they live (cached pages or the request's own extend pages).
    """

    def __init__(self, draft):
        self.draft, self.rows = draft, None

    def __call__(self, hidden, dinputs, meta, mla, index):
        out = self.draft(hidden, dinputs, meta, mla, index)
        prefix = meta.prefix_slots[meta.prefix_slots >= 0]
        live = meta.row_slots >= 0
        order = torch.argsort(meta.positions[live])
        slots = torch.cat([prefix, meta.row_slots[live][order]])
        self.rows = (mla[slots].clone(), index[slots].clone())
        return out


@pytest.fixture(scope="module")
def tiny():
    model = ref.build()

    def forward(ids, meta, mla, index, **kw):
        return model(ids, meta, mla, index, **kw)

    return model, forward, _SeenDraft(model.draft_module())


def _rand(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _other(token):
    return (token + 1) % VOCAB


def _tree_rows(eng, model, tokens):
    """Draft (MLA, index-K) rows of ``tokens``'s whole pages in the pages the engine's tree maps them to."""
    import numpy as np

    full = len(tokens) // PS
    raw = np.asarray(tokens[: full * PS], dtype="<i4").tobytes()
    node, off, pages = eng.tree.root, 0, []
    while off < len(raw):  # a read-only walk (no split, no LRU tick, no draft check)
        node = node.children[raw[off : off + PS * 4]]
        assert raw[off : off + len(node.key)] == node.key
        pages += [int(p) for p in node.device_pages]
        off += len(node.key)
    assert len(pages) == full
    pos = torch.arange(full * PS)
    slots = torch.as_tensor(pages)[pos // PS] * PS + pos % PS
    N = model.config.draft_layer
    return eng.pool.mla_pool(N)[slots].clone(), eng.pool.index_pool(N)[slots].clone()


def _cold(tiny, prompt):
    from cpgraph.runtime.engine import run_prefill

    model, forward, draft = tiny
    res = run_prefill(forward, model, [prompt], page_size=PS, draft=draft)
    return res, draft.rows


def _assert_cold(tiny, res, prompt):
    """Target and draft logits and every draft record the pass used equal a cold run of ``prompt``, bytewise."""
    seen = tiny[2].rows
    assert seen[0].shape[0] == len(prompt)
    cold, rows = _cold(tiny, prompt)
    assert torch.equal(res.logits, cold.logits)
    assert torch.equal(res.draft_logits, cold.draft_logits)
    assert torch.equal(seen[0], rows[0]) and torch.equal(seen[1], rows[1])


def test_divergence_at_a_page_boundary_backs_off_one_page(tiny):
    from cpgraph.runtime.cache_engine import CacheEngine

    model, forward, draft = tiny
    shared = _rand(2 * PS, 1)
    a = shared + _rand(9, 2)
    b = shared + [_other(a[2 * PS])] + _rand(8, 3)  # diverges right at the end of page 2
    c = shared + [a[2 * PS]] + _rand(10, 4)  # continues like a: its token after page 2 is a's
    eng = CacheEngine(forward, model, num_pages=32, page_size=PS, draft=draft)
    first = eng.prefill([a])
    a_rows = _tree_rows(eng, model, a)
    res_b = eng.prefill([b])
    assert res_b.hits[0]["device"] == PS  # page 2's last draft row encodes a's token: recomputed
    _assert_cold(tiny, res_b, b)
    # The page the tree shares with a kept a's bytes (b's recomputed copy went to b's own pages, then freed).
    again = _tree_rows(eng, model, a)
    assert torch.equal(again[0], a_rows[0]) and torch.equal(again[1], a_rows[1])
    # The test can fail: a's record at the boundary row is not b's.
    _, b_cold = _cold(tiny, b)
    assert not torch.equal(a_rows[0][2 * PS - 1], b_cold[0][2 * PS - 1])
    res_c = eng.prefill([c])
    assert res_c.hits[0]["device"] == 2 * PS  # same continuation: the full hit stays
    _assert_cold(tiny, res_c, c)
    # Inner node end: b again walks the shared node into b's branch; the shared node's end is a's.
    b2 = b + _rand(5, 5)
    res_b2 = eng.prefill([b2])
    assert res_b2.hits[0]["device"] == PS
    _assert_cold(tiny, res_b2, b2)
    assert first.hits[0]["device"] == 0


def test_prompt_ending_on_a_page_boundary_keeps_the_sampled_token(tiny):
    """A prompt of whole pages: its last page's last row encodes the sampled token, recorded at insert."""
    from cpgraph.runtime.cache_engine import CacheEngine

    model, forward, draft = tiny
    a = _rand(2 * PS, 6)
    eng = CacheEngine(forward, model, num_pages=32, page_size=PS, draft=draft)
    res_a = eng.prefill([a])
    sampled = int(res_a.logits[0].argmax())
    turn = a + [sampled] + _rand(7, 7)  # the next turn continues with the sampled token: full hit
    res_t = eng.prefill([turn])
    assert res_t.hits[0]["device"] == 2 * PS
    _assert_cold(tiny, res_t, turn)
    other = a + [_other(sampled)] + _rand(7, 8)
    res_o = eng.prefill([other])
    assert res_o.hits[0]["device"] == PS
    _assert_cold(tiny, res_o, other)


def test_without_a_draft_the_match_does_not_back_off(tiny):
    from cpgraph.runtime.cache_engine import CacheEngine

    model, forward, _ = tiny
    shared = _rand(2 * PS, 1)
    a = shared + _rand(9, 2)
    b = shared + [_other(a[2 * PS])] + _rand(8, 3)
    eng = CacheEngine(forward, model, num_pages=32, page_size=PS)
    eng.prefill([a])
    assert eng.prefill([b]).hits[0]["device"] == 2 * PS


def test_divergence_after_an_l2_round_trip(tiny):
    """The back-off splits an L2-only node; the recomputed half is revived with b's continuation and b's bytes."""
    from cpgraph.runtime.cache_engine import CacheEngine

    model, forward, draft = tiny
    shared = _rand(2 * PS, 11)
    a = shared + _rand(9, 12)
    b = shared + [_other(a[2 * PS])] + _rand(8, 13)
    eng = CacheEngine(forward, model, num_pages=32, page_size=PS, host_pages=32, draft=draft)
    eng.prefill([a])
    assert eng.evict_device() > 0
    res_b = eng.prefill([b])
    assert res_b.hits[0] == {"device": 0, "host": PS, "computed": len(b) - PS}
    _assert_cold(tiny, res_b, b)
    assert eng.evict_device() > 0
    res_b2 = eng.prefill([b])  # page 2 now holds b's record (its stale L2 copy was dropped, then re-backed up)
    assert res_b2.hits[0]["host"] == 2 * PS
    _assert_cold(tiny, res_b2, b)
    a2 = a + _rand(3, 14)  # a's page 2 continuation is no longer cached: a backs off there
    res_a2 = eng.prefill([a2])
    assert res_a2.hits[0]["device"] + res_a2.hits[0]["host"] == PS
    _assert_cold(tiny, res_a2, a2)
