"""The CP pass pipeline on a real model graph: snapshots, op counts per pass, IndexCache, recompiles.

The model is a 2-layer GLM-5-style tiny model: layer 0 dense MLP with a full
indexer, layer 1 MoE with a shared (IndexCache) indexer.  CP graphs are
compiled in this process against a fake process group (tracing and compiling
need no peers); numerics over real gloo ranks are in ``test_cp_numerics.py``.
FX/AOT caches are off so every compile really runs the passes.
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path
from types import SimpleNamespace

import expecttest
import pytest
import torch

from cpgraph.models import DSAConfig, build_model, init_random, tiny_model
from cpgraph.models.config import bundled_config_dict
from cpgraph.models.prefill import make_layout
from cpgraph.passes import CPConfig, compile
from cpgraph.passes.fx_utils import normalized_graph, op_counts
from cpgraph.passes.pipeline import default_passes
from cpgraph.runtime.engine import run_prefill

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import fake_group  # noqa: E402

PAGE = 16
PROMPTS = [list(range(3, 40)), list(range(7, 12)), list(range(100, 133))]
PREFIX = [16, 0, 32]


@pytest.fixture(autouse=True)
def _no_caches():
    # torch's config modules patch themselves; pytest's monkeypatch would delete (hide) the
    # option on undo, since it is served by the module's __getattr__.
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        yield
        torch._dynamo.reset()


def two_layer_model():
    d = dict(bundled_config_dict("tiny-glm5"), num_hidden_layers=2)
    model = init_random(build_model(DSAConfig.from_hf_dict(d)), seed=0, std=0.1).eval()
    cfg = model.config
    assert cfg.mlp_layer_types == ("dense", "sparse") and cfg.indexer_types == ("full", "shared")
    model.kv_layout = make_layout(model, "bf16", PAGE)
    return model


def _compile_captured(model, cfg: CPConfig, dynamic=None):
    """``(forward, graphs)``: ``model`` compiled with the default pipeline + a pass capturing each graph."""
    graphs = []

    def capture(gm, c):
        graphs.append(copy.deepcopy(gm.graph))
        return gm

    compiled = compile(model, cfg, backend="aot_eager", dynamic=dynamic, passes=default_passes() + [("capture", capture)])
    return compiled, graphs


def run_compiled(model, cfg: CPConfig, rank: int = 0, prompts=PROMPTS, prefix=PREFIX, *, dynamic=None,
                 extend_pass_only=False):
    """Compile with the default pipeline + a capture pass; run one batch (prefix + extend pass).

    ``extend_pass_only``: the prefix pass is not run (its forward returns ``None``, which
    ``run_prefill`` does not read), so only the extend pass compiles: for graph tests against a fake
    group, whose collectives move no data anyway.
    """
    compiled, graphs = _compile_captured(model, cfg, dynamic)
    skip = [extend_pass_only and any(prefix)]

    def forward(ids, meta, mla, index, **kw):
        if skip[0]:
            skip[0] = False
            return None
        return compiled(ids, meta, mla, index, **kw)

    res = run_prefill(forward, model, prompts, prefix_lens=prefix, page_size=PAGE, rank=rank, cp_size=cfg.cp_size)
    return res, graphs, compiled.cpgraph_passes


# The recompile test's batches, (prompt lengths, cached prefix lengths), after PROMPTS: warm-up (prefix and
# no-prefix passes, one and several requests), then other lengths and compositions that must reuse those graphs.
WARM_UP = [([40, 9], [16, 0]), ([23], [0]), ([70, 5, 33], [32, 0, 16])]
NO_RECOMPILE = [([50, 19], [32, 0]), ([12, 90, 7, 64], [0, 64, 0, 48]), ([131, 3], [112, 0])]


def _batch(forward, model, lens, prefix, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]
    return run_prefill(forward, model, prompts, prefix_lens=prefix, page_size=PAGE).logits


@functools.lru_cache(maxsize=None)
def _single_device_run():
    """The two-layer model compiled for one device (``dynamic=True``) once, for three tests.

    It runs PROMPTS (the last graph and the pass history the snapshot test inspects, the logits
    compared with eager), then the recompile test's batches: ``WARM_UP``, and ``NO_RECOMPILE`` under
    ``fail_on_recompile``, whose error (if any) that test raises.  Tests copy ``history`` before trimming it.
    """
    model = two_layer_model()  # both layer kinds (dense + indexer, MoE + IndexCache): every dynamic size
    compiled, graphs = _compile_captured(model, CPConfig(), dynamic=True)

    def forward(ids, meta, mla, index, **kw):
        return compiled(ids, meta, mla, index, **kw)

    res = run_prefill(forward, model, PROMPTS, prefix_lens=PREFIX, page_size=PAGE)
    run = SimpleNamespace(model=model, res=res, graph=graphs[-1], history=list(compiled.cpgraph_passes.history),
                          outputs=[], recompile_error=None)
    for k, (lens, prefix) in enumerate(WARM_UP):
        _batch(forward, model, lens, prefix, k)
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            for k, (lens, prefix) in enumerate(NO_RECOMPILE):
                run.outputs.append(_batch(forward, model, lens, prefix, 10 + k))
    except Exception as exc:  # raised by test_no_recompiles_across_lengths_and_batch_compositions
        run.recompile_error = exc
    return run


def pass_delta(manager, name):
    for n, before, after in manager.history:
        if n == name:
            keys = set(before) | set(after)
            return {k: after[k] - before[k] for k in sorted(keys) if after[k] != before[k]}
    raise KeyError(name)


class TestCPPipeline(expecttest.TestCase):
    def test_cp2_graph_snapshot_and_counts(self):
        model = two_layer_model()
        with fake_group(world_size=2, rank=0) as gn:
            _, graphs, manager = run_compiled(model, CPConfig(group=gn, cp_size=2), dynamic=True, extend_pass_only=True)
        final = graphs[-1]  # the extend pass (with a cached prefix)
        keep = ("cpgraph.", "_c10d_functional.")
        self.assertExpectedInline(
            normalized_graph(final, keep=keep),
            """\
