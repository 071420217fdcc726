"""Every rule of the model contract: a graph that breaks it gets one ``PassMatchError`` naming the rule and the node.

The rules are ``graph_facts.CONTRACT_RULES``, one section each in
docs/model_contract.md.  Each test traces a small forward that breaks one
rule (``make_fx``: no compile, no module stack, so every node sits at the top
level) and runs the whole pass pipeline on it, which must stop with that
rule's error, before rewriting anything.  Two rules need the functionalised
graph of a real compile (a pool write, the module regions Dynamo records);
those compile tiny modules with ``aot_eager``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import cpgraph.ops  # noqa: F401
from cpgraph.passes import CPConfig, HostSyncError, build_pass_manager, compile
from cpgraph.passes.fx_utils import find_nodes
from cpgraph.passes.graph_facts import CONTRACT_RULES, PassMatchError
from cpgraph.passes.pipeline import default_passes

ops = torch.ops.cpgraph
ROOT = Path(__file__).resolve().parents[2]
M, P, S, D, DI = 4, 2, 16, 8, 4  # rows, prefix rows, pool slots, record width, index-key width
CP2 = CPConfig(group="contract-test", cp_size=2)


def _inputs():
    return dict(
        x=torch.randn(M, D),
        pool=torch.zeros(S, D),
        ipool=torch.zeros(S, DI),
        ks=torch.zeros(M, dtype=torch.int32),
        ke=torch.arange(1, M + 1, dtype=torch.int32),
        slots=torch.arange(M),
        prefix_slots=torch.arange(P),
        kv_source=torch.arange(P + M),
        last=torch.tensor([M - 1]),
    )


class _Forward(nn.Module):
    def __init__(self, fn, names):
        super().__init__()
        self.fn, self.names = fn, names

    def forward(self, *args):
        out = self.fn(**dict(zip(self.names, args)))
        return out if isinstance(out, tuple) else (out,)


def _trace(fn, **extra):
    """The functionalised inference graph of ``fn(**inputs)`` (as AOT autograd hands it to the passes)."""
    from torch._functorch.aot_autograd import aot_export_module

    args = dict(_inputs(), **extra)
    gm, _ = aot_export_module(_Forward(fn, list(args)), tuple(args.values()), trace_joint=False)
    return gm


def _topk(x, k_full, ks, ke):
    q = x[:, :DI].reshape(M, 1, DI)
    return ops.indexer_topk(q, k_full, torch.ones(M, 1), ks, ke, 2, 1 << 20)


def _attend(x, kv, topk):
    out, _ = ops.sparse_mla(x.reshape(M, 1, D), kv, topk, 0.5, D)
    return out.reshape(M, D)


def _layer(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source, **_):
    """One attention layer as the contract wants it: stores, then the full views from ``kv_compose``."""
    k = x[:, :DI].contiguous()
    ops.paged_store(pool, x, slots)
    ops.paged_store(ipool, k, slots)
    (kv,) = ops.kv_compose([ops.paged_gather(pool, prefix_slots)], [x], kv_source)
    (kf,) = ops.kv_compose([ops.paged_gather(ipool, prefix_slots)], [k], kv_source)
    return _attend(x, kv, _topk(x, kf, ks, ke))


def _breaks(rule: str, gm, cfg: CPConfig = CPConfig(), *nodes: str, error=PassMatchError):
    """Run the whole pipeline on ``gm``: it must raise ``rule``'s error, naming ``nodes``."""
    with pytest.raises(error) as info:
        build_pass_manager(cfg).run(gm)
    err = info.value
    assert err.rule == rule, err
    assert f"model contract rule '{rule}'" in str(err) and f"model_contract.md#{rule}" in str(err)
    for name in nodes:
        assert name in err.nodes and name in str(err), (name, err.nodes, str(err))
    return err


def _node(gm, op: str, k: int = 0):
    return find_nodes(gm.graph, op)[k]


# ------------------------------------------------------------------ one test per rule
def test_one_row_window():
    def fn(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source, ke2, **_):
        h = _layer(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source)
        return _layer(h, pool, ipool, ks, ke2, slots, prefix_slots, kv_source)  # layer 2 reads other windows

    gm = _trace(fn, ke2=torch.arange(1, M + 1, dtype=torch.int32))
    _breaks("one-row-window", gm, CPConfig(), _node(gm, "cpgraph.indexer_topk", 1).name)


