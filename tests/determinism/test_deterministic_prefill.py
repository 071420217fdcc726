"""Deterministic prefill on CPU: a request's logits and KV bytes, whatever else the batch, the cache or the chunking did.

The followed request ``TARGET`` (``det_model.py``) runs alone, then in five
batch compositions (other requests before and after it, with and without
cached prefixes of their own, and next to a copy of itself with a cached
prefix), chunked (a prefix pass then an extend pass, at three split
points, and four chunks through the radix cache), and behind a cached
prefix another request computed.  Every run gives the followed request the
same logits and the same KV bytes, bit for bit.  The mode makes that hold by
construction (docs/deterministic.md), so it holds at any thread count: these
tests run at the suite's count and pass at ``CPGRAPH_TEST_THREADS`` = 1, 2, 4.

Compiled (``aot_eager``, ``CPConfig(deterministic=True)``, compiled once for
the module): the extend pass over a cached prefix -- the graph with every
kind of op -- runs compiled, its prefix pass eagerly in the mode (one
compile instead of two; the graph without a cached prefix is compiled by the
CP test).  Checked: the pass's rewrite as op counts and a snapshot, the
numerics against the default (unrewritten) eager model to a tolerance, and
the followed request in two batch compositions equal to the eager run
alone, bit for bit.
"""

from __future__ import annotations

import copy

import expecttest
import pytest
import torch

import det_model as dm
from cpgraph.ops.invariant_mode import deterministic, deterministic_forward
from cpgraph.passes import CPConfig, compile
from cpgraph.passes.fx_utils import normalized_graph, op_counts
from cpgraph.passes.pipeline import default_passes
from cpgraph.runtime.engine import run_prefill

PAGE = dm.PAGE
TARGET, OTHERS = dm.prompts()
O0, O1, O2, O3 = OTHERS
# (prompts, cached prefix lengths, index of TARGET): five batches TARGET shares.
COMPOSITIONS = [
    ([O0, TARGET], [16, 0], 1),
    ([TARGET, O1, O2], [0, 0, 48], 0),
    ([O3, O0, TARGET, O1], [16, 32, 0, 0], 2),
    ([O2, TARGET, O3], [64, 0, 16], 1),
    ([TARGET, TARGET], [0, 16], 0),  # next to a copy of itself that has a cached prefix (compared too, below)
]
# Batches the compiled extend pass runs: two requests or more in both passes (a batch of one specializes).
COMPILED = [([O0, TARGET, O1], [16, 0, 16], 1), ([O3, O0, TARGET, O2], [16, 32, 0, 48], 2)]


@pytest.fixture(scope="module")
def model():
    return dm.build()


@pytest.fixture(scope="module")
def alone(model):
    """``(logits, records)`` of TARGET prefilled alone, eagerly, in deterministic mode: what every run must give."""
    with deterministic():
        res = run_prefill(dm.eager(model), model, [TARGET], page_size=PAGE)
    return res.logits[0].clone(), dm.request_records(model, res, 0, len(TARGET))


def _run(model, forward, prompts, prefix, i):
    res = run_prefill(forward, model, prompts, prefix_lens=prefix, page_size=PAGE)
    return res.logits[i], dm.request_records(model, res, i, len(prompts[i]))


def _assert_alone(alone, logits, records, what):
    assert torch.equal(logits, alone[0]), f"{what}: logits differ from the request alone"
    assert dm.same_records(records, alone[1]), f"{what}: KV bytes differ from the request alone"


def test_batch_compositions_change_no_bit(model, alone):
    with deterministic():
        for prompts, prefix, i in COMPOSITIONS:
            logits, records = _run(model, dm.eager(model), prompts, prefix, i)
            _assert_alone(alone, logits, records, f"batch {prefix}")
        res = run_prefill(dm.eager(model), model, [TARGET, TARGET], prefix_lens=[0, 16], page_size=PAGE)
        _assert_alone(alone, res.logits[1], dm.request_records(model, res, 1, len(TARGET)), "the copy behind 16")


