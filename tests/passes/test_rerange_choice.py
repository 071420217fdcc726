"""The rerange form the lowered CP forward uses: P2P on CUDA + NCCL, all-gather elsewhere.

The choice is made from static facts (device of the rows, backend of the
group) when ``lower_cp_collectives`` runs, and shows in the lowered graph as
a distinct op (``cpgraph.cp_rerange_p2p`` with its ``min_bytes`` argument).
The P2P op itself (reference and the block provider of
``cpgraph.kernels.p2p``) is checked bit for bit against the all-gather form
on 2 gloo ranks, and with ``opcheck``; ``torch.compile`` / CUDA-graph runs
over NCCL are in ``benchmarks/rerange_nccl_bench.py`` (GPU only).
"""

from __future__ import annotations

import sys
from pathlib import Path

import expecttest
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import cpgraph.ops  # noqa: F401
from cpgraph.kernels import p2p
from cpgraph.ops.collectives import (
    RERANGE_P2P_MIN_BYTES,
    cp_rerange_decomposed,
    cp_rerange_p2p_reference,
    rerange_form,
)
from cpgraph.passes import CPConfig, lower_collectives
from cpgraph.passes.fx_utils import normalized_graph
from cpgraph.plan import plan_prefill

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import fake_group, shared_pool  # noqa: E402
from row_invariant import row_invariant_matmul  # noqa: E402

KEEP = ("cpgraph.", "_c10d_functional.")


def _lowered(device: str, backend: str | None, monkeypatch) -> str:
    """Trace ``cp_rerange`` on fake ``device`` tensors, lower it with the group's backend reading ``backend``."""
    monkeypatch.setattr(lower_collectives, "group_backend", lambda name, device_type: backend)
    with fake_group(world_size=2, rank=0) as gn:

        def fn(rows, index):
            return torch.ops.cpgraph.cp_rerange(rows, index, gn, 2)

        with FakeTensorMode(allow_non_fake_inputs=False):
            rows = torch.empty(12, 8, device=device, dtype=torch.bfloat16)
            index = torch.empty(20, device=device, dtype=torch.int64)
        gm = make_fx(fn, tracing_mode="fake")(rows, index)
        gm = lower_collectives.lower_cp_collectives(gm, CPConfig(group=gn, cp_size=2))
        return normalized_graph(gm.graph, keep=KEEP)


class TestRerangeChoice(expecttest.TestCase):
    def test_cuda_nccl_graph_uses_the_p2p_op(self):
        with pytest.MonkeyPatch.context() as mp:
            text = _lowered("cuda", "nccl", mp)
        self.assertExpectedInline(text, """v0 = cpgraph.cp_rerange_p2p(in0, in1, '0', 2, 8388608)""")

    def test_cpu_gloo_graph_keeps_the_all_gather_form(self):
        with pytest.MonkeyPatch.context() as mp:
            text = _lowered("cpu", "gloo", mp)
        self.assertExpectedInline(
            text,
            """\
v0 = _c10d_functional.all_gather_into_tensor(in0, 2, '0')
v1 = _c10d_functional.wait_tensor(v0)
v2 = cpgraph.take_rows(v1, in1)""",
        )

    def test_cuda_without_nccl_keeps_the_all_gather_form(self):
        with pytest.MonkeyPatch.context() as mp:
            text = _lowered("cuda", "gloo", mp)
        self.assertNotIn("cp_rerange_p2p", text)
        self.assertIn("all_gather_into_tensor", text)


def test_rule_from_static_facts():
    assert rerange_form("cuda", "nccl") == "p2p"
    assert rerange_form("cuda", "NCCL") == "p2p"
    for device, backend in (("cpu", "gloo"), ("cpu", "nccl"), ("cuda", "gloo"), ("cuda", None), ("cuda", "fake")):
        assert rerange_form(device, backend) == "all_gather", (device, backend)
    assert RERANGE_P2P_MIN_BYTES > 0


def test_group_backend_reads_the_registry():
    with fake_group(world_size=2, rank=0) as gn:
        assert lower_collectives.group_backend(gn, "cpu") == "fake"
    assert lower_collectives.group_backend("no-such-group", "cuda") is None


# ------------------------------------------------------------ the op over 2 gloo ranks
PLANS = [([0, 0, 0], [37, 5, 64], 4, 1), ([8, 0], [1, 23], 2, 8), ([0, 8, 0, 0], [16, 16, 9, 40], 8, 4)]


def job_p2p_op(ctx, k: int):
    prefix, extend, page, align = PLANS[k]
    plan = plan_prefill(prefix, extend, cp_size=ctx.world_size, page_size=page, row_align=align)
    index = plan.rank(ctx.rank, rerange=True).rerange_index
    gn, ws = ctx.group_name, ctx.world_size
    for shape, dtype in (((6,), torch.float32), ((3, 5), torch.bfloat16), ((4,), torch.int64)):
        g = torch.Generator().manual_seed(100 * ctx.rank + k)
        rows = (torch.randn((plan.num_rows, *shape), generator=g) * 3).to(dtype)
        want = cp_rerange_decomposed(rows, index, gn, ws)
        for min_bytes in (0, 1 << 40):  # P2P path / all-gather path inside the op
            for got in (
                torch.ops.cpgraph.cp_rerange_p2p(rows, index, gn, ws, min_bytes),
                cp_rerange_p2p_reference(rows, index, gn, ws, min_bytes),
                p2p.cp_rerange_p2p_blocks(rows, index, gn, ws, min_bytes),  # Triton placement (interpreter)
            ):
                assert got.shape == want.shape and got.dtype == want.dtype
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (shape, dtype, min_bytes)
    rows = torch.randn(plan.num_rows, 6)
    for min_bytes in (0, 1 << 40):
        torch.library.opcheck(torch.ops.cpgraph.cp_rerange_p2p.default, (rows, index, gn, ws, min_bytes))
    return True


