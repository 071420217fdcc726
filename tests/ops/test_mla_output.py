"""``cpgraph::mla_output``: the reference against a per-head loop written apart, opcheck, the providers, and
its row-invariant form.

The brute force is one head at a time in fp64, placed into the ``[M, H * v]`` rows by explicit slicing.
"""

from __future__ import annotations

import os

import pytest
import torch

import cpgraph.ops  # noqa: F401
from cpgraph.ops import mla_output as mo
from cpgraph.ops.invariant import invariant_mla_output_reference

ops = torch.ops.cpgraph


def brute(out_lat, w_uv):
    M, H, _ = out_lat.shape
    v = w_uv.shape[1]
    out = torch.zeros(M, H * v, dtype=torch.float64)
    for h in range(H):
        out[:, h * v:(h + 1) * v] = out_lat[:, h].double() @ w_uv[h].double().t()
    return out


def inputs(M, H, L, v, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    out_lat = torch.randn(M, H, L, generator=g).to(dtype)
    w = torch.randn(H, 16 + v, L, generator=g).to(dtype)[:, 16:]  # a view, as the model passes W_UV
    return out_lat.to(device), w.to(device)


@pytest.mark.parametrize("M,H,L,v", [(5, 3, 16, 8), (1, 1, 8, 4), (0, 2, 16, 8), (9, 4, 32, 16)])
def test_reference_equals_brute_force(M, H, L, v):
    a, w = inputs(M, H, L, v)
    torch.testing.assert_close(ops.mla_output(a, w).double(), brute(a, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(invariant_mla_output_reference(a, w).double(), brute(a, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["mla_output", "invariant_mla_output"])
def test_opcheck_dynamic_shapes(op):
    for args in (inputs(5, 3, 16, 8), inputs(7, 2, 32, 4, seed=1), inputs(1, 1, 8, 4, seed=2),
                 inputs(4, 2, 8, 4, dtype=torch.bfloat16, seed=3)):
        torch.library.opcheck(getattr(ops, op).default, args)
    a, w = inputs(6, 3, 16, 8)
    f = torch.compile(lambda *x: getattr(ops, op)(*x), backend="aot_eager", dynamic=True, fullgraph=True)
    torch.testing.assert_close(f(a, w), mo.mla_output_reference(a, w))


def test_bad_arguments_name_the_argument():
    a, w = inputs(5, 3, 16, 8)
    with pytest.raises(ValueError, match="'w_uv'"):
        ops.mla_output(a, w[:2])
    with pytest.raises(ValueError, match="'w_uv'"):
        ops.mla_output(a, w[:, :, :8])
    with pytest.raises(ValueError, match="'w_uv'"):
        ops.mla_output(a, w.double())
    with pytest.raises(ValueError, match="'out_lat'"):
        ops.mla_output(a[0], w)


def _provider_device():
    if os.environ.get("TRITON_INTERPRET", "") == "1":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


@pytest.mark.skipif(_provider_device() is None, reason="the providers need TRITON_INTERPRET=1 or CUDA")
@pytest.mark.parametrize("M,H,L,v", [(5, 3, 16, 8), (33, 20, 32, 16), (0, 2, 16, 8)])
def test_providers_write_the_rows_directly(M, H, L, v):
    """The GEMM's strided output is the final layout: same values as the reference, a fresh contiguous tensor."""
    from cpgraph.kernels.invariant_gemm import invariant_mla_output
    from cpgraph.kernels.mla_query import mla_output

    dev = _provider_device()
    a, w = inputs(M, H, L, v, device=dev)
    got = mla_output(a, w)
    assert got.shape == (M, H * v) and got.is_contiguous()
    torch.testing.assert_close(got, mo.mla_output_reference(a, w), rtol=1e-5, atol=1e-5)
    inv = invariant_mla_output(a, w)
    assert inv.shape == (M, H * v) and inv.is_contiguous()
    torch.testing.assert_close(inv.double().cpu(), brute(a.cpu(), w.cpu()), rtol=1e-4, atol=1e-4)
    if dev == "cuda" and M:  # bf16 at production heads: to the GEMM's rounding
        a, w = inputs(M, 128, 512, 128, dtype=torch.bfloat16, device=dev)
        torch.testing.assert_close(mla_output(a, w).double().cpu(), brute(a.cpu(), w.cpu()), rtol=2e-2, atol=5e-2)


@pytest.mark.skipif(_provider_device() is None, reason="the providers need TRITON_INTERPRET=1 or CUDA")
@pytest.mark.bitexact
def test_invariant_rows_do_not_depend_on_the_row_count():
    from cpgraph.kernels.invariant_gemm import invariant_mla_output

    dev = _provider_device()
    a, w = inputs(37, 4, 32, 16, device=dev, seed=5)
    full = invariant_mla_output(a, w)
    for lo, hi in ((0, 1), (3, 20), (20, 37)):
        assert torch.equal(invariant_mla_output(a[lo:hi].clone(), w), full[lo:hi])
