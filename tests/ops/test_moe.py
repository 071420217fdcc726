"""cpgraph::moe_experts: dense reference vs per-row brute force, grouped dispatch vs reference, opcheck, errors.

The grouped path runs on CPU through ``torch._grouped_mm`` (torch 2.13 has a
CPU kernel) with the torch combine, and with the Triton combine under
``TRITON_INTERPRET=1``; the GPU tests (skewed routing, CUDA-graph capture)
run only on a CUDA machine.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import cpgraph.ops  # noqa: F401  (registers the ops)
from cpgraph.ops.moe import combine_reference, dispatch_plan, moe_experts_grouped, moe_experts_reference

ops = torch.ops.cpgraph
INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"
needs_grouped_cpu = pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm missing in this torch build"
)


def make_inputs(M=11, H=16, I=8, E=6, k=2, dtype=torch.float32, seed=0, skew=None, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g).to(dtype)
    if skew is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    else:  # expert `skew` in every row's first slot, the rest spread
        rest = torch.stack([torch.randperm(E - 1, generator=g)[: k - 1] for _ in range(M)])
        rest = rest + (rest >= skew).long()
        ids = torch.cat([torch.full((M, 1), skew), rest], dim=1)
    w = torch.rand(M, k, generator=g) + 0.1
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    return [t.to(device) for t in (x, ids, w, gate_up, down)]


def brute_force(x, ids, w, gate_up, down, num_valid=None):
    """One row, one slot at a time, in float64."""
    M, H = x.shape
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    out = torch.zeros(M, H, dtype=torch.float64)
    limit = M if num_valid is None else int(num_valid)
    for m in range(min(limit, M)):
        for j in range(ids.shape[1]):
            e = int(ids[m, j])
            if not 0 <= e < E:
                continue
            gu = gate_up[e].double() @ x[m].double()
            act = F.silu(gu[:I]) * gu[I:]
            out[m] += float(w[m, j]) * (down[e].double() @ act)
    return out


@pytest.mark.parametrize("num_valid", [None, 11, 7, 0])
def test_reference_matches_brute_force(num_valid):
    x, ids, w, gu, d = make_inputs()
    nv = None if num_valid is None else torch.tensor([num_valid])
    got = ops.moe_experts(x, ids, w, gu, d, nv)
    assert torch.allclose(got.double(), brute_force(x, ids, w, gu, d, num_valid), atol=1e-5, rtol=1e-5)
    if num_valid is not None:
        assert torch.equal(got[num_valid:], torch.zeros_like(got[num_valid:]))  # exact zeros, not small


def test_dispatch_plan_sorts_pairs_and_bounds_groups():
    x, ids, w, gu, d = make_inputs(M=9, E=5, k=3)
    ids[2, 1] = 7  # out of range: routes nowhere
    ids[4, 0] = -1
    plan = dispatch_plan(ids, torch.tensor([6]), 5)
    C = 9 * 3
    assert plan.order.shape == (C,) and plan.group_ends.dtype == torch.int32 and plan.slot_pos.shape == (9, 3)
    routed = [(m, j) for m in range(6) for j in range(3) if 0 <= int(ids[m, j]) < 5]
    ends = plan.group_ends.tolist()
    assert ends[-1] == len(routed)
    counts = [sum(1 for m, j in routed if int(ids[m, j]) == e) for e in range(5)]
    assert [b - a for a, b in zip([0] + ends[:-1], ends)] == counts
    for m in range(9):
        for j in range(3):
            p = int(plan.slot_pos[m, j])
            if (m, j) in routed:
                e = int(ids[m, j])
                assert (ends[e - 1] if e else 0) <= p < ends[e]
                assert int(plan.order[p]) == m * 3 + j
            else:
                assert p == -1


@needs_grouped_cpu
@pytest.mark.parametrize("num_valid", [None, 9, 3, 0])
@pytest.mark.parametrize("skew", [None, 2])
def test_grouped_equals_dense_fp32(num_valid, skew):
    x, ids, w, gu, d = make_inputs(M=13, E=6, k=2, skew=skew, seed=3)
    nv = None if num_valid is None else torch.tensor([num_valid])
    dense = moe_experts_reference(x, ids, w, gu, d, nv)
    grouped = moe_experts_grouped(x, ids, w, gu, d, nv)
    assert torch.allclose(grouped, dense, atol=1e-6, rtol=1e-5)
    if num_valid is not None:
        assert torch.equal(grouped[num_valid:], torch.zeros_like(grouped[num_valid:]))


@needs_grouped_cpu
def test_grouped_ignores_out_of_range_ids_like_reference():
    x, ids, w, gu, d = make_inputs(M=8, E=4, k=2)
    ids[1, 0], ids[5, 1] = 4, -3
    dense = moe_experts_reference(x, ids, w, gu, d)
    assert torch.allclose(moe_experts_grouped(x, ids, w, gu, d), dense, atol=1e-6, rtol=1e-5)
    assert torch.allclose(dense.double(), brute_force(x, ids, w, gu, d), atol=1e-5)


@needs_grouped_cpu
def test_grouped_bf16_close_to_fp32():
    x, ids, w, gu, d = make_inputs(M=32, H=64, I=32, E=8, k=2, seed=4)
    ref = moe_experts_reference(x, ids, w, gu, d)
    got = moe_experts_grouped(x.bfloat16(), ids, w, gu.bfloat16(), d.bfloat16(), None)
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().max() <= 0.02 * ref.abs().max()


def test_combine_reference_skips_unread_positions():
    y = torch.full((6, 4), float("nan"))  # stands for uninitialised rows past the last group
    y[0], y[1] = 1.0, 2.0
    pos = torch.tensor([[0, -1], [1, 0], [-1, -1]])
    w = torch.tensor([[0.5, 3.0], [1.0, 2.0], [1.0, 1.0]])
    out = combine_reference(y, pos, w, torch.float32)
    assert torch.equal(out, torch.tensor([[0.5] * 4, [4.0] * 4, [0.0] * 4]))


@pytest.mark.skipif(not INTERPRET, reason="Triton combine on CPU needs TRITON_INTERPRET=1")
def test_triton_combine_matches_torch_combine():
    from cpgraph.kernels.moe import combine

    g = torch.Generator().manual_seed(0)
    C, H, M, k = 40, 70, 17, 3
    y = torch.randn(C, H, generator=g).bfloat16()
    y[30:] = float("nan")  # never addressed: positions past the last group
    pos = torch.randint(-1, 30, (M, k), generator=g)
    w = torch.rand(M, k, generator=g)
    got = combine(y, pos, w, torch.bfloat16)
    ref = combine_reference(y, pos, w, torch.bfloat16)
    assert not got.isnan().any()
    assert torch.allclose(got.float(), ref.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(not INTERPRET, reason="the Triton provider on CPU needs TRITON_INTERPRET=1")
@needs_grouped_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_provider_through_the_op(dtype):
    from cpgraph.kernels import moe as kmoe
    from cpgraph.ops.providers import active_provider, register_provider, unregister_provider

    x, ids, w, gu, d = make_inputs(M=21, H=16, I=8, E=5, k=2, skew=1, seed=7)
    nv = torch.tensor([15])
    ref = ops.moe_experts(x, ids, w, gu, d, nv)
    register_provider("moe_experts", "cpu", "triton", kmoe.moe_experts)
    try:
        assert active_provider("moe_experts", "cpu") == "triton"
        got = ops.moe_experts(x.to(dtype), ids, w, gu.to(dtype), d.to(dtype), nv)
    finally:
        unregister_provider("moe_experts", "cpu")
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float(), ref, atol=tol, rtol=tol)
    assert torch.equal(got[15:].float(), torch.zeros(6, 16))


@pytest.mark.parametrize(
    "kw,num_valid",
    [
        (dict(M=5, H=8, I=4, E=3, k=1), None),
        (dict(M=9, H=16, I=8, E=6, k=2), torch.tensor([4])),
        (dict(M=12, H=8, I=4, E=4, k=3, dtype=torch.bfloat16), torch.tensor([12], dtype=torch.int32)),
        (dict(M=1, H=8, I=4, E=2, k=2), torch.tensor([0])),
    ],
)
def test_moe_experts_opcheck(kw, num_valid):
    x, ids, w, gu, d = make_inputs(**kw)
    opcheck(ops.moe_experts.default, (x, ids, w, gu, d, num_valid))
    opcheck(ops.moe_experts.default, (x, ids.int(), w, gu, d))


def test_traces_with_dynamic_rows_without_recompiles():
    def f(x, ids, w, gu, d, nv):
        return ops.moe_experts(x, ids, w, gu, d, nv) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    for M in (5, 9, 14):
        x, ids, w, gu, d = make_inputs(M=M)
        nv = torch.tensor([M - 2])
        assert torch.allclose(compiled(x, ids, w, gu, d, nv), f(x, ids, w, gu, d, nv))
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.__setitem__(2, a[2].double()), "'topk_w' must have dtype float32"),
        (lambda a: a.__setitem__(1, a[1].float()), "'topk_ids' must have dtype"),
        (lambda a: a.__setitem__(3, a[3][:, :7]), "'gate_up' must be [E, 2*I, H]"),
        (lambda a: a.__setitem__(4, a[4][:2]), "'down' must have shape"),
        (lambda a: a.__setitem__(0, a[0].bfloat16()), "'gate_up' must have dtype bfloat16"),
        (lambda a: a.append(torch.tensor([3.0])), "'num_valid' must have dtype"),
        (lambda a: a.append(torch.tensor([[3]])), "'num_valid' must have shape"),
    ],
)
def test_bad_input_one_line_error(change, message):
    args = list(make_inputs())
    change(args)
    with pytest.raises(ValueError) as err:
        ops.moe_experts(*args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_debug_flag_rejects_out_of_range_ids(monkeypatch):
    x, ids, w, gu, d = make_inputs(E=6)
    ids[0, 0] = 6
    monkeypatch.setenv("CPGRAPH_DEBUG", "1")
    with pytest.raises(ValueError, match="topk_ids"):
        ops.moe_experts(x, ids, w, gu, d)


# ------------------------------------------------------------------ GPU only
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("num_valid", [None, 3000])
def test_gpu_skewed_routing_matches_dense(num_valid):
    from cpgraph.ops.providers import active_provider, bind_providers

    bind_providers("cuda")

    assert active_provider("moe_experts", "cuda") == "triton"
    # Expert 3 gets every row's first slot: one group holds M of the 2M pairs.
    x, ids, w, gu, d = make_inputs(M=4096, H=256, I=128, E=16, k=2, skew=3, device="cuda")
    nv = None if num_valid is None else torch.tensor([num_valid], device="cuda")
    ref = moe_experts_reference(x, ids, w, gu, d, nv)
    got = ops.moe_experts(x.bfloat16(), ids, w, gu.bfloat16(), d.bfloat16(), nv)
    err = (got.float() - ref).abs().max() / ref.abs().max()
    assert err < 2e-2, float(err)
    if num_valid is not None:
        assert torch.equal(got[num_valid:], torch.zeros_like(got[num_valid:]))


@cuda
def test_gpu_cuda_graph_replay_follows_new_routing():
    cpgraph.ops.bind_providers("cuda")
    x, ids, w, gu, d = make_inputs(M=512, H=128, I=64, E=8, k=2, device="cuda")
    x, gu, d = x.bfloat16(), gu.bfloat16(), d.bfloat16()
    nv = torch.tensor([400], device="cuda")
    ops.moe_experts(x, ids, w, gu, d, nv)  # warm up (Triton compile, cuBLAS/CUTLASS workspaces)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.moe_experts(x, ids, w, gu, d, nv)
    _, ids2, w2, _, _ = make_inputs(M=512, H=128, I=64, E=8, k=2, skew=5, seed=9, device="cuda")
    ids.copy_(ids2)
    w.copy_(w2)
    nv.fill_(256)
    graph.replay()
    torch.cuda.synchronize()
    ref = moe_experts_reference(x.float(), ids, w, gu.float(), d.float(), nv)
    assert (out.float() - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert torch.equal(out[256:], torch.zeros_like(out[256:]))
