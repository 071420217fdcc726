"""A pass without a cached prefix and a pass that reads cached pages run ONE dynamic graph.

Why: Dynamo specialises a dim of size 0 or 1 even under ``dynamic=True``.  A
pass without cached prefix rows (a cold prefill, the prefix pass of a run
with cached prefixes, a server's first request) had ``prefix_slots`` of size
0, so the next pass over cached pages recompiled the forward (guard
``tensor 'meta.prefix_slots' size mismatch at index 0. expected 0``): one
compile more per multi-pass run, a stall on the first cached request.
``build_batch`` now gives every rank at least ``MIN_PREFIX_ROWS`` prefix
rows, ``-1`` where there is nothing cached.

* the metadata: a cold batch has ``MIN_PREFIX_ROWS`` ``-1`` slots on every
  rank (cp = 1 and 2), a one-row prefix (page size 1) is padded too, and
  ``kv_source`` names exactly the rows it named before, re-expressed in the
  padded layout (never a pad row);
* the values: the eager forward on the padded metadata equals the forward on
  the unpadded one bit for bit (logits, top-k, the written cache), with the
  dense and the FP8 cache (the FP8 path gathers index-K bytes and scales);
* the compile count: prefix pass then extend pass, then a cold batch, is one
  graph on one device and on each of 2 gloo ranks (aot_eager: the count is
  Dynamo's guards, the same for every backend; ``tests/runtime/
  test_graph_runner.py`` compiles Inductor over the padded metadata).

The compiled model is the bundled tiny GLM-5 config cut to one layer (dense
MLP with its own indexer: every op that reads the prefix metadata), the
cheapest model that has the property.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cp_model import CP_TIMEOUT_S  # noqa: E402
from dist_utils import shared_pool  # noqa: E402

from cpgraph.models.batch import MIN_PREFIX_ROWS, build_batch  # noqa: E402
from cpgraph.plan import GatherLayout, materialize_descriptors, plan_prefill  # noqa: E402

PAGE = 16
# Two requests in both passes (B never 1: a dim of size 1 is specialised too), prefixes of 1 and 2 pages.
PROMPT_LENS = (41, 50)
PREFIX_LENS = [16, 32]
COLD_LENS = (23, 37)


def _tables(lens, page, cp, rank):
    """Page tables of a cold batch planned at ``cp``: this rank's page ids, ``-1`` for another rank's pages."""
    plan = plan_prefill([0] * len(lens), list(lens), cp_size=cp, page_size=page)
    tables, nxt = [], 0
    for i in range(len(lens)):
        t = []
        for owner in plan.page_owners(i):
            t.append(nxt if owner == rank else -1)
            nxt += owner == rank
        tables.append(t)
    return plan, tables


@pytest.mark.parametrize("cp", [1, 2])
def test_cold_batch_has_pad_prefix_rows_never_named(cp):
    lens = (21, 6, 40)
    for rank in range(cp):
        plan, tables = _tables(lens, PAGE, cp, rank)
        toks = [[1] * n for n in lens]
        _, meta = build_batch(plan, toks, tables, rank=rank, prefix_page_owners=[[] for _ in lens])
        desc = materialize_descriptors(plan, [[] for _ in lens], [[] for _ in lens], rank)
        assert desc.send_slots.shape == (0,)  # the descriptors themselves are unpadded
        assert meta.prefix_slots.tolist() == [-1] * MIN_PREFIX_ROWS
        # kv_source names the same rows as the unpadded descriptors, in the padded layout: rank r's
        # compute row j moves from r * M + j to r * (P + M) + P + j, and no entry lands on a pad row.
        M, P = plan.num_rows, MIN_PREFIX_ROWS
        old = desc.kv_source
        want = torch.where(old >= 0, (old // M) * (P + M) + P + old % M, old)
        assert torch.equal(meta.kv_source, want)
        assert torch.equal(meta.kv_source, desc.layout.repad(old, GatherLayout(cp, P, M)))
        offset = meta.kv_source[meta.kv_source >= 0] % (P + M)
        assert bool((offset >= P).all())


def test_one_row_prefix_is_padded_and_longer_ones_are_not():
    # Page size 1: a one-token prefix is one prefix row, a specialised size like 0.
    plan = plan_prefill([1], [5], cp_size=1, page_size=1)
    _, meta = build_batch(plan, [[1] * 5], [[7, 0, 1, 2, 3, 4]])
    assert meta.prefix_slots.tolist() == [7] + [-1] * (MIN_PREFIX_ROWS - 1)
    assert meta.kv_source.tolist() == [0] + list(range(MIN_PREFIX_ROWS, MIN_PREFIX_ROWS + 5))
    plan = plan_prefill([16], [5], cp_size=1, page_size=PAGE)
    _, meta = build_batch(plan, [[1] * 5], [[3, 0]])
    assert meta.prefix_slots.tolist() == list(range(48, 64))  # a real prefix: no pad
    assert meta.kv_source.tolist() == list(range(16 + 5)) + [-1] * 11  # page-tail slack of the last page


def _one_layer(name="tiny-glm5"):
    from cpgraph.models.config import DSAConfig, bundled_config_dict
    from cpgraph.models.loading import build_model, init_random

    d = dict(bundled_config_dict(name), num_hidden_layers=1)
    model = build_model(DSAConfig.from_hf_dict(d), torch.float32, "cpu")
    return init_random(model, seed=0, std=float(d.get("initializer_range", 0.02)))


@pytest.mark.parametrize("name,fmt", [("tiny-glm5", "bf16"), ("tiny-deepseek-v32-fp8", "fp8")])
def test_pad_rows_change_no_value(name, fmt):
    from cpgraph.models.prefill import make_layout
    from cpgraph.runtime.engine import pool_config, pool_tensors
    from cpgraph.runtime.kv_pool import KVPool

    model = _one_layer(name)
    model.kv_layout = make_layout(model, fmt, PAGE)
    lens = (21, 6, 40)
    plan = plan_prefill([0] * len(lens), list(lens), cp_size=1, page_size=PAGE)
    g = torch.Generator().manual_seed(3)
    toks = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    outs = []
    for padded in (True, False):
        pool = KVPool(pool_config(model, fmt, PAGE, int(plan.num_pages.sum())))
        tables = [pool.alloc_pages_with_owners([0] * int(n)) for n in plan.num_pages]
        ids, meta = build_batch(plan, toks, tables)
        if not padded:
            desc = materialize_descriptors(plan, [[] for _ in lens], [[] for _ in lens], 0)
            meta = replace(meta, prefix_slots=desc.send_slots, kv_source=desc.kv_source)
        assert meta.prefix_slots.shape[0] == (MIN_PREFIX_ROWS if padded else 0)
        mla, index = pool_tensors(pool, model)
        with torch.no_grad():
            out = model(ids, meta, mla, index, return_topk=True)
        outs.append((out, [p.clone() for p in mla + index]))
    (a, pa), (b, pb) = outs
    assert torch.equal(a.logits, b.logits)
    assert all(torch.equal(x, y) for x, y in zip(a.topk, b.topk))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))


def _passes(forward, model, cp_size=1, rank=0):
    """Prefix pass + extend pass (``run_prefill`` with cached prefixes), then a cold batch: the logits of both runs."""
    from cpgraph.runtime.engine import run_prefill

    g = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    warm = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    cold = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in COLD_LENS]
    kw = dict(page_size=PAGE, rank=rank, cp_size=cp_size)
    return (run_prefill(forward, model, warm, prefix_lens=PREFIX_LENS, **kw).logits,
            run_prefill(forward, model, cold, **kw).logits)


def _compile_and_count(model, cp=None):
    from torch._dynamo.utils import counters

    from cpgraph.passes import compile

    fn = compile(model, cp, backend="aot_eager", dynamic=True)
    before = counters["stats"]["unique_graphs"]
    return fn, lambda: counters["stats"]["unique_graphs"] - before


@pytest.mark.slow
def test_prefix_pass_extend_pass_and_cold_batch_compile_one_graph():
    model = _one_layer()
    fn, graphs = _compile_and_count(model)
    got = _passes(fn, model)
    assert graphs() == 1  # was 2: the prefix pass (prefix_slots of size 0) had a graph of its own
    for a, b in zip(got, _passes(model, model)):
        assert torch.equal(a, b)


def job_cp_one_graph(ctx):
    from cp_model import use_numerics_compile_settings

    from cpgraph.passes import CPConfig

    use_numerics_compile_settings()
    model = _one_layer()
    fn, graphs = _compile_and_count(model, CPConfig(group=ctx.group_name, cp_size=ctx.world_size))
    warm, cold = _passes(fn, model, ctx.world_size, ctx.rank)
    out = {"graphs": graphs(), "warm": warm.numpy(), "cold": cold.numpy()}
    if ctx.rank == 0:
        out["ref"] = [t.numpy() for t in _passes(model, model)]
    return out


@pytest.mark.slow
def test_cp2_prefix_pass_extend_pass_and_cold_batch_compile_one_graph():
    results = shared_pool(2, CP_TIMEOUT_S).run(job_cp_one_graph)
    for r in results:
        assert r["graphs"] == 1, [x["graphs"] for x in results]  # was 2 on every rank
        assert np.array_equal(r["warm"], results[0]["warm"]) and np.array_equal(r["cold"], results[0]["cold"])
    for got, ref in zip((results[0]["warm"], results[0]["cold"]), results[0]["ref"]):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
