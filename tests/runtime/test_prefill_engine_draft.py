"""The MTP draft served by PrefillEngine: chunks, batches, sampled first tokens and prefix hits stay a cold run's.

The draft's row ``i`` reads token ``i + 1`` (docs/mtp.md): inside a prompt
the prompt's, at its last row the first token the engine chose.  So the
engine must choose that token *between* the target's forward and the
draft's, a chunk's last row must read the next chunk's first token, and a
cached page may only be reused where the token after it matches.  Each test
compares the served draft with ``run_prefill`` of the request alone, given
the same first token (an independent single-pass path), bit for bit: the
``bitexact`` marker computes the matrix products in a fixed order, so
batches of other shapes (chunks, neighbours, cache hits) give the same bits.
Eager forwards, one device, the bundled tiny GLM-5 with its seeded draft.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from cpgraph.runtime.engine import run_prefill
from cpgraph.runtime.prefill_engine import PrefillEngine, engine_request
from cpgraph.runtime.scheduler import SchedulerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_tiny import tiny_with_draft  # noqa: E402

pytestmark = pytest.mark.bitexact

PAGE = 16


class _Recorded:
    """The draft forward, keeping each call's sampled ids and logits (the engine reports only the top token)."""

    def __init__(self, draft):
        self.draft, self.calls = draft, []

    def __call__(self, hidden, dinputs, meta, mla, index):
        out = self.draft(hidden, dinputs, meta, mla, index)
        self.calls.append((dinputs.sampled.clone(), out.logits.clone()))
        return out


@pytest.fixture(scope="module")
def tiny():
    return tiny_with_draft(PAGE)


def _engine(tiny, budget=48, **kw):
    model, forward, draft = tiny
    rec = _Recorded(draft)
    eng = PrefillEngine(forward, model, num_pages=256, page_size=PAGE, draft=rec,
                        scheduler=SchedulerConfig(token_budget=budget), **kw)
    return eng, rec


def _prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]


def _cold(tiny, prompt, first):
    model, forward, draft = tiny
    return run_prefill(forward, model, [prompt], page_size=PAGE, draft=draft, draft_tokens=[first])


