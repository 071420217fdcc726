"""transformers' own DSA models under ``cpgraph.compile``, adapted by module swap only.

``cpgraph.adapters.transformers.adapt`` swaps the attention, indexer and MoE
modules of transformers 5.24's ``DeepseekV32ForCausalLM`` and
``GlmMoeDsaForCausalLM`` for thin modules over cpgraph ops; everything else
is transformers' code and the parameters are transformers' objects.  Each
model (DeepSeek-V3.2: one MoE layer with its indexer; GLM-5: a dense layer,
then a MoE layer reusing its top-k) is compiled once per process with the CP
passes (``aot_eager``: the rewritten graph's ops run eagerly; static shapes,
one batch per process) and prefills one batch with page-tail slack, a
one-token request and compute padding (every request has fewer pages than
the 4 chunks of cp = 2; rank 1 computes 7 padding rows).  It must equal
transformers' forward with the indexer's top-k under cpgraph's tie rule
(docs/contracts.md) to 1e-5 on one device and on 2 gloo ranks, and the CP
runs the single-device compiled run to fp32 rounding (a rank's GEMMs have
fewer rows, docs/bitwise.md).  The CP graph (rank 0 of 2) and the op counts
of every pass are snapshots.

One CP size: the adapter's part is the module swap and the passes matching
transformers' graph, which do not depend on the CP size (the CP size is an
argument of the same ops and passes).  What more ranks add -- ranks with
fewer pages than ranks, a rank that owns no page -- is the CP ops' and
passes' behaviour, proven on cpgraph's own model at 4 ranks
(``tests/passes/test_cp_numerics.py``); every rank of a CP size compiles
both models here, so 4 more ranks cost CI twice what 2 do.

The batch has no cached prefix: a prefix needs a second compiled graph per
rank and model (these compiles have static shapes, and an extend pass's
differ from its prefix pass's), and the owner-sharded prefix reads are the
same ops with the same arguments as in cpgraph's own model, whose CP tests
cover them (tests/passes/test_cp_numerics.py).  The CP graphs still gather
prefix rows (``paged_gather(_, in13)``): ``build_batch`` gives every batch at
least ``MIN_PREFIX_ROWS`` of them, ``-1`` (zero rows) when nothing is cached.
"""

from __future__ import annotations

import copy
import functools
import sys
import time
from collections import Counter
from pathlib import Path

import expecttest
import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "models"))
from cp_model import CP_TIMEOUT_S  # noqa: E402
from dist_utils import shared_pool  # noqa: E402

PAGE = 16
LENS = [40, 1, 17, 33]
PASSES_SHOWN = ("materialize_kv_by_owner", "read_kv_in_place", "compact_moe_rows", "gather_output_rows",
                "lower_cp_collectives")


def _config(model_type: str) -> dict:
    from hf_oracle import config_variants

    if model_type == "deepseek_v32":  # one MoE layer with its own indexer (half-split indexer RoPE, yarn)
        return dict(config_variants()["ds-a"], num_hidden_layers=1, first_k_dense_replace=0)
    # A dense layer with an indexer, then a MoE layer reusing its top-k (IndexCache; interleaved indexer RoPE).
    return dict(config_variants()["glm-a"], num_hidden_layers=2)


def transformers_model(model_type: str):
    """transformers' own model with its own seeded initialisation (identical in every process)."""
    from hf_oracle import _HF, hf_config

    _, cls = _HF[model_type]
    torch.manual_seed(0)
    return cls(hf_config(_config(model_type))).eval()


def batch_prompts(model_type: str) -> list[list[int]]:
    from hf_oracle import prompts

    return prompts(_config(model_type)["vocab_size"], LENS, seed=5)


