"""The router's and the indexer head weights' fp32 product (cpgraph/models/fp32_linear.py).

The tensor-core form rests on one fact: an fp32 weight is the exact sum of its
three bf16 parts.  That is checked here in fp64 (no rounding in the check), at
the weight scales checkpoints hold; the GPU test then compares the split GEMM
with the fp32 GEMM it replaces.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpgraph.models.fp32_linear import bf16_parts, fp32_linear, split_product, uses_split
from cpgraph.ops.invariant_mode import deterministic


@pytest.mark.parametrize("scale", [1e-4, 2e-2, 1.0, 300.0])
def test_three_bf16_parts_sum_to_the_weight_exactly(scale):
    g = torch.Generator().manual_seed(int(scale * 1000) % 97)
    w = torch.randn(64, 96, generator=g) * scale
    parts = bf16_parts(w).double().view(3, 64, 96)
    assert torch.equal((parts[0] + parts[1]) + parts[2], w.double())
    # two parts are not enough for a full fp32 weight: the third carries real bits
    assert not torch.equal(parts[0] + parts[1], w.double())


def test_a_bf16_valued_weight_has_zero_tails():
    w = torch.randn(32, 48).to(torch.bfloat16).float()
    parts = bf16_parts(w).view(3, 32, 48)
    assert torch.equal(parts[0].float(), w)
    assert not parts[1:].any()


def test_split_product_in_fp64_equals_the_fp32_weights_product():
    # the split form's algebra without a CUDA GEMM: x @ [hi; mid; lo] summed is x @ w (fp64, no rounding)
    x = torch.randn(40, 96).to(torch.bfloat16)
    w = torch.randn(24, 96) * 0.05
    parts = bf16_parts(w).double()
    y = x.double() @ parts.t()
    assert torch.allclose((y[:, :24] + y[:, 24:48]) + y[:, 48:], x.double() @ w.double().t(), rtol=0, atol=1e-12)


def test_cpu_and_fp32_inputs_keep_the_plain_product():
    x = torch.randn(8, 32).to(torch.bfloat16)
    w = torch.randn(4, 32)
    assert not uses_split(x)
    assert torch.equal(fp32_linear(x, w), F.linear(x.float(), w))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_split_gemm_matches_the_fp32_gemm_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 7168, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(256, 7168, device="cuda", generator=g) * 0.02
    assert uses_split(x)
    got = fp32_linear(x, w)
    assert got.dtype == torch.float32
    want = x.double() @ w.double().t()  # the exact product: both GEMMs round only in their fp32 sums
    fp32 = F.linear(x.float(), w)
    bound = (x.double().abs() @ w.double().abs().t()) * 7168 * 2**-24  # K * eps * sum |x w|
    assert ((got.double() - want).abs() <= bound).all()
    assert ((fp32.double() - want).abs() <= bound).all()
    # and closer than one bf16 rounding of the weight would be
    coarse = F.linear(x.float(), w.to(torch.bfloat16).float())
    assert (got.double() - want).abs().max() < (coarse.double() - want).abs().max() / 50
    with deterministic():
        assert not uses_split(x)  # the row-invariant product stays in charge there


def test_split_product_needs_cuda_bf16():
    # on CPU the dtype overload of mm does not exist: fp32_linear never calls it there
    x = torch.randn(4, 16).to(torch.bfloat16)
    with pytest.raises((RuntimeError, NotImplementedError)):
        split_product(x, torch.randn(2, 16))
