"""cpgraph::fp8_block_linear: the reference against a float64 definition, opcheck, errors, and the kernels.

The kernel tests run the Triton provider on CPU tensors under
``TRITON_INTERPRET=1`` (the interpreter handles e4m3 loads and dots) and on
CUDA when a GPU is present; the ``scaled_mm`` GEMM and CUDA-graph capture
are GPU-only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.library import opcheck

import cpgraph.ops  # noqa: F401  (registers the ops)
from cpgraph.ops.fp8_linear import dequantize_weight, fp8_block_linear_reference, quantize_activations

ops = torch.ops.cpgraph
FP8 = torch.float8_e4m3fn


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_env import kernel_device, needs_gpu, needs_kernels  # noqa: E402


def make_inputs(M=7, K=200, N=150, block=(128, 128), dtype=torch.float32, seed=0, device="cpu", spread=True):
    """Activations with per-column magnitudes over 5 decades (so group scales differ), e4m3 weights, block scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    if spread:
        x = x * torch.logspace(-3, 2, K)[torch.randperm(K, generator=g)]
    w = (torch.randn(N, K, generator=g) * 100).clamp(-448, 448).to(FP8)
    bn, bk = block
    ws = torch.rand(-(-N // bn), -(-K // bk), generator=g) * 1e-2 + 1e-4
    return x.to(dtype).to(device), w.to(device), ws.to(device)


def definition(x, w, ws, bn, bk, pow2):
    """The op's contract written out with Python loops over groups, summed in float64."""
    M, K = x.shape
    N = w.shape[0]
    xf = x.double()
    wf = w.double()
    out = torch.zeros(M, N, dtype=torch.float64)
    for g0 in range(0, K, bk):
        cols = slice(g0, min(g0 + bk, K))
        amax = xf[:, cols].abs().amax(dim=1).clamp_min(1e-4).float()
        if pow2:
            scale = torch.tensor([2.0 ** torch.ceil(torch.log2(a.double() / 448)).item() for a in amax])
        else:
            scale = amax / 448.0
        q = (xf[:, cols].float() / scale[:, None]).clamp(-448, 448).to(FP8).double() * scale.double()[:, None]
        wscale = ws[:, g0 // bk].double().repeat_interleave(bn)[:N]
        out += q @ (wf[:, cols] * wscale[:, None]).t()
    return out


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize(
    "M,K,N,block",
    [(7, 200, 150, (128, 128)), (3, 256, 256, (128, 128)), (5, 96, 70, (32, 64)), (1, 300, 33, (64, 128))],
)
def test_reference_matches_definition(M, K, N, block, pow2):
    x, w, ws = make_inputs(M, K, N, block)
    got = ops.fp8_block_linear(x, w, ws, block[0], block[1], pow2)
    want = definition(x, w, ws, block[0], block[1], pow2)
    assert got.shape == (M, N) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_activation_quantisation_recipe():
    x, _, _ = make_inputs(M=4, K=300)
    q, s = quantize_activations(x, 128, pow2=True)
    assert q.dtype == FP8 and q.shape == (4, 300) and s.shape == (4, 3)
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    q32, s32 = quantize_activations(x, 128, pow2=False)
    amax = torch.stack([x[:, i : i + 128].abs().amax(1) for i in range(0, 300, 128)], 1)
    assert torch.equal(s32, amax / 448)
    # Every group's largest value maps to +-448 (fp32 scales) and nothing saturates beyond it.
    assert torch.equal(q32.float().abs().view(4, -1)[:, :128].amax(1), torch.full((4,), 448.0))
    per_value = s32.repeat_interleave(128, 1)[:, :300]
    deq = q32.float() * per_value
    # e4m3 round to nearest: half an ulp of 3 mantissa bits, or half the subnormal step 2**-9 (times the scale)
    assert ((deq - x).abs() <= torch.maximum(2**-4 * x.abs(), 2**-10 * per_value)).all()


def test_dequantize_weight_uses_each_block_scale():
    w = torch.ones(130, 129).to(FP8)
    ws = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    d = dequantize_weight(w, ws, 128, 128)
    assert d[0, 0] == 1 and d[0, 128] == 2 and d[128, 0] == 3 and d[129, 128] == 4


def test_rows_are_independent_and_non_finite_rows_are_nan():
    x, w, ws = make_inputs(M=6)
    full = ops.fp8_block_linear(x, w, ws, 128, 128, True)
    for r in range(6):  # torch's CPU GEMM may block the sum differently for one row: equal to rounding
        alone = ops.fp8_block_linear(x[r : r + 1], w, ws, 128, 128, True)[0]
        assert torch.allclose(alone, full[r], rtol=1e-6, atol=1e-6 * full.abs().max().item())
    for bad in (float("nan"), float("inf"), float("-inf")):
        for pow2 in (False, True):
            y = x.clone()
            y[2, 5] = bad
            out = ops.fp8_block_linear(y, w, ws, 128, 128, pow2)
            assert torch.isnan(out[2]).all(), (bad, pow2)
            ok = [0, 1, 3, 4, 5]
            clean = ops.fp8_block_linear(x, w, ws, 128, 128, pow2)[ok]
            assert torch.isfinite(out[ok]).all() and torch.allclose(out[ok], clean, rtol=1e-6, atol=1e-6 * clean.abs().max().item())


def test_bf16_output_is_the_rounded_fp32_result():
    x, w, ws = make_inputs(M=5, dtype=torch.bfloat16)
    got = ops.fp8_block_linear(x, w, ws, 128, 128, False)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, fp8_block_linear_reference(x.float(), w, ws, 128, 128, False).to(torch.bfloat16))


@pytest.mark.parametrize(
    "M,K,N,block,dtype,pow2",
    [
        (7, 200, 150, (128, 128), torch.float32, False),
        (3, 256, 128, (128, 128), torch.bfloat16, True),
        (1, 64, 40, (32, 32), torch.float16, False),
        (0, 128, 16, (128, 128), torch.float32, True),
    ],
)
def test_opcheck(M, K, N, block, dtype, pow2):
    """opcheck minus ``test_schema``, whose mutation check multiplies inputs (no e4m3 ``mul`` kernel on CPU).

    What ``test_schema`` would check is checked directly: the op leaves every input bit-identical.
    """
    x, w, ws = make_inputs(M, K, N, block, dtype)
    args = (x, w, ws, block[0], block[1], pow2)
    opcheck(ops.fp8_block_linear.default, args,
            test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    before = [t.clone() for t in (x, w, ws)]
    ops.fp8_block_linear(*args)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, (x, w, ws)))


def test_traces_with_dynamic_rows_without_recompiles():
    def f(x, w, ws):
        return ops.fp8_block_linear(x, w, ws, 128, 128, True) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    for M in (5, 9, 14):
        x, w, ws = make_inputs(M=M)
        assert torch.equal(compiled(x, w, ws), f(x, w, ws))


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda x, w, ws: (x, w.float(), ws), "argument 'weight' must have dtype float8_e4m3fn"),
        (lambda x, w, ws: (x, w, ws[:, :1]), "argument 'weight_scale_inv' must have shape (2, 2)"),
        (lambda x, w, ws: (x, w, ws.double()), "argument 'weight_scale_inv' must have dtype float32"),
        (lambda x, w, ws: (x[:, :100], w, ws), "argument 'weight' must have shape (None, 100)"),
        (lambda x, w, ws: (x.long(), w, ws), "argument 'x' must have dtype"),
        (lambda x, w, ws: (x[None], w, ws), "argument 'x' must be 2-D"),
    ],
)
def test_bad_arguments_raise_one_line_errors(change, needle):
    x, w, ws = make_inputs()
    with pytest.raises(ValueError) as err:
        ops.fp8_block_linear(*change(x, w, ws), 128, 128, False)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_bad_block_sizes():
    x, w, ws = make_inputs()
    with pytest.raises(ValueError, match="'block_k' must be a positive int"):
        ops.fp8_block_linear(x, w, ws, 128, 0, False)


