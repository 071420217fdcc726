"""A cp=2 gloo ``cpgraph serve`` node answers like one device, over real HTTP.

Why this file sits here, beside ``test_cp_numerics``: it reuses that
module's CP ranks and their compiled model (``shared_pool(2, CP_TIMEOUT_S)``,
``cp_model.compiled_cp``); ``tests/runtime/test_cache_cp`` closes those ranks
when it ends, and a fresh compile would cost CI a minute.

Two gloo ranks from the suite's shared pool (``tests/dist_utils.py``), each
with the CP-compiled two-layer model of ``tests/cp_model.py`` (aot_eager;
the same compile ``test_cache_cp`` uses, so the ranks build it once).  Rank
0 runs the scheduler and the HTTP server; rank 1 follows its ops
(:meth:`PrefillEngine.follow`).  The requests share a prefix (cache hits
under CP, with the owner sequence every rank agrees on) and one is longer
than the step budget (chunked).  Rank 0 also computes the single-device eager
reference; CP and one device differ in reduction order, so log-probabilities
are compared with ``TOL`` = 2e-5 (1e-5 on logits, as in the CP numerics tests, and as much
again through the log-sum-exp).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "serve"))
from cp_model import CP_TIMEOUT_S, PAGE  # noqa: E402
from dist_utils import shared_pool  # noqa: E402
from serve_utils import get, logprob_table, post, post_many  # noqa: E402

pytestmark = pytest.mark.slow
TOL = 2e-5
GRAPH_PREFIX_CAP = 160  # cached-prefix rows per step the graphed node's warm-up covers (3 x the 48-token prefix)


def job_serve_cp(ctx, prompts, port_file, stop_file, graphs: bool = False, **engine_kw):
    """One rank of the cp=2 node.  ``graphs``: the forward goes through ``graphed_forward`` as ``cpgraph serve
    --cuda-graphs --cp 2`` builds it (buckets, KV view derived from them; no capture on CPU) and the server's
    warm-up prepares every reachable bucket on both ranks first."""
    from cp_model import compiled_cp, model_pair

    from cpgraph.models.prefill import prefill_logits
    from cpgraph.runtime.graph_runner import graphed_forward
    from cpgraph.runtime.prefill_engine import PrefillEngine
    from cpgraph.runtime.scheduler import SchedulerConfig
    from cpgraph.serve.app import PrefillServer
    from cpgraph.serve.node import warm_up

    _, model = model_pair()
    forward = compiled_cp(ctx, "aot_eager")
    sched = SchedulerConfig(token_budget=64)
    if graphs:
        sched = SchedulerConfig(token_budget=64, max_batch_requests=4)
        forward = graphed_forward(forward, max_requests=4, cp_size=ctx.world_size, page_size=PAGE)
    engine = PrefillEngine(forward, model, num_pages=48, page_size=PAGE, rank=ctx.rank, cp_size=ctx.world_size,
                           scheduler=sched, **engine_kw)
    out = {}
    if ctx.rank == 0:
        warm = (lambda: warm_up(engine, 16, prefix_tokens=GRAPH_PREFIX_CAP)) if graphs else None
        server = PrefillServer(engine, served=("cp-model",), heartbeat=1.0, warmup=warm).start_background()
        try:
            server.wait_ready()
        except BaseException as exc:  # the test stops waiting at once; the ranks' error reaches it via result()
            Path(port_file).write_text(f"failed: {exc}")
            server.stop()
            raise
        Path(port_file).write_text(server.url)
        for _ in range(6000):  # bounded: 10 minutes
            if os.path.exists(stop_file):
                break
            time.sleep(0.1)
        server.stop()
        out["reference"] = prefill_logits(model, prompts).numpy()
        out["outcomes"] = engine.snapshot()["outcomes"]
    else:
        engine.follow()
        engine.close()  # as cpgraph serve's followers do: the leader's engine thread closes its own
    if graphs:
        (runner,) = forward.runners.values()
        out["buckets"] = sorted((b.rows, b.kv_rows, b.prefix_rows) for b in runner.stats)
        out["reachable"] = sorted((b.rows, b.kv_rows, b.prefix_rows)
                                  for b in runner.reachable_buckets(64, PAGE, GRAPH_PREFIX_CAP))
        out["bucket_calls"] = sum(s.replays for s in runner.stats.values())
        out["steps"] = dict(engine.stats.steps)
        out["cold_steps"] = engine.cold_steps
    out["used"] = engine.cache.device.ledger.used.tolist()
    out["fingerprint"] = engine.cache.tree.fingerprint()
    out["pages_in_pool"] = engine.cache.pool.config.num_pages - engine.cache.pool.num_free
    return out


@pytest.mark.parametrize("graphs", [False, True], ids=["plain", "graph_buckets"])
def test_cp2_gloo_server_equals_single_device(graphs):
    """``graph_buckets``: the same node over CUDA-graph buckets (``--cuda-graphs --cp 2``; on CPU the padding
    and bucket logic without the capture): every step planned in a bucket the warm-up prepared on both ranks,
    no cold step under load, and the same answers."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 512, (48,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 512, (n,), generator=g).tolist() for n in (9, 30, 3)]
    prompts.append(torch.randint(0, 512, (150,), generator=g).tolist())  # > the 64-token budget: 3 chunks
    with tempfile.TemporaryDirectory() as tmp:
        port_file, stop_file = os.path.join(tmp, "url"), os.path.join(tmp, "stop")
        pending = shared_pool(2, CP_TIMEOUT_S).submit(job_serve_cp, prompts, port_file, stop_file, graphs)
        try:
            for _ in range(9000):  # bounded: 15 minutes (the ranks may compile first)
                if os.path.exists(port_file):
                    break
                time.sleep(0.1)
            url = Path(port_file).read_text()
            assert get(url, "/health")[0] == 200
            first = post(url, {"prompt": prompts[0], "logprobs": 10})  # caches the shared prefix
            rest = post_many(url, [{"prompt": p, "logprobs": 10} for p in prompts[1:]])
            bad = post(url, {"prompt": [1, 2], "max_tokens": 2})
        finally:
            Path(stop_file).touch()
            ranks = pending.result()
    responses = [first] + rest
    assert [s for s, _ in responses] == [200] * 4, responses
    assert bad[0] == 400
    ref = torch.log_softmax(torch.from_numpy(ranks[0]["reference"]), -1)
    for (_, body), r in zip(responses, ref):
        choice = body["choices"][0]
        assert choice["token_ids"] == [int(r.argmax())]
        for tok, lp in logprob_table(choice).items():
            assert abs(lp - float(r[tok])) <= TOL, (tok, lp, float(r[tok]))
    hits = [body["choices"][0]["prefill"]["cached_tokens"]["device"] for _, body in responses]
    assert hits[1:3] == [48, 48] and hits[0] == 0
    assert responses[3][1]["choices"][0]["prefill"]["chunks"] >= 3  # 150 tokens, 64 per step (shared)
    # Both ranks went through the same cache states: same ledger, same tree, no page held outside the cache.
    assert ranks[0]["used"] == ranks[1]["used"] and ranks[0]["fingerprint"] == ranks[1]["fingerprint"]
    for r in range(2):
        assert ranks[r]["pages_in_pool"] == ranks[r]["used"][r]
    assert ranks[0]["outcomes"]["finished"] == 4
    if graphs:
        for r in ranks:  # both ranks prepared the same buckets: all the reachable ones, and none under load
            assert r["buckets"] == r["reachable"] == ranks[0]["reachable"], (r["buckets"], r["reachable"])
            assert r["cold_steps"] == 0
        # Every step ran in a bucket (the runner refuses a CP batch whose rows are not one) that was prepared
        # before /health turned 200: the load's steps went through the runner and prepared nothing.
        steps = sum(ranks[0]["steps"].values())
        assert steps >= 4 and ranks[1]["steps"] == ranks[0]["steps"]
        assert ranks[0]["bucket_calls"] > steps