def test_chunked_prefill_changes_no_bit(model, alone):
    from cpgraph.runtime.cache_engine import CacheEngine

    with deterministic():
        for first in (16, 32, 48):  # two chunks: [0, first) in a prefix pass, the rest in the extend pass
            logits, records = _run(model, dm.eager(model), [TARGET], [first], 0)
            _assert_alone(alone, logits, records, f"chunked at {first}")
        seen = dm.SeenRecords(dm.eager(model), model)
        engine = CacheEngine(seen, model, num_pages=32, page_size=PAGE)
        for end in (16, 32, 48):  # four chunks through the radix cache, each over the pages cached before it
            engine.prefill([TARGET[:end]])
        res = engine.prefill([TARGET])
    assert res.hits[0]["device"] == 48
    _assert_alone(alone, res.logits[0], seen.records, "four chunks through the cache")


def test_a_prefix_another_request_cached_changes_no_bit(model, alone):
    from cpgraph.runtime.cache_engine import CacheEngine

    other = TARGET[:32] + OTHERS[2][:30]  # shares TARGET's first two pages, then diverges
    with deterministic():
        seen = dm.SeenRecords(dm.eager(model), model)
        engine = CacheEngine(seen, model, num_pages=32, page_size=PAGE)
        engine.prefill([other, OTHERS[0]])
        res = engine.prefill([TARGET])
    assert res.hits[0]["device"] == 32
    _assert_alone(alone, res.logits[0], seen.records, "behind a prefix cached by another request")


# ------------------------------------------------------------------ compiled
@pytest.fixture(scope="module")
def compiled_runs(model):
    """The model compiled once (deterministic, aot_eager), run on ``COMPILED``; the graph before and after the pass."""
    graphs = {"before": [], "after": []}

    def capture(when):
        def grab(gm, cfg):
            graphs[when].append(copy.deepcopy(gm))
            return gm

        return grab

    passes = []
    for name, fn in default_passes():
        if name == "use_invariant_kernels":
            passes.append(("capture_before", capture("before")))
        passes.append((name, fn))
        if name == "use_invariant_kernels":
            passes.append(("capture_after", capture("after")))
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(
            enable_autograd_cache=False):
        torch._dynamo.reset()
        fn = compile(model, CPConfig(deterministic=True), backend="aot_eager", dynamic=True, passes=passes)
        runs = []
        for batch in COMPILED:
            passes_left = iter([deterministic_forward(dm.eager(model)), fn])  # prefix pass eager, extend compiled

            def forward(ids, meta, mla, index, **kw):
                return next(passes_left)(ids, meta, mla, index, **kw)

            runs.append(_run(model, forward, *batch))
            assert next(passes_left, None) is None  # both passes ran
        torch._dynamo.reset()
    return runs, graphs, fn.cpgraph_passes


