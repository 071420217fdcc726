"""``cpgraph serve`` on one device over real HTTP (aiohttp client, loopback): answers, cache, chunks, errors, cancel.

The server runs in this process (``PrefillServer.start_background``) over the
bundled ``tiny-glm5`` (fp32, eager), so the tests can also read the engine's
pool ledger.  Reference logits come from ``prefill_logits`` of the same
prompt alone.  A served request generally runs in another batch shape than
its reference (other requests beside it, a cached prefix, chunks), and CPU
GEMM bits depend on the shape, so those comparisons use ``TOL`` on
log-probabilities (fp32; observed differences are ~1e-6); the first token
must match exactly.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_utils import TIMEOUT, aget, apost, get, logprob_table, metric, post, post_many  # noqa: E402

from cpgraph.models.prefill import prefill_logits  # noqa: E402
from cpgraph.runtime.prefill_engine import PrefillEngine  # noqa: E402
from cpgraph.runtime.scheduler import SchedulerConfig  # noqa: E402
from cpgraph.serve.app import PrefillServer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5  # |logprob| difference allowed between batch shapes (fp32 tiny model)
PAGE = 16


def _forward(model):
    def forward(ids, meta, mla, index, **kw):
        return model(ids, meta, mla, index, **kw)
    return forward


def make_server(model, *, budget=128, num_pages=512, max_queue=1024, **kw):
    engine = PrefillEngine(_forward(model), model, num_pages=num_pages, page_size=PAGE,
                           scheduler=SchedulerConfig(token_budget=budget, max_waiting=max_queue), **kw)
    server = PrefillServer(engine, served=("tiny-glm5",)).start_background()
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def server(model):
    s = make_server(model)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def slow_server(model):
    """One page per step and a queue of two: a long prompt stays in flight for many steps."""
    s = make_server(model, budget=PAGE, max_queue=2)
    yield s
    s.stop()


def _prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]


def _check_against(choice, ref_logits):
    """The first token is the reference's argmax and every reported logprob matches the reference's."""
    ref = torch.log_softmax(ref_logits.float(), -1)
    assert choice["token_ids"] == [int(ref.argmax())]
    table = logprob_table(choice)
    assert table, "no top logprobs"
    for tok, lp in table.items():
        assert abs(lp - float(ref[tok])) <= TOL, (tok, lp, float(ref[tok]))
    # They are the reference's most likely tokens (up to TOL at the cut).
    assert min(table.values()) >= float(torch.topk(ref, len(table)).values[-1]) - TOL


def _ledger(server):
    eng = server.engine
    eng.sync()  # an answer can precede its step's commit: read the state the next step starts from
    return eng.cache.device.ledger.used.copy(), eng.cache.pool.num_free, eng.cache.tree.device_pages_total


def test_one_request_equals_prefill_logits(server, model):
    [prompt] = _prompts([40], seed=3)
    status, body = post(server.url, {"model": "tiny-glm5", "prompt": prompt, "max_tokens": 1, "logprobs": 20})
    assert status == 200, body
    assert body["object"] == "text_completion" and body["model"] == "tiny-glm5"
    [choice] = body["choices"]
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert choice["text"] == str(choice["token_ids"][0]) == choice["logprobs"]["tokens"][0]
    assert len(logprob_table(choice)) == 20
    assert body["usage"] == {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    ref = prefill_logits(model, [prompt])[0]
    # Same batch shape as the reference (one request, no prefix): the logprobs are the reference's.
    _check_against(choice, ref)
    assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(
        float(torch.log_softmax(ref, -1)[choice["token_ids"][0]]), abs=TOL)


def test_32_concurrent_requests_sharing_4_system_prompts(server, model):
    systems = _prompts([48, 48, 64, 80], seed=11)  # whole pages, so a hit covers them
    suffix_lens = [1, 7, 16, 33, 50, 80, 3, 21] * 4
    suffixes = _prompts(suffix_lens, seed=12)
    prompts = [systems[i % 4] + s for i, s in enumerate(suffixes)]
    results = post_many(server.url, [{"prompt": p, "logprobs": 5} for p in prompts])
    assert [s for s, _ in results] == [200] * 32, [b for s, b in results if s != 200][:2]
    refs = prefill_logits(model, prompts)  # one batch, no cache: a different shape for every request
    for (_, body), ref in zip(results, refs):
        _check_against(body["choices"][0], ref)
    cached = [body["usage"]["prompt_tokens_details"]["cached_tokens"] for _, body in results]
    for i in range(4):  # every system prompt was computed once and then served from the cache
        mine = [c for j, c in enumerate(cached) if j % 4 == i]
        assert max(mine) >= len(systems[i]), (i, mine)
    assert sum(c > 0 for c in cached) >= 24, cached
    tiers = [body["choices"][0]["prefill"]["cached_tokens"] for _, body in results]
    assert all(t["host"] == 0 for t in tiers) and sum(t["device"] for t in tiers) == sum(cached)
    # No page leaked: everything in use is held by the radix cache.
    used, _, tree_pages = _ledger(server)
    assert int(used[0]) == tree_pages


def test_a_prompt_longer_than_the_budget_runs_chunked_and_equals_unchunked(server, model):
    [prompt] = _prompts([300], seed=21)  # budget 128: chunks of 128, 128, 44
    status, body = post(server.url, {"prompt": prompt, "logprobs": 20})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["prefill"]["chunks"] == 3
    _check_against(choice, prefill_logits(model, [prompt])[0])


def test_sampling_is_reproducible_with_a_seed(server):
    [prompt] = _prompts([24], seed=5)
    body = {"prompt": prompt, "temperature": 1.5, "top_p": 0.9, "seed": 1234, "logprobs": 0}
    (s1, a), (s2, b) = post_many(server.url, [body, body])
    assert s1 == s2 == 200
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert len(a["choices"][0]["logprobs"]["top_logprobs"][0]) == 1  # logprobs 0: the chosen token only


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),  # nested too deeply for the parser
    (b'{"prompt": [1' + b"0" * 5000 + b']}', 400, None),  # an integer past the parser's digit limit
    ({"max_tokens": 1}, 400, "prompt"),
    ({"prompt": [1, 2], "max_tokens": 16}, 400, "max_tokens"),
    ({"prompt": [1, 2], "temperature": "hot"}, 400, "temperature"),
    ({"prompt": [1, 2], "temperature": 3}, 400, "temperature"),
    ({"prompt": [1, 2], "top_p": 0}, 400, "top_p"),
    ({"prompt": [1, 2], "logprobs": 21}, 400, "logprobs"),
    ({"prompt": [1, 2], "seed": -1}, 400, "seed"),
    ({"prompt": [1, 2], "n": 2}, 400, "n"),
    ({"prompt": [1, 2], "stream": True}, 400, "stream"),
    ({"prompt": [1, 2], "bogus": 1}, 400, "bogus"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 512]}, 400, "prompt"),
    ({"prompt": [1, True]}, 400, "prompt"),
    ({"prompt": "text needs a tokenizer"}, 400, "prompt"),
    ({"prompt": [[1, 2], {"x": 1}]}, 400, "prompt"),
    ({"prompt": [1, 2], "kv_transfer": {"room": 3}}, 400, "kv_transfer.room"),
    ({"prompt": [1, 2], "kv_transfer": [3]}, 400, "kv_transfer"),
    ({"prompt": [1] * 9000}, 413, "prompt"),
    ({"prompt": [1, 2], "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{s}-{p}-{i}" for i, (_, s, p) in enumerate(BAD)])
def test_bad_input_gets_its_status_and_the_server_still_answers(server, body, status, param):
    got, err = post(server.url, body)
    assert got == status, err
    assert isinstance(err, dict) and err["error"]["param"] == param and err["error"]["message"]
    ok, _ = post(server.url, {"prompt": [1, 2, 3]})
    assert ok == 200


def test_other_endpoints(server):
    assert get(server.url, "/health") == (200, {"status": "ok"})
    status, models = get(server.url, "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "tiny-glm5" and models["object"] == "list"
    assert get(server.url, "/nowhere")[0] == 404
    assert get(server.url, "/v1/kv_transfer")[0] == 404  # no transfer configured
    status, page = get(server.url, "/metrics")
    assert status == 200
    for name, labels in [("cpgraph_queue_depth", ""), ("cpgraph_running_tokens", ""),
                         ("cpgraph_kv_pages", 'state="used"'), ("cpgraph_kv_pages", 'state="free"'),
                         ("cpgraph_cached_tokens_total", 'tier="device"'),
                         ("cpgraph_cached_tokens_total", 'tier="host"'),
                         ("cpgraph_steps_total", 'kind="graph"'), ("cpgraph_steps_total", 'kind="eager"'),
                         ("cpgraph_transfer_bytes_total", ""), ("cpgraph_transfer_failures_total", ""),
                         ("cpgraph_prompt_tokens_total", ""), ("cpgraph_ttft_seconds_count", ""),
                         ("cpgraph_cold_steps_total", "")]:
        metric(page, name, labels)
    assert metric(page, "cpgraph_ttft_seconds_count") >= 1
    assert metric(page, "cpgraph_steps_total", 'kind="graph"') == 0  # CPU: nothing is captured
    assert metric(page, "cpgraph_kv_pages", 'state="used"') + metric(page, "cpgraph_kv_pages", 'state="free"') == 512


def test_health_is_503_before_warm_up(model):
    import threading

    release = threading.Event()
    engine = PrefillEngine(_forward(model), model, num_pages=64, page_size=PAGE)
    server = PrefillServer(engine, served=("tiny-glm5",), warmup=lambda: release.wait(60)).start_background()
    try:
        assert get(server.url, "/health")[0] == 503
        assert post(server.url, {"prompt": [1, 2]})[0] == 503
        release.set()
        server.wait_ready()
        assert get(server.url, "/health")[0] == 200
    finally:
        release.set()
        server.stop()


async def _wait_metric(session, url, name, labels, pred, what):
    for _ in range(3000):  # bounded: 3000 polls of 10 ms at most
        _, page = await aget(session, url, "/metrics")
        if pred(metric(page, name, labels)):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_cancel_mid_prefill_frees_its_pages_and_a_full_queue_is_429(slow_server):
    url = slow_server.url
    before = _ledger(slow_server)
    [long, other] = _prompts([2000, 1500], seed=31)

    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            task = asyncio.ensure_future(apost(s, url, {"prompt": long}))
            # Mid-prefill: admitted (running) and holding pages beyond what the cache held.
            await _wait_metric(s, url, "cpgraph_kv_pages", 'state="used"', lambda v: v > before[0][0] + 2,
                               "the request to hold pages")
            # The running request takes the whole budget, so two more wait: the queue (2) is full.
            waiting = [asyncio.ensure_future(apost(s, url, {"prompt": other})) for _ in range(2)]
            await _wait_metric(s, url, "cpgraph_queue_depth", "", lambda v: v == 2, "two waiting requests")
            status, err = await apost(s, url, {"prompt": [1, 2, 3]})
            assert status == 429 and "queue" in err["error"]["message"]
            for t in [task, *waiting]:
                t.cancel()  # the client goes away: the server cancels the requests
            await asyncio.gather(task, *waiting, return_exceptions=True)
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            await _wait_metric(s, url, "cpgraph_running_requests", "", lambda v: v == 0, "the cancel")
            await _wait_metric(s, url, "cpgraph_queue_depth", "", lambda v: v == 0, "the queue to empty")

    asyncio.run(run())
    after = _ledger(slow_server)
    assert np.array_equal(after[0], before[0]) and after[1:] == before[1:], (before, after)
    assert slow_server.engine.snapshot()["outcomes"]["cancelled"] == 3
    assert post(url, {"prompt": [4, 5, 6]})[0] == 200  # and it keeps serving


@pytest.mark.parametrize("on_loop", [True, False], ids=["idle_step_on_loop", "engine_thread_only"])
def test_a_failing_engine_answers_its_requests_and_stops(model, on_loop):
    def broken(ids, meta, mla, index, **kw):
        raise AssertionError("a bug in the forward")

    engine = PrefillEngine(broken, model, num_pages=64, page_size=PAGE)
    # A bug outside one step, on whichever thread steps (the engine thread, or the loop at idle).
    engine.step = engine.try_step = lambda: (_ for _ in ()).throw(RuntimeError("the step loop broke"))
    server = PrefillServer(engine, served=("tiny-glm5",), idle_steps_on_loop=on_loop).start_background()
    server.wait_ready()
    status, err = post(server.url, {"prompt": [1, 2, 3]})
    assert status == 500 and "the step loop broke" in err["error"]["message"]
    server._thread.join(30)  # it shut itself down
    assert not server._thread.is_alive() and server.failed
