"""``read_kv_in_place``: on one device sparse MLA reads the KV pool by PAGED slot ids.

Three kinds of checks, as for every rewrite pass: op counts before/after,
a snapshot of the rewritten graph, and numerics against the unrewritten
(eager) model -- fp32 on the CPU, bit-equal, for bf16-style dense records
and for 656-byte FP8 records.  Small hand-written functions pin the match
rules (what must match, what must fail loudly, the dynamic-shape form and
that the pool is read at the value current at the attention call).

Compile cost: the model tests compile each format once (``aot_eager``,
shared through ``lru_cache``); the prefix pass of ``run_prefill`` runs the
eager model so that only the extend pass (which reads the prefix from the
pool) goes through the compiler.
"""

from __future__ import annotations

import copy
import functools
import inspect
import operator

import expecttest
import pytest
import torch

import cpgraph.ops  # noqa: F401
import cpgraph.ops.layer_events  # noqa: F401
import cpgraph.ops.materialize  # noqa: F401
import cpgraph.ops.paged  # noqa: F401
import cpgraph.ops.sparse_mla  # noqa: F401
from cpgraph.models import DSAConfig, build_model, init_random
from cpgraph.models.config import bundled_config_dict
from cpgraph.models.prefill import make_layout
from cpgraph.passes import CPConfig, compile
from cpgraph.passes.cleanup import eliminate_dead_code
from cpgraph.passes.fx_utils import _AUTO_FUNC, find_nodes, is_op, normalized_graph, op_counts
from cpgraph.passes.graph_facts import PassMatchError
from cpgraph.passes.kv_in_place import read_kv_in_place
from cpgraph.passes.pipeline import default_passes
from cpgraph.runtime.engine import run_prefill

ops = torch.ops.cpgraph
PAGE = 16
PROMPTS = [list(range(3, 40)), list(range(7, 12)), list(range(100, 133))]
PREFIX = [16, 0, 32]


@pytest.fixture(autouse=True)
def _no_caches():
    # A cached graph would skip the passes (and their history); config modules patch themselves.
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        yield
        torch._dynamo.reset()


def delta(history, name):
    for n, before, after in history:
        if n == name:
            return {k: after[k] - before[k] for k in sorted(set(before) | set(after)) if after[k] != before[k]}
    raise KeyError(name)


# ------------------------------------------------------------ small graphs
def attend(q, pool, rows, slots, prefix_slots, kv_source, idx):
    """One layer's KV traffic as the model writes it (dense records)."""
    ops.kv_layer_ready(pool, 0)
    ops.paged_store(pool, rows, slots)
    (kv,) = ops.kv_compose([ops.paged_gather(pool, prefix_slots)], [rows], kv_source)
    ops.kv_layer_written(pool, 0)
    return ops.sparse_mla(q, kv, idx, 0.5, 4)


def attend_fp8(q, pool, rows, slots, prefix_slots, kv_source, idx):
    """The same with 656-byte FP8 records (``rows`` are packed records)."""
    ops.kv_layer_ready(pool, 0)
    ops.paged_store(pool, rows, slots)
    (kv,) = ops.kv_compose([ops.paged_gather(pool, prefix_slots)], [rows], kv_source)
    ops.kv_layer_written(pool, 0)
    return ops.sparse_mla(q, ops.mla_fp8_unpack(kv, q.dtype), idx, 0.05, 512)


