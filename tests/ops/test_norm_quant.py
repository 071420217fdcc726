"""cpgraph::fp8_rms_norm_quantize: reference against torch's own RMSNorm, opcheck, errors, and the kernel.

The oracle for the norm is ``F.rms_norm`` (ATen's, not ours) on the rounded residual sum; the codes are
checked bit for bit against ``fp8_quantize_activations`` of the ``h`` the op returns (the contract says the
codes are exactly those of that ``h``).  The kernel runs on CPU tensors under ``TRITON_INTERPRET=1`` and on
CUDA when a GPU is present.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import cpgraph.ops  # noqa: F401  (registers the ops)
from cpgraph.ops.fp8_linear import quantize_activations_reference
from cpgraph.ops.norm_quant import rms_norm_quantize_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_env import kernel_device, needs_gpu, needs_kernels  # noqa: E402

ops = torch.ops.cpgraph
U8 = torch.uint8


def inputs(m=6, k=256, dtype=torch.bfloat16, seed=0, residual=True, device="cpu", w_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)).to(dtype)
    r = (torch.randn(m, k, generator=g) * 2).to(dtype) if residual else None
    w = (torch.rand(k, generator=g) + 0.5).to(w_dtype or dtype)
    return x.to(device), (r.to(device) if r is not None else None), w.to(device)


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the last place of the activation dtype (relative to |b|)."""
    eps = torch.finfo(b.dtype).eps
    a, b = a.double(), b.double()
    return float(((a - b).abs() / (b.abs() * eps).clamp_min(torch.finfo(torch.float32).tiny)).max())


def codes_of(h, group, pow2):
    q, s = quantize_activations_reference(h, group, pow2)
    return q.view(U8), s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("pow2", [True, False])
def test_reference_is_torch_rms_norm_then_the_quantiser(dtype, residual, pow2):
    x, r, w = inputs(7, 320, dtype, residual=residual)
    summed, normed, q, s = rms_norm_quantize_reference(x, r, w, 1e-6, 128, pow2, True)
    want_s = x + r if residual else x
    want_h = F.rms_norm(want_s, (320,), w.to(dtype), 1e-6)  # ATen's norm (fused kernel or its decomposition)
    assert summed.shape == ((7, 320) if residual else (0, 320))
    if residual:
        assert torch.equal(summed, want_s)
    assert normed.dtype == dtype and ulps(normed, want_h) <= 1.0
    want_q, want_sc = codes_of(normed, 128, pow2)
    assert torch.equal(q.view(U8), want_q) and torch.equal(s, want_sc)
    assert s.stride() == (1, 7)  # column-major, what fp8_linear_quantized's SM90 GEMMs read


def test_outputs_not_asked_for_are_empty():
    x, r, w = inputs(5, 130)
    summed, normed, q, s = ops.fp8_rms_norm_quantize(x, None, w, 1e-5, 64, False, False)
    assert summed.shape == (0, 130) and normed.shape == (0, 130) and q.shape == (5, 130) and s.shape == (5, 3)
    full = ops.fp8_rms_norm_quantize(x, None, w, 1e-5, 64, False, True)
    assert torch.equal(q.view(U8), full[2].view(U8)) and torch.equal(s, full[3])


@pytest.mark.parametrize("m,k,dtype,res,w_dtype,lead", [(1, 200, torch.bfloat16, True, None, ()),
                                                        (5, 256, torch.float32, False, None, ()),
                                                        (33, 96, torch.float16, True, torch.float32, ()),
                                                        (12, 128, torch.bfloat16, True, None, (3, 4))])
def test_opcheck(m, k, dtype, res, w_dtype, lead):
    """opcheck with dynamic shapes, minus ``test_schema`` (its mutation check multiplies the outputs: no e4m3
    ``mul`` on CPU); the inputs are checked to stay bit-identical directly.  ``lead``: ``x`` as ``[..., K]``."""
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    x, r, w = inputs(m, k, dtype, seed=m, residual=res, w_dtype=w_dtype)
    if lead:
        x, r = x.reshape(*lead, k), r.reshape(*lead, k)
    for emit in (True, False):
        opcheck(ops.fp8_rms_norm_quantize.default, (x, r, w, 1e-6, 64, emit, emit), test_utils=checks)
    before = [t.clone() for t in (x, r, w) if t is not None]
    ops.fp8_rms_norm_quantize(x, r, w, 1e-6, 64, True, True)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for t in (x, r, w) if t is not None]))


