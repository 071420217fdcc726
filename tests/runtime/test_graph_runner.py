"""GraphRunner: bucket ladders, padding to a bucket, one compile per bucket, CUDA capture on a GPU.

On CPU the runner pads and calls the forward without capturing, so the bucket
selection, the padding contract (padded logits equal the unpadded batch's) and
the compile count are checked here; the capture itself runs in the GPU test.
"""

from __future__ import annotations

import math

import pytest
import torch

from cpgraph.models import build_batch, tiny_model
from cpgraph.models.batch import MIN_PREFIX_ROWS
from cpgraph.models.prefill import make_layout
from cpgraph.plan import plan_prefill
from cpgraph.runtime.engine import pool_config, pool_tensors
from cpgraph.runtime.graph_runner import GraphRunner, bucket_ladder, pick_bucket
from cpgraph.runtime.kv_pool import KVPool

PAGE = 16
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")


def test_ladder_values_and_padding_bound():
    assert bucket_ladder(16, 200, 2) == (16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert bucket_ladder(64, 100, 4) == (64, 80, 96, 112)
    lad = bucket_ladder(1, 1 << 16, 4)
    for n in range(1, 1 << 16, 97):
        b = pick_bucket(lad, n, "rows")
        assert n <= b and (n < 8 or b <= math.ceil(n * 1.25)), (n, b)


def test_pick_past_the_largest_bucket_is_a_clear_error():
    with pytest.raises(ValueError, match="exceeds the largest bucket 32"):
        pick_bucket((16, 32), 33, "compute rows")
    with pytest.raises(ValueError, match="lo <= hi"):
        bucket_ladder(8, 4)


def _setup(dtype=torch.float32, device="cpu"):
    model = tiny_model("tiny-deepseek-v32", dtype=dtype, device=device).eval()
    model.kv_layout = make_layout(model, "bf16", PAGE)
    pool = KVPool(pool_config(model, "bf16", PAGE, 64))
    mla, index = pool_tensors(pool, model)
    return model, pool, mla, index


def _batch(runner, pool, prompts, prefix, device, plan=None):
    lens = [len(p) - prefix for p in prompts]
    plan = plan or runner.plan([prefix] * len(prompts), lens, PAGE)
    tables = [pool.alloc_pages_with_owners([0] * math.ceil(len(p) / PAGE)) for p in prompts]
    ids, meta = build_batch(plan, [p[prefix:] for p in prompts], tables, device)
    return ids, meta, tables


def _release(pool, tables):
    for t in tables:
        pool.free(t)


BATCHES = [[7], [3, 9], [20], [1, 2, 3], [30], [5, 5, 5, 5], [12]]  # extend lengths, no prefix


@torch.no_grad()
def test_padded_batch_matches_unpadded_eager():
    model, pool, mla, index = _setup()
    runner = GraphRunner(lambda i, m: model(i, m, mla, index).logits, max_requests=4, row_buckets=(16, 32, 64),
                         kv_buckets=bucket_ladder(16, 4096, 2))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for lens in BATCHES:
        prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lens]
        ids, meta, tables = _batch(runner, pool, prompts, 0, "cpu")
        assert ids.shape[0] in runner.row_buckets and (meta.positions.shape[0] == ids.shape[0])
        # No cached prefix: build_batch's MIN_PREFIX_ROWS -1 rows are the bucket's P (not the smallest KV bucket).
        assert runner.bucket_for(ids, meta).prefix_rows == meta.prefix_slots.shape[0] == MIN_PREFIX_ROWS
        got = runner(ids, meta)
        _release(pool, tables)
        plain = plan_prefill([0] * len(lens), lens, cp_size=1, page_size=PAGE)
        ids, meta, tables = _batch(runner, pool, prompts, 0, "cpu", plan=plain)
        want = model(ids, meta, mla, index).logits
        _release(pool, tables)
        assert got.shape == want.shape == (len(lens), model.config.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
@torch.no_grad()
def test_prefix_batch_pads_kv_view(device):
    """Cached prefixes of 32 and 16 rows (P = 48) padded to the 64-row prefix bucket; captured on a GPU."""
    dtype = torch.float32
    model, pool, mla, index = _setup(dtype, device)
    runner = GraphRunner(lambda i, m: model(i, m, mla, index).logits, max_requests=4, row_buckets=(16, 32),
                         kv_buckets=(64, 128, 256))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    prefix = [32, 16]
    prompts = [torch.randint(0, model.config.vocab_size, (p + n,), generator=g).tolist()
               for p, n in zip(prefix, (3, 6))]  # fmt: skip
    tables = [pool.alloc_pages_with_owners([0] * math.ceil(len(p) / PAGE)) for p in prompts]
    for i, (p, n) in enumerate(zip(prompts, prefix)):  # cache the prefixes
        pre = plan_prefill([0], [n], cp_size=1, page_size=PAGE)
        ids, meta = build_batch(pre, [p[:n]], [tables[i][: n // PAGE]], device, prefix_page_owners=[[]])
        model(ids, meta, mla, index)
    plan = runner.plan(prefix, [3, 6], PAGE)
    ids, meta = build_batch(plan, [p[n:] for p, n in zip(prompts, prefix)], tables, device)
    bucket = runner.bucket_for(ids, meta)
    assert (meta.prefix_slots.shape[0], bucket.prefix_rows) == (48, 64)  # P padded by one page
    assert (meta.kv_source.shape[0], bucket.kv_rows) == (80, 128)  # (32 + 16) + (16 + 16) view rows
    got = runner(ids, meta)
    assert runner.capture_report()[0]["captured"] == (device == "cuda")
    plain = plan_prefill(prefix, [3, 6], cp_size=1, page_size=PAGE)
    ids, meta = build_batch(plain, [p[n:] for p, n in zip(prompts, prefix)], tables, device)
    # Padding changes the shapes (M, P, N), so the logits agree to a tolerance, not bit for bit.
    torch.testing.assert_close(got, model(ids, meta, mla, index).logits, rtol=1e-5, atol=1e-5)


def test_bad_batches_are_refused():
    model, pool, mla, index = _setup()
    runner = GraphRunner(lambda i, m: model(i, m, mla, index).logits, max_requests=2, row_buckets=(16, 32))
    ids, meta, _ = _batch(runner, pool, [[1] * 5], 0, "cpu", plan=plan_prefill([0], [5], cp_size=1, page_size=PAGE))
    assert runner.bucket_for(ids, meta).rows == 16  # one device: rows padded on load
    cp2 = GraphRunner(lambda i, m: None, max_requests=2, row_buckets=(16, 32), cp_size=2)
    with pytest.raises(ValueError, match="not a row bucket"):
        cp2.bucket_for(ids, meta)
    ids, meta, _ = _batch(runner, pool, [[1] * 3] * 3, 0, "cpu")
    with pytest.raises(ValueError, match="exceed max_requests=2"):
        runner(ids, meta)
    with pytest.raises(ValueError, match="largest bucket 32"):
        runner.plan([0], [40], PAGE)


@pytest.mark.slow
@torch.no_grad()
def test_one_compile_per_bucket_and_none_on_replay():
    from torch._dynamo.utils import counters

    import cpgraph

    model, pool, mla, index = _setup()
    torch._dynamo.reset()
    counters.clear()
    compiled = cpgraph.compile(model, backend="aot_eager", dynamic=False)
    runner = GraphRunner(lambda i, m: compiled(i, m, mla, index).logits, max_requests=4, row_buckets=(16, 32),
                         kv_buckets=(64,))  # fmt: skip
    g = torch.Generator().manual_seed(2)
    seen = set()
    for rnd in range(2):
        for lens in BATCHES[:5]:
            prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lens]
            ids, meta, tables = _batch(runner, pool, prompts, 0, "cpu")
            seen.add(runner.bucket_for(ids, meta))
            runner(ids, meta)
            _release(pool, tables)
        if rnd == 0:
            first = counters["stats"]["unique_graphs"]
    assert len(seen) == 2  # rows 16 and 32, one KV bucket
    assert counters["stats"]["unique_graphs"] == first == len(seen)  # one compile per bucket, none when repeated
    assert sum(s.replays for s in runner.stats.values()) == 10 and len(runner.stats) == len(seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
@torch.no_grad()
def test_cuda_capture_replays_without_recapture():
    model, pool, mla, index = _setup(torch.bfloat16, "cuda")
    for t in mla + index:
        torch._dynamo.mark_static_address(t)
    runner = GraphRunner(lambda i, m: model(i, m, mla, index).logits, max_requests=4, row_buckets=(16, 32, 64))
    g = torch.Generator().manual_seed(3)
    for lens in BATCHES + BATCHES:
        prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lens]
        ids, meta, tables = _batch(runner, pool, prompts, 0, "cuda")
        got = runner(ids, meta)
        want = model(ids, meta, mla, index).logits  # eager on the same padded batch
        _release(pool, tables)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    report = runner.capture_report()
    assert all(r["captured"] for r in report)
    assert len(report) == len(runner.stats) <= 3 and sum(r["replays"] for r in report) == 2 * len(BATCHES)


@torch.no_grad()
def test_graphed_forward_drops_into_run_prefill():
    from cpgraph.runtime.engine import run_prefill
    from cpgraph.runtime.graph_runner import graphed_forward

    model = tiny_model("tiny-deepseek-v32").eval()
    fwd = graphed_forward(model, max_requests=4, row_buckets=(16, 32, 64))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (20, 7, 33)]
    want = run_prefill(model, model, prompts, prefix_lens=[16, 0, 32], page_size=PAGE).logits
    got = run_prefill(fwd, model, prompts, prefix_lens=[16, 0, 32], page_size=PAGE).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (runner,) = fwd.runners.values()  # one pool, two passes (prefix, extend): two buckets
    assert len(runner.stats) == 2
    with pytest.raises(ValueError, match="return_topk"):
        fwd(None, None, [], [], return_topk=True)


@torch.no_grad()
def test_graphed_forward_in_the_cache_engine():
    """Two passes over one persistent pool (radix hits on the second): one runner, a bucket per batch shape."""
    from cpgraph.models.prefill import make_layout
    from cpgraph.runtime.cache_engine import CacheEngine, default_capacity, run_twice
    from cpgraph.runtime.graph_runner import graphed_forward

    model = tiny_model("tiny-deepseek-v32").eval()
    layout = make_layout(model, "bf16", PAGE)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (40, 21, 35)]

    def eager(ids, meta, mla, index, **kw):
        return model(ids, meta, mla, index, layout, **kw)

    outs = {}
    graphed = graphed_forward(eager, max_requests=4, row_buckets=(16, 32, 64, 128))
    for name, fwd in (("eager", eager), ("graphed", graphed)):
        engine = CacheEngine(fwd, model, num_pages=default_capacity(prompts, PAGE), kv_format="bf16", page_size=PAGE)
        outs[name] = run_twice(engine, prompts)
    for key in ("first", "second"):
        torch.testing.assert_close(outs["graphed"][key], outs["eager"][key], rtol=1e-5, atol=1e-5)
    assert outs["graphed"]["hits"] == outs["eager"]["hits"] and outs["graphed"]["hits"][1]["device"] > 0
    (runner,) = graphed.runners.values()  # one persistent pool: one runner, the two passes' shapes
    assert len(runner.stats) == 2 and all(s.replays == 1 for s in runner.stats.values())


class _FakeStream:
    def wait_stream(self, other):
        pass


class _FakeGraph:
    def replay(self):
        pass


@pytest.fixture
def fake_capture(monkeypatch):
    """The capture path of ``GraphRunner._prepare`` on CPU: ``torch.cuda``'s stream, graph and memory calls
    stubbed, so the warm-up calls, the capture call and the garbage collections can be counted."""
    import contextlib
    import gc

    monkeypatch.setattr(GraphRunner, "_capturing", lambda self, device: True)
    for name, fake in (("Stream", lambda device=None: _FakeStream()),
                       ("current_stream", lambda device=None: _FakeStream()),
                       ("stream", lambda s: contextlib.nullcontext()), ("synchronize", lambda device=None: None),
                       ("empty_cache", lambda: None), ("memory_reserved", lambda device=None: 0),
                       ("graph_pool_handle", lambda: object()), ("CUDAGraph", _FakeGraph),
                       ("graph", lambda g, pool=None: contextlib.nullcontext())):  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, fake)
    collects = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: collects.append(a) or real(*a))
    return collects