def layer_inputs(seed, num_prefix, num_rows, fp8=False, slots_total=40, heads=2):
    """A batch that keeps the planner's contract: keys of a valid window are real prefix or current rows.

    Full view: the prefix rows, then the current rows, then one page-tail slack
    row (``kv_source == -1``); prefix and current slots are distinct.  Top-k
    ids name real full-view rows or ``-1`` (never the slack row).
    """
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(slots_total, generator=g)
    prefix_slots = perm[:num_prefix].clone()
    slots = perm[num_prefix : num_prefix + num_rows].clone()
    kv_source = torch.cat([torch.arange(num_prefix + num_rows), torch.tensor([-1])])
    n_real = num_prefix + num_rows
    topk = 5
    idx = torch.randint(0, n_real, (num_rows, topk), generator=g, dtype=torch.int32)
    idx[:, -1] = -1  # a short row
    if num_rows > 1:
        idx[1] = -1  # a dummy row: no keys
    D = 576 if fp8 else 8
    q = torch.randn(num_rows, heads, D, generator=g)
    if fp8:
        latent, rope = torch.randn(slots_total, 512, generator=g), torch.randn(slots_total, 64, generator=g)
        pool = ops.mla_fp8_pack(latent, rope)
        rows = ops.mla_fp8_pack(torch.randn(num_rows, 512, generator=g), torch.randn(num_rows, 64, generator=g))
    else:
        pool = torch.randn(slots_total, D, generator=g)
        rows = torch.randn(num_rows, D, generator=g)
    return [q, pool, rows, slots, prefix_slots, kv_source, idx]


def run_both(fn, args, **compile_kw):
    """``(eager result, compiled result, eager pool, compiled pool, manager, graph after the pass)``."""
    graphs = []
    passes = [
        ("read_kv_in_place", read_kv_in_place),
        ("eliminate_dead_code", eliminate_dead_code),
        ("capture", lambda gm, cfg: graphs.append(copy.deepcopy(gm.graph)) or gm),
    ]
    compiled = compile(fn, backend="aot_eager", passes=passes, **compile_kw)
    a, b = [t.clone() for t in args], [t.clone() for t in args]
    ref, out = fn(*a), compiled(*b)
    return ref, out, a[1], b[1], compiled.cpgraph_passes, graphs[-1]


