"""The idle fast path of ``cpgraph serve``: a request that finds the engine idle is stepped on the event loop.

What must hold (``cpgraph/serve/app.py``, docs/serve.md): at idle the step
runs on the loop's thread and the engine thread is not woken; handlers made
runnable in the same turn of the loop share that one step; a prompt longer
than the budget has its first chunk stepped on the loop and the rest on the
engine thread, answering like ``prefill_logits``; with the path off, every
step runs on the engine thread.  The forward records the thread that ran it.
Either thread makes the engine's GPU its current CUDA device.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_utils import logprob_table, post  # noqa: E402

from cpgraph.models.prefill import prefill_logits  # noqa: E402
from cpgraph.runtime.prefill_engine import PrefillEngine  # noqa: E402
from cpgraph.runtime.scheduler import SchedulerConfig  # noqa: E402
from cpgraph.serve.app import PrefillServer  # noqa: E402
from cpgraph.serve.protocol import parse_completion  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PAGE = 16
TOL = 1e-5  # as tests/serve/test_serve.py: other batch shapes than the reference's


class Recorder:
    """The forward, recording the thread and the rows of every call."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, ids, meta, mla, index, **kw):
        self.calls.append((threading.current_thread().name, int(ids.shape[-1])))
        return self.model(ids, meta, mla, index, **kw)


def _server(model, on_loop=True, budget=128):
    rec = Recorder(model)
    engine = PrefillEngine(rec, model, num_pages=256, page_size=PAGE,
                           scheduler=SchedulerConfig(token_budget=budget))
    server = PrefillServer(engine, served=("tiny-glm5",), idle_steps_on_loop=on_loop).start_background()
    server.wait_ready()
    return server, rec


def _prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]


def _wakes(engine):
    """Count the engine thread's returns from ``wait_for_work`` with work (its wake-ups to step)."""
    counter = {"n": 0}
    inner = engine.wait_for_work

    def wait_for_work(timeout):
        got = inner(timeout)
        if got and threading.current_thread().name == "cpgraph-engine":
            counter["n"] += 1
        return got

    engine.wait_for_work = wait_for_work
    return counter


@pytest.mark.parametrize("on_loop", [True, False], ids=["on_loop", "engine_thread_only"])
def test_an_idle_request_is_stepped_where_the_option_says(model, on_loop):
    server, rec = _server(model, on_loop)
    try:
        engine = server.engine
        wakes = _wakes(engine)
        engine.wake()  # the engine thread re-enters the wrapped wait_for_work
        prompt = _prompts([40], 1)[0]
        status, body = post(server.url, {"prompt": prompt, "logprobs": 3})
        assert status == 200, body
        ref = torch.log_softmax(prefill_logits(model, [prompt])[0].float(), -1)
        choice = body["choices"][0]
        assert choice["token_ids"] == [int(ref.argmax())]
        for tok, lp in logprob_table(choice).items():
            assert abs(lp - float(ref[tok])) <= TOL
        threads = [t for t, _ in rec.calls]
        assert threads == (["cpgraph-http"] if on_loop else ["cpgraph-engine"]), threads
        server.engine.sync()
        # On the loop the engine thread slept through it (the step and the radix commit after it).
        assert (wakes["n"] == 0) if on_loop else (wakes["n"] >= 1), wakes
    finally:
        server.stop()


def test_handlers_of_one_turn_share_the_step_on_the_loop(model):
    server, rec = _server(model)
    try:
        engine, loop = server.engine, server._loop
        prompts = _prompts([20, 33, 47], 2)
        comps = [parse_completion({"prompt": p, "max_tokens": 1}, served=server.served, vocab=engine.vocab,
                                  max_prompt_tokens=engine.max_prompt_tokens) for p in prompts]

        async def one_turn():  # three handlers made runnable in the same turn of the loop
            return await asyncio.gather(*(server._run(c, None) for c in comps))

        responses = asyncio.run_coroutine_threadsafe(one_turn(), loop).result(60)
        assert [r.status for r in responses] == [200, 200, 200]
        assert rec.calls == [("cpgraph-http", sum(len(p) for p in prompts))], rec.calls  # one step, all rows
        steps = engine.snapshot()["steps"]
        assert steps.get("eager") == 1 and not steps.get("graph"), steps
    finally:
        server.stop()