def _counting_runner(pool, **kw):
    calls = []

    def forward(ids, meta):
        calls.append(ids.shape[0])
        return torch.zeros(meta.last_token_index.shape[0], 8)

    runner = GraphRunner(forward, max_requests=4, row_buckets=(16, 32, 64), kv_buckets=(64, 128, 256), **kw)
    ids, meta, _ = _batch(runner, pool, [[1] * 5], 0, "cpu")
    return runner, calls, ids, meta


@torch.no_grad()
def test_capture_collects_once_per_warm_and_never_on_first_use(fake_capture):
    """gc.collect() cost ~0.4 s per bucket on the H200: at most one per warm(), none on a first-use capture."""
    _, pool, _, _ = _setup()
    runner, calls, ids, meta = _counting_runner(pool, warmup_calls=3)
    runner(ids, meta)  # first use under load: warm-up calls and a capture, no collection
    assert fake_capture == [] and calls == [16] * 4  # warmup_calls on the runner's first bucket, then the capture
    assert runner.stats[runner.bucket_for(ids, meta)].calls == 3
    buckets = runner.reachable_buckets(64, PAGE)
    assert len(buckets) > 3
    calls.clear()
    n = runner.warm(buckets)
    assert n == len(buckets) - 1 and len(fake_capture) <= 1  # one collection for the whole warm-up
    assert len(calls) == 2 * n  # later buckets: one warm-up call each, then the capture
    assert runner.warm(buckets) == 0 and len(fake_capture) <= 1  # nothing to prepare: no collection
    fake_capture.clear()
    extra = runner.reachable_buckets(64, PAGE, 2 * PAGE)
    ids2, meta2, _ = _batch(runner, pool, [[2] * 40], 32, "cpu")  # a cached prefix: a bucket not warmed yet
    assert runner.bucket_for(ids2, meta2) not in runner.stats and runner.bucket_for(ids2, meta2) in extra
    calls.clear()
    runner(ids2, meta2)
    assert fake_capture == []
    assert calls == [calls[0]] * 2 and runner.stats[runner.bucket_for(ids2, meta2)].calls == 1  # one warm-up call