def test_row_window_present():
    def fn(x, pool, slots, prefix_slots, kv_source, **_):
        ops.paged_store(pool, x, slots)  # a KV store, but no indexer op states which rows are real
        (kv,) = ops.kv_compose([ops.paged_gather(pool, prefix_slots)], [x], kv_source)
        return kv

    gm = _trace(fn)
    _breaks("row-window-present", gm, CPConfig(), _node(gm, "cpgraph.paged_store").name)


def test_pool_ops_only():
    # A graph that still holds the mutating store itself, not its functionalised form (a hand-traced
    # graph): the store guard could not rewrite its slots.  A model's aten pool write is the next test.
    args = _inputs()
    gm = make_fx(lambda *a: _layer(**dict(zip(args, a))), tracing_mode="fake")(*args.values())
    _breaks("pool-ops-only", gm, CPConfig(), _node(gm, "cpgraph.paged_store").name)


class _AtenPoolWrite(nn.Module):
    """Writes the MLA pool with ``pool[slots] = x`` instead of ``paged_store``."""

    def forward(self, x, pool, ipool, ks, ke, slots, prefix_slots, kv_source, last):
        pool[slots] = x
        k = x[:, :DI].contiguous()
        ops.paged_store(ipool, k, slots)
        (kv,) = ops.kv_compose([ops.paged_gather(pool, prefix_slots)], [x], kv_source)
        (kf,) = ops.kv_compose([ops.paged_gather(ipool, prefix_slots)], [k], kv_source)
        return _attend(x, kv, _topk(x, kf, ks, ke))


@pytest.mark.slow
def test_pool_ops_only_refuses_an_aten_pool_write_through_compile():
    torch._dynamo.reset()
    fn = compile(_AtenPoolWrite(), CPConfig(), backend="aot_eager")
    with pytest.raises(PassMatchError) as info:  # the error itself, not Dynamo's BackendCompilerFailed
        fn(**_inputs())
    assert info.value.rule == "pool-ops-only" and "index_put" in str(info.value), info.value
    torch._dynamo.reset()


def test_compose_outputs_unpacked():
    gm = _trace(_layer)
    compose = _node(gm, "cpgraph.kv_compose")
    with gm.graph.inserting_after(compose):  # a user that takes the list whole instead of getitem
        whole = gm.graph.call_function(len, (compose,))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ((*out.args[0], whole),)
    _breaks("compose-outputs-unpacked", gm, CP2, compose.name, whole.name)


def test_compose_feeds_attention():
    def fn(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source, **_):
        h = _layer(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source)
        (stray,) = ops.kv_compose([ops.paged_gather(pool, prefix_slots)], [h], kv_source)  # no attention reads it
        return h, stray

    gm = _trace(fn)
    _breaks("compose-feeds-attention", gm, CP2, _node(gm, "cpgraph.kv_compose", 2).name)


def test_one_kv_source():
    def fn(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source, kv_source2, **_):
        (kv,) = ops.kv_compose([ops.paged_gather(pool, prefix_slots)], [x], kv_source)
        (kf,) = ops.kv_compose([ops.paged_gather(ipool, prefix_slots)], [x[:, :DI].contiguous()], kv_source2)
        return _attend(x, kv, _topk(x, kf, ks, ke))

    gm = _trace(fn, kv_source2=torch.arange(P + M))
    _breaks("one-kv-source", gm, CP2, _node(gm, "cpgraph.sparse_mla").name)


def test_keys_from_compose():
    def fn(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source, all_slots, **_):
        k = x[:, :DI].contiguous()
        ops.paged_store(pool, x, slots)
        ops.paged_store(ipool, k, slots)
        (kf,) = ops.kv_compose([ops.paged_gather(ipool, prefix_slots)], [k], kv_source)
        kv = ops.paged_gather(pool, all_slots)  # the whole view read back from this rank's pool
        return _attend(x, kv, _topk(x, kf, ks, ke))

    gm = _trace(fn, all_slots=torch.arange(S))
    _breaks("keys-from-compose", gm, CP2, _node(gm, "cpgraph.sparse_mla").name)
    build_pass_manager(CPConfig()).run(_trace(fn, all_slots=torch.arange(S)))  # one device: the pool is whole