class TestSmallGraphs(expecttest.TestCase):
    def test_dense_rewrite_snapshot_counts_and_bits(self):
        ref, out, pool_ref, pool_out, manager, graph = run_both(attend, layer_inputs(0, 3, 4))
        self.assertEqual(
            delta(manager.history, "read_kv_in_place"),
            {"aten.add": 2, "aten.bitwise_and": 2, "aten.cat": 1, "aten.constant_pad_nd": 2, "aten.ge": 2,
             "aten.index": 2, "aten.lt": 2, "aten.where": 2, "cpgraph.kv_compose": -1, "cpgraph.paged_gather": -1,
             "prims.convert_element_type": 1},
        )
        self.assertExpectedInline(
            normalized_graph(graph),
            """\
v0 = cpgraph.kv_layer_ready(layer=0)
v1 = getitem(v0, 1)
v2 = cpgraph.paged_store(rows=in1, slots=in2)
v3 = getitem(v2, 1)
v4 = cpgraph.kv_layer_written(layer=0)
v5 = getitem(v4, 1)
v6 = aten.cat([in3, in2])
v7 = aten.ge(in4, 0)
v8 = aten.lt(in4, 7)
v9 = aten.bitwise_and(v7, v8)
v10 = aten.add(in4, 1)
v11 = aten.where(v9, v10, 0)
v12 = aten.constant_pad_nd(v6, [1, 0], -1)
v13 = aten.index(v12, [v11])
v14 = prims.convert_element_type(v13, int32)
v15 = aten.ge(in6, 0)
v16 = aten.lt(in6, 8)
v17 = aten.bitwise_and(v15, v16)
v18 = aten.add(in6, 1)
v19 = aten.where(v17, v18, 0)
v20 = aten.constant_pad_nd(v14, [1, 0], -1)
v21 = aten.index(v20, [v19])
v22 = cpgraph.sparse_mla(in5, v5, v21, 0.5, 4)
v23 = getitem(v22, 0)
v24 = getitem(v22, 1)""",
        )
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
        assert torch.equal(pool_out, pool_ref)

    def test_fp8_records_use_sparse_mla_fp8(self):
        ref, out, _, _, manager, graph = run_both(attend_fp8, layer_inputs(1, 2, 3, fp8=True),
                                                  cp=CPConfig(fp8_records_in_place=True))
        d = delta(manager.history, "read_kv_in_place")
        assert d["cpgraph.sparse_mla"] == -1 and d["cpgraph.sparse_mla_fp8"] == 1
        assert d["cpgraph.mla_fp8_unpack"] == -1 and d["cpgraph.kv_compose"] == -1
        (attn,) = find_nodes(graph, "cpgraph.sparse_mla_fp8")
        assert attn.args[1].meta["val"].dtype == torch.uint8  # the pool itself, 656-byte records
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])

    def test_fp8_records_keep_the_unpacked_view_by_default(self):
        """Default: the bf16 attention provider reads the unpacked view; nothing of the layer is rewritten."""
        ref, out, _, _, manager, graph = run_both(attend_fp8, layer_inputs(1, 2, 3, fp8=True))
        assert delta(manager.history, "read_kv_in_place") == {}
        counts = op_counts(graph)
        assert counts["cpgraph.sparse_mla"] == 1 and counts["cpgraph.mla_fp8_unpack"] == 1
        assert counts.get("cpgraph.sparse_mla_fp8", 0) == 0
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])

    def test_reads_the_pool_value_current_at_the_attention(self):
        """The pool value read is the newest one before the call, so no later write needs a pool copy."""
        *_, graph = run_both(attend, layer_inputs(2, 2, 3))
        (attn,) = find_nodes(graph, "cpgraph.sparse_mla")
        pool = attn.args[1]
        assert pool.target is operator.getitem
        assert op_counts(graph)["cpgraph.kv_layer_written"] == 1
        written = next(n for n in graph.nodes if n.target in _AUTO_FUNC and "kv_layer_written" in str(n.args[0]))
        assert pool.args[0] is written
        assert not [u for u in pool.users if u.target in _AUTO_FUNC]

    def test_adds_no_pool_copy_when_inductor_reinplaces(self):
        """Inductor's reinplacing clones a buffer whose old value is read after a write; the rewrite must not cause one.

        Compared with the unrewritten graph (the captured aot graphs return
        mutated inputs instead of copying them back, so the first write of
        an input is cloned in both).  Reading the pool value from before
        ``kv_layer_written`` would make that event clone the pool: checked too.
        """
        from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops
        from torch._inductor.fx_utils import FakeTensorUpdater

        # Built as Inductor's post-grad passes build it: from the graph module in torch 2.13, from its
        # graph in 2.11 (reinplace_inplaceable_ops itself is the same in both).
        graph_arg = "gm" not in inspect.signature(FakeTensorUpdater).parameters

        def clones(passes, tamper=None):
            torch._dynamo.reset()
            gms = []
            capture = ("capture", lambda gm, c: gms.append(copy.deepcopy(gm)) or gm)
            compile(attend, backend="aot_eager", passes=passes + [capture])(*layer_inputs(6, 3, 4))
            gm = gms[0]
            if tamper:
                tamper(gm.graph)
            reinplace_inplaceable_ops(FakeTensorUpdater(gm.graph if graph_arg else gm), gm.graph)
            return {str(n.args[0]): n.meta["only_clone_these_tensors"] for n in gm.graph.nodes if n.target in _AUTO_FUNC}

        def read_before_written(graph):
            (attn,) = find_nodes(graph, "cpgraph.sparse_mla")
            (written,) = [n for n in graph.nodes if n.target in _AUTO_FUNC and "kv_layer_written" in str(n.args[0])]
            attn.replace_input_with(attn.args[1], written.kwargs["_all_bases"][0])

        rewritten = clones([("read_kv_in_place", read_kv_in_place)])
        assert rewritten == clones([])
        assert rewritten["cpgraph.kv_layer_written.default"] == []
        tampered = clones([("read_kv_in_place", read_kv_in_place)], read_before_written)
        assert tampered["cpgraph.kv_layer_written.default"] == [0]  # the check can fail

    def test_dynamic_shapes(self):
        graphs = []
        passes = [("read_kv_in_place", read_kv_in_place), ("capture", lambda gm, c: graphs.append(gm.graph) or gm)]
        compiled = compile(attend, backend="aot_eager", dynamic=True, passes=passes)
        for seed, (p, m) in enumerate([(3, 4), (5, 2), (0, 6)]):
            args = layer_inputs(10 + seed, p, m)
            a, b = [t.clone() for t in args], [t.clone() for t in args]
            ref, out = attend(*a), compiled(*b)
            assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
        assert op_counts(graphs[-1])["aten.sym_size"] == 2  # lengths of the slot tables are symbolic

    def test_cp_keeps_the_materialised_view(self):
        graphs = []
        compile(attend, backend="aot_eager", passes=[("capture", lambda gm, c: graphs.append(gm) or gm)])(
            *layer_inputs(3, 2, 3)
        )
        before = op_counts(graphs[0].graph)
        read_kv_in_place(graphs[0], CPConfig(group="g", cp_size=2))
        assert op_counts(graphs[0].graph) == before and before["cpgraph.kv_compose"] == 1