def _compiled(model_type: str, group: str | None, cp_size: int):
    """``(adapted model, compiled forward, captured post-pass graphs)``: a fresh model and compile per call."""
    from cpgraph.adapters.transformers import MOE_MODULES, adapt
    from cpgraph.passes import CPConfig, compile
    from cpgraph.passes.pipeline import default_passes

    graphs = []

    def capture(gm, cfg):
        graphs.append(copy.deepcopy(gm.graph))
        return gm

    lm = adapt(transformers_model(model_type))
    cfg = CPConfig(group=group, cp_size=cp_size, moe_modules=MOE_MODULES)
    # Static shapes: each process runs one batch, and a static trace of transformers' code takes about half
    # the time of a dynamic one (the passes are the same; dynamic=True was checked by hand, docs/model_contract.md).
    fn = compile(lm, cfg, backend="aot_eager", dynamic=False, passes=default_passes() + [("capture", capture)])
    return lm, fn, graphs


def _pass_deltas(manager) -> str:
    """One line per pass shown: the ops it added (+) and removed (-) in the last graph it compiled."""
    last = {name: (before, after) for name, before, after in manager.history}
    lines = []
    for name in PASSES_SHOWN:
        before, after = last[name]
        delta = {k: after[k] - before[k] for k in sorted(set(before) | set(after)) if after[k] != before[k]}
        if name == "lower_cp_collectives":  # its placement arithmetic is the ops' business (docs/ops/collectives.md)
            delta = {k: v for k, v in delta.items() if k.startswith(("cpgraph.", "_c10d_functional."))}
        lines.append(f"{name}: " + (", ".join(f"{k} {v:+d}" for k, v in delta.items()) or "no change"))
    return "\n".join(lines)


def _cpgraph_ops(counts: Counter) -> dict:
    return {k: v for k, v in sorted(counts.items()) if k.startswith(("cpgraph.", "_c10d_functional."))}


def _run(model_type: str, group: str | None, rank: int, cp_size: int) -> dict:
    from cpgraph.passes.fx_utils import normalized_graph, op_counts
    from cpgraph.passes.pipeline import default_passes
    from cpgraph.runtime.engine import run_prefill

    lm, fn, graphs = _compiled(model_type, group, cp_size)
    res = run_prefill(fn, lm, batch_prompts(model_type), page_size=PAGE, rank=rank, cp_size=cp_size)
    history = fn.cpgraph_passes.history
    first_pass = len(history) - len(default_passes()) - 1  # the last graph compiled: its first pass
    return {
        "logits": res.logits.numpy().copy(),
        "graph": normalized_graph(graphs[-1], keep=("cpgraph.", "_c10d_functional.")),
        "deltas": _pass_deltas(fn.cpgraph_passes),
        "before": _cpgraph_ops(history[first_pass][1]),
        "after": _cpgraph_ops(op_counts(graphs[-1])),
        "indexer_layers": lm.config.indexer_layers,
        "pages": res.pages_owned,
        "total_pages": res.total_pages,
    }


def job_cp(ctx, model_types):
    """This rank's CP prefill of the batch, per model."""
    from cp_model import use_numerics_compile_settings

    use_numerics_compile_settings()
    t = time.process_time()
    out = {m: _run(m, ctx.group_name, ctx.rank, ctx.world_size) for m in model_types}
    out["cpu_s"] = time.process_time() - t
    return out


MODELS = ("deepseek_v32", "glm_moe_dsa")


@functools.lru_cache(maxsize=None)
def references(model_type: str) -> dict:
    """transformers (tie rule), the adapted model run eagerly, and the single-device compiled run."""
    from hf_oracle import TopkCapture

    from cpgraph.adapters.transformers import adapt
    from cpgraph.runtime.engine import run_prefill

    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        hf = transformers_model(model_type)
        hf_logits = np.stack([TopkCapture(hf, tie_rule=True).run(p)[0].numpy() for p in batch_prompts(model_type)])
        single = _run(model_type, None, 0, 1)
        lm = adapt(transformers_model(model_type))
        eager = run_prefill(lm, lm, batch_prompts(model_type), page_size=PAGE).logits.numpy()
    return {"hf": hf_logits, "eager": eager, **single}


_CP_RESULTS: dict = {}


