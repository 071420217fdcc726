"""Cache-hit CP prefill on gloo (2 and 4 ranks): prefill, evict to L2, load back, extend == single device.

Each rank compiles the model once with the CP passes (aot_eager; the model and
its compile are ``tests/cp_model.py``'s, shared with ``test_cp_numerics`` when
both run on the same ranks) and drives a :class:`CacheEngine` through: a cold
bs>1 batch whose requests share an uncached prefix, the same batch again (L1
hits), an eviction of everything to L2, the batch again (owner-preserving
load-back), and a batch of longer prompts that extend cached ones and share
cached prefix pages.  Rank 0 runs the single-device eager reference (cold, no
cache).  After every step the tree fingerprints are compared across ranks (one
collective) and every L1 node is checked to hold pages exactly where this rank
is the saved owner.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cp_model import CP_TIMEOUT_S, PAGE  # noqa: E402
from dist_utils import close_shared_pools, shared_pool  # noqa: E402

pytestmark = pytest.mark.slow


def _prompts():
    g = torch.Generator().manual_seed(7)

    def r(n):
        return torch.randint(0, 512, (n,), generator=g).tolist()

    shared, a, b, c = r(40), r(30), r(9), r(56)
    first = [shared + a, shared + b, c, shared[:32]]
    # Extends of cached prompts; two requests share the cached prefix pages of ``shared``.
    second = [shared + a + r(25), shared + r(20), c + r(13), shared + b + r(3)]
    return first, second


def _owner_check(engine, rank):
    for node in engine.tree.nodes():
        if node.device_pages is not None:
            assert np.array_equal(node.device_pages >= 0, node.page_owners == rank), f"rank {rank}: {node}"


def job_cache(ctx, layout, graphs=False):
    """``graphs``: the forward is a CP ``graphed_forward`` (row buckets; no capture on CPU), so every pass is
    planned in a row bucket and padded to its KV buckets."""
    from cp_model import compiled_cp, eager_forward, model_pair

    from cpgraph.runtime.cache_engine import CacheEngine
    from cpgraph.runtime.engine import run_prefill
    from cpgraph.runtime.graph_runner import graphed_forward
    from cpgraph.runtime.radix import check_consistent

    _, model = model_pair()
    forward = compiled_cp(ctx, "aot_eager")
    if graphs:
        forward = graphed_forward(forward, max_requests=4, cp_size=ctx.world_size, page_size=PAGE)
    eng = CacheEngine(forward, model, num_pages=24, page_size=PAGE, rank=ctx.rank,
                      cp_size=ctx.world_size, host_pages=24, host_layout=layout, write_policy="write_back")
    first, second = _prompts()
    out = {}

    import time

    def step(name, prompts):
        t0 = time.perf_counter()
        res = eng.prefill(prompts)
        out.setdefault("times", {})[name] = round(time.perf_counter() - t0, 2)
        check_consistent(eng.tree, force=True)
        _owner_check(eng, ctx.rank)
        out[name] = {"logits": res.logits.numpy().copy(), "hits": res.hits}

    step("cold", first)
    step("device", first)
    out["evicted"] = eng.evict_device()
    check_consistent(eng.tree, force=True)
    out["used_after_evict"] = eng.device.ledger.used.tolist()
    step("host", first)
    step("extend", second)
    out["stats"] = dict(eng.hicache.stats)
    out["owned_in_tree"] = sum(int((n.device_pages >= 0).sum()) for n in eng.tree.nodes() if n.on_device)
    out["lane_used"] = int(eng.device.ledger.used[ctx.rank])
    if graphs:
        (runner,) = forward.runners.values()
        out["bucket_rows"] = sorted({b.rows for b in runner.stats})
        out["bucket_calls"] = sum(st.replays for st in runner.stats.values())
    if ctx.rank == 0:
        eager = eager_forward()
        out["ref_first"] = run_prefill(eager, model, first, page_size=PAGE).logits.numpy()
        out["ref_second"] = run_prefill(eager, model, second, page_size=PAGE).logits.numpy()
    return out


def teardown_module(module):
    # The last module of the suite on the CP ranks: free their memory for the rest of the run.
    close_shared_pools(CP_TIMEOUT_S)


@pytest.mark.parametrize("world,layout,graphs", [(2, "layer_page_first", False), (4, "page_first", False),
                                                 (2, "page_first", True)])
def test_cache_hit_cp_equals_single_device(world, layout, graphs):
    results = shared_pool(world, CP_TIMEOUT_S).run(job_cache, layout, graphs)
    r0 = results[0]
    for r in results[1:]:  # every rank returns the same logits and the same hit accounting
        for name in ("cold", "device", "host", "extend"):
            assert np.array_equal(r[name]["logits"], r0[name]["logits"]) and r[name]["hits"] == r0[name]["hits"]
    assert [h["device"] for h in r0["device"]["hits"]] == [64, 48, 48, 16]
    assert r0["evicted"] == 8 and r0["used_after_evict"] == [0] * world
    assert r0["host"]["hits"][0]["host"] == 64 and r0["stats"]["load_misses"] == 0
    assert [h["device"] + h["host"] for h in r0["extend"]["hits"]] == [64, 32, 48, 48]
    cold = r0["cold"]["logits"]
    for name in ("device", "host"):  # warm-cache passes equal the cold pass
        np.testing.assert_allclose(r0[name]["logits"], cold, rtol=0, atol=1e-5)
    np.testing.assert_allclose(cold, r0["ref_first"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(r0["extend"]["logits"], r0["ref_second"], rtol=0, atol=1e-5)
    for r in results:  # no leaked pages: a rank's lane holds exactly the owned pages the tree references
        assert r["lane_used"] == r["owned_in_tree"]
    if graphs:  # every pass went through the runner, in row buckets (16, 24, 32, ...: never the raw rows)
        from cpgraph.runtime.graph_runner import DEFAULT_ROW_BUCKETS

        assert r0["bucket_calls"] >= 4 and set(r0["bucket_rows"]) <= set(DEFAULT_ROW_BUCKETS), r0
    bitwise = {n: bool(np.array_equal(r0[n]["logits"], cold)) for n in ("device", "host")}
    print(f"\ncp={world} {layout}: step seconds {r0['times']}; warm passes bit-identical to cold: {bitwise}; stats {r0['stats']}")


def job_hole_on_one_rank(ctx, root):
    from cp_model import compiled_cp, model_pair
    from l3_rig import FailingGets, counting

    from cpgraph.runtime.cache_engine import CacheEngine
    from cpgraph.runtime.l3 import L3Config
    from cpgraph.runtime.storage.file_store import FileStore

    _, model = model_pair()
    first, _ = _prompts()  # job_cache's batch: the compiled graphs of its passes are reused
    kw = dict(num_pages=24, page_size=PAGE, rank=ctx.rank, cp_size=ctx.world_size, host_pages=24)
    from torch._dynamo.utils import counters

    fwd = compiled_cp(ctx, "aot_eager")
    graphs = counters["stats"]["unique_graphs"]
    cold_eng = CacheEngine(fwd, model, l3=f"file:{root}", **kw)
    cold = cold_eng.prefill(first)
    cold_eng.close()
    rows = []
    # Request 0's run is pages 0-3 with owners [0, 0, 1, 1]: rank 1 reads pages 2-3 first and loses page 2.
    store = FailingGets(FileStore(root), {0: {0}} if ctx.rank == 1 else {})
    eng = CacheEngine(counting(fwd, rows), model, l3=L3Config(store), **kw)
    warm = eng.prefill(first)
    _owner_check(eng, ctx.rank)
    return {"cold": cold.logits.numpy(), "warm": warm.logits.numpy(), "hits": warm.hits, "calls": store.calls,
            "passes": len(rows), "new_graphs": counters["stats"]["unique_graphs"] - graphs, "stats": dict(eng.l3.stats), "lane_used": int(eng.device.ledger.used[ctx.rank]),
            "owned_in_tree": sum(int((n.device_pages >= 0).sum()) for n in eng.tree.nodes() if n.on_device)}


def test_cp2_a_page_one_rank_fails_to_read_is_a_hole_on_both(tmp_path):
    """An L3 page that only rank 1 fails to read is a hole on both ranks (the arrival bits are all-reduced MIN),
    so both run the same hole pass and their collectives line up."""
    results = shared_pool(2, CP_TIMEOUT_S).run(job_hole_on_one_rank, str(tmp_path / "l3"))
    r0, r1 = results
    assert r1["calls"][0] == 2  # rank 1 read only its own pages of request 0's run
    for r in results:  # both ranks: page 2 recomputed in a pass of its own, page 3 restored after it
        assert r["hits"][0] == {"device": 0, "host": 0, "l3": 48, "computed": 16 + 6}
        assert r["stats"]["fetch_failed_pages"] == 1 and r["passes"] == 2
        assert r["lane_used"] == r["owned_in_tree"]  # nothing leaked
        assert r["hits"] == r0["hits"]
    assert np.array_equal(r0["warm"], r1["warm"])
    np.testing.assert_allclose(r0["warm"], r0["cold"], rtol=0, atol=1e-5)
    print(f"\nhits {r0['hits']}; L3 {r0['stats']}; graphs compiled by the job: {r0['new_graphs']}")