def test_a_chunked_prompt_starts_on_the_loop_and_ends_on_the_engine_thread(model):
    server, rec = _server(model, budget=32)
    try:
        prompt = _prompts([100], 3)[0]
        status, body = post(server.url, {"prompt": prompt, "logprobs": 3})
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["prefill"]["chunks"] == 4
        ref = torch.log_softmax(prefill_logits(model, [prompt])[0].float(), -1)
        assert choice["token_ids"] == [int(ref.argmax())]
        for tok, lp in logprob_table(choice).items():
            assert abs(lp - float(ref[tok])) <= TOL
        threads = [t for t, _ in rec.calls]
        assert threads == ["cpgraph-http"] + ["cpgraph-engine"] * 3, threads
    finally:
        server.stop()


def test_both_threads_take_the_engines_gpu_as_their_current_device(model, monkeypatch):
    """CUDA's current device is per thread and a new thread starts on device 0: a leader on another GPU (a DP
    group's, cuda:4 of 8) would launch its Triton kernels and capture its graphs on device 0.  Both threads
    that step the engine set the engine's device first (recorded here through a stand-in ``set_device``)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))
    engine = PrefillEngine(Recorder(model), model, num_pages=64, page_size=PAGE)
    engine.device = torch.device("cuda", 3)  # only read by the threads' set-up here: nothing is stepped
    server = PrefillServer(engine, served=("tiny-glm5",)).start_background()
    try:
        server.wait_ready()
    finally:
        server.stop()
    assert sorted(calls) == [("cpgraph-engine", torch.device("cuda", 3)), ("cpgraph-http", torch.device("cuda", 3))]


def test_a_request_right_after_a_step_goes_to_the_engine_thread(model):
    """``settled``: idle for at least as long as the last step took.  The next request of a busy period (here: the
    last step is made to look an hour long, so no gap after it is long enough) is stepped on the engine thread,
    and once the engine has settled the path is taken again."""
    server, rec = _server(model)
    try:
        engine = server.engine
        prompts = _prompts([24, 24, 24], 4)
        assert post(server.url, {"prompt": prompts[0]})[0] == 200
        assert engine._last_batch_s > 0  # the step that ran the first request was timed
        engine._last_batch_s = 3600.0
        assert engine.idle() and not engine.settled()
        assert post(server.url, {"prompt": prompts[1]})[0] == 200
        engine.sync()  # the engine thread's step ends after its answer: wait for it (it stamps its end time last)
        engine._last_batch_end = float("-inf")  # long ago
        assert engine.settled()
        assert post(server.url, {"prompt": prompts[2]})[0] == 200
        assert [t for t, _ in rec.calls] == ["cpgraph-http", "cpgraph-engine", "cpgraph-http"], rec.calls
    finally:
        server.stop()


def test_the_engine_is_not_settled_while_a_step_answers(model):
    """A step answers its requests before it stamps its end: a request sent from an answer's callback (a client
    that replies at once) must not find the engine settled on the previous step's stamp."""
    engine = PrefillEngine(Recorder(model), model, num_pages=64, page_size=PAGE)
    seen = []
    from cpgraph.runtime.prefill_engine import engine_request

    assert engine.settled()  # nothing has run yet
    h = engine.submit(engine_request(_prompts([20], 5)[0]), wake=False)
    assert not engine.settled()  # queued
    h.add_done_callback(lambda h: seen.append((engine.idle(), engine.settled())))
    engine.step()
    assert h.done() and seen == [(True, False)], seen