v0 = cpgraph.mla_query(_, _, _, _)
v1 = cpgraph.kv_layer_ready(layer=0)
v2 = cpgraph.mla_dense_pack(_, _)
v3 = cpgraph.paged_store(rows=v2, slots=_)
v4 = cpgraph.paged_gather(v3[1], in19)
v5 = cpgraph.paged_store(rows=_, slots=_)
v6 = cpgraph.paged_gather(v5[1], in19)
v7 = _c10d_functional.all_gather_into_tensor(_, 2, '0')
v8 = _c10d_functional.wait_tensor(v7)
v9 = cpgraph.take_rows(_, in21)
v10 = cpgraph.take_rows(_, in21)
v11 = cpgraph.indexer_topk(_, _, _, in31, in32, 16, 1073741824)
v12 = cpgraph.kv_layer_written(layer=0)
v13 = cpgraph.sparse_mla(v0, _, v11, 0.176777, 32)
v14 = cpgraph.mla_output(v13[0], _)
v15 = cpgraph.mla_query(_, _, _, _)
v16 = cpgraph.kv_layer_ready(layer=1)
v17 = cpgraph.mla_dense_pack(_, _)
v18 = cpgraph.paged_store(rows=v17, slots=_)
v19 = cpgraph.paged_gather(v18[1], in19)
v20 = _c10d_functional.all_gather_into_tensor(_, 2, '0')
v21 = _c10d_functional.wait_tensor(v20)
v22 = cpgraph.take_rows(_, in21)
v23 = cpgraph.kv_layer_written(layer=1)
v24 = cpgraph.sparse_mla(v15, _, v11, 0.176777, 32)
v25 = cpgraph.mla_output(v24[0], _)
v26 = cpgraph.compact_valid_static(_, _)
v27 = cpgraph.moe_route(_, in51, 1, 1, 2, True, 2.5)
v28 = cpgraph.moe_experts(v26[0], v27[0], v27[1], in52, in53, _)
v29 = cpgraph.restore_compute_static(_, _)
v30 = _c10d_functional.all_gather_into_tensor(_, 2, '0')
v31 = _c10d_functional.wait_tensor(v30)""",
        )
        # Counts per pass (the last compile, i.e. the extend-pass graph).  Every rewrite
        # pass must have matched something: an empty delta fails here.
        n = len(manager.history) // len(default_passes() + [("capture", None)])
        hist = manager.history[-len(default_passes()) - 1 :]
        manager.history = hist
        self.assertEqual(
            pass_delta(manager, "materialize_kv_by_owner"),
            {"aten.gt": 1, "aten.where": 1, "cpgraph.cp_materialize_kv": 2, "cpgraph.kv_compose": -3},
        )
        self.assertEqual(
            pass_delta(manager, "compact_moe_rows"),
            {"aten.le": 1, "cpgraph.compact_valid_static": 1, "cpgraph.restore_compute_static": 1,
             "prims.convert_element_type": 1},
        )
        self.assertEqual(pass_delta(manager, "gather_output_rows"), {"cpgraph.cp_last_tokens": 1, "cpgraph.take_rows": -1})
        lowered = pass_delta(manager, "lower_cp_collectives")
        self.assertEqual(lowered["cpgraph.cp_materialize_kv"], -2)
        self.assertEqual(lowered["cpgraph.cp_last_tokens"], -1)
        self.assertEqual(lowered["_c10d_functional.all_gather_into_tensor"], 3)  # one per layer + the logits rows
        self.assertEqual(lowered["_c10d_functional.wait_tensor"], 3)
        counts = op_counts(final)
        self.assertEqual(counts["cpgraph.paged_store"], 3)  # MLA x2 + index x1: stores stay, guarded
        self.assertEqual(counts["cpgraph.indexer_topk"], 1)  # the shared layer has no indexer
        self.assertEqual(sum(v for k, v in counts.items() if k.startswith("cpgraph.cp_")), 0)
        self.assertGreater(n, 0)

    def test_single_device_pipeline_only_guards_and_compacts(self):
        run = _single_device_run()
        manager = SimpleNamespace(history=run.history[-len(default_passes()) - 1 :])
        self.assertEqual(pass_delta(manager, "gather_output_rows"), {})
        self.assertEqual(pass_delta(manager, "materialize_kv_by_owner"), {"aten.gt": 1, "aten.where": 1})
        self.assertEqual(pass_delta(manager, "compact_moe_rows")["cpgraph.compact_valid_static"], 1)
        self.assertExpectedInline(
            normalized_graph(run.graph, keep=("cpgraph.",)),
            """\
