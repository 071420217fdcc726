"""The serve warm-up (``cpgraph.serve.node.warm_up``) leaves nothing to compile or capture under load.

Two forwards over the bundled ``tiny-glm5`` (fp32), on CPU:

* a ``graphed_forward`` (``--cuda-graphs``; on CPU it pads to buckets and
  calls the forward on the padded buffers, only the capture is skipped):
  after the warm-up every bucket of ``GraphRunner.reachable_buckets`` is
  prepared, a mix of requests within the budget and the prefix cap prepares
  no new one (``cold_steps`` stays 0) and answers as ``prefill_logits`` does
  (the padding rows, the KV-view bucket derived from the others, do not
  change a logit beyond ``TOL``); a step past the prefix cap is counted cold;
* a forward compiled by TorchDynamo (``dynamic=True``, backend ``eager``:
  the guards and recompiles are Dynamo's, no code generation to wait for;
  two of the model's layers, a dense and a MoE one): after the warm-up the
  same kind of mix compiles no graph.
"""

from __future__ import annotations

import random

import pytest
import torch

from cpgraph.models.prefill import make_layout, prefill_logits
from cpgraph.runtime.prefill_engine import _compiles, engine_request
from cpgraph.serve.metrics import ServeMetrics
from cpgraph.serve.node import ServeSpec, build_engine, make_forward, warm_up

PAGE, BUDGET, MAX_REQ, CAP = 16, 64, 4, 256
pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5


def _spec(**kw):
    return ServeSpec(model="tiny-glm5", page_size=PAGE, num_pages=256, token_budget=BUDGET,
                     max_batch_requests=MAX_REQ, request_timeout=None, **kw)


def _mix(engine, seed: int, groups: int = 10):
    """Groups of 1-6 requests submitted together: fresh prompts and prompts over a shared prefix, 1-80 tokens
    (a cached prefix of at most 64 tokens each, so at most ``MAX_REQ * 64 == CAP`` prefix rows per step)."""
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    base = torch.randint(0, 512, (70,), generator=g).tolist()
    prompts, handles = [], []
    for _ in range(groups):
        group = []
        for _ in range(rnd.randint(1, 6)):
            n = rnd.randint(1, 80)
            p = base[: rnd.randint(1, 70)] + torch.randint(0, 512, (rnd.randint(1, 10),), generator=g).tolist() \
                if rnd.random() < 0.5 else torch.randint(0, 512, (n,), generator=g).tolist()
            p = p[:80]
            group.append(engine.submit(engine_request(p, top_logprobs=2)))
            prompts.append(p)
        engine.run_until_idle()
        handles += group
    assert all(h.result.status == "finished" for h in handles)
    return prompts, handles


def test_warm_up_prepares_every_reachable_bucket(model):
    engine = build_engine(model, make_forward(model, _spec(cuda_graphs=True)), _spec(cuda_graphs=True))
    warm_up(engine, 16, prefix_tokens=CAP)
    (runner,) = engine.cache.forward.runners.values()
    reachable = set(runner.reachable_buckets(BUDGET, PAGE, CAP))
    assert set(runner.stats) == reachable  # every bucket, and the real warm-up requests' buckets among them
    assert engine.cold_steps == 0 and engine.snapshot()["steps"] == {"graph": 0, "eager": 0}  # fresh counters
    prompts, handles = _mix(engine, seed=1)
    assert engine.cold_steps == 0 and set(runner.stats) == reachable  # nothing new under load
    ref = torch.log_softmax(prefill_logits(model, prompts), -1)
    for h, r in zip(handles, ref):
        assert h.result.token == int(r.argmax()) and abs(h.result.logprob - float(r[h.result.token])) <= TOL
    # A step past the prefix cap prepares its bucket under load: counted, and exported.
    g = torch.Generator().manual_seed(5)
    long = torch.randint(0, 512, (CAP + 3 * PAGE,), generator=g).tolist()
    for p in (long, long[:-1] + [7]):  # the second has CAP + 2 pages cached
        h = engine.submit(engine_request(p))
        engine.run_until_idle()
        assert h.result.status == "finished"
    assert engine.cold_steps >= 1 and len(runner.stats) > len(reachable)
    page = ServeMetrics(engine).render().decode()
    assert f"cpgraph_cold_steps_total {float(engine.cold_steps)}" in page


def test_warm_up_compiles_every_class_before_load():
    from cpgraph.models import DSAConfig, build_model, init_random
    from cpgraph.models.config import bundled_config_dict

    # Two layers of tiny-glm5 (its dense one and a MoE one): the same inputs and guards, half the tracing.
    small = init_random(build_model(DSAConfig.from_hf_dict(dict(bundled_config_dict("tiny-glm5"),
                                                                num_hidden_layers=2))), seed=0).eval()
    small.kv_layout = make_layout(small, "bf16", PAGE)
    compiled = torch.compile(lambda ids, meta, mla, index, **kw: small(ids, meta, mla, index, **kw), backend="eager",
                             dynamic=True, fullgraph=True)
    engine = build_engine(small, compiled, _spec())
    before = _compiles()
    warm_up(engine, 16)
    assert _compiles() > before  # it did compile (the counter sees it)
    compiled_by_warm_up = _compiles()
    _mix(engine, seed=2, groups=8)
    assert _compiles() == compiled_by_warm_up and engine.cold_steps == 0