def cp_results(world: int) -> list[dict]:
    """Every rank's results at CP size ``world`` (the references compute in this process meanwhile)."""
    if world not in _CP_RESULTS:
        pending = shared_pool(world, CP_TIMEOUT_S).submit(job_cp, MODELS)
        for m in MODELS:
            references(m)
        _CP_RESULTS[world] = pending.result()
    return _CP_RESULTS[world]


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def test_adapt_swaps_modules_and_keeps_the_parameters():
    from cpgraph.adapters.transformers import SparseMLAttention, adapt

    for model_type in MODELS:
        hf = transformers_model(model_type)
        named = list(hf.named_parameters())
        lm = adapt(hf)
        assert lm.hf is hf
        # The same Parameter objects under the same names: nothing copied, nothing renamed.
        assert [(n, id(p)) for n, p in lm.hf.named_parameters()] == [(n, id(p)) for n, p in named]
        assert all(type(layer.self_attn) is SparseMLAttention for layer in hf.model.layers)
        mlps = [type(layer.mlp).__name__ for layer in hf.model.layers]
        assert mlps == (["RoutedMoE"] if model_type == "deepseek_v32" else ["GlmMoeDsaMLP", "RoutedMoE"])
        assert lm.config.indexer_layers == (0,)  # GLM-5's layer 1 reuses layer 0's top-k
        with pytest.raises(ValueError, match="adapted already"):
            adapt(hf)


def test_doc_example_names_what_exists():
    """The example in docs/model_contract.md parses, and everything it imports from cpgraph exists."""
    import ast
    import importlib
    import re

    doc = (HERE.parents[1] / "docs" / "model_contract.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert 30 <= len(example.splitlines()) <= 50
    for node in ast.walk(ast.parse(example)):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("cpgraph"):
            module = importlib.import_module(node.module)
            assert all(hasattr(module, a.name) for a in node.names), node.module


@pytest.mark.slow
def test_cp_equals_single_device_and_transformers():
    world = 2
    results = cp_results(world)
    print(f"\ncp={world}: CPU seconds per rank (both models: build, compile, prefill): "
          f"{[round(r['cpu_s'], 1) for r in results]}")
    for model_type in MODELS:
        ref = references(model_type)
        per_rank = [r[model_type] for r in results]
        first = per_rank[0]["logits"]
        for r in per_rank[1:]:
            assert np.array_equal(r["logits"], first), f"{model_type}: ranks disagree"
        assert _rel(first, ref["logits"]) <= 1e-6, f"{model_type} cp={world}: CP vs single-device compiled"
        assert _rel(first, ref["hf"]) <= 1e-5, f"{model_type} cp={world}: CP vs transformers (tie rule)"
        # Owner-sharded KV: the ranks' pages partition the batch's pages.
        assert sum(r["pages"] for r in per_rank) == per_rank[0]["total_pages"]
        # Every rank issues the same collectives in the same order (a rank that owns no page has an empty
        # pool, a graph specialized to that size, but the same communication).
        collectives = [[ln.split(" = ")[1] for ln in r["graph"].splitlines() if "_c10d_functional" in ln]
                       for r in per_rank]
        assert collectives[0] and all(c == collectives[0] for c in collectives)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MODELS)
def test_single_device_equals_transformers(model_type):
    ref = references(model_type)
    assert _rel(ref["logits"], ref["hf"]) <= 1e-5, "compiled adapter vs transformers (tie rule)"
    # The same aten ops on the same shapes in one process (aot_eager; read_kv_in_place reads the
    # same records from the pool instead of the copied view): bit-identical to the eager adapter.
    assert np.array_equal(ref["logits"], ref["eager"])