def _not_stored(q, pool, rows, slots, prefix_slots, kv_source, idx):
    (kv,) = ops.kv_compose([ops.paged_gather(pool, prefix_slots)], [rows], kv_source)
    return ops.sparse_mla(q, kv, idx, 0.5, 4)


def _stored_after(q, pool, rows, slots, prefix_slots, kv_source, idx):
    (kv,) = ops.kv_compose([ops.paged_gather(pool, prefix_slots)], [rows], kv_source)
    out = ops.sparse_mla(q, kv, idx, 0.5, 4)
    ops.paged_store(pool, rows, slots)
    return out


def _prefix_not_from_pool(q, pool, rows, slots, prefix_slots, kv_source, idx):
    ops.paged_store(pool, rows, slots)
    (kv,) = ops.kv_compose([pool[:3] * 1], [rows], kv_source)
    return ops.sparse_mla(q, kv, idx, 0.5, 4)


def _other_write_between(q, pool, rows, slots, prefix_slots, kv_source, idx):
    ops.paged_store(pool, rows, slots)
    (kv,) = ops.kv_compose([ops.paged_gather(pool, prefix_slots)], [rows], kv_source)
    ops.paged_store(pool, rows * 2, prefix_slots)
    return ops.sparse_mla(q, kv, idx, 0.5, 4)


@pytest.mark.parametrize(
    "fn, message",
    [
        (_not_stored, "are not stored into the pool"),
        (_stored_after, "are not stored into the pool"),
        (_prefix_not_from_pool, "not a paged_gather"),
        (_other_write_between, "between its prefix gather and the attention"),
    ],
)
def test_a_materialised_view_that_does_not_match_fails(fn, message):
    args = layer_inputs(4, 3, 3)
    compiled = compile(fn, backend="aot_eager", passes=[("read_kv_in_place", read_kv_in_place)])
    with pytest.raises(Exception, match=message) as info:
        compiled(*[t.clone() for t in args])
    assert isinstance(getattr(info.value, "inner_exception", info.value), PassMatchError)


def test_keyword_arguments_are_refused_not_misread():
    gms = []
    compile(attend, backend="aot_eager", passes=[("capture", lambda gm, c: gms.append(gm) or gm)])(*layer_inputs(7, 2, 3))
    (attn,) = find_nodes(gms[0].graph, "cpgraph.sparse_mla")
    attn.args, attn.kwargs = attn.args[:4], {"d_v": attn.args[4]}
    with pytest.raises(PassMatchError, match="positionally"):
        read_kv_in_place(gms[0], CPConfig())


def test_attention_over_a_plain_tensor_is_left_alone():
    """Keys that are not a composed view (no kv_compose) are not a materialisation: nothing to rewrite."""

    def fn(q, kv, idx):
        return ops.sparse_mla(q, kv * 2, idx, 0.5, 4)

    g = torch.Generator().manual_seed(5)
    args = (torch.randn(3, 2, 8, generator=g), torch.randn(6, 8, generator=g), torch.tensor([[0, 5, -1]] * 3))
    compiled = compile(fn, backend="aot_eager", passes=[("read_kv_in_place", read_kv_in_place)])
    assert torch.equal(compiled(*args)[0], fn(*args)[0])
    assert delta(compiled.cpgraph_passes.history, "read_kv_in_place") == {}


