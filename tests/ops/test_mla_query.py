"""``cpgraph::mla_query``: the reference against an independent per-head loop, opcheck, and the provider.

The brute force below is written apart from the op: one head and one row pair at a time, plain
matmuls and explicit cos/sin rotation formulas, in fp64.
"""

from __future__ import annotations

import os

import pytest
import torch

import cpgraph.ops  # noqa: F401
from cpgraph.ops import mla_query as mq

ops = torch.ops.cpgraph


def brute(q, w_uk, cos, sin):
    M, H, D = q.shape
    nope, L = w_uk.shape[1], w_uk.shape[2]
    R = D - nope
    out = torch.zeros(M, H, L + R, dtype=torch.float64)
    for h in range(H):
        out[:, h, :L] = q[:, h, :nope].double() @ w_uk[h].double()
        for i in range(R // 2):
            a, b = q[:, h, nope + 2 * i].double(), q[:, h, nope + 2 * i + 1].double()
            c, s = cos[:, i].double(), sin[:, i].double()
            out[:, h, L + 2 * i] = a * c - b * s
            out[:, h, L + 2 * i + 1] = a * s + b * c
    return out


def inputs(M, H, nope, R, L, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(M, H, nope + R, generator=g).to(dtype)
    w = torch.randn(H, nope + 8, L, generator=g).to(dtype)[:, :nope]  # a view, as the model passes W_UK
    ang = torch.rand(M, R // 2, generator=g) * 6.0
    return q.to(device), w.to(device), ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)


@pytest.mark.parametrize("M,H,nope,R,L", [(5, 3, 8, 4, 16), (1, 1, 4, 2, 8), (0, 2, 8, 4, 16), (9, 4, 16, 8, 32)])
def test_reference_equals_brute_force(M, H, nope, R, L):
    q, w, c, s = inputs(M, H, nope, R, L)
    torch.testing.assert_close(ops.mla_query(q, w, c, s).double(), brute(q, w, c, s), rtol=1e-5, atol=1e-5)


def test_opcheck_dynamic_shapes():
    for args in (inputs(5, 3, 8, 4, 16), inputs(7, 2, 16, 8, 32, seed=1), inputs(1, 1, 4, 2, 8, seed=2)):
        torch.library.opcheck(torch.ops.cpgraph.mla_query.default, args)
    q, w, c, s = inputs(6, 3, 8, 4, 16)
    f = torch.compile(lambda *a: ops.mla_query(*a), backend="aot_eager", dynamic=True, fullgraph=True)
    torch.testing.assert_close(f(q, w, c, s), mq.mla_query_reference(q, w, c, s))


def test_bad_arguments_name_the_argument():
    q, w, c, s = inputs(5, 3, 8, 4, 16)
    with pytest.raises(ValueError, match="'w_uk'"):
        ops.mla_query(q, w[:2], c, s)
    with pytest.raises(ValueError, match="'cos'"):
        ops.mla_query(q, w, c[:, :1], s)
    with pytest.raises(ValueError, match="even, positive number of RoPE dims"):
        ops.mla_query(q[:, :, :11], w, c, s)


def _provider_device():
    if os.environ.get("TRITON_INTERPRET", "") == "1":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


@pytest.mark.skipif(_provider_device() is None, reason="the Triton provider needs TRITON_INTERPRET=1 or CUDA")
@pytest.mark.parametrize("M,H,nope,R,L", [(5, 3, 8, 4, 16), (33, 20, 16, 6, 32)])
def test_provider_matches_reference(M, H, nope, R, L):
    from cpgraph.kernels.mla_query import mla_query as provider

    dev = _provider_device()
    q, w, c, s = inputs(M, H, nope, R, L, device=dev)
    torch.testing.assert_close(provider(q, w, c, s), mq.mla_query_reference(q, w, c, s), rtol=1e-5, atol=1e-5)
    if dev == "cuda":  # bf16: the RoPE lanes computed in fp32 and rounded once
        q, w, c, s = inputs(M, H, nope, R, L, dtype=torch.bfloat16, device=dev)
        want = brute(q.cpu(), w.cpu(), c.cpu(), s.cpu())
        torch.testing.assert_close(provider(q, w, c, s).double().cpu(), want, rtol=2e-2, atol=2e-2)