def test_materialised_view():
    def fn(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source, **_):
        k = x[:, :DI].contiguous()
        ops.paged_store(pool, x, slots)
        ops.paged_store(ipool, k, slots)
        (kv,) = ops.kv_compose([x[:P] * 0], [x], kv_source)  # prefix rows made up, not gathered from a pool
        (kf,) = ops.kv_compose([ops.paged_gather(ipool, prefix_slots)], [k], kv_source)
        return _attend(x, kv, _topk(x, kf, ks, ke))

    gm = _trace(fn)
    _breaks("materialised-view", gm, CPConfig(), _node(gm, "cpgraph.sparse_mla").name)


def test_index_topk_pattern():
    gm = _trace(_layer)
    _breaks("index-topk-pattern", gm, CPConfig(index_topk_pattern="FS"), _node(gm, "cpgraph.sparse_mla").name)


def _moe_inputs():
    return dict(ids=torch.zeros(M, 2, dtype=torch.int64), w=torch.ones(M, 2), gate_up=torch.randn(4, 6, D),
                down=torch.randn(4, D, 3))


def _in_module(gm, names, cls, path="layers.0.mlp"):
    """Module stacks as Dynamo records them: nodes running ``names`` inside ``path`` (class ``cls``), the rest at the top."""
    for n in gm.graph.nodes:
        if n.op == "call_function":
            inside = any(name in str(n.target) for name in names)
            n.meta["nn_module_stack"] = {"L__self__": ("", "Model"), **({path: (path, cls)} if inside else {})}


def test_moe_region_io():
    def fn(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source, ids, w, gate_up, down, **_):
        h = _layer(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source)
        return ops.moe_experts(h, ids, w, gate_up, down) + ops.moe_experts(h * 2, ids, w, gate_up, down)

    gm = _trace(fn, **_moe_inputs())
    _in_module(gm, ("moe_experts", "aten.add"), cls="SparseMoe")  # one region, two computed inputs: h, h * 2
    _breaks("moe-region-io", gm, CPConfig(moe_modules=("SparseMoe",)))


def test_moe_experts_in_region():
    def fn(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source, ids, w, gate_up, down, **_):
        return ops.moe_experts(_layer(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source), ids, w, gate_up, down)

    gm = _trace(fn, **_moe_inputs())
    _in_module(gm, ("moe_experts",), cls="SparseMoeBlock")  # a class CPConfig.moe_modules does not name
    _breaks("moe-experts-in-region", gm, CPConfig(), _node(gm, "cpgraph.moe_experts").name)


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(4, 6, D))
        self.down = nn.Parameter(torch.randn(4, D, 3))

    def forward(self, x, ids, w):
        return ops.moe_experts(x, ids, w, self.gate_up, self.down)


@pytest.mark.slow
def test_moe_experts_in_region_through_compile():
    """Dynamo's own module stack: the experts' module is not of a class ``CPConfig.moe_modules`` names."""
    torch._dynamo.reset()
    fn = compile(_Experts(), CPConfig(), backend="aot_eager")
    with pytest.raises(PassMatchError) as info:  # the error itself, not Dynamo's BackendCompilerFailed
        fn(torch.randn(M, D), torch.zeros(M, 2, dtype=torch.int64), torch.ones(M, 2))
    assert info.value.rule == "moe-experts-in-region" and "'MoE'" in str(info.value), info.value
    torch._dynamo.reset()


