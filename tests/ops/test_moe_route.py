"""cpgraph::moe_route: the reference against a brute force written apart, opcheck, errors, and the kernel.

The brute force ranks with Python's ``sorted`` on ``(NaN first, -value, index)`` keys and does the fp32
arithmetic in numpy, one row at a time; the reference (torch stable sorts, gathers) must equal it bit for
bit, ties, NaN and signed zeros included.  The kernel runs on CPU tensors under ``TRITON_INTERPRET=1`` and
on CUDA when a GPU is present, and must equal the reference bit for bit.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.library import opcheck

import cpgraph.ops  # noqa: F401  (registers the ops)
from cpgraph.ops.moe_route import moe_route_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_env import kernel_device, needs_gpu, needs_kernels  # noqa: E402

ops = torch.ops.cpgraph
F32 = np.float32
# (experts, n_group, topk_group, top_k): V3.2 / GLM-5's, and small ones with odd group counts
SHAPES = [(256, 8, 4, 8), (16, 4, 2, 3), (8, 1, 1, 2), (12, 3, 2, 5), (64, 8, 8, 8)]


def brute_route(scores, bias, n_group, topk_group, top_k, norm, scaling):
    """One row at a time in plain Python and numpy fp32 (written apart from the op's reference)."""

    def ranked(values, idx):
        return sorted(idx, key=lambda i: (0 if math.isnan(values[i]) else 1, 0.0 if math.isnan(values[i]) else
                                          -float(values[i]), i))

    s = scores.numpy().astype(F32)
    b = bias.numpy().astype(F32)
    m, e = s.shape
    per = e // n_group
    ids = np.zeros((m, top_k), dtype=np.int64)
    w = np.zeros((m, top_k), dtype=F32)
    for r in range(m):
        choice = [F32(s[r, i] + b[i]) for i in range(e)]
        group_score = []
        for g in range(n_group):
            first, second = ranked(choice, range(g * per, g * per + per))[:2]
            group_score.append(F32(choice[first] + choice[second]))
        kept = set(ranked(group_score, range(n_group))[:topk_group])
        masked = [choice[i] if i // per in kept else F32(-np.inf) for i in range(e)]
        chosen = ranked(masked, range(e))[:top_k]
        ws = [F32(s[r, i]) for i in chosen]
        if norm:
            total = ws[0]
            for x in ws[1:]:
                total = F32(total + x)
            ws = [F32(x / F32(total + F32(1e-20))) for x in ws]
        ids[r] = chosen
        w[r] = [F32(x * F32(scaling)) for x in ws]
    return torch.from_numpy(ids), torch.from_numpy(w)


def scores_for(m, e, seed=0, kind="random"):
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        s = torch.rand(m, e, generator=g)
    elif kind == "ties":  # few levels: ties inside groups, between groups and at the k-th expert
        s = torch.randint(0, 4, (m, e), generator=g).float() / 4
    else:  # "special": NaN, signed zeros, infinities and ties in some rows
        s = torch.randint(0, 3, (m, e), generator=g).float() / 2
        s[0, :: max(1, e // 5)] = float("nan")
        s[1] = -0.0
        s[1, e // 2:] = 0.0
        s[2, 1] = float("inf")
        s[2, -1] = float("-inf")
        s[3] = float("nan")
    bias = (torch.randint(-2, 3, (e,), generator=g).float() / 8) if kind != "random" else torch.randn(e, generator=g) / 64
    return s, bias


def same_bits(a, b) -> bool:
    """Equal bit patterns, NaN aside: a NaN must sit where the other has one, but its payload and sign are the
    hardware's (x86 makes ``-nan`` where a GPU makes its canonical ``nan``), so NaNs compare as one pattern."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    if not torch.equal(a.isnan(), b.isnan()):
        return False
    a, b = a.nan_to_num(0.0, posinf=float("inf"), neginf=float("-inf")), b.nan_to_num(0.0, posinf=float("inf"),
                                                                                      neginf=float("-inf"))
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def bit_diff(a, b) -> str:
    """The first entries whose bits differ (NaNs as one pattern), for an assertion's message."""
    a, b = a.float(), b.float()
    bad = (a.isnan() != b.isnan()) | (~a.isnan() & (a.view(torch.int32) != b.view(torch.int32)))
    at = bad.nonzero()[:4].tolist()
    return f"{int(bad.sum())} entries differ, e.g. " + ", ".join(f"{tuple(i)}: {a[tuple(i)].item()!r} vs "
                                                                  f"{b[tuple(i)].item()!r}" for i in at)


def test_same_bits_treats_nan_payloads_alike_and_nothing_else():
    x = torch.tensor([1.0, float("nan"), -0.0, float("inf")])
    y = x.clone()
    y.view(torch.int32)[1] = -4194304  # 0xFFC00000: x86's default NaN, a GPU's is 0x7FFFFFFF
    assert same_bits(x, y)
    for i, v in ((0, 1.0000001), (2, 0.0), (3, 3.0e38), (1, 0.0)):
        z = y.clone()
        z[i] = v
        assert not same_bits(x, z), i


@pytest.mark.parametrize("e,n_group,topk_group,top_k", SHAPES)
@pytest.mark.parametrize("kind", ["random", "ties", "special"])
@pytest.mark.parametrize("norm", [True, False])
def test_reference_equals_the_brute_force(e, n_group, topk_group, top_k, kind, norm):
    s, b = scores_for(7, e, seed=e + top_k, kind=kind)
    got = moe_route_reference(s, b, n_group, topk_group, top_k, norm, 2.5)
    want = brute_route(s, b, n_group, topk_group, top_k, norm, 2.5)
    assert torch.equal(got[0], want[0])
    assert same_bits(got[1], want[1])


def test_reference_routes_like_three_topk_calls_on_distinct_scores():
    """On scores without ties, the chosen set and its weights are those of the torch formulation the model used
    before (topk of the groups' best two, topk of the groups, topk of the kept experts)."""
    s, b = scores_for(64, 256, seed=3)
    ids, w = moe_route_reference(s, b, 8, 4, 8, True, 2.5)
    choice = s + b
    group = choice.view(64, 8, 32).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group).scatter(1, group.topk(4, dim=-1).indices, 1.0)
    masked = choice.masked_fill(keep.repeat_interleave(32, dim=1) == 0, float("-inf"))
    old = masked.topk(8, dim=-1).indices
    assert torch.equal(ids.sort(-1).values, old.sort(-1).values)
    ow = s.gather(1, old)
    ow = ow / (ow.sum(-1, keepdim=True) + 1e-20) * 2.5
    by_id = ids.argsort(-1)
    assert torch.allclose(w.gather(1, by_id), ow.gather(1, old.argsort(-1)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("m,e,n_group,topk_group,top_k", [(5, 256, 8, 4, 8), (1, 16, 4, 2, 3), (9, 12, 3, 2, 5),
                                                         (3, 8, 1, 1, 2)])
def test_opcheck(m, e, n_group, topk_group, top_k):
    s, b = scores_for(m, e, seed=m)
    for norm in (True, False):
        opcheck(ops.moe_route.default, (s, b, n_group, topk_group, top_k, norm, 1.5))


def test_compiles_with_a_dynamic_row_count():
    def route(x, bias):
        return ops.moe_route(x.sigmoid(), bias, 4, 2, 3, True, 2.5)

    compiled = torch.compile(route, backend="aot_eager", dynamic=True, fullgraph=True)
    for m in (3, 17, 40):
        s, b = scores_for(m, 16, seed=m)
        got, want = compiled(s, b), route(s, b)
        assert torch.equal(got[0], want[0]) and same_bits(got[1], want[1])


def test_no_rows():
    ids, w = ops.moe_route(torch.empty(0, 16), torch.zeros(16), 4, 2, 3, True, 1.0)
    assert ids.shape == (0, 3) and ids.dtype == torch.int64 and w.shape == (0, 3) and w.dtype == torch.float32


@pytest.mark.parametrize("change,needle", [
    (dict(n_group=5), "do not split into n_group=5 groups"),
    (dict(n_group=16), "groups of >= 2"),
    (dict(topk_group=5), "'topk_group' (5) exceeds n_group (4)"),
    (dict(top_k=9), "'top_k' (9) exceeds the 8 experts of the kept groups"),
    (dict(top_k=0), "'top_k' must be a positive int"),
    (dict(n_group=0), "'n_group' must be a positive int"),
    (dict(scores=torch.rand(3, 16, dtype=torch.float64)), "scores"),
    (dict(scores=torch.rand(16)), "scores"),
    (dict(bias=torch.zeros(15)), "bias"),
])
def test_bad_arguments_raise_one_line_errors(change, needle):
    args = dict(scores=torch.rand(3, 16), bias=torch.zeros(16), n_group=4, topk_group=2, top_k=3, norm=True,
                scaling=1.0)
    args.update(change)
    with pytest.raises((ValueError, TypeError)) as info:
        ops.moe_route(**args)
    assert needle in str(info.value) and "\n" not in str(info.value).strip()


@needs_kernels
@pytest.mark.parametrize("e,n_group,topk_group,top_k", SHAPES)
@pytest.mark.parametrize("kind", ["random", "ties", "special"])
def test_kernel_equals_the_reference(e, n_group, topk_group, top_k, kind):
    from cpgraph.kernels.moe_route import moe_route

    s, b = scores_for(21, e, seed=e, kind=kind)
    for norm, rows in ((True, 16), (False, 4)):
        got = moe_route(s.to(kernel_device()), b.to(kernel_device()), n_group, topk_group, top_k, norm, 2.5,
                        rows_per_program=rows)
        want = moe_route_reference(s, b, n_group, topk_group, top_k, norm, 2.5)
        assert torch.equal(got[0].cpu(), want[0]), (norm, rows)
        assert same_bits(got[1].cpu(), want[1]), (norm, rows, bit_diff(got[1].cpu(), want[1]))


@needs_kernels
@pytest.mark.bitexact
def test_kernel_rows_do_not_depend_on_the_batch():
    """A row routed in a batch of 19 equals the same row routed alone (CP = single device)."""
    from cpgraph.kernels.moe_route import moe_route

    s, b = scores_for(19, 256, seed=1, kind="ties")
    s, b = s.to(kernel_device()), b.to(kernel_device())
    ids, w = moe_route(s, b, 8, 4, 8, True, 2.5)
    for i in (0, 9, 18):
        one = moe_route(s[i:i + 1], b, 8, 4, 8, True, 2.5)
        assert torch.equal(one[0], ids[i:i + 1]) and same_bits(one[1], w[i:i + 1])


@needs_gpu
@pytest.mark.parametrize("m", [1, 4096, 5000])
def test_gpu_kernel_at_model_sizes(m):
    """V3.2's router (256 experts, 8 groups, top-4 groups, top-8) through the op (the CUDA provider)."""
    s, b = scores_for(m, 256, seed=m, kind="ties" if m == 5000 else "random")
    ids, w = ops.moe_route(s.cuda(), b.cuda(), 8, 4, 8, True, 2.5)
    want = moe_route_reference(s, b, 8, 4, 8, True, 2.5)
    assert torch.equal(ids.cpu(), want[0]) and same_bits(w.cpu(), want[1])


@needs_gpu
def test_gpu_kernel_replays_in_cuda_graph():
    s, b = scores_for(512, 256, seed=2)
    s, b = s.cuda(), b.cuda()
    ops.moe_route(s, b, 8, 4, 8, True, 2.5)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.moe_route(s, b, 8, 4, 8, True, 2.5)
    s.copy_(scores_for(512, 256, seed=7)[0].cuda())
    graph.replay()
    torch.cuda.synchronize()
    want = ops.moe_route(s, b, 8, 4, 8, True, 2.5)
    assert torch.equal(out[0], want[0]) and same_bits(out[1], want[1])