def test_leading_dims_are_kept_for_the_rows_and_flattened_for_the_codes():
    x, r, w = inputs(6, 256)
    flat = ops.fp8_rms_norm_quantize(x, r, w, 1e-6, 128, True, True)
    summed, normed, q, s = ops.fp8_rms_norm_quantize(x.view(2, 3, 256), r.view(2, 3, 256), w, 1e-6, 128, True, True)
    assert summed.shape == normed.shape == (2, 3, 256) and q.shape == (6, 256) and s.shape == (6, 2)
    assert torch.equal(summed.view(6, 256), flat[0]) and torch.equal(q.view(U8), flat[2].view(U8))
    assert torch.equal(normed.view(6, 256), flat[1]) and torch.equal(s, flat[3])


def test_no_rows():
    x, r, w = inputs(0, 256)
    summed, normed, q, s = ops.fp8_rms_norm_quantize(x, r, w, 1e-6, 128, True, True)
    assert summed.shape == normed.shape == q.shape == (0, 256) and s.shape == (0, 2)


@pytest.mark.parametrize("change,needle", [
    (lambda a: {**a, "x": a["x"][0], "residual": None}, "'x' must be \\[..., K\\] with rows"),
    (lambda a: {**a, "x": a["x"].to(torch.int32)}, "'x' must have dtype"),
    (lambda a: {**a, "residual": a["residual"][:, :8]}, "'residual' must have shape"),
    (lambda a: {**a, "residual": a["residual"].float()}, "'residual' must have dtype bfloat16"),
    (lambda a: {**a, "weight": a["weight"][:8]}, "'weight' must have shape"),
    (lambda a: {**a, "group": 0}, "'group' must be a positive int"),
    (lambda a: {**a, "eps": float("nan")}, "'eps' must be a finite float"),
    (lambda a: {**a, "x": a["x"][:, :0], "residual": None, "weight": a["weight"][:0]}, "at least one column"),
])
def test_bad_arguments_raise_one_line_errors(change, needle):
    x, r, w = inputs(4, 256)
    args = change({"x": x, "residual": r, "weight": w, "eps": 1e-6, "group": 128})
    with pytest.raises(ValueError, match=needle) as err:
        ops.fp8_rms_norm_quantize(args["x"], args["residual"], args["weight"], args["eps"], args["group"], True, True)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ kernel
@needs_kernels
@pytest.mark.parametrize("m,k,group,dtype,res,emit,pow2", [
    (5, 256, 128, torch.bfloat16, True, True, True),
    (3, 200, 128, torch.bfloat16, False, True, False),  # a short last group
    (4, 7168, 128, torch.bfloat16, True, False, True),  # V3.2's hidden: several tiles per row
    (2, 96, 64, torch.float32, True, True, False),
    (3, 130, 64, torch.float16, False, True, True),
    (1, 1, 128, torch.bfloat16, True, True, True),
])
def test_kernel_matches_the_reference(m, k, group, dtype, res, emit, pow2):
    from cpgraph.kernels.norm_quant import rms_norm_quantize

    dev = kernel_device()
    x, r, w = inputs(m, k, dtype, seed=k, residual=res, device=dev)
    summed, normed, q, s = rms_norm_quantize(x, r, w, 1e-6, group, pow2, emit)
    want = rms_norm_quantize_reference(x.cpu(), r.cpu() if res else None, w.cpu(), 1e-6, group, pow2, True)
    assert summed.shape == ((m, k) if res else (0, k)) and normed.shape == ((m, k) if emit else (0, k))
    if res:
        assert torch.equal(summed.cpu(), want[0])  # one rounding of an exact sum: no freedom
    h = normed.cpu() if emit else rms_norm_quantize(x, r, w, 1e-6, group, pow2, True)[1].cpu()
    assert ulps(h, want[1]) <= 1.0  # only the summation order of the squares differs
    want_q, want_s = codes_of(h, group, pow2)  # the codes are those of the h returned, bit for bit
    assert torch.equal(q.cpu().view(U8), want_q) and torch.equal(s.cpu(), want_s)
    assert s.stride() == (1, m)


@needs_kernels
def test_kernel_keeps_the_leading_dims():
    from cpgraph.kernels.norm_quant import rms_norm_quantize

    x, r, w = inputs(6, 256, device=kernel_device())
    flat = rms_norm_quantize(x, r, w, 1e-6, 128, True, True)
    nd = rms_norm_quantize(x.view(3, 2, 256), r.view(3, 2, 256), w, 1e-6, 128, True, True)
    assert nd[0].shape == nd[1].shape == (3, 2, 256) and nd[2].shape == (6, 256)
    for a, b in zip(nd, flat):
        assert torch.equal(a.reshape(b.shape).contiguous().view(U8), b.contiguous().view(U8))