v0 = cpgraph.mla_query(_, _, _, _)
v1 = cpgraph.kv_layer_ready(layer=0)
v2 = cpgraph.mla_dense_pack(_, _)
v3 = cpgraph.paged_store(rows=v2, slots=_)
v4 = cpgraph.paged_store(rows=_, slots=_)
v5 = cpgraph.paged_gather(v4[1], in19)
v6 = cpgraph.kv_compose([v5], [cat_1], in21)
v7 = cpgraph.indexer_topk(_, v6[0], _, in31, in32, 16, 1073741824)
v8 = cpgraph.kv_layer_written(layer=0)
v9 = cpgraph.sparse_mla(v0, v8[1], _, 0.176777, 32)
v10 = cpgraph.mla_output(v9[0], _)
v11 = cpgraph.mla_query(_, _, _, _)
v12 = cpgraph.kv_layer_ready(layer=1)
v13 = cpgraph.mla_dense_pack(_, _)
v14 = cpgraph.paged_store(rows=v13, slots=_)
v15 = cpgraph.kv_layer_written(layer=1)
v16 = cpgraph.sparse_mla(v11, v15[1], _, 0.176777, 32)
v17 = cpgraph.mla_output(v16[0], _)
v18 = cpgraph.compact_valid_static(_, _)
v19 = cpgraph.moe_route(_, in51, 1, 1, 2, True, 2.5)
v20 = cpgraph.moe_experts(v18[0], v19[0], v19[1], in52, in53, _)
v21 = cpgraph.restore_compute_static(_, _)
v22 = cpgraph.take_rows(_, in58)""",
        )


def test_compiled_single_device_equals_eager():
    run = _single_device_run()
    ref = run_prefill(lambda *a, **k: run.model(*a, **k), run.model, PROMPTS, prefix_lens=PREFIX, page_size=PAGE)
    assert torch.equal(run.res.logits, ref.logits)


def test_index_cache_pass_removes_shared_indexers():
    """DeepSeek-V3.2 (an indexer on every layer) compiled with IndexCache 'FSS'."""
    model = tiny_model("tiny-deepseek-v32")
    model.kv_layout = make_layout(model, "bf16", PAGE)
    n = model.config.num_hidden_layers
    assert model.config.indexer_types == ("full",) * n and n == 3
    res, graphs, manager = run_compiled(model, CPConfig(index_topk_pattern="FSS"))
    manager.history = manager.history[-len(default_passes()) - 1 :]
    delta = pass_delta(manager, "reuse_shared_topk")
    assert delta["cpgraph.indexer_topk"] == -2
    assert delta["cpgraph.paged_store"] == -2  # the shared layers' index-K stores are gone
    assert delta["cpgraph.kv_compose"] == -2
    # Reference: the same weights with layers 1 and 2 reusing layer 0's top-k (what GLM-5 does natively).
    shared = copy.deepcopy(model)
    for i in (1, 2):
        shared.model.layers[i].self_attn.indexer = None
    ref = run_prefill(lambda *a, **k: shared(*a, **k), shared, PROMPTS, prefix_lens=PREFIX, page_size=PAGE)
    assert torch.equal(res.logits, ref.logits)
    full = run_prefill(lambda *a, **k: model(*a, **k), model, PROMPTS, prefix_lens=PREFIX, page_size=PAGE)
    assert not torch.equal(res.logits, full.logits)  # the pattern really changed what layers 1 and 2 attend to


def test_index_cache_pattern_must_fit_the_model():
    model = two_layer_model()  # layer 1 already shares: "FF" asks for an indexer it does not have
    with pytest.raises(Exception, match="layer 1 is 'F'"):
        run_compiled(model, CPConfig(index_topk_pattern="FF"))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="index_topk_pattern has 3 layers"):
        run_compiled(model, CPConfig(index_topk_pattern="FSF"))


def test_moe_pass_fails_when_regions_unexpected():
    model = two_layer_model()
    with pytest.raises(Exception, match="expected one computed input"):
        run_compiled(model, CPConfig(moe_modules=("DecoderLayer",)))


def test_no_recompiles_across_lengths_and_batch_compositions():
    """After warm-up (prefix and no-prefix passes, one and several requests), other lengths and batch
    compositions reuse the graphs: ``fail_on_recompile`` raises otherwise (the shared run, ``_single_device_run``)."""
    run = _single_device_run()
    if run.recompile_error is not None:
        raise run.recompile_error
    assert [out.shape for out in run.outputs] == [(len(lens), 512) for lens, _ in NO_RECOMPILE]