@torch.no_grad()
def test_warm_first_bucket_gets_warmup_calls(fake_capture):
    _, pool, _, _ = _setup()
    runner, calls, ids, meta = _counting_runner(pool, warmup_calls=2)
    runner._like = (meta, ids.device)  # a real batch's dtypes, without preparing its bucket
    buckets = runner.reachable_buckets(32, PAGE)
    assert runner.warm(buckets) == len(buckets) >= 2
    got = [s.calls for s in runner.stats.values()]
    assert got == [2] + [1] * (len(buckets) - 1) and len(calls) == sum(got) + len(buckets)
    assert all(r["warmup_calls"] == c for r, c in zip(runner.capture_report(), got))


@torch.no_grad()
def test_warm_summary_counts_the_buckets_it_prepared():
    _, pool, _, _ = _setup()
    runner, calls, ids, meta = _counting_runner(pool)
    runner(ids, meta)  # on CPU: one call to prepare its bucket, one to answer
    buckets = runner.reachable_buckets(64, PAGE)
    assert runner.last_warm is None
    n = runner.warm(buckets + buckets[:2])  # repeats are prepared once
    s = runner.last_warm
    assert n == s.count == len(buckets) - 1 == len(calls) - 2
    assert s.total_s >= s.warmup_s + s.capture_s + s.collect_s - 1e-9 and s.capture_s == 0 == s.collect_s  # CPU
    assert s.line().startswith(f"{n} bucket(s) in ")
    assert runner.warm(buckets) == 0 and runner.last_warm.count == 0
