"""The expert-parallel rewrite: op counts, graph snapshot, refusals, and numerics vs the unrewritten MoE.

Graph tests compile the two-layer GLM-5-style tiny model (layer 1 is a MoE)
holding rank 0's expert shard against a fake process group in this process
(tracing needs no peers).  Numerics run the model's ``MoE`` module, compiled
with the passes, on gloo ranks that each hold ``E / W`` experts, against the
same module unsharded and unrewritten (eager and compiled): the whole-model
CP+EP check is ``tests/runtime/test_ep_cp.py``.
"""

from __future__ import annotations

import copy
import operator
import sys
from pathlib import Path

import expecttest
import pytest
import torch

from cpgraph.models import DSAConfig, build_model, init_random
from cpgraph.models.config import bundled_config_dict
from cpgraph.models.moe import MoE, shard_experts
from cpgraph.models.prefill import make_layout
from cpgraph.passes import CPConfig, compile
from cpgraph.passes.fx_utils import op_counts, op_name, op_of
from cpgraph.passes.pipeline import default_passes
from cpgraph.runtime.engine import run_prefill

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import fake_group, shared_pool  # noqa: E402

pytestmark = pytest.mark.slow

PAGE = 16
# Gloo timeout: a rank may wait in an all-to-all while a peer still compiles (minutes on a loaded machine).
COMPILE_TIMEOUT_S = 900.0


@pytest.fixture(autouse=True)
def _no_caches():
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        yield
        torch._dynamo.reset()


def _config(**over):
    return DSAConfig.from_hf_dict(dict(bundled_config_dict("tiny-glm5"), num_hidden_layers=2, **over))


def two_layer_model(experts=None):
    model = init_random(build_model(_config()), seed=0, std=0.1).eval()
    model.kv_layout = make_layout(model, "bf16", PAGE)
    return model if experts is None else shard_experts(model, experts)


def moe_module(seed=0):
    """The model's MoE layer alone, seeded (8 experts, top-2, one shared expert)."""
    torch.manual_seed(seed)
    moe = MoE(_config())
    with torch.no_grad():
        for name, p in sorted(moe.named_parameters()):
            p.normal_(0, 0.1 if "gate.weight" not in name else 0.5)
        moe.gate.e_score_correction_bias.normal_(0, 0.05)
    return moe.eval()


def ep_round_trip(graph) -> str:
    """The rewritten experts call as text: the round-trip ops, tuple items named by index, other inputs ``_``."""
    shown = ("cpgraph.compact_valid_static", "cpgraph.restore_compute_static", "cpgraph.moe_dispatch", "cpgraph.moe_experts", "cpgraph.moe_combine", "aten.full", "aten.sym_size")
    names, lines = {}, []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is operator.getitem and n.args[0] in names:
            names[n] = f"{names[n.args[0]]}[{n.args[1]}]"
            continue
        name = op_name(op_of(n))
        if name not in shown or (name == "aten.sym_size" and n.args[0] not in names):
            continue
        names[n] = f"v{len(lines)}"

        def fmt(a):
            if isinstance(a, torch.fx.Node):
                return names.get(a, "_")
            if isinstance(a, (list, tuple)):
                return "[" + ", ".join(fmt(b) for b in a) + "]"
            return repr(a).replace("torch.", "")

        args = ", ".join([fmt(a) for a in n.args] + [f"{k}={fmt(v)}" for k, v in n.kwargs.items() if k == "dtype"])
        lines.append(f"{names[n]} = {name}({args})")
    return "\n".join(lines)