# ------------------------------------------------------------ the model
def _model(fmt: str, dtype=torch.float32, device="cpu"):
    name = "tiny-glm5" if fmt == "bf16" else "tiny-deepseek-v32-fp8"
    d = dict(bundled_config_dict(name), num_hidden_layers=2)
    model = init_random(build_model(DSAConfig.from_hf_dict(d), dtype, device), seed=0, std=0.1).eval()
    model.kv_layout = make_layout(model, fmt, PAGE)
    return model


@functools.lru_cache(maxsize=None)
def _model_run(fmt: str):
    """``(model, compiled result, eager result, graph after the pipeline, history)`` for one KV format.

    FP8 records are read in place here (``fp8_records_in_place``), so the rewrite of both formats is
    checked on the model; the default for FP8 (keep the view) is checked on the small graphs.
    """
    model = _model(fmt)
    graphs = []
    capture = ("capture", lambda gm, c: graphs.append(copy.deepcopy(gm.graph)) or gm)
    compiled = compile(model, CPConfig(fp8_records_in_place=fmt == "fp8"), backend="aot_eager",
                       passes=default_passes() + [capture])
    calls = []

    def forward(*a, **k):  # prefix pass eager, extend pass compiled: one compile
        calls.append(1)
        return (model if len(calls) == 1 else compiled)(*a, **k)

    res = run_prefill(forward, model, PROMPTS, prefix_lens=PREFIX, page_size=PAGE, kv_format=fmt)
    ref = run_prefill(lambda *a, **k: model(*a, **k), model, PROMPTS, prefix_lens=PREFIX, page_size=PAGE,
                      kv_format=fmt)
    return model, res, ref, graphs[-1], list(compiled.cpgraph_passes.history)


class TestModel(expecttest.TestCase):
    def test_dense_records_counts_and_snapshot(self):
        _, _, _, graph, history = _model_run("bf16")
        self.assertEqual(
            delta(history, "read_kv_in_place"),
            {"aten.add": 2, "aten.bitwise_and": 2, "aten.cat": 1, "aten.constant_pad_nd": 2, "aten.ge": 2,
             "aten.index": 2, "aten.lt": 2, "aten.where": 2, "cpgraph.kv_compose": -2, "cpgraph.paged_gather": -2,
             "prims.convert_element_type": 1},
        )
        self.assertExpectedInline(
            normalized_graph(graph, keep=("cpgraph.", "aten.index", "aten.where")),
            """\
v0 = aten.where(_, in12, -1)
v1 = cpgraph.mla_query(_, _, _, _)
v2 = cpgraph.kv_layer_ready(layer=0)
v3 = cpgraph.mla_dense_pack(_, _)
v4 = cpgraph.paged_store(rows=v3, slots=v0)
v5 = cpgraph.paged_store(rows=_, slots=v0)
v6 = cpgraph.paged_gather(v5[1], in13)
v7 = cpgraph.kv_compose([v6], [cat_1], in14)
v8 = cpgraph.indexer_topk(_, v7[0], _, in21, in22, 16, 1073741824)
v9 = cpgraph.kv_layer_written(layer=0)
v10 = aten.where(_, _, 0)
v11 = aten.index(_, [v10])
v12 = aten.where(_, _, 0)
v13 = aten.index(_, [v12])
v14 = cpgraph.sparse_mla(v1, v9[1], v13, 0.176777, 32)
v15 = cpgraph.mla_output(v14[0], _)
v16 = cpgraph.mla_query(_, _, _, _)
v17 = cpgraph.kv_layer_ready(layer=1)
v18 = cpgraph.mla_dense_pack(_, _)
v19 = cpgraph.paged_store(rows=v18, slots=v0)
v20 = cpgraph.kv_layer_written(layer=1)
v21 = cpgraph.sparse_mla(v16, v20[1], v13, 0.176777, 32)
v22 = cpgraph.mla_output(v21[0], _)
v23 = cpgraph.compact_valid_static(_, _)
v24 = cpgraph.moe_route(_, in39, 1, 1, 2, True, 2.5)
v25 = cpgraph.moe_experts(v23[0], v24[0], v24[1], in40, in41, _)
v26 = cpgraph.restore_compute_static(_, _)
v27 = cpgraph.take_rows(_, in45)""",
        )

    def test_fp8_records_counts(self):
        _, _, _, graph, history = _model_run("fp8")
        d = delta(history, "read_kv_in_place")
        assert d["cpgraph.sparse_mla"] == -2 and d["cpgraph.sparse_mla_fp8"] == 2
        assert d["cpgraph.mla_fp8_unpack"] == -2
        assert d["cpgraph.kv_compose"] == -2  # the MLA views; the index-K views stay (the indexer scores them)
        counts = op_counts(graph)
        assert counts["cpgraph.kv_compose"] == 2 and counts["cpgraph.index_k_gather"] == 2
        assert counts["cpgraph.paged_gather"] == 0


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_logits_bit_equal_to_the_eager_model(fmt):
    _, res, ref, _, _ = _model_run(fmt)
    assert torch.equal(res.logits, ref.logits)
    assert res.kv_bytes == ref.kv_bytes