@needs_kernels
@pytest.mark.parametrize("k,res,emit", [(1000, True, True), (7168, False, True), (640, True, False)])
def test_kernel_two_sweep_path_for_rows_past_the_register_tile(k, res, emit):
    """Rows wider than ``row_values`` take two sweeps (tiles of ``tile_values``): same contract."""
    from cpgraph.kernels.norm_quant import rms_norm_quantize

    x, r, w = inputs(3, k, seed=k, residual=res, device=kernel_device())
    summed, normed, q, s = rms_norm_quantize(x, r, w, 1e-6, 128, True, True, row_values=256, tile_values=256)
    want = rms_norm_quantize_reference(x.cpu(), r.cpu() if res else None, w.cpu(), 1e-6, 128, True, True)
    if res:
        assert torch.equal(summed.cpu(), want[0])
    assert ulps(normed.cpu(), want[1]) <= 1.0
    want_q, want_s = codes_of(normed.cpu(), 128, True)
    assert torch.equal(q.cpu().view(U8), want_q) and torch.equal(s.cpu(), want_s)
    if not emit:
        _, none, q2, s2 = rms_norm_quantize(x, r, w, 1e-6, 128, True, False, row_values=256, tile_values=256)
        assert none.shape == (0, k) and torch.equal(q2.view(U8), q.view(U8)) and torch.equal(s2, s)


@needs_kernels
@pytest.mark.bitexact
def test_kernel_rows_do_not_depend_on_the_batch():
    """A row computed in a batch of 9 equals the same row computed alone, bit for bit (CP = single device)."""
    from cpgraph.kernels.norm_quant import rms_norm_quantize

    x, r, w = inputs(9, 384, device=kernel_device())
    batch = rms_norm_quantize(x, r, w, 1e-6, 128, True, True)
    for i in (0, 4, 8):
        alone = rms_norm_quantize(x[i:i + 1], r[i:i + 1], w, 1e-6, 128, True, True)
        for b, a in zip(batch, alone):
            assert torch.equal(b[i:i + 1].contiguous().view(U8), a.contiguous().view(U8))


@needs_kernels
def test_kernel_non_finite_values_stay_in_their_row():
    from cpgraph.kernels.norm_quant import rms_norm_quantize

    x, r, w = inputs(4, 256, device=kernel_device())
    x[2, 5] = float("inf")
    x[1, 200] = float("nan")
    _, normed, q, s = rms_norm_quantize(x, r, w, 1e-6, 128, True, True)
    # As torch's norm: the row's rstd is 0, so its infinity becomes NaN (its group's scale NaN) and the rest 0.
    want = rms_norm_quantize_reference(x.cpu(), r.cpu(), w.cpu(), 1e-6, 128, True, True)
    assert torch.isnan(s[2, 0]) and torch.equal(s[2, 1:].cpu(), want[3][2, 1:]) and torch.isnan(want[3][2, 0])
    assert torch.allclose(normed[2].cpu().float(), want[1][2].float(), equal_nan=True)
    assert torch.isnan(s[1]).all() and torch.isnan(want[3][1]).all()  # a NaN poisons its whole row's norm
    assert torch.isfinite(s[[0, 3]]).all()
    clean = rms_norm_quantize(x[[0, 3]], r[[0, 3]], w, 1e-6, 128, True, True)
    assert torch.equal(q[[0, 3]].view(U8), clean[2].view(U8))


@needs_gpu
@pytest.mark.parametrize("m,k", [(300, 7168), (64, 6144), (1000, 1536)])
def test_gpu_kernel_at_model_widths(m, k):
    """V3.2's hidden and q latent, GLM-5's hidden, through the op (the CUDA provider)."""
    x, r, w = inputs(m, k, seed=m, device="cuda")
    summed, normed, q, s = ops.fp8_rms_norm_quantize(x, r, w, 1e-6, 128, True, True)
    want = rms_norm_quantize_reference(x.cpu(), r.cpu(), w.cpu(), 1e-6, 128, True, True)
    assert torch.equal(summed.cpu(), want[0]) and ulps(normed.cpu(), want[1]) <= 1.0
    want_q, want_s = codes_of(normed.cpu(), 128, True)
    assert torch.equal(q.cpu().view(U8), want_q) and torch.equal(s.cpu(), want_s)


@needs_gpu
def test_gpu_kernel_replays_in_cuda_graph():
    x, r, w = inputs(64, 7168, device="cuda")
    ops.fp8_rms_norm_quantize(x, r, w, 1e-6, 128, True, False)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fp8_rms_norm_quantize(x, r, w, 1e-6, 128, True, False)
    x2, r2, _ = inputs(64, 7168, seed=5, device="cuda")
    x.copy_(x2)
    r.copy_(r2)
    graph.replay()
    torch.cuda.synchronize()
    want = ops.fp8_rms_norm_quantize(x2, r2, w, 1e-6, 128, True, False)
    assert torch.equal(out[0], want[0]) and torch.equal(out[2].view(U8), want[2].view(U8)) and torch.equal(out[3], want[3])