class TestExpertParallelPass(expecttest.TestCase):
    def test_ep2_graph_snapshot_and_counts(self):
        model = two_layer_model(experts=(0, 4))
        graphs = []

        def capture(gm, c):
            graphs.append(copy.deepcopy(gm.graph))
            return gm

        with fake_group(world_size=2, rank=0) as gn:
            cfg = CPConfig(group=gn, cp_size=2, ep=2)
            fn = compile(model, cfg, backend="aot_eager", dynamic=True, passes=default_passes() + [("capture", capture)])
            run_prefill(lambda *a, **k: fn(*a, **k), model, [list(range(3, 40)), list(range(7, 12))],
                        page_size=PAGE, rank=0, cp_size=2)
        history = {name: (before, after) for name, before, after in fn.cpgraph_passes.history}
        before, after = history["compact_moe_rows"]
        delta = {k: after[k] - before[k] for k in sorted(set(before) | set(after)) if after[k] != before[k]}
        # One MoE layer: compaction around it, and its one experts call wrapped in the round trip.
        self.assertEqual(before["cpgraph.moe_experts"], 1)
        self.assertEqual(after["cpgraph.moe_experts"], 1)
        self.assertEqual(
            {k: v for k, v in delta.items() if k.startswith("cpgraph.")},
            {"cpgraph.compact_valid_static": 1, "cpgraph.moe_combine": 1, "cpgraph.moe_dispatch": 1,
             "cpgraph.restore_compute_static": 1},
        )
        final = op_counts(graphs[-1], "cpgraph.moe")
        # The router's selection stays on this rank's rows: only the experts call travels.
        self.assertEqual(dict(final), {"cpgraph.moe_route": 1, "cpgraph.moe_dispatch": 1, "cpgraph.moe_experts": 1,
                                       "cpgraph.moe_combine": 1})
        self.assertExpectedInline(ep_round_trip(graphs[-1]), """\
v0 = cpgraph.compact_valid_static(_, _)
v1 = cpgraph.moe_dispatch(v0[0], _, _, 8, 2, '0', 2)
v2 = aten.sym_size(v1[1], 0)
v3 = aten.full([v2, 1], 1.0, dtype=float32)
v4 = cpgraph.moe_experts(v1[0], v1[1], v3, _, _, v1[2])
v5 = cpgraph.moe_combine(v4, v1[3], v1[4], _, '0', 2)
v6 = cpgraph.restore_compute_static(_, _)""")

    def test_ep1_refuses_an_expert_shard(self):
        moe = shard_experts(moe_module(), (0, 4))
        fn = compile(moe, CPConfig(moe_modules=()), backend="aot_eager")
        with pytest.raises(Exception, match="the router scores 8 experts but the experts hold 4"), torch.no_grad():
            fn(torch.randn(5, 64))

    def test_a_plain_topk_router_is_read_too(self):
        """A user's router written with ``torch.topk`` (as transformers' is) tells the pass its width as well."""

        class TopkRouter(torch.nn.Module):
            def __init__(self, gate):
                super().__init__()
                self.weight = gate.weight

            def forward(self, x):
                scores = (x.float() @ self.weight.t()).sigmoid()
                w, ids = scores.topk(2, dim=-1)
                return ids, w

        moe = shard_experts(moe_module(), (0, 4))
        moe.gate = TopkRouter(moe.gate)
        fn = compile(moe, CPConfig(moe_modules=()), backend="aot_eager")
        with pytest.raises(Exception, match="the router scores 8 experts but the experts hold 4"), torch.no_grad():
            fn(torch.randn(5, 64))

    def test_shard_of_the_wrong_size_is_refused(self):
        moe = shard_experts(moe_module(), (0, 2))  # 2 experts: a shard for ep=4, compiled for ep=2
        with fake_group(world_size=2) as gn:
            fn = compile(moe, CPConfig(group=gn, cp_size=2, ep=2, moe_modules=()), backend="aot_eager")
            with pytest.raises(Exception, match=r"router scores 8 experts but 2 local experts x ep 2 = 4"):
                with torch.no_grad():
                    fn(torch.randn(5, 64))

    def test_eager_shard_refuses_to_compute(self):
        moe = shard_experts(moe_module(), (4, 8))
        with pytest.raises(RuntimeError, match=r"Experts hold experts \[4, 8\) of 8"), torch.no_grad():
            moe(torch.randn(3, 64))

    def test_config_errors(self):
        with pytest.raises(ValueError, match="ep must be 1 or cp_size"):
            CPConfig(group="g", cp_size=4, ep=2)
        with pytest.raises(ValueError, match="needs the compact_moe_rows pass"):
            CPConfig(group="g", cp_size=2, ep=2, disabled_passes=("compact_moe_rows",))


