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


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("extra", [[], ["--ep", "2", "--draft"]], ids=["cp2", "cp2_ep2_draft"])
def test_cp2_cuda_graph_server_replays_and_matches_prefill_logits(extra):
    """``cpgraph serve --cp 2 --cuda-graphs`` on two GPUs (NCCL, Inductor): the warm-up captures every bucket of
    the budget on both ranks, then every step under load replays a graph (no cold step) and the answers
    match ``prefill_logits`` on one GPU within ``TOL`` (CP and padded buckets change reduction shapes).
    ``cp2_ep2_draft``: each rank holds half of the routed experts (the all-to-all dispatch inside the captured
    graphs) and the MTP draft replays its own graphs; every choice names a draft token."""
    import os
    import re
    import signal
    import subprocess
    import threading
    import time

    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout, prefill_logits

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), NCCL_NVLS_ENABLE="0")
    proc = subprocess.Popen([sys.executable, "-m", "cpgraph", "serve", "--model", "tiny-glm5", "--port", "0",
                             "--cp", "2", "--device", "cuda", "--backend", "inductor", "--cuda-graphs",
                             "--page", "16", "--num-pages", "256", "--token-budget", "256",
                             "--max-batch-requests", "8", "--warmup-prefix-tokens", "0", *extra], cwd=root, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()  # keeps reading: a full stderr pipe would block the ranks
    try:
        url, deadline = None, time.monotonic() + 540
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", "".join(lines))
            url = m.group(1) if m else time.sleep(0.2)
        assert url, "server did not start: " + "".join(lines[-40:])
        while get(url, "/health")[0] != 200:  # the warm-up compiles and captures on both ranks
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-40:])
            time.sleep(0.5)
        model = from_pretrained("tiny-glm5", device="cuda").eval()
        model.kv_layout = make_layout(model, "bf16", 16)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 90, 200, 7)]
        ref = torch.log_softmax(prefill_logits(model, prompts).float().cpu(), -1)
        for p, r in zip(prompts, ref):
            status, body = post(url, {"prompt": p, "logprobs": 5})
            assert status == 200, body
            choice = body["choices"][0]
            assert choice["token_ids"] == [int(r.argmax())]
            for tok, lp in logprob_table(choice).items():
                assert abs(lp - float(r[tok])) <= TOL, (tok, lp, float(r[tok]))
            assert ("draft_token_ids" in choice) == ("--draft" in extra)
        page = get(url, "/metrics")[1]
        assert metric(page, "cpgraph_steps_total", 'kind="graph"') == len(prompts)
        assert metric(page, "cpgraph_steps_total", 'kind="eager"') == 0
        assert metric(page, "cpgraph_cold_steps_total") == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_draft_served_on_cuda_with_inductor_equals_run_prefill():
    """``cpgraph serve --draft --device cuda --backend inductor``: the compiled target and the compiled draft on
    the GPU, chunked (budget 64) and batched; each choice's first token and draft guess are those of
    ``run_prefill`` (eager, the request alone) given the same first token, and the draft logits agree within
    ``TOL`` (other batch shapes, Triton vs torch kernels)."""
    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout
    from cpgraph.runtime.engine import run_prefill
    from cpgraph.serve.app import PrefillServer
    from cpgraph.serve.node import ServeSpec, build_engine, make_draft, make_forward

    model = from_pretrained("tiny-glm5", device="cuda", draft=True).eval()
    model.kv_layout = make_layout(model, "bf16", 16)
    spec = ServeSpec(model="tiny-glm5", page_size=16, num_pages=256, token_budget=64, max_batch_requests=8,
                     backend="inductor", draft=True)
    logits = []
    draft = make_draft(model, spec)

    def recorded(hidden, dinputs, meta, mla, index):
        out = draft(hidden, dinputs, meta, mla, index)
        logits.append((dinputs.sampled.cpu(), out.logits.float().cpu()))
        return out

    engine = build_engine(model, make_forward(model, spec), spec, draft=recorded)
    server = PrefillServer(engine, served=("tiny-glm5",)).start_background()
    try:
        server.wait_ready()
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 150, 17)]
        for p in prompts:
            status, body = post(server.url, {"prompt": p})
            assert status == 200, body
            choice = body["choices"][0]
            ref = run_prefill(lambda *a, **k: model(*a, **k), model, [p], page_size=16, draft=model.draft_module(),
                              draft_tokens=choice["token_ids"])
            assert choice["token_ids"] == [int(ref.logits[0].argmax())]
            assert choice["draft_token_ids"] == [int(ref.draft_logits[0].argmax())]
            sampled, served = logits[-1]  # the request's last chunk ran in the latest draft call, as row 0
            assert int(sampled[0]) == choice["token_ids"][0]
            assert torch.allclose(served[0], ref.draft_logits[0].float().cpu(), atol=TOL, rtol=0)
    finally:
        server.stop()