@pytest.mark.slow
@pytest.mark.parametrize("k", range(len(PLANS)))
def test_p2p_op_equals_all_gather_form(k):
    assert shared_pool(2).run(job_p2p_op, k) == [True, True]


def test_p2p_op_compiles_with_dynamic_shapes():
    with fake_group(world_size=2, rank=0) as gn:

        def fn(rows, index):
            return torch.ops.cpgraph.cp_rerange_p2p(rows, index, gn, 2, RERANGE_P2P_MIN_BYTES) * 2

        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
        for m, t in ((6, 9), (10, 17)):
            out = compiled(torch.randn(m, 4), torch.zeros(t, dtype=torch.int64))
            assert out.shape == (t, 4)


def test_p2p_op_bad_min_bytes():
    with fake_group(world_size=2, rank=0) as gn:
        with pytest.raises(ValueError, match="min_bytes"):
            torch.ops.cpgraph.cp_rerange_p2p(torch.zeros(4, 2), torch.zeros(3, dtype=torch.int64), gn, 2, -1)


# ------------------------------------------------------------ the op inside a compiled CP model
def job_compiled_model_p2p_rerange(ctx):
    """Tiny model, extend-only batch returning all hidden states: cp=2 with the P2P rerange forced in
    (gloo stands in for NCCL, ``min_bytes=0``) equals the one-device run, bit for bit (fp32).

    The cp=2 rank's GEMMs have fewer rows than the one-device run's: fixed-order matrix products make
    the comparison bit-exact by construction (docs/bitwise.md).  The one-device run is the eager
    model: with fixed-order products the one-device ``aot_eager`` compile equals it bit for bit
    (``test_cp_numerics``, ``test_cp_pipeline``), and not compiling it halves the ranks' work.  One
    decoder layer: the rerange is the output rows' selection (one op, after the last layer),
    whatever the depth."""
    with row_invariant_matmul():
        return _compiled_model_p2p_rerange(ctx)


def _compiled_model_p2p_rerange(ctx):
    import torch.distributed as dist

    from cpgraph.models import DSAConfig, build_batch, build_model, init_random
    from cpgraph.models.config import bundled_config_dict
    from cpgraph.models.prefill import make_layout
    from cpgraph.passes import compile as cp_compile
    from cpgraph.runtime.engine import pool_config
    from cpgraph.runtime.kv_pool import KVPool

    torch._dynamo.config.specialize_float = True
    torch._dynamo.config.recompile_limit = 64
    page = 16
    config = dict(bundled_config_dict("tiny-deepseek-v32"), num_hidden_layers=1)
    model = init_random(build_model(DSAConfig.from_hf_dict(config)), seed=0, std=0.1).eval()
    model.kv_layout = make_layout(model, "bf16", page)
    cfg = model.config
    extend = [37, 5, 64]
    toks = [[(7 * i + 3 * j) % cfg.vocab_size for j in range(n)] for i, n in enumerate(extend)]

    def hidden(cp: int, rank: int, compiled):
        plan = plan_prefill([0] * len(extend), extend, cp_size=cp, page_size=page)
        owners = [plan.page_owners(i) for i in range(len(extend))]
        pool = KVPool(pool_config(model, "bf16", page, sum(o.count(rank) for o in owners), rank))
        tables = [pool.alloc_pages_with_owners(o) for o in owners]
        mla = [pool.mla_pool(i) for i in range(cfg.num_hidden_layers)]
        index = [pool.index_pool(i) for i in cfg.indexer_layers]
        ids, meta = build_batch(plan, toks, tables, torch.device("cpu"), rank=rank)
        with torch.no_grad():
            return compiled(ids, meta, mla, index, return_hidden=True).hidden

    one = hidden(1, 0, model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lower_collectives, "rerange_form", lambda device_type, backend: "p2p")
        mp.setattr(lower_collectives, "RERANGE_P2P_MIN_BYTES", 0)
        compiled = cp_compile(model, CPConfig(group=ctx.group_name, cp_size=2), backend="aot_eager", dynamic=True)
        got = hidden(2, ctx.rank, compiled)
    lowered = [after for name, _, after in compiled.cpgraph_passes.history if name == "lower_cp_collectives"][-1]
    assert lowered.get("cpgraph.cp_rerange_p2p", 0) == 1 and lowered.get("cpgraph.cp_rerange", 0) == 0, lowered
    assert dist.get_world_size() == 2
    assert got.shape == one.shape and torch.equal(got, one), float((got - one).abs().max())
    return True


@pytest.mark.slow
@pytest.mark.bitexact
def test_compiled_model_uses_and_matches_the_p2p_rerange():
    assert shared_pool(2, 900.0).run(job_compiled_model_p2p_rerange) == [True, True]
