"""PrefillEngine in process (no HTTP): page admission, timeouts, and the ledger after a cancel.

The bundled ``tiny-glm5`` (fp32, eager).  Served requests run in other batch
shapes than their ``prefill_logits`` reference (a neighbour in the batch,
chunks), so logits agree to ``TOL``, not bitwise (CPU GEMM bits depend on M).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpgraph.models import from_pretrained
from cpgraph.models.prefill import make_layout, prefill_logits
from cpgraph.runtime.prefill_engine import PrefillEngine, engine_request
from cpgraph.runtime.scheduler import SchedulerConfig

PAGE = 16
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    m = from_pretrained("tiny-glm5").eval()
    m.kv_layout = make_layout(m, "bf16", PAGE)
    return m


def _engine(model, **kw):
    def forward(ids, meta, mla, index, **k):
        return model(ids, meta, mla, index, **k)
    sched = kw.pop("scheduler", SchedulerConfig(token_budget=64))
    return PrefillEngine(forward, model, page_size=PAGE, scheduler=sched, **kw)


def _prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]


def test_never_fits_is_refused_and_fits_later_waits(model):
    eng = _engine(model, num_pages=12)  # 192 tokens of KV
    too_long = eng.submit(engine_request(list(range(200))))
    assert too_long.done() and too_long.result.status == "refused" and too_long.result.refusal == "too_long"
    a, b = _prompts([150, 150], seed=2)  # 10 pages each: the second waits for the first's pages
    ha, hb = eng.submit(engine_request(a, top_logprobs=5)), eng.submit(engine_request(b, top_logprobs=5))
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        if not ha.done():
            assert eng.snapshot()["running"] == 1  # b is never admitted beside a
        assert eng.cache.device.ledger.used[0] <= 12
    assert ha.result.status == hb.result.status == "finished" and steps >= 6
    ref = torch.log_softmax(prefill_logits(model, [a, b]), -1)
    for h, r in zip((ha, hb), ref):
        assert h.result.token == int(r.argmax()) and abs(h.result.logprob - float(r[h.result.token])) <= TOL
    bad = eng.submit(engine_request([1, 512]))
    assert bad.result.status == "refused" and bad.result.refusal == "invalid"


def test_timeout_and_cancel_return_the_ledger(model):
    now = [0.0]
    eng = _engine(model, num_pages=64, request_timeout=5.0, clock=lambda: now[0],
                  scheduler=SchedulerConfig(token_budget=64, chunk_tokens=32))
    [warm] = _prompts([40], seed=3)
    eng.submit(engine_request(warm))
    eng.run_until_idle()
    before = (eng.cache.device.ledger.used.copy(), eng.cache.pool.num_free, eng.cache.tree.device_pages_total)
    slow, gone = _prompts([300, 300], seed=4)
    h1 = eng.submit(engine_request(slow))
    h2 = eng.submit(engine_request(gone, timeout=100.0))
    eng.step()
    eng.step()  # both admitted (32 tokens each per step) and holding their chunks' pages
    assert eng.snapshot()["running"] == 2 and eng.cache.device.ledger.used[0] >= before[0][0] + 8
    now[0] = 6.0
    eng.cancel(h2)
    eng.step()
    assert h1.result.status == "timeout" and h2.result.status == "cancelled"
    assert not eng.has_work()
    after = (eng.cache.device.ledger.used, eng.cache.pool.num_free, eng.cache.tree.device_pages_total)
    assert np.array_equal(after[0], before[0]) and after[1:] == before[1:]


def test_a_failed_forward_fails_its_requests_and_gives_their_pages_back(model):
    broken = {"on": False}

    def forward(ids, meta, mla, index, **k):
        if broken["on"]:
            raise RuntimeError("injected failure")
        return model(ids, meta, mla, index, **k)

    eng = PrefillEngine(forward, model, num_pages=32, page_size=PAGE, scheduler=SchedulerConfig(token_budget=64))
    before = (eng.cache.device.ledger.used.copy(), eng.cache.pool.num_free)
    broken["on"] = True
    h = eng.submit(engine_request(list(range(100))))
    eng.run_until_idle()
    assert h.result.status == "failed" and "injected failure" in h.result.error
    assert np.array_equal(eng.cache.device.ledger.used, before[0]) and eng.cache.pool.num_free == before[1]
    broken["on"] = False
    ok = eng.submit(engine_request(list(range(100))))
    eng.run_until_idle()
    assert ok.result.status == "finished"


def test_l2_hits_are_loaded_back_and_reported_per_tier(model):
    eng = _engine(model, num_pages=32, host_pages=32)
    [prompt] = _prompts([70], seed=8)
    first = eng.submit(engine_request(prompt, top_logprobs=3))
    eng.run_until_idle()
    assert first.result.cached_tokens == {"device": 0, "host": 0}
    assert eng.cache.evict_device() > 0  # everything to L2
    again = eng.submit(engine_request(prompt, top_logprobs=3))
    eng.run_until_idle()
    r = again.result
    assert r.status == "finished" and r.cached_tokens == {"device": 0, "host": 64} and r.computed_tokens == 6
    assert r.token == first.result.token and abs(r.logprob - first.result.logprob) <= TOL
    assert eng.snapshot()["cached_tokens"]["host"] == 64


def test_request_handle_wait_done_and_callbacks():
    """The handle builds its Event only for a waiter; wait, done and callbacks behave as with one from the start."""
    import threading
    import time

    from cpgraph.runtime.requests import RequestHandle, RequestResult

    h = RequestHandle(1, None)
    assert not h.done() and h.wait(0.01) is None  # a timed-out wait returns no result
    got, res = [], RequestResult("finished", 3)
    h.add_done_callback(lambda hh: got.append(("before", hh.result)))
    waiter = threading.Thread(target=lambda: got.append(("waiter", h.wait(10))))
    waiter.start()
    time.sleep(0.02)
    h._finish(res)
    waiter.join(10)
    h._finish(RequestResult("failed", 3))  # a second finish changes nothing
    h.add_done_callback(lambda hh: got.append(("after", hh.result)))  # at once, in this thread
    assert h.done() and h.wait() is res and h.result is res
    assert sorted(got, key=lambda g: g[0]) == [("after", res), ("before", res), ("waiter", res)]
    fresh = RequestHandle(2, None)  # no waiter before the answer: no Event at all
    fresh._finish(res)
    assert fresh._event is None and fresh.wait() is res


def test_one_lane_available_pages_equal_the_lane_arithmetic(model):
    """``_available`` on one lane (ints) against free + evictable - reserved computed with the lane arrays."""
    engine = _engine(model, num_pages=40)
    prompts = _prompts([70, 33, 90], 3)
    handles = [engine.submit(engine_request(p)) for p in prompts]
    seen = 0
    while not all(h.done() for h in handles):
        reserved = np.zeros(1, dtype=np.int64)
        for r in engine.scheduler.running:
            if r.reserve is not None:
                reserved += r.reserve
        want = engine.cache.device.ledger.free_pages() + engine.cache.evictable_by_lane() - reserved
        got = engine._available()
        assert got.dtype == np.int64 and got.tolist() == want.tolist()
        seen += bool(engine.scheduler.running)
        engine.step()
    engine.sync()
    assert seen  # some steps had running requests with reservations
    assert engine._available().tolist() == (engine.cache.device.ledger.free_pages()
                                             + engine.cache.evictable_by_lane()).tolist()


def test_timings_split_the_forward_from_the_engine_work(model):
    """``timings["forward"]`` is the forward time of the steps that computed the request's chunks (each step's
    forward counted whole for every request in it), inside ``prefill``; a request cancelled in the queue ran none."""
    eng = _engine(model, num_pages=64)  # token budget 64: a 150-token prompt runs in 3 chunks
    a, b = _prompts([150, 40], seed=5)
    ha, hb = eng.submit(engine_request(a)), eng.submit(engine_request(b))
    per_step = []
    while eng.has_work():
        f0 = eng.stats.step_seconds
        eng.step()
        per_step.append(eng.stats.step_seconds - f0)
    ta, tb = ha.result.timings, hb.result.timings
    assert ha.result.chunks == 3 and len(per_step) >= 3
    assert 0 < ta["forward"] <= ta["prefill"] <= ta["total"] and 0 < tb["forward"] <= tb["prefill"]
    assert ta["forward"] + tb["forward"] > sum(per_step)  # a step that ran both is counted in both
    assert max(ta["forward"], tb["forward"]) <= sum(per_step) + 1e-9
    waiting = eng.submit(engine_request(a))  # cancelled before any step: it ran no forward
    eng.cancel(waiting)
    eng.step()
    assert waiting.result.status == "cancelled" and waiting.result.timings["forward"] == 0.0