# ------------------------------------------------------------ numerics on gloo ranks
def _rows(m, seed):
    return torch.randn(m, 64, generator=torch.Generator().manual_seed(seed))


def job_moe_numerics(ctx, batches):
    """Per batch: (EP compiled on this rank's shard, unsharded eager, unsharded compiled with ep=1)."""
    W = ctx.world_size
    whole = moe_module()
    per = 8 // W
    shard = shard_experts(copy.deepcopy(whole), (ctx.rank * per, (ctx.rank + 1) * per))
    ep = compile(shard, CPConfig(group=ctx.group_name, cp_size=W, ep=W, moe_modules=()), backend="aot_eager",
                 dynamic=True)
    plain = compile(whole, CPConfig(moe_modules=()), backend="aot_eager", dynamic=True)
    out = []
    for m, real, skew in batches:
        x = _rows(m, seed=10 * ctx.rank + m)
        ks = torch.zeros(m, dtype=torch.int32)
        ke = (torch.arange(m) < real).to(torch.int32)  # real rows first: non-empty key window
        biases = [b.gate.e_score_correction_bias for b in (whole, shard)]
        saved = biases[0].clone()
        if skew is not None:  # every row routes to the experts of rank `skew`
            for b in biases:
                b[skew * per:(skew + 1) * per] += 100.0
        with torch.no_grad():
            got = ep(x, (ks, ke))
            ref = whole(x, (ks, ke))
            comp = plain(x, (ks, ke))
        for b in biases:
            b.copy_(saved)
        out.append((got.numpy(), ref.numpy(), comp.numpy()))
    return out


BATCHES = [(9, 9, None), (7, 4, None), (6, 6, 0), (5, 5, 1), (3, 0, None)]  # (rows, real rows, all-to-rank)


@pytest.mark.parametrize("world", [2, 4])
def test_ep_moe_matches_the_unrewritten_moe(world):
    import numpy as np

    results = shared_pool(world, COMPILE_TIMEOUT_S).run(job_moe_numerics, BATCHES)
    worst = 0.0
    for rank, per_batch in enumerate(results):
        for (m, real, skew), (got, ref, comp) in zip(BATCHES, per_batch):
            assert np.array_equal(ref, comp), (rank, m)  # the unrewritten compile is the eager module
            scale = max(float(np.abs(ref).max()), 1e-30)
            rel = float(np.abs(got - ref).max()) / scale
            worst = max(worst, rel)
            # fp32: the combine sums top-k slots where the dense reference sums E columns.
            assert rel <= 1e-5, (world, rank, m, real, skew, rel)
    print(f"\nEP MoE vs unrewritten, {world} ranks: max relative difference {worst:.1e}")


def job_moe_inductor(ctx):
    """The EP MoE compiled by Inductor (the dispatch/combine ops run as opaque custom ops inside)."""
    W = ctx.world_size
    whole = moe_module()
    per = 8 // W
    shard = shard_experts(copy.deepcopy(whole), (ctx.rank * per, (ctx.rank + 1) * per))
    torch._inductor.config.fx_graph_cache = False
    # Scalar C++ kernels, as the CP model tests compile (tests/cp_model.py): this checks the graph Inductor
    # lowers around the EP ops, not the CPU vector code; scalar kernels compile in about half the time, and
    # with the CP tests' compiler flags, so they share one precompiled header on a cold machine.
    torch._inductor.config.cpp.vec_isa_ok = False
    ep = compile(shard, CPConfig(group=ctx.group_name, cp_size=W, ep=W, moe_modules=()), backend="inductor",
                 dynamic=True)
    x = _rows(7, seed=ctx.rank)
    ks, ke = torch.zeros(7, dtype=torch.int32), (torch.arange(7) < 5).to(torch.int32)
    with torch.no_grad():
        return ep(x, (ks, ke)).numpy(), whole(x, (ks, ke)).numpy()


def test_ep_moe_compiles_with_inductor():
    import numpy as np

    for got, ref in shared_pool(2, COMPILE_TIMEOUT_S).run(job_moe_inductor):
        assert float(np.abs(got - ref).max() / np.abs(ref).max()) <= 1e-5
