"""The Triton providers of the invariant ops (``cpgraph/kernels/invariant_gemm.py``), under the interpreter or on a GPU.

Each provider against its op's fixed-order reference (to rounding: tensor
cores and the interpreter sum in another order than the reference), and the
row invariance of the dense and grouped bf16 / fp32 GEMMs bit for bit: a
row's output in products of other row counts and offsets, and an expert
row's output with every other row routed elsewhere.  On CPU the
interpreter's dot is a sum over K (``_dot_by_sum``), so the check covers the
kernels' own structure (fixed tiles, masking, strides, the grouped tile
map); the GPU test (``test_deterministic_gpu.py``) checks the tensor-core path.
The FP8 providers reuse kernels whose interpreter dot is numpy's BLAS (its
bits follow a row's position in the tile), so they are checked for
accuracy here and for invariance on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from kernel_env import kernel_device, needs_kernels

pytestmark = needs_kernels

# Row ranges of other sizes and offsets: one row, rows across the first tile boundary, the second tile alone.
SPANS = [(0, 1), (5, 70), (64, 100)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def dev():
    return kernel_device()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_matches_reference_and_rows_are_invariant(dev, dtype):
    from cpgraph.kernels.invariant_gemm import matmul
    from cpgraph.ops.invariant import invariant_mm_reference

    g = _gen(0)
    x = torch.randn(100, 70, generator=g).to(dtype).to(dev)
    w = torch.randn(40, 70, generator=g).to(dtype).to(dev)
    b = torch.randn(40, generator=g).to(dtype).to(dev)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=3e-2)
    for args in [(x, w.t()), (x, w.t(), b, 1.0, 1.0), (x, w.t(), b, 0.5, -2.0)]:
        torch.testing.assert_close(matmul(*args).float(), invariant_mm_reference(*args).float(), **tol)
    full = matmul(x, w.t(), b)
    for a, c in SPANS:
        assert torch.equal(matmul(x[a:c].clone(), w.t(), b), full[a:c]), (a, c)
    # Batched, and written through a strided view of a wider output (the absorbed-query layout).
    q = torch.randn(3, 100, 16, generator=g).to(dtype).to(dev)
    wk = torch.randn(3, 16, 24, generator=g).to(dtype).to(dev)
    o = matmul(q, wk)
    torch.testing.assert_close(o.float(), invariant_mm_reference(q, wk).float(), **tol)
    wide = torch.zeros(100, 3, 30, dtype=dtype, device=dev)
    matmul(q, wk, out=wide[:, :, :24].transpose(0, 1))
    assert torch.equal(wide[:, :, :24].transpose(0, 1), o) and not wide[:, :, 24:].any()
    for a, c in SPANS:
        assert torch.equal(matmul(q[:, a:c].clone(), wk), o[:, a:c]), (a, c)


def test_tiles_come_from_the_weight_only(monkeypatch):
    from cpgraph.kernels import invariant_gemm

    assert "m" not in invariant_gemm.tiles.__code__.co_varnames[: invariant_gemm.tiles.__code__.co_argcount]
    monkeypatch.setenv(invariant_gemm.TILES_ENV, "128,64")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="BM,BN,BK,warps,stages"):
        invariant_gemm.tiles(256, 256, torch.bfloat16)


def _routes(m, e, k, g):
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    return ids, torch.rand(m, k, generator=g)


def test_grouped_experts_match_reference_and_ignore_other_routes(dev):
    from cpgraph.kernels.invariant_gemm import invariant_moe_experts
    from cpgraph.ops.invariant import invariant_moe_experts_reference

    g = _gen(1)
    m, e, h, i, k = 100, 6, 64, 32, 2
    x = (torch.randn(m, h, generator=g) * 0.5).to(torch.bfloat16).to(dev)
    gu = (torch.randn(e, 2 * i, h, generator=g) * 0.2).to(torch.bfloat16).to(dev)
    dn = (torch.randn(e, h, i, generator=g) * 0.2).to(torch.bfloat16).to(dev)
    ids, w = (t.to(dev) for t in _routes(m, e, k, g))
    nv = torch.tensor([90], device=dev)
    got = invariant_moe_experts(x, ids, w, gu, dn, nv)
    want = invariant_moe_experts_reference(x, ids, w, gu, dn, nv)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(got[90:], torch.zeros_like(got[90:]))
    full = invariant_moe_experts(x, ids, w, gu, dn)
    for a, c in SPANS:
        assert torch.equal(invariant_moe_experts(x[a:c].clone(), ids[a:c].clone(), w[a:c].clone(), gu, dn),
                           full[a:c]), (a, c)
    ids2, w2 = (t.to(dev) for t in _routes(m, e, k, _gen(2)))
    ids2[7], w2[7] = ids[7], w[7]
    assert torch.equal(invariant_moe_experts(x, ids2, w2, gu, dn, torch.tensor([30], device=dev))[7], full[7])


def test_fp8_providers_match_their_references(dev):
    from cpgraph.kernels.invariant_gemm import invariant_fp8_linear, invariant_moe_experts
    from cpgraph.ops.invariant import invariant_fp8_linear_reference, invariant_moe_experts_reference

    g = _gen(3)
    x = torch.randn(40, 64, generator=g).to(torch.bfloat16).to(dev)
    w = (torch.randn(48, 64, generator=g) * 0.5).to(torch.float8_e4m3fn).to(dev)
    s = (torch.rand(2, 2, generator=g) * 0.02 + 0.005).to(dev)
    torch.testing.assert_close(invariant_fp8_linear(x, w, s, 32, 32, True).float(),
                               invariant_fp8_linear_reference(x, w, s, 32, 32, True).float(), rtol=1e-2, atol=1e-2)
    e, h, i, k = 4, 64, 32, 2
    gu = (torch.randn(e, 2 * i, h, generator=g) * 0.5).to(torch.float8_e4m3fn).to(dev)
    dn = (torch.randn(e, h, i, generator=g) * 0.5).to(torch.float8_e4m3fn).to(dev)
    gus = (torch.rand(e, 2, 2, generator=g) * 0.02 + 0.005).to(dev)
    dns = (torch.rand(e, 2, 1, generator=g) * 0.02 + 0.005).to(dev)
    ids, rw = (t.to(dev) for t in _routes(40, e, k, g))
    args = (x, ids, rw, gu, dn, None, gus, dns, 32, 32, False)
    torch.testing.assert_close(invariant_moe_experts(*args).float(), invariant_moe_experts_reference(*args).float(),
                               rtol=2e-2, atol=2e-2)


def test_mla_query_provider_matches_reference_and_rows_are_invariant(dev):
    from cpgraph.kernels.invariant_gemm import invariant_mla_query
    from cpgraph.ops.invariant import invariant_mla_query_reference

    g = _gen(4)
    m, h, nope, rope, lat = 100, 4, 16, 16, 32
    q = torch.randn(m, h, nope + rope, generator=g).to(torch.bfloat16).to(dev)
    w_uk = torch.randn(h, nope, lat, generator=g).to(torch.bfloat16).to(dev)
    ang = torch.rand(m, rope // 2, generator=g) * 6
    cos, sin = ang.cos().to(torch.bfloat16).to(dev), ang.sin().to(torch.bfloat16).to(dev)
    got = invariant_mla_query(q, w_uk, cos, sin)
    torch.testing.assert_close(got.float(), invariant_mla_query_reference(q, w_uk, cos, sin).float(),
                               rtol=1e-2, atol=3e-2)
    for a, c in SPANS:
        assert torch.equal(invariant_mla_query(q[a:c].clone(), w_uk, cos[a:c].clone(), sin[a:c].clone()), got[a:c])