@pytest.mark.slow
class TestAdaptedGraphs(expecttest.TestCase):
    def test_deepseek_cp2_graph_and_op_counts(self):
        r = cp_results(2)[0]["deepseek_v32"]
        self.assertExpectedInline(r["graph"], """\
v0 = cpgraph.mla_query(_, _, _, _)
v1 = cpgraph.kv_layer_ready(layer=0)
v2 = cpgraph.mla_dense_pack(_, _)
v3 = cpgraph.paged_store(rows=v2, slots=_)
v4 = cpgraph.paged_gather(v3[1], in13)
v5 = cpgraph.paged_store(rows=_, slots=_)
v6 = cpgraph.paged_gather(v5[1], in13)
v7 = _c10d_functional.all_gather_into_tensor(_, 2, '0')
v8 = _c10d_functional.wait_tensor(v7)
v9 = cpgraph.take_rows(_, in14)
v10 = cpgraph.take_rows(_, in14)
v11 = cpgraph.indexer_topk(_, _, _, in21, in22, 16, 1073741824)
v12 = cpgraph.kv_layer_written(layer=0)
v13 = cpgraph.sparse_mla(v0, _, v11, 0.229187, 32)
v14 = cpgraph.compact_valid_static(_, _)
v15 = cpgraph.moe_experts(_, _, _, in27, in28, v14[1])
v16 = cpgraph.restore_compute_static(_, _)
v17 = _c10d_functional.all_gather_into_tensor(_, 2, '0')
v18 = _c10d_functional.wait_tensor(v17)""")
        self.assertExpectedInline(r["deltas"], """\
materialize_kv_by_owner: aten.gt +1, aten.where +1, cpgraph.cp_materialize_kv +1, cpgraph.kv_compose -2
read_kv_in_place: no change
compact_moe_rows: aten.le +1, cpgraph.compact_valid_static +1, cpgraph.restore_compute_static +1, prims.convert_element_type +1
gather_output_rows: cpgraph.cp_last_tokens +1, cpgraph.take_rows -1
lower_cp_collectives: _c10d_functional.all_gather_into_tensor +2, _c10d_functional.wait_tensor +2, cpgraph.cp_last_tokens -1, cpgraph.cp_materialize_kv -1, cpgraph.take_rows +2""")
        self.assertExpectedInline(repr(r["before"]), """{'cpgraph.indexer_topk': 1, 'cpgraph.kv_compose': 2, 'cpgraph.kv_layer_ready': 1, 'cpgraph.kv_layer_written': 1, 'cpgraph.mla_dense_pack': 1, 'cpgraph.mla_query': 1, 'cpgraph.moe_experts': 1, 'cpgraph.paged_gather': 2, 'cpgraph.paged_store': 2, 'cpgraph.sparse_mla': 1, 'cpgraph.take_rows': 1}""")
        self.assertExpectedInline(repr(r["after"]), """{'_c10d_functional.all_gather_into_tensor': 2, '_c10d_functional.wait_tensor': 2, 'cpgraph.compact_valid_static': 1, 'cpgraph.indexer_topk': 1, 'cpgraph.kv_layer_ready': 1, 'cpgraph.kv_layer_written': 1, 'cpgraph.mla_dense_pack': 1, 'cpgraph.mla_query': 1, 'cpgraph.moe_experts': 1, 'cpgraph.paged_gather': 2, 'cpgraph.paged_store': 2, 'cpgraph.restore_compute_static': 1, 'cpgraph.sparse_mla': 1, 'cpgraph.take_rows': 2}""")

    def test_glm_cp2_graph_and_op_counts(self):
        r = cp_results(2)[0]["glm_moe_dsa"]
        self.assertExpectedInline(r["graph"], """\
v0 = cpgraph.mla_query(_, _, _, _)
v1 = cpgraph.kv_layer_ready(layer=0)
v2 = cpgraph.mla_dense_pack(_, _)
v3 = cpgraph.paged_store(rows=v2, slots=_)
v4 = cpgraph.paged_gather(v3[1], in13)
v5 = cpgraph.paged_store(rows=_, slots=_)
v6 = cpgraph.paged_gather(v5[1], in13)
v7 = _c10d_functional.all_gather_into_tensor(_, 2, '0')
v8 = _c10d_functional.wait_tensor(v7)
v9 = cpgraph.take_rows(_, in14)
v10 = cpgraph.take_rows(_, in14)
v11 = cpgraph.indexer_topk(_, _, _, in21, in22, 16, 1073741824)
v12 = cpgraph.kv_layer_written(layer=0)
v13 = cpgraph.sparse_mla(v0, _, v11, 0.176777, 32)
v14 = cpgraph.mla_query(_, _, _, _)
v15 = cpgraph.kv_layer_ready(layer=1)
v16 = cpgraph.mla_dense_pack(_, _)
v17 = cpgraph.paged_store(rows=v16, slots=_)
v18 = cpgraph.paged_gather(v17[1], in13)
v19 = _c10d_functional.all_gather_into_tensor(_, 2, '0')
v20 = _c10d_functional.wait_tensor(v19)
v21 = cpgraph.take_rows(_, in14)
v22 = cpgraph.kv_layer_written(layer=1)
v23 = cpgraph.sparse_mla(v14, _, v11, 0.176777, 32)
v24 = cpgraph.compact_valid_static(_, _)
v25 = cpgraph.moe_experts(_, _, _, in40, in41, v24[1])
v26 = cpgraph.restore_compute_static(_, _)
v27 = _c10d_functional.all_gather_into_tensor(_, 2, '0')
v28 = _c10d_functional.wait_tensor(v27)""")
        self.assertExpectedInline(r["deltas"], """\
materialize_kv_by_owner: aten.gt +1, aten.where +1, cpgraph.cp_materialize_kv +2, cpgraph.kv_compose -3
read_kv_in_place: no change
compact_moe_rows: aten.le +1, cpgraph.compact_valid_static +1, cpgraph.restore_compute_static +1, prims.convert_element_type +1
gather_output_rows: cpgraph.cp_last_tokens +1, cpgraph.take_rows -1
lower_cp_collectives: _c10d_functional.all_gather_into_tensor +3, _c10d_functional.wait_tensor +3, cpgraph.cp_last_tokens -1, cpgraph.cp_materialize_kv -2, cpgraph.take_rows +3""")
        self.assertExpectedInline(repr(r["before"]), """{'cpgraph.indexer_topk': 1, 'cpgraph.kv_compose': 3, 'cpgraph.kv_layer_ready': 2, 'cpgraph.kv_layer_written': 2, 'cpgraph.mla_dense_pack': 2, 'cpgraph.mla_query': 2, 'cpgraph.moe_experts': 1, 'cpgraph.paged_gather': 3, 'cpgraph.paged_store': 3, 'cpgraph.sparse_mla': 2, 'cpgraph.take_rows': 1}""")
        self.assertExpectedInline(repr(r["after"]), """{'_c10d_functional.all_gather_into_tensor': 3, '_c10d_functional.wait_tensor': 3, 'cpgraph.compact_valid_static': 1, 'cpgraph.indexer_topk': 1, 'cpgraph.kv_layer_ready': 2, 'cpgraph.kv_layer_written': 2, 'cpgraph.mla_dense_pack': 2, 'cpgraph.mla_query': 2, 'cpgraph.moe_experts': 1, 'cpgraph.paged_gather': 3, 'cpgraph.paged_store': 3, 'cpgraph.restore_compute_static': 1, 'cpgraph.sparse_mla': 2, 'cpgraph.take_rows': 3}""")

    def test_single_device_op_counts(self):
        for model_type in MODELS:
            r = references(model_type)
            # One device: stores guarded, sparse MLA reads the pool in place (only the indexers' key views
            # stay composed), MoE compacted, nothing gathered.
            self.assertEqual(r["after"]["cpgraph.kv_compose"], len(r["indexer_layers"]))
            self.assertEqual(r["after"]["cpgraph.compact_valid_static"], 1)
            self.assertFalse([k for k in r["after"] if k.startswith(("cpgraph.cp_", "_c10d_functional."))])
        self.assertExpectedInline(references("glm_moe_dsa")["deltas"], """\
materialize_kv_by_owner: aten.gt +1, aten.where +1
read_kv_in_place: aten.add +2, aten.bitwise_and +2, aten.cat +1, aten.constant_pad_nd +2, aten.ge +2, aten.index +2, aten.lt +2, aten.where +2, cpgraph.kv_compose -2, cpgraph.paged_gather -2, prims.convert_element_type +1
compact_moe_rows: aten.le +1, cpgraph.compact_valid_static +1, cpgraph.restore_compute_static +1, prims.convert_element_type +1
gather_output_rows: no change
lower_cp_collectives: no change""")
