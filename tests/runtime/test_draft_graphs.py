"""The MTP draft over CUDA-graph buckets (``graphed_draft``) serves like the plain draft: CPU, no capture.

On CPU a ``graphed_forward`` pads each batch to its bucket and calls the
forward on the padded static buffers (only the capture is skipped), and the
draft's graphs do the same on the target bucket's buffers: the target's
hidden output (padded rows), its static meta, and the draft inputs padded
as the target pads.  So everything but the capture is checked here: the
same requests (batched, chunked, over cached prefixes) served through an
engine over buckets and through a plain one give the same first tokens, the
same draft guesses, the same draft logits and the same draft KV records,
bit for bit (``bitexact``: fixed-order matrix products, so padded rows do
not change a real row's bits); the warm-up prepares the draft's graph of
every bucket it prepares, and a later mix prepares none.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from cpgraph.runtime.draft_graphs import graphed_draft
from cpgraph.runtime.graph_runner import graph_counts, graphed_forward
from cpgraph.runtime.prefill_engine import PrefillEngine, engine_request
from cpgraph.runtime.scheduler import SchedulerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_tiny import tiny_with_draft  # noqa: E402

pytestmark = pytest.mark.bitexact

PAGE, BUDGET, MAX_REQ = 16, 64, 4


@pytest.fixture(scope="module")
def tiny():
    return tiny_with_draft(PAGE)


class _Recorded:
    """Keeps the draft logits each call returns (unpadded: one row per request of the step)."""

    def __init__(self, draft):
        self.draft, self.logits = draft, []

    def __call__(self, hidden, dinputs, meta, mla, index):
        out = self.draft(hidden, dinputs, meta, mla, index)
        self.logits.append(out.logits.clone())
        return out


def _engine(tiny, graphs: bool):
    model, forward, draft = tiny
    if graphs:
        forward = graphed_forward(forward, max_requests=MAX_REQ, page_size=PAGE)
        draft = graphed_draft(draft, forward)
    rec = _Recorded(draft)
    eng = PrefillEngine(forward, model, num_pages=256, page_size=PAGE, draft=rec,
                        scheduler=SchedulerConfig(token_budget=BUDGET, max_batch_requests=MAX_REQ))
    steps, run = [], eng._run

    def logged(chunks):
        steps.append(list(chunks))
        return run(chunks)

    eng._run = logged
    records, commit = {}, eng._commit

    def reading_commit(live):  # the prompt's draft records before the tree adopts or frees its pages
        L = model.config.num_hidden_layers
        pos = torch.arange(len(live.tokens))
        slots = torch.as_tensor(live.pages)[pos // PAGE] * PAGE + pos % PAGE
        records[live.id] = (eng.cache.pool.mla_pool(L)[slots].clone(), eng.cache.pool.index_pool(L)[slots].clone())
        commit(live)

    eng._commit = reading_commit
    return eng, rec, steps, records


def _serve(eng, seed: int, groups: int = 6):
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    base = torch.randint(0, 512, (70,), generator=g).tolist()
    handles = []
    for _ in range(groups):
        group = []
        for _ in range(rnd.randint(1, 4)):
            if rnd.random() < 0.5:
                p = base[: rnd.randint(20, 70)] + torch.randint(0, 512, (rnd.randint(1, 12),), generator=g).tolist()
            else:
                p = torch.randint(0, 512, (rnd.randint(1, 100),), generator=g).tolist()
            group.append(eng.submit(engine_request(p, top_logprobs=2)))
        eng.run_until_idle()
        handles += group
    eng.sync()
    return handles


def _final_logits(rec, steps):
    out = {}
    for chunks, logits in zip(steps, rec.logits):
        for j, (rid, _, _) in enumerate(chunks):
            out[rid] = logits[j]
    return out


def test_graphed_draft_serves_like_the_plain_draft(tiny):
    plain, p_rec, p_steps, p_records = _engine(tiny, graphs=False)
    graphed, g_rec, g_steps, g_records = _engine(tiny, graphs=True)
    a, b = _serve(plain, seed=7), _serve(graphed, seed=7)
    assert graph_counts(graphed.draft.draft)[1] >= 3  # the draft prepared (here: ran padded) several buckets
    rows = {key[1].rows for key in graphed.draft.draft.stats}
    assert any(sum(e - s for _, s, e in chunks) not in rows for chunks in g_steps)  # steps padded to a bucket
    assert [c for c in p_steps] == [c for c in g_steps]  # the same steps (chunks) in both engines
    p_final, g_final = _final_logits(p_rec, p_steps), _final_logits(g_rec, g_steps)
    assert max(h.result.chunks for h in a) >= 2 and any(h.result.cached > 0 for h in a)
    for x, y in zip(a, b):
        rx, ry = x.result, y.result
        assert rx.status == ry.status == "finished"
        assert (rx.token, rx.draft_token, rx.cached) == (ry.token, ry.draft_token, ry.cached)
        assert torch.equal(p_final[x.id], g_final[y.id])
        assert torch.equal(p_records[x.id][0], g_records[y.id][0])
        assert torch.equal(p_records[x.id][1], g_records[y.id][1])


def test_warm_up_prepares_the_drafts_graphs_too(tiny):
    eng, _, _, _ = _engine(tiny, graphs=True)
    first = eng.submit(engine_request(list(range(1, 30))))
    eng.run_until_idle()
    assert first.result.status == "finished"
    eng.warm_graphs(max_prefix_tokens=MAX_REQ * 80)
    (runner,) = eng.cache.forward.runners.values()
    draft_graphs = eng.draft.draft
    assert {k[1] for k in draft_graphs.stats} == set(runner.stats)  # one draft graph per target bucket
    eng.reset_cache()
    _serve(eng, seed=3, groups=4)
    assert eng.cold_steps == 0


def test_a_graphed_target_needs_a_graphed_draft(tiny):
    model, forward, draft = tiny
    graphed = graphed_forward(forward, max_requests=MAX_REQ, page_size=PAGE)
    with pytest.raises(ValueError, match="graphed_draft"):
        PrefillEngine(graphed, model, num_pages=16, page_size=PAGE, draft=draft)
    with pytest.raises(ValueError, match="graphed_forward"):
        graphed_draft(draft, forward)