def _draft_rows(eng, model, pages, n):
    """The draft layer's (MLA, index-K) records of positions ``0..n-1`` through a page table."""
    pos = torch.arange(n)
    slots = torch.as_tensor(pages)[pos // PAGE] * PAGE + pos % PAGE
    L = model.config.num_hidden_layers
    return eng.cache.pool.mla_pool(L)[slots].clone(), eng.cache.pool.index_pool(L)[slots].clone()


def _last_logits(rec, first):
    """The recorded draft logits of the step that gave the draft ``first`` at a prompt's end (that request's row)."""
    for sampled, logits in reversed(rec.calls):
        hit = (sampled == first).nonzero()
        if hit.numel():
            return logits[int(hit[0, 0])]
    raise AssertionError(f"no draft call was given token {first}")


def test_chunked_batched_draft_equals_a_cold_single_pass(tiny):
    model = tiny[0]
    eng, rec = _engine(tiny, budget=48)
    prompts = _prompts([37, 100, 32, 5], seed=0)  # 100 runs as three chunks; 32 ends on a page boundary
    # Each prompt's draft records as the engine leaves them: read at its radix commit (before the tree
    # adopts or frees its pages; on one device that comes at the next step, after the answer).
    served, commit = {}, eng._commit

    def reading_commit(live):
        served[live.id] = _draft_rows(eng, model, live.pages, len(live.tokens))
        commit(live)

    eng._commit = reading_commit
    handles = [eng.submit(engine_request(p, top_logprobs=3)) for p in prompts]
    eng.run_until_idle()
    eng.sync()
    assert max(h.result.chunks for h in handles) >= 3
    for p, h in zip(prompts, handles):
        r = h.result
        assert r.status == "finished"
        cold = _cold(tiny, p, r.token)
        assert r.token == int(cold.logits[0].argmax())  # greedy: the target's choice
        assert torch.equal(_last_logits(rec, r.token), cold.draft_logits[0])
        assert r.draft_token == int(cold.draft_logits[0].argmax())
        # Every draft record of the prompt equals the cold pass's: chunk ends read the next chunk's first token.
        mine, cold_rows = served[h.id], _draft_rows_of(cold, model, len(p))
        assert torch.equal(mine[0], cold_rows[0]) and torch.equal(mine[1], cold_rows[1])


def _draft_rows_of(res, model, n):
    pos = torch.arange(n)
    table = torch.as_tensor(res.tables[0])
    slots = table[pos // PAGE] * PAGE + pos % PAGE
    L = model.config.num_hidden_layers
    return res.pool.mla_pool(L)[slots].clone(), res.pool.index_pool(L)[slots].clone()


def test_a_sampled_first_token_is_what_the_draft_reads(tiny):
    eng, rec = _engine(tiny)
    [p] = _prompts([40], seed=1)
    greedy = eng.submit(engine_request(p))
    eng.run_until_idle()
    # A hot temperature and a seed that draws another token than the greedy one (the test fails otherwise).
    seed = next(s for s in range(64) if _draws_other(tiny, p, s, greedy.result.token))
    h = eng.submit(engine_request(p, temperature=5.0, seed=seed))
    eng.run_until_idle()
    r = h.result
    assert r.token != greedy.result.token
    cold = _cold(tiny, p, r.token)
    assert torch.equal(_last_logits(rec, r.token), cold.draft_logits[0])
    assert r.draft_token == int(cold.draft_logits[0].argmax())
    other = _cold(tiny, p, greedy.result.token)
    assert not torch.equal(other.draft_logits[0], cold.draft_logits[0])  # the token matters to the draft


def _draws_other(tiny, prompt, seed, greedy_token):
    from cpgraph.runtime.sampling import Sampling, choose_first_token

    logits = _cold(tiny, prompt, 0).logits[0]
    return choose_first_token(logits, Sampling(5.0, 1.0, seed)).token != greedy_token


def test_prefix_hits_back_off_where_the_next_token_differs(tiny):
    eng, rec = _engine(tiny)
    [shared, tail_a, tail_b] = _prompts([2 * PAGE, 9, 8], seed=2)
    a = shared + tail_a
    b = shared + [(a[2 * PAGE] + 1) % 512] + tail_b  # diverges right at the end of page 2
    c = shared + tail_a[:1] + tail_b  # continues like a past page 2
    for prompt, hit in ((a, 0), (b, PAGE), (c, 2 * PAGE)):
        h = eng.submit(engine_request(prompt))
        eng.run_until_idle()
        eng.sync()
        r = h.result
        assert r.cached_tokens["device"] == hit, prompt
        cold = _cold(tiny, prompt, r.token)
        assert torch.equal(_last_logits(rec, r.token), cold.draft_logits[0])


def test_a_prompt_of_whole_pages_keeps_its_first_token_for_the_next_turn(tiny):
    eng, rec = _engine(tiny)
    [p] = _prompts([2 * PAGE], seed=3)
    h = eng.submit(engine_request(p))
    eng.run_until_idle()
    eng.sync()
    first = h.result.token
    # The next turn continues with the token the draft was given: its last page's records stay valid.
    nxt = eng.submit(engine_request(p + [first] + [7, 8]))
    eng.run_until_idle()
    assert nxt.result.cached_tokens["device"] == 2 * PAGE
    # Another continuation: that page's last record encodes ``first``, so it is recomputed.
    other = eng.submit(engine_request(p + [(first + 1) % 512, 9]))
    eng.run_until_idle()
    assert other.result.cached_tokens["device"] == PAGE
    cold = _cold(tiny, p + [(first + 1) % 512, 9], other.result.token)
    assert torch.equal(_last_logits(rec, other.result.token), cold.draft_logits[0])



def test_a_cancelled_chunked_request_returns_the_ledger(tiny):
    eng, _ = _engine(tiny, budget=32)
    [warm, long] = _prompts([40, 200], seed=4)
    eng.submit(engine_request(warm))
    eng.run_until_idle()
    eng.sync()
    before = (eng.cache.device.ledger.used.copy(), eng.cache.pool.num_free, eng.cache.tree.device_pages_total)
    h = eng.submit(engine_request(long))
    eng.step()
    eng.step()  # two chunks computed (target and draft records in its own pages)
    assert not h.done() and eng.cache.device.ledger.used[0] > before[0][0]
    eng.cancel(h)
    eng.step()
    assert h.result.status == "cancelled"
    after = (eng.cache.device.ledger.used, eng.cache.pool.num_free, eng.cache.tree.device_pages_total)
    assert (after[0] == before[0]).all() and after[1:] == before[1:]


def test_an_l3_hit_restores_the_drafts_records_and_keeps_the_next_token_rule(tiny, tmp_path):
    """A restarted engine over the same page store: the prompt's pages come from L3 with the draft's layer
    and the token that followed each page; a prompt that continues differently at a page boundary gets one
    page less from L3 (its last record encodes the stored token), and both answer like a cold run."""
    store = f"file:{tmp_path / 'l3'}"
    [p] = _prompts([3 * PAGE + 5], seed=5)
    first, _ = _engine(tiny, host_pages=64, l3=store)
    h = first.submit(engine_request(p))
    first.run_until_idle()
    first.sync()
    first.close()  # stores what L3 lacks
    assert h.result.status == "finished"
    other = p[: 2 * PAGE] + [(p[2 * PAGE] + 1) % 512] + p[2 * PAGE + 1 :]
    for prompt, l3_hit in ((p, 3 * PAGE), (other, PAGE)):
        eng, rec = _engine(tiny, host_pages=64, l3=store)  # a fresh engine: only L3 holds the pages
        r = eng.submit(engine_request(prompt))
        eng.run_until_idle()
        res = r.result
        assert res.status == "finished" and res.cached_tokens["l3"] == l3_hit, res.cached_tokens
        cold = _cold(tiny, prompt, res.token)
        assert res.token == int(cold.logits[0].argmax())
        assert torch.equal(_last_logits(rec, res.token), cold.draft_logits[0])
        eng.close()