class TestCompiled(expecttest.TestCase):
    @pytest.fixture(autouse=True)
    def _inject(self, model, alone, compiled_runs):
        self.model, self.alone, (self.runs, self.graphs, self.manager) = model, alone, compiled_runs

    def test_compiled_equals_eager_alone_bit_for_bit(self):
        for (logits, records), (_, prefix, _) in zip(self.runs, COMPILED):
            _assert_alone(self.alone, logits, records, f"compiled batch {prefix}")

    def test_numerics_match_the_default_forward_to_rounding(self):
        default = run_prefill(dm.eager(self.model), self.model, [TARGET], page_size=PAGE).logits[0]
        torch.testing.assert_close(self.alone[0], default, rtol=0, atol=0.08)  # bf16 logits, other sum orders

    def test_pass_op_counts(self):
        before, after = self.graphs["before"][-1], self.graphs["after"][-1]  # extend pass, cached prefix
        delta = {k: op_counts(after.graph)[k] - op_counts(before.graph)[k]
                 for k in set(op_counts(before.graph)) | set(op_counts(after.graph))}
        delta = {k: v for k, v in sorted(delta.items()) if v}
        self.assertEqual(delta, {
            "aten.mm": -19, "cpgraph.invariant_mla_output": 2, "cpgraph.invariant_mla_query": 2,
            "cpgraph.invariant_mm": 19, "cpgraph.invariant_moe_experts": 1, "cpgraph.mla_output": -2,
            "cpgraph.mla_query": -2, "cpgraph.moe_experts": -1,
        })
        products = ("aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "cpgraph.moe_experts", "cpgraph.mla_query",
                    "cpgraph.mla_output")
        assert not any(op_counts(after.graph)[p] for p in products)
        # With deterministic off the pass leaves a graph as it is.
        from cpgraph.passes.invariant_kernels import use_invariant_kernels

        same = use_invariant_kernels(copy.deepcopy(before), CPConfig())
        self.assertEqual(op_counts(same.graph), op_counts(before.graph))

    def test_pass_snapshot(self):
        keep = ("cpgraph.invariant", "cpgraph.sparse_mla", "cpgraph.indexer_topk")
        self.assertExpectedInline(normalized_graph(self.graphs["after"][-1].graph, keep=keep), """\
v0 = cpgraph.invariant_rms_norm(_, [64], in6, 1e-05)
v1 = cpgraph.invariant_mm(v0, _)
v2 = cpgraph.invariant_rms_norm(v1, [48], in9, 1e-06)
v3 = cpgraph.invariant_mm(v2, _)
v4 = cpgraph.invariant_mla_query(_, _, _, _)
v5 = cpgraph.invariant_mm(v0, _)
v6 = cpgraph.invariant_rms_norm(_, [32], in12, 1e-06)
v7 = cpgraph.invariant_mm(v2, _)
v8 = cpgraph.invariant_mm(v0, _)
v9 = cpgraph.invariant_layer_norm(v8, [32], in24, in25, 1e-06)
v10 = cpgraph.invariant_mm(_, _)
v11 = cpgraph.indexer_topk(_, _, _, in31, in32, 16, 1073741824)
v12 = cpgraph.sparse_mla(v4, _, _, 0.176777, 32)
v13 = cpgraph.invariant_mla_output(v12[0], _)
v14 = cpgraph.invariant_mm(v13, _)
v15 = cpgraph.invariant_rms_norm(_, [64], in34, 1e-05)
v16 = cpgraph.invariant_mm(v15, _)
v17 = cpgraph.invariant_mm(v15, _)
v18 = cpgraph.invariant_mm(_, _)
v19 = cpgraph.invariant_rms_norm(_, [64], in38, 1e-05)
v20 = cpgraph.invariant_mm(v19, _)
v21 = cpgraph.invariant_rms_norm(v20, [48], in41, 1e-06)
v22 = cpgraph.invariant_mm(v21, _)
v23 = cpgraph.invariant_mla_query(_, _, _, _)
v24 = cpgraph.invariant_mm(v19, _)
v25 = cpgraph.invariant_rms_norm(_, [32], in44, 1e-06)
v26 = cpgraph.sparse_mla(v23, _, _, 0.176777, 32)
v27 = cpgraph.invariant_mla_output(v26[0], _)
v28 = cpgraph.invariant_mm(v27, _)
v29 = cpgraph.invariant_rms_norm(_, [64], in49, 1e-05)
v30 = cpgraph.invariant_mm(_, _)
v31 = cpgraph.invariant_moe_experts(_, _, _, in52, in53, _)
v32 = cpgraph.invariant_mm(_, _)
v33 = cpgraph.invariant_mm(_, _)
v34 = cpgraph.invariant_mm(_, _)
v35 = cpgraph.invariant_rms_norm(_, [64], in59, 1e-05)
v36 = cpgraph.invariant_mm(v35, _)""")