def test_draft_graphs_capture_and_replay_on_cuda():
    """``cpgraph serve --cuda-graphs --draft`` on one GPU (eager forwards under ``graphed_forward`` and
    ``graphed_draft``): the first pass captures the target's and the draft's graph of each bucket, the second
    replays both, and every answer's first token and draft guess are ``run_prefill``'s given that token."""
    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout
    from cpgraph.runtime.engine import run_prefill
    from cpgraph.runtime.graph_runner import graph_counts
    from cpgraph.serve.app import PrefillServer
    from cpgraph.serve.node import ServeSpec, build_engine, make_draft, make_forward

    model = from_pretrained("tiny-glm5", device="cuda", draft=True).eval()
    model.kv_layout = make_layout(model, "bf16", 16)
    spec = ServeSpec(model="tiny-glm5", page_size=16, num_pages=256, token_budget=256, max_batch_requests=8,
                     cuda_graphs=True, draft=True)
    engine = build_engine(model, make_forward(model, spec), spec, draft=make_draft(model, spec))
    server = PrefillServer(engine, served=("tiny-glm5",)).start_background()
    try:
        server.wait_ready()
        g = torch.Generator().manual_seed(4)
        prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 90, 200)]
        for rnd in range(2):
            engine.reset_cache()
            draft_replays0 = graph_counts(engine.draft)[0]
            for p in prompts:
                status, body = post(server.url, {"prompt": p})
                assert status == 200, body
                choice = body["choices"][0]
                ref = run_prefill(lambda *a, **k: model(*a, **k), model, [p], page_size=16,
                                  draft=model.draft_module(), draft_tokens=choice["token_ids"])
                assert choice["token_ids"] == [int(ref.logits[0].argmax())]
                assert choice["draft_token_ids"] == [int(ref.draft_logits[0].argmax())]
        assert graph_counts(engine.draft)[0] - draft_replays0 == len(prompts)  # the second pass replayed them
        assert engine.snapshot()["steps"].get("eager", 0) == 0 and engine.cold_steps == 0
    finally:
        server.stop()


def test_auto_pool_fills_the_fraction_on_cuda():
    """``--num-pages auto --kv-memory-fraction 0.3`` on the GPU: the pool and the weights stay within 30% of
    the device (one step's activations booked beside them) and the engine answers a request."""
    import gc
    from dataclasses import replace

    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout, prefill_logits
    from cpgraph.runtime.prefill_engine import engine_request
    from cpgraph.serve.node import ServeSpec, auto_pages, build_engine, make_forward

    model = from_pretrained("tiny-glm5", device="cuda").eval()
    model.kv_layout = make_layout(model, "bf16", 16)
    spec = ServeSpec(model="tiny-glm5", page_size=16, num_pages=None, kv_memory_fraction=0.3, token_budget=256)
    free0, total = torch.cuda.mem_get_info()
    pages = auto_pages(model, spec)
    engine = build_engine(model, make_forward(model, spec), replace(spec, num_pages=pages))
    try:
        held = engine.cache.pool.total_bytes()
        assert held == pages * engine.cache.pool.bytes_per_page() > 0
        assert free0 - held >= 0.7 * total - 64 * 2**20  # within the fraction (allocator rounding aside)
        prompt = list(range(1, 41))
        h = engine.submit(engine_request(prompt))
        engine.run_until_idle()
        assert h.result.token == int(prefill_logits(model, [prompt])[0].argmax())
    finally:
        del engine
        gc.collect()
        torch.cuda.empty_cache()