# ------------------------------------------------------------------ kernels
@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [False, True])
def test_kernel_quantisation_is_bit_exact(dtype, pow2):
    from cpgraph.kernels.fp8_linear import quantize_activations as kq

    dev = kernel_device()
    x, _, _ = make_inputs(M=9, K=200, dtype=dtype, device=dev)
    x[3, 7] = 0.0
    x[4] = 0.0  # all-zero row: the 1e-4 floor
    x[5, 130] = float("nan")  # a NaN or an infinity makes its group's scale NaN
    x[6, 2] = float("-inf")
    q, s = quantize_activations(x.cpu(), 128, pow2)
    kq_, ks = kq(x, 128, pow2)
    assert torch.isnan(s[5, 1]) and torch.isnan(s[6, 0]) and torch.isfinite(s[5, 0])
    assert torch.equal(kq_.cpu().view(torch.uint8), q.view(torch.uint8))
    assert torch.allclose(ks.cpu(), s, rtol=0, atol=0, equal_nan=True)  # bit-equal, NaN where NaN
    qc, sc = kq(x, 128, pow2, scales_column_major=True)
    assert sc.stride() == (1, 9) and torch.allclose(sc.cpu(), s, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(qc.cpu().view(torch.uint8), q.view(torch.uint8))


@needs_kernels
@pytest.mark.parametrize(
    "M,K,N,block,dtype",
    [(37, 200, 150, (128, 128), torch.float32), (5, 256, 96, (64, 128), torch.bfloat16), (33, 64, 70, (16, 32), torch.float32)],
)
def test_triton_gemm_matches_reference(M, K, N, block, dtype):
    from cpgraph.kernels.fp8_linear import block_scaled_gemm, quantize_activations as kq

    dev = kernel_device()
    x, w, ws = make_inputs(M, K, N, block, dtype, device=dev)
    xq, xs = kq(x, block[1], True)
    got = block_scaled_gemm(xq, xs, w, ws, block[0], block[1], dtype).cpu().float()
    want = fp8_block_linear_reference(x.cpu().float(), w.cpu(), ws.cpu(), block[0], block[1], True)
    # fp32 output: the interpreter accumulates each block's FP8 dot exactly in fp32, but Hopper's FP8
    # tensor-core MMA keeps fewer accumulator bits inside one K block (scales are applied in fp32
    # between blocks; measured on H200: 5e-4), so on a GPU the bound is 2**-9 of the largest output.
    exact = 1e-5 if dev == "cpu" else 2**-9
    tol = (2**-7 if dtype == torch.bfloat16 else exact) * want.abs().max().item()
    assert (got - want).abs().max().item() <= tol


@needs_kernels
def test_triton_gemm_rejects_unsupported_block_k():
    from cpgraph.kernels.fp8_linear import block_scaled_gemm

    dev = kernel_device()
    x, w, ws = make_inputs(4, 48, 16, (16, 48), device=dev)
    xq = x.to(FP8)
    with pytest.raises(ValueError, match="block_k a power of two"):
        block_scaled_gemm(xq, torch.ones(4, 1, device=dev), w, ws, 16, 48, torch.float32)


@needs_kernels
def test_provider_through_the_op(monkeypatch):
    """The registered provider end to end (CPU under the interpreter: registered for 'cpu' for this test)."""
    from cpgraph.kernels import fp8_linear as kernel
    from cpgraph.ops.providers import active_provider, register_provider, unregister_provider

    dev = kernel_device()
    monkeypatch.setenv("CPGRAPH_FP8_LINEAR", "triton")
    if dev == "cpu":
        register_provider("fp8_block_linear", "cpu", "triton", kernel.fp8_block_linear)
    try:
        assert active_provider("fp8_block_linear", dev) == "triton"
        x, w, ws = make_inputs(20, 256, 130, dtype=torch.bfloat16, device=dev)
        got = ops.fp8_block_linear(x, w, ws, 128, 128, True).cpu().float()
    finally:
        if dev == "cpu":
            unregister_provider("fp8_block_linear", "cpu")
    want = fp8_block_linear_reference(x.cpu().float(), w.cpu(), ws.cpu(), 128, 128, True)
    assert (got - want).abs().max().item() <= 2**-7 * want.abs().max().item()
    monkeypatch.setenv("CPGRAPH_FP8_LINEAR", "bogus")
    with pytest.raises(ValueError, match="CPGRAPH_FP8_LINEAR must be one of"):
        kernel.fp8_block_linear(x, w, ws, 128, 128, True)


@needs_gpu
@pytest.mark.parametrize("N,K", [(1536, 7168), (576, 7168), (7168, 2048), (24576, 1536)])
@pytest.mark.parametrize("backend", ["triton", "scaled_mm"])
def test_gpu_backends_match_reference(monkeypatch, backend, N, K):
    from cpgraph.kernels import fp8_linear as kernel

    x, w, ws = make_inputs(300, K, N, dtype=torch.bfloat16, device="cuda", spread=False)
    reason = kernel.scaled_mm_reason(x, w, 128, 128)
    if backend == "scaled_mm" and reason is not None:
        pytest.skip(f"scaled_mm does not apply: {reason}")
    monkeypatch.setenv("CPGRAPH_FP8_LINEAR", backend)
    got = ops.fp8_block_linear(x, w, ws, 128, 128, True).float()
    want = fp8_block_linear_reference(x.float(), w, ws, 128, 128, True)
    assert (got - want).abs().max().item() <= 2**-7 * want.abs().max().item()


@needs_gpu
def test_gpu_provider_replays_in_cuda_graph():
    x, w, ws = make_inputs(64, 512, 256, dtype=torch.bfloat16, device="cuda")
    ops.fp8_block_linear(x, w, ws, 128, 128, True)  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fp8_block_linear(x, w, ws, 128, 128, True)
    x2, _, _ = make_inputs(64, 512, 256, dtype=torch.bfloat16, device="cuda", seed=3)
    x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ops.fp8_block_linear(x2, w, ws, 128, 128, True))