def test_disabling_the_pass_keeps_the_materialised_view():
    """Disabled by name, the pass leaves the one-device graph as traced: attention reads the composed view.

    The same passes as ``run_both``, whose rewrite ``test_dense_rewrite_snapshot_counts_and_bits`` counts.
    """
    graphs = []
    passes = [
        ("read_kv_in_place", read_kv_in_place),
        ("eliminate_dead_code", eliminate_dead_code),
        ("capture", lambda gm, c: graphs.append(copy.deepcopy(gm.graph)) or gm),
    ]
    compiled = compile(attend, CPConfig(disabled_passes=("read_kv_in_place",)), backend="aot_eager", passes=passes)
    args = layer_inputs(8, 3, 4)
    a, b = [t.clone() for t in args], [t.clone() for t in args]
    ref, out = attend(*a), compiled(*b)
    counts = op_counts(graphs[-1])
    assert (counts["cpgraph.kv_compose"], counts["cpgraph.paged_gather"], counts["cpgraph.sparse_mla"]) == (1, 1, 1)
    (attn,) = find_nodes(graphs[-1], "cpgraph.sparse_mla")
    assert attn.args[1].target is operator.getitem and is_op(attn.args[1].args[0], "cpgraph.kv_compose")
    assert "read_kv_in_place" not in [n for n, _, _ in compiled.cpgraph_passes.history]
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]) and torch.equal(b[1], a[1])


# ------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_gpu_compiled_forward_reads_in_place_and_matches_the_materialised_path(fmt):
    """Inductor on CUDA, bf16 weights: the in-place graph vs the same graph with the pass disabled."""
    model = _model(fmt, torch.bfloat16, "cuda")
    results = {}
    for name, cfg in [("in_place", CPConfig(fp8_records_in_place=True)),
                      ("materialised", CPConfig(disabled_passes=("read_kv_in_place",)))]:
        torch._dynamo.reset()
        compiled = compile(model, cfg, backend="inductor")
        res = run_prefill(lambda *a, **k: compiled(*a, **k), model, PROMPTS, prefix_lens=PREFIX, page_size=PAGE,
                          kv_format=fmt)
        results[name] = (res.logits, compiled.cpgraph_passes)
    d = delta(results["in_place"][1].history, "read_kv_in_place")
    assert d["cpgraph.kv_compose"] == -2 and d["cpgraph.paged_gather"] == -2
    if fmt == "fp8":
        assert d["cpgraph.sparse_mla_fp8"] == 2
    a, b = results["in_place"][0], results["materialised"][0]
    assert torch.isfinite(a).all()
    rel = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()
    assert rel <= 2e-2, rel
