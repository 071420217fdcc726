"""``cpgraph serve`` on one GPU with CUDA graphs: steady-state steps replay captured graphs (skips on CPU).

The bundled ``tiny-glm5`` on ``cuda`` (eager forward under ``graphed_forward``).
The same batch shapes arrive twice: the first pass captures a graph per
bucket, the second must replay them (``cpgraph_steps_total{kind="graph"}``),
and both passes must answer like ``prefill_logits`` within ``TOL`` (padded
bucket shapes differ from the reference's).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_env import needs_gpu  # noqa: E402
from serve_utils import get, logprob_table, metric, post  # noqa: E402

pytestmark = [pytest.mark.gpu, needs_gpu]
TOL = 1e-4  # fp32 on the GPU (TF32 off by default), padded bucket shapes


def test_cuda_graph_steps_replay_and_match_prefill_logits():
    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout, prefill_logits
    from cpgraph.runtime.prefill_engine import _graph_replays
    from cpgraph.serve.app import PrefillServer
    from cpgraph.serve.node import ServeSpec, build_engine, make_forward

    model = from_pretrained("tiny-glm5", device="cuda").eval()
    model.kv_layout = make_layout(model, "bf16", 16)
    spec = ServeSpec(model="tiny-glm5", page_size=16, num_pages=256, token_budget=256, max_batch_requests=8,
                     cuda_graphs=True)
    engine = build_engine(model, make_forward(model, spec), spec)
    server = PrefillServer(engine, served=("tiny-glm5",)).start_background()
    try:
        server.wait_ready()
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 90, 200)]
        ref = torch.log_softmax(prefill_logits(model, prompts).float().cpu(), -1)
        for rnd in range(2):
            engine.reset_cache()  # the same shapes again: no cache hit changes them (and the counters restart)
            replays0 = _graph_replays(engine.cache.forward)
            for p, r in zip(prompts, ref):
                status, body = post(server.url, {"prompt": p, "logprobs": 5})
                assert status == 200, body
                choice = body["choices"][0]
                assert choice["token_ids"] == [int(r.argmax())]
                for tok, lp in logprob_table(choice).items():
                    assert abs(lp - float(r[tok])) <= TOL
        # Second pass: every step replayed a graph captured in the first (the counters restarted at the reset).
        page = get(server.url, "/metrics")[1]
        assert metric(page, "cpgraph_steps_total", 'kind="graph"') == len(prompts)
        assert engine.snapshot()["steps"].get("eager", 0) == 0
        assert _graph_replays(engine.cache.forward) - replays0 == len(prompts)
    finally:
        server.stop()
