"""The bf16 experts' SwiGLU kernel (cpgraph/kernels/swiglu.py) against the eager ``F.silu(gate) * up``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpgraph.kernels.swiglu import swiglu


def _eager(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,inter,routed", [(24, 64, 24), (37, 96, 20), (5, 200, 0)])
def test_swiglu_matches_eager_on_routed_rows(device, dtype, rows, inter, routed):
    g = torch.Generator().manual_seed(rows * inter)
    h = (torch.randn(rows, 2 * inter, generator=g) * 3).to(dtype).to(device)
    group_ends = torch.tensor([routed // 2, routed], dtype=torch.int64, device=device)
    out = swiglu(h, group_ends)
    assert out.shape == (rows, inter) and out.dtype == dtype
    want = _eager(h)
    # bf16: each step rounds as the eager kernels do; only the exp of the two back ends may differ
    tol = dict(rtol=2**-7, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[:routed], want[:routed], **tol)
    if dtype == torch.bfloat16:  # the double rounding is kept: most elements are bit-equal
        same = (out[:routed] == want[:routed]).float().mean().item() if routed else 1.0
        assert same > 0.99


def test_swiglu_ignores_a_bad_routed_count(device):
    # a routed count past C is clamped: no access beyond the buffer
    h = torch.randn(8, 32, device=device).to(torch.bfloat16)
    out = swiglu(h, torch.tensor([100], dtype=torch.int64, device=device))
    torch.testing.assert_close(out, _eager(h), rtol=2**-7, atol=1e-6)
