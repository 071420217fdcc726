"""Pass manager, cleanup, lint and uuid on small hand-built graphs."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._inductor import config as inductor_config

import cpgraph.ops  # noqa: F401
from cpgraph.passes import CPConfig, CPPassManager, HostSyncError, build_pass_manager, compile
from cpgraph.passes.cleanup import eliminate_dead_code, sort_topologically
from cpgraph.passes.fx_utils import insert_call, normalized_graph, op_counts
from cpgraph.passes.lint import reject_host_syncs

ops = torch.ops.cpgraph


def make_graph(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*args)


def test_sort_topologically_is_stable_and_fixes_order():
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.ops.aten.relu.default, (x,))
    b = g.call_function(torch.ops.aten.neg.default, (a,))
    g.output(b)
    gm = fx.GraphModule(torch.nn.Module(), g)
    before = [n.name for n in g.nodes]
    sort_topologically(gm)
    assert [n.name for n in g.nodes] == before  # already sorted: untouched
    # Move the producer after its user, then sort back.
    b.append(a)
    assert [n.name for n in g.nodes] != before
    sort_topologically(gm)
    assert [n.name for n in g.nodes] == before
    g.lint()


def test_dce_keeps_cache_writes_and_drops_dead_math():
    def f(pool, rows, slots):
        dead = rows * 3  # noqa: F841  (no user: must go)
        torch.ops.aten.copy_(pool, pool + 1)  # a mutation with no user: must stay
        return rows + 1

    gm = make_graph(f, torch.zeros(4, 2), torch.ones(3, 2), torch.tensor([0, 1, 2]))
    assert op_counts(gm.graph)["aten.mul"] == 1
    eliminate_dead_code(gm)
    counts = op_counts(gm.graph)
    assert counts["aten.mul"] == 0
    assert counts["aten.copy_"] == 1


def test_dce_keeps_mutating_custom_op():
    g = fx.Graph()
    pool = g.placeholder("pool")
    rows = g.placeholder("rows")
    idx = g.placeholder("idx")
    # A mutating aten op stands in for any op with a mutable schema.
    g.call_function(torch.ops.aten.index_copy_.default, (pool, 0, idx, rows))
    g.call_function(torch.ops.aten.neg.default, (rows,))
    g.output(rows)
    gm = fx.GraphModule(torch.nn.Module(), g)
    eliminate_dead_code(gm)
    c = op_counts(g)
    assert c["aten.index_copy_"] == 1 and c["aten.neg"] == 0


def test_host_sync_lint_names_the_node():
    gm = make_graph(lambda x: x[x > 0], torch.randn(5))  # boolean-mask indexing
    with pytest.raises(HostSyncError, match="aten.index"):
        reject_host_syncs(gm)

    def f(x, i):
        n = i.max().item()  # an int read back from the device to size a slice
        torch._check(n >= 0)
        torch._check(n <= x.shape[0])
        return x[:n] * 2

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = compile(f, backend="aot_eager")
        with pytest.raises(Exception, match="node '_local_scalar_dense' runs aten._local_scalar_dense"):
            compiled(torch.randn(4), torch.tensor([1, 2]))
    torch._dynamo.reset()


def test_host_sync_lint_passes_clean_graph():
    gm = make_graph(lambda x, i: ops.take_rows(x, i) * 2, torch.randn(5, 2), torch.tensor([1, -1]))
    reject_host_syncs(gm)


def test_insert_call_sets_meta_val_only():
    gm = make_graph(lambda x, i: x + 1, torch.randn(5, 2), torch.tensor([1, -1]))
    g = gm.graph
    x, i = [n for n in g.nodes if n.op == "placeholder"]
    add = next(n for n in g.nodes if n.op == "call_function")
    with g.inserting_after(add):
        node = insert_call(g, ops.take_rows.default, (add, i))
    assert set(node.meta) == {"val"}
    assert tuple(node.meta["val"].shape) == (2, 2)


def test_normalized_graph_snapshot():
    gm = make_graph(lambda x, i: ops.take_rows(x.relu(), i), torch.randn(5, 2), torch.tensor([1, -1]))
    text = normalized_graph(gm.graph)
    assert text == "v0 = aten.relu(in0)\nv1 = cpgraph.take_rows(v0, in1)"
    assert normalized_graph(gm.graph, keep=("cpgraph.",)) == "v0 = cpgraph.take_rows(_, in1)"


def test_uuid_stable_and_sensitive():
    base = build_pass_manager(CPConfig())
    assert base.uuid() == build_pass_manager(CPConfig()).uuid()
    assert base.uuid() != build_pass_manager(CPConfig(group="g", cp_size=2)).uuid()
    assert base.uuid() != build_pass_manager(CPConfig(disabled_passes=("sort_topologically",))).uuid()
    assert base.uuid() != build_pass_manager(CPConfig(index_topk_pattern="FS")).uuid()
    assert base.uuid() != build_pass_manager(CPConfig(moe_modules=("MoE", "SparseMoeBlock"))).uuid()
    # The lowered collectives name their group: two groups of one size must not share a cached graph.
    assert build_pass_manager(CPConfig(group="a", cp_size=2)).uuid() != build_pass_manager(CPConfig(group="b", cp_size=2)).uuid()
    assert build_pass_manager(CPConfig(group="a", cp_size=2)).uuid() == build_pass_manager(CPConfig(group="a", cp_size=2)).uuid()

    class Absorbed:
        def __init__(self, tag):
            self.tag = tag

        def __call__(self, graph):
            pass

        def uuid(self):
            return self.tag

    a = build_pass_manager(CPConfig(), absorbed=Absorbed("x")).uuid()
    assert a != base.uuid() and a != build_pass_manager(CPConfig(), absorbed=Absorbed("y")).uuid()
    assert build_pass_manager(CPConfig(), absorbed=lambda g: None).uuid() is None


def test_uuid_covers_pass_sources(tmp_path, monkeypatch):
    import importlib.util

    src = tmp_path / "my_pass.py"
    src.write_text("def touch(gm, cfg):\n    return gm\n")
    spec = importlib.util.spec_from_file_location("my_pass", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    first = CPPassManager(CPConfig(), [("touch", mod.touch)]).uuid()
    src.write_text("def touch(gm, cfg):\n    return gm  # changed\n")
    assert CPPassManager(CPConfig(), [("touch", mod.touch)]).uuid() != first


def test_disable_by_name_and_unknown_name():
    m = build_pass_manager(CPConfig(disabled_passes=("sort_topologically",)))
    assert "sort_topologically" not in [n for n, _ in m.enabled]
    with pytest.raises(ValueError, match="unknown pass"):
        build_pass_manager(CPConfig(disabled_passes=("no_such_pass",)))


def test_inductor_backend_runs_passes_and_absorbs_user_pass(request):
    seen = []

    class UserPass:
        def __call__(self, graph):
            seen.append(len(graph.nodes))

        def uuid(self):
            return "user"

    patch = inductor_config.patch(post_grad_custom_pre_pass=UserPass(), fx_graph_cache=False)
    patch.__enter__()
    request.addfinalizer(lambda: patch.__exit__(None, None, None))
    torch._dynamo.reset()
    fn = compile(lambda x, i: ops.take_rows(x, i).sin(), backend="inductor")
    x, i = torch.randn(6, 3), torch.tensor([5, -1, 0])
    assert torch.allclose(fn(x, i), ops.take_rows(x, i).sin())
    assert seen, "the user's pass did not run"
    from cpgraph.passes.pipeline import default_passes

    assert [name for name, _, _ in fn.cpgraph_passes.history] == [name for name, _ in default_passes()]
    torch._dynamo.reset()


def test_graph_dumps_behind_env_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("CPGRAPH_DUMP_GRAPHS", str(tmp_path))
    torch._dynamo.reset()
    fn = compile(lambda x: x.cos() + 1, backend="aot_eager")
    fn(torch.randn(3))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.endswith("eliminate_dead_code_before.txt") for n in names)
    assert any(n.endswith("reject_host_syncs_after.txt") for n in names)
    torch._dynamo.reset()


def test_cpconfig_validation():
    with pytest.raises(ValueError, match="cp_size"):
        CPConfig(cp_size=0)
    with pytest.raises(ValueError, match="needs a process group"):
        CPConfig(cp_size=2)
    with pytest.raises(ValueError, match="group must be"):
        CPConfig(group=3, cp_size=2)
    with pytest.raises(ValueError, match="index_topk_pattern"):
        CPConfig(index_topk_pattern="SF")
    with pytest.raises(ValueError, match="index_topk_pattern"):
        CPConfig(index_topk_pattern="FX")