class MoE(nn.Module):
    """Named as ``CPConfig.moe_modules`` defaults to: a router, then the experts called without a real-row count."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, 4, bias=False)
        self.gate_up = nn.Parameter(torch.randn(4, 6, D))
        self.down = nn.Parameter(torch.randn(4, D, 3))

    def forward(self, x):
        w, ids = self.router(x).sigmoid().topk(2, dim=-1)
        return ops.moe_experts(x, ids, w, self.gate_up, self.down) * 2


class _WithMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.mlp = MoE()

    def forward(self, x, keys, ks, ke):
        topk = _topk(x, keys, ks, ke)  # the row windows: rows 1 and 3 are dummies (ks == ke)
        return self.mlp(self.norm(x)), topk


@pytest.mark.slow
def test_moe_region_gets_the_real_row_count_under_inductor():
    """The MoE pass hands its real-row count to a ``moe_experts`` called without one, in a form Inductor lowers."""
    torch._dynamo.reset()
    graphs = []

    def capture(gm, cfg):
        (experts,) = find_nodes(gm.graph, "cpgraph.moe_experts")
        count = experts.args[5] if len(experts.args) > 5 else experts.kwargs.get("num_valid")
        graphs.append(count is not None and find_nodes(gm.graph, "cpgraph.compact_valid_static") == [count.args[0]])
        return gm

    model = _WithMoE()
    fn = compile(model, CPConfig(), passes=default_passes() + [("capture", capture)])
    x, keys = torch.randn(M, D), torch.randn(3, DI)
    ks = torch.tensor([0, 1, 0, 2], dtype=torch.int32)
    ke = torch.tensor([1, 1, 3, 2], dtype=torch.int32)
    # Scalar C++ kernels in this process: the lowering is under test, not the CPU vector code.
    with torch._inductor.config.patch(fx_graph_cache=False, **{"cpp.vec_isa_ok": False}):
        out, _ = fn(x, keys, ks, ke)
    torch._dynamo.reset()
    assert graphs == [True]  # num_valid is the compaction's count
    with torch.no_grad():
        ref, _ = model(x, keys, ks, ke)
    real = torch.tensor([True, False, True, False])
    torch.testing.assert_close(out[real], ref[real])
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))  # dummy rows: exact zeros


def test_expert_shard():
    def fn(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source, w, gate_up, down, scores, **_):
        h = _layer(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source)
        ids = torch.topk(scores, 2).indices  # the router scores 8 experts; the stacks hold 4
        return ops.moe_experts(h, ids, w, gate_up, down)

    inputs = _moe_inputs()
    del inputs["ids"]
    gm = _trace(fn, scores=torch.randn(M, 8), **inputs)
    _breaks("expert-shard", gm, CPConfig(moe_modules=()), _node(gm, "cpgraph.moe_experts").name)


def test_row_scope_stated():
    def fn(x, last, **kw):
        return ops.take_rows(_layer(x, **kw), last)  # no row_scope statement

    gm = _trace(fn)
    _breaks("row-scope-stated", gm, CP2, _node(gm, "cpgraph.take_rows").name)


def test_row_scope_consistent():
    def fn(x, last, **kw):
        # The last rows picked with aten indexing: the output pass rewrites only take_rows.
        return ops.row_scope(_layer(x, **kw)[last], "global")

    gm = _trace(fn)
    err = _breaks("row-scope-consistent", gm, CP2)
    assert "no output row selection" in str(err)
    build_pass_manager(CPConfig()).run(_trace(fn))  # one device: local rows are all rows


def test_no_host_syncs():
    gm = make_fx(lambda x: x[x[:, 0] > 0] * 2, tracing_mode="fake")(torch.randn(M, D))  # a data-dependent row count
    err = _breaks("no-host-syncs", gm, CPConfig(), error=HostSyncError)
    assert err.nodes and all(n in str(err) for n in err.nodes)


def test_invariant_products():
    def fn(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source, **_):
        h = _layer(x, pool, ipool, ks, ke, slots, prefix_slots, kv_source)
        return torch.mv(h, h[0])  # a matrix-vector product: no row-invariant form

    gm = _trace(fn)
    _breaks("invariant-products", gm, CPConfig(deterministic=True), _node(gm, "aten.mv").name)


# ------------------------------------------------------------------ the rules as a whole
def test_every_pass_error_names_a_documented_rule():
    """Each ``PassMatchError(...)`` raised by a pass names a rule, and each rule has its section in the doc."""
    used = set()
    for path in sorted((ROOT / "cpgraph" / "passes").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("PassMatchError", "HostSyncError"):
                rule = next((k.value for k in node.keywords if k.arg == "rule"), None)
                assert isinstance(rule, ast.Constant), f"{path.name}:{node.lineno}: PassMatchError without rule="
                used.add(rule.value)
    assert used == set(CONTRACT_RULES), set(CONTRACT_RULES) ^ used
    doc = (ROOT / "docs" / "model_contract.md").read_text()
    headings = set(re.findall(r"^#### `([a-z-]+)`", doc, flags=re.M))
    assert headings == set(CONTRACT_RULES), set(CONTRACT_RULES) ^ headings
    tested = {name[len("test_"):].replace("_", "-") for name in globals() if name.startswith("test_")}
    assert set(CONTRACT_RULES) <= tested, set(CONTRACT_RULES) - tested


def test_the_pipeline_accepts_the_layer_the_rules_are_cut_from():
    """The forward the tests above break meets the contract: the passes rewrite it without error."""
    build_pass_manager(CPConfig()).run(_trace(_layer))
    cp = build_pass_manager(CP2, [p for p in default_passes() if p[0] != "lower_cp_collectives"])  # no group here
    cp.run(_trace(_layer))
    assert cp.counts_after("materialize_kv_by_owner")["cpgraph.cp_materialize_kv"] == 1