def _serve_once(prompts, bodies, **engine_kw):
    """Start the cp=2 server on the shared ranks, POST ``bodies`` one by one, stop it; ``(responses, ranks)``."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file, stop_file = os.path.join(tmp, "url"), os.path.join(tmp, "stop")
        pending = shared_pool(2, CP_TIMEOUT_S).submit(job_serve_cp, prompts, port_file, stop_file, **engine_kw)
        try:
            for _ in range(9000):
                if os.path.exists(port_file):
                    break
                time.sleep(0.1)
            url = Path(port_file).read_text()
            responses = [post(url, b) for b in bodies]
        finally:
            Path(stop_file).touch()
            ranks = pending.result()
    return responses, ranks


def test_cp2_gloo_server_restarted_serves_the_prefix_from_l3(tmp_path):
    """``--l3`` under CP: the L3 lookups and the agreement on what arrived are collectives, run by both ranks in
    the engine's L3 phase; a restarted node restores the prompt's pages (each rank its own) from the store."""
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 512, (57,), generator=g).tolist()  # 3 whole pages before the last token's page
    kw = dict(host_pages=48, l3=f"file:{tmp_path / 'l3'}")
    (cold,), _ = _serve_once([prompt], [{"prompt": prompt, "logprobs": 5}], **kw)
    (warm,), ranks = _serve_once([prompt], [{"prompt": prompt, "logprobs": 5}], **kw)
    assert cold[0] == warm[0] == 200, (cold, warm)
    assert warm[1]["choices"][0]["prefill"]["cached_tokens"] == {"device": 0, "host": 0, "l3": 48}
    ref = torch.log_softmax(torch.from_numpy(ranks[0]["reference"]), -1)[0]
    choice = warm[1]["choices"][0]
    assert choice["token_ids"] == [int(ref.argmax())]
    for tok, lp in logprob_table(choice).items():
        assert abs(lp - float(ref[tok])) <= TOL, (tok, lp, float(ref[tok]))
    assert ranks[0]["used"] == ranks[1]["used"] and ranks[0]["fingerprint"] == ranks[1]["fingerprint"]
