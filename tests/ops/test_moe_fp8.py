"""cpgraph::moe_experts with FP8 (e4m3 + block-scale) experts: reference, Triton grouped provider, errors.

The reference (CPU) dequantises the weights and quantises the activations
by the recipe; it is checked row by row against a loop that applies the
contract to one row and one slot at a time, and against the bf16 experts on
the dequantised weights (they differ by the activation quantisation only).
The Triton provider runs on CPU tensors under ``TRITON_INTERPRET=1`` and on
CUDA; CUDA-graph capture is GPU-only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import cpgraph.ops  # noqa: F401  (registers the ops)
from cpgraph.ops.fp8_linear import dequantize_weight, quantize_activations
from cpgraph.ops.moe import moe_experts_fp8_reference, moe_experts_reference

ops = torch.ops.cpgraph
FP8 = torch.float8_e4m3fn


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_env import kernel_device, needs_gpu, needs_kernels  # noqa: E402


def quantize_blocks(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, N, K]`` float -> (e4m3, fp32 scales ``[E, ceil(N/bn), ceil(K/bk)]``), ``scale = amax / 448`` per block."""
    E, N, K = w.shape
    nb, kb = -(-N // bn), -(-K // bk)
    padded = F.pad(w.float(), (0, kb * bk - K, 0, nb * bn - N)).view(E, nb, bn, kb, bk)
    scale = padded.abs().amax(dim=(2, 4)).clamp_min(1e-12) / 448
    q = (padded / scale[:, :, None, :, None]).clamp(-448, 448).view(E, nb * bn, kb * bk)[:, :N, :K].to(FP8)
    return q.contiguous(), scale.contiguous()


def make_inputs(M=9, H=256, I=128, E=4, k=2, block=(128, 128), dtype=torch.float32, seed=0, device="cpu", skew=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g)
    if skew is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    else:  # expert `skew` in every row's first slot
        rest = torch.stack([torch.randperm(E - 1, generator=g)[: k - 1] for _ in range(M)])
        ids = torch.cat([torch.full((M, 1), skew), rest + (rest >= skew).long()], dim=1)
    w = torch.rand(M, k, generator=g) + 0.1
    gu, gus = quantize_blocks(torch.randn(E, 2 * I, H, generator=g) / H**0.5, *block)
    d, ds = quantize_blocks(torch.randn(E, H, I, generator=g) / I**0.5, *block)
    return [t.to(device) for t in (x.to(dtype), ids, w, gu, d, gus, ds)]


def dequantized(gu, d, gus, ds, block):
    return (torch.stack([dequantize_weight(gu[e], gus[e], *block) for e in range(gu.shape[0])]),
            torch.stack([dequantize_weight(d[e], ds[e], *block) for e in range(d.shape[0])]))


def per_row(x, ids, w, gu, d, gus, ds, block, pow2, num_valid=None):
    """The contract applied to one row and one slot at a time (fp32)."""
    bn, bk = block
    M, H = x.shape
    E = gu.shape[0]
    gu_f, d_f = dequantized(gu, d, gus, ds, block)
    out = torch.zeros(M, H)
    for m in range(M if num_valid is None else min(M, num_valid)):
        q, s = quantize_activations(x[m : m + 1], bk, pow2)
        xq = q.float() * s.repeat_interleave(bk, dim=1)[:, :H]
        for j in range(ids.shape[1]):
            e = int(ids[m, j])
            if not 0 <= e < E:
                continue
            gate, up = (xq @ gu_f[e].t()).to(x.dtype).float().chunk(2, dim=-1)
            act = F.silu(gate) * up
            qa, sa = quantize_activations(act, bk, pow2)
            aq = qa.float() * sa.repeat_interleave(bk, dim=1)[:, : act.shape[1]]
            out[m] += float(w[m, j]) * (aq @ d_f[e].t()).to(x.dtype).float()[0]
    return out


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


# -------------------------------------------------------------- reference
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("H,I,block", [(256, 128, (128, 128)), (200, 64, (64, 128)), (96, 64, (32, 32))])
def test_reference_matches_the_per_row_contract(H, I, block, pow2):
    x, ids, w, gu, d, gus, ds = make_inputs(M=7, H=H, I=I, E=5, k=3, block=block)
    ids[2, 1] = 5  # out of range: routes nowhere
    got = ops.moe_experts(x, ids, w, gu, d, torch.tensor([6]), gus, ds, *block, pow2)
    want = per_row(x, ids, w, gu, d, gus, ds, block, pow2, num_valid=6)
    # Same quantiser, same products; only fp32 summation order differs (a rare flipped e4m3 code of the
    # SwiGLU output moves one row by at most ~1 %).
    assert rel(got, want) <= 2e-2
    assert float((got - want).norm() / want.norm()) <= 2e-3
    assert torch.equal(got[6], torch.zeros_like(got[6]))


def test_fp8_experts_track_the_dequantised_bf16_experts():
    """The only difference from the experts on dequantised weights is the activation quantisation."""
    block = (128, 128)
    x, ids, w, gu, d, gus, ds = make_inputs(M=32, H=256, I=128, E=6, k=2)
    gu_f, d_f = dequantized(gu, d, gus, ds, block)
    dense = moe_experts_reference(x, ids, w, gu_f, d_f)
    for pow2 in (False, True):
        got = ops.moe_experts(x, ids, w, gu, d, None, gus, ds, *block, pow2)
        err = float((got - dense).norm() / dense.norm())
        # Two e4m3 roundings (input, SwiGLU output) of ~2**-5 rms each: measured 0.043 (fp32 scales) / 0.046 (ue8m0).
        assert 0 < err <= 0.08, (pow2, err)


def test_non_finite_row_stays_in_its_row():
    x, ids, w, gu, d, gus, ds = make_inputs(M=6, E=4, k=2)
    x[2, 5] = float("nan")
    got = ops.moe_experts(x, ids, w, gu, d, None, gus, ds, 128, 128, True)
    assert torch.isnan(got[2]).all()
    clean = torch.cat([torch.arange(2), torch.arange(3, 6)])
    assert torch.isfinite(got[clean]).all()


@pytest.mark.parametrize("M", [1, 9])
def test_opcheck(M):
    """opcheck minus ``test_schema``, whose mutation check multiplies inputs (no e4m3 ``mul`` kernel on CPU).

    What ``test_schema`` would check is checked directly: the op leaves every input bit-identical.
    """
    x, ids, w, gu, d, gus, ds = make_inputs(M=M, H=96, I=64, E=3, k=2, block=(32, 32), dtype=torch.bfloat16)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for args in ((x, ids, w, gu, d, torch.tensor([M]), gus, ds, 32, 32, True),
                 (x.float(), ids.int(), w, gu, d, None, gus, ds, 32, 32, False)):
        opcheck(ops.moe_experts.default, args, test_utils=utils)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        before = [t.clone() for t in tensors]
        ops.moe_experts(*args)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, tensors))


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda a: a.update(ds=None), "need both 'gate_up_scale' and 'down_scale'"),
        (lambda a: a.update(gus=a["gus"][:, :1]), "argument 'gate_up_scale'"),
        (lambda a: a.update(ds=a["ds"].double()), "argument 'down_scale'"),
        (lambda a: a.update(gu=a["gu"].float()), "argument 'gate_up'"),
        (lambda a: a.update(bn=256), "multiple of block_n=256"),
        (lambda a: a.update(bk=0), "'block_k' must be a positive int"),
    ],
)
def test_bad_fp8_arguments_raise_one_line_errors(change, needle):
    x, ids, w, gu, d, gus, ds = make_inputs(M=3, E=3)
    a = dict(gu=gu, d=d, gus=gus, ds=ds, bn=128, bk=128)
    change(a)
    with pytest.raises(ValueError, match=needle):
        ops.moe_experts(x, ids, w, a["gu"], a["d"], None, a["gus"], a["ds"], a["bn"], a["bk"], True)


# ------------------------------------------------------------------ kernels
@needs_kernels
@pytest.mark.parametrize(
    "M,H,I,E,k,block,dtype,pow2",
    [(9, 256, 128, 4, 2, (128, 128), torch.float32, False), (13, 200, 64, 5, 3, (64, 64), torch.bfloat16, True),
     (6, 96, 64, 7, 2, (32, 32), torch.float32, False)],
)
def test_triton_provider_matches_reference(M, H, I, E, k, block, dtype, pow2):
    """One scale recipe per shape, both recipes over the three.

    ``pow2`` only picks how a group's scale is rounded (the SwiGLU quantiser's constexpr branch and
    the activation quantiser), which no tile, block or dtype of the GEMMs depends on; the bf16 shape
    runs the production recipe (ue8m0, ``pow2``), the fp32 shapes the other, and the production block
    with ``pow2`` runs end to end in ``test_triton_provider_through_the_op_with_skewed_routing``."""
    from cpgraph.kernels.fp8_grouped import moe_experts_fp8

    dev = kernel_device()
    x, ids, w, gu, d, gus, ds = make_inputs(M, H, I, E, k, block, dtype, device=dev)
    ids[1, 0] = -1  # routes nowhere
    nv = torch.tensor([M - 2], device=dev)
    got = moe_experts_fp8(x, ids, w, gu, d, nv, gus, ds, *block, pow2).cpu()
    want = moe_experts_fp8_reference(*(t.cpu() for t in (x, ids, w, gu, d, nv, gus, ds)), *block, pow2)
    assert torch.equal(got[M - 2 :], torch.zeros_like(got[M - 2 :]))  # rows past num_valid: exact zeros
    # fp32 under the interpreter: the same e4m3 codes and scales, fp32 sums in another order.  Otherwise
    # a gate/up value rounded differently (bf16 output; Hopper's FP8 MMA keeps fewer accumulator bits
    # inside one K block) now and then moves a SwiGLU output across an e4m3 boundary: measured on H200
    # up to 8.7e-3 relative L2 (bf16, 13 rows, 64 x 64 blocks).
    exact = dtype == torch.float32 and dev == "cpu"
    assert rel(got, want) <= (1e-5 if exact else 2**-5)
    assert float((got.float() - want.float()).norm() / want.float().norm()) <= (1e-5 if exact else 2**-6)


@needs_kernels
@pytest.mark.parametrize("launch", [(2, False), (3, True), (1, True)], ids=["groups", "groups+pairs", "pairs"])
def test_grouped_gemm_launch_forms_keep_the_bits(launch):
    """The grouped raster order and paired K blocks change only the schedule: the same bits as the 2-D grid.

    K = 256 is two 128-blocks, so the paired path runs (it needs whole pairs and one weight-scale block
    per column tile); groups of 2 and 3 row tiles split the tiles unevenly, the last group short.
    """
    from cpgraph.kernels.fp8_grouped import grouped_gemm
    from cpgraph.ops.moe import dispatch_plan

    group_t, pair_k = launch
    dev = kernel_device()
    M, k = 37, 2
    x, ids, _, gu, _, gus, _ = make_inputs(M=M, H=256, I=64, E=5, k=k, device=dev)
    plan = dispatch_plan(ids, torch.tensor([M], device=dev), gu.shape[0])
    xq, xs = quantize_activations(x, 128, False)
    base = (32, 32, 4, 1) if dev == "cpu" else (64, 128, 4, 4)
    if pair_k and dev != "cpu":
        base = (128, 128, 8, 3)
    args = (xq, xs, plan.order // k, gu, gus, plan.group_ends, 128, 128, torch.float32, M * k)
    want = grouped_gemm(*args, tiles=base)
    got = grouped_gemm(*args, tiles=base + (group_t, int(pair_k)))
    assert torch.equal(got, want)


@needs_kernels
def test_triton_provider_through_the_op_with_skewed_routing():
    """The registered provider end to end; one expert gets every row (its group spans several row tiles)."""
    from cpgraph.kernels import moe as kernel
    from cpgraph.ops.providers import active_provider, register_provider, unregister_provider

    dev = kernel_device()
    if dev == "cpu":
        register_provider("moe_experts", "cpu", "triton", kernel.moe_experts)
    try:
        assert active_provider("moe_experts", dev) == "triton"
        # The skewed expert's rows span two row tiles: 32-row tiles under the interpreter, 64 on the GPU.
        x, ids, w, gu, d, gus, ds = make_inputs(M=40 if dev == "cpu" else 70, E=4, k=2, skew=2, device=dev)
        got = ops.moe_experts(x, ids, w, gu, d, None, gus, ds, 128, 128, True).cpu()
    finally:
        if dev == "cpu":
            unregister_provider("moe_experts", "cpu")
    want = moe_experts_fp8_reference(*(t.cpu() for t in (x, ids, w, gu, d)), None, gus.cpu(), ds.cpu(), 128, 128, True)
    # The kernel's exp() may differ from torch's in the last bit, which now and then moves one SwiGLU
    # output across an e4m3 rounding boundary (one code: measured 2.4e-4 of the largest output here).
    assert rel(got, want) <= 2**-5
    assert float((got - want).norm() / want.norm()) <= (1e-4 if dev == "cpu" else 2**-7)


@needs_kernels
def test_swiglu_quantize_matches_the_recipe_on_routed_rows():
    from cpgraph.kernels.fp8_grouped import swiglu_quantize

    dev = kernel_device()
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(10, 2 * 192, generator=g) * 3).to(dev)
    ends = torch.tensor([3, 7, 7], dtype=torch.int32, device=dev)  # 7 routed rows
    q, s = swiglu_quantize(h, ends, 128, True)
    gate, up = h.cpu().chunk(2, dim=-1)
    wq, ws = quantize_activations(F.silu(gate) * up, 128, True)
    # The exponential may differ in its last bit from torch's: allow a rare one-code difference.
    codes = (q.cpu()[:7].float() - wq[:7].float()).abs() / wq[:7].float().abs().clamp_min(1e-30)
    assert float(codes.max()) <= 0.13 and float((codes > 0).float().mean()) <= 0.01
    assert torch.equal(s.cpu()[:7], ws[:7])


# ------------------------------------------------------------------ GPU only
@needs_gpu
@pytest.mark.parametrize("num_valid", [None, 1500])
def test_gpu_fp8_experts_match_reference_and_bf16(num_valid):
    cpgraph.ops.bind_providers("cuda")
    block = (128, 128)
    x, ids, w, gu, d, gus, ds = make_inputs(M=2048, H=1024, I=256, E=16, k=4, dtype=torch.bfloat16, skew=3,
                                            device="cuda")
    nv = None if num_valid is None else torch.tensor([num_valid], device="cuda")
    got = ops.moe_experts(x, ids, w, gu, d, nv, gus, ds, *block, True)
    want = moe_experts_fp8_reference(x, ids, w, gu, d, nv, gus, ds, *block, True)
    assert rel(got, want) <= 2**-5  # bf16 roundings + Hopper FP8 MMA accumulation
    assert float((got.float() - want.float()).norm() / want.float().norm()) <= 2**-7
    gu_f, d_f = dequantized(gu, d, gus, ds, block)
    dense = ops.moe_experts(x, ids, w, gu_f.bfloat16(), d_f.bfloat16(), nv)
    assert float((got.float() - dense.float()).norm() / dense.float().norm()) <= 0.08  # activation quantisation
    if num_valid is not None:
        assert torch.equal(got[num_valid:], torch.zeros_like(got[num_valid:]))


def replay_with_new_routing(before_capture=None):
    """Capture FP8 experts on one routing, replay on another: ``(replayed, eager)`` outputs for the second.

    ``before_capture()`` runs after the first (compiling) call, outside the capture.
    """
    cpgraph.ops.bind_providers("cuda")
    x, ids, w, gu, d, gus, ds = make_inputs(M=512, H=256, I=128, E=8, k=2, dtype=torch.bfloat16, device="cuda")
    nv = torch.tensor([400], device="cuda")
    ops.moe_experts(x, ids, w, gu, d, nv, gus, ds, 128, 128, True)  # compile outside the capture
    torch.cuda.synchronize()
    if before_capture is not None:
        before_capture(lambda: ops.moe_experts(x, ids, w, gu, d, nv, gus, ds, 128, 128, True))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.moe_experts(x, ids, w, gu, d, nv, gus, ds, 128, 128, True)
    x2, ids2, w2, *_ = make_inputs(M=512, H=256, I=128, E=8, k=2, dtype=torch.bfloat16, skew=5, seed=9, device="cuda")
    x.copy_(x2)
    ids.copy_(ids2)
    w.copy_(w2)
    nv.fill_(256)
    graph.replay()
    torch.cuda.synchronize()
    return out, ops.moe_experts(x, ids, w, gu, d, nv, gus, ds, 128, 128, True)


@needs_gpu
def test_gpu_fp8_experts_replay_in_cuda_graph_with_new_routing():
    out, eager = replay_with_new_routing()
    assert torch.equal(out, eager)  # same kernels, same inputs: bit-identical
    assert torch.equal(out[256:], torch.zeros_like(out[256:]))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "") == "1", reason="the interpreter replaces Triton's compiler")
def test_kernels_compile_for_sm90_without_a_gpu():
    """The compiled (not interpreted) kernels build for Hopper, multi-stage pipelined, on any machine.

    The interpreter runs the kernels' arithmetic but not Triton's compiler; this compiles the grouped
    GEMM and the SwiGLU quantiser for SM90 the way a launch would (16-divisible sizes and pointers), so
    a construct only the compiler rejects fails here rather than on the first GPU run.
    """
    import re

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cpgraph.kernels import fp8_grouped as fg

    def build(fn, sig, consts, aligned, **opts):
        attrs = {(list(sig).index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)

    sig = dict.fromkeys(["N", "K", "E", "C", "stride_sam", "stride_sak", "stride_be", "stride_bse", "n_kb", "T", "NT"], "i32")
    sig = {"a": "*fp8e4nv", "a_scale": "*fp32", "a_rows": "*i64", "b": "*fp8e4nv", "b_scale": "*fp32",
           "group_ends": "*i32", "out": "*i16", **sig}
    consts = {"EP": 256, "BLOCK_N_Q": 128, "BK": 128, "OUT_KIND": 1, "LOOP_WHILE": False}
    sig.update(dict.fromkeys(["EP", "GATHER", "BLOCK_N_Q", "BM", "BN", "BK", "OUT_KIND", "LOOP_WHILE", "SB_SCALAR",
                              "EVEN_K", "GROUP_T", "PAIR_K"], "constexpr"))
    aligned = ["a", "a_scale", "a_rows", "b", "b_scale", "group_ends", "out", "N", "K", "stride_sam", "stride_be"]
    variants = ((True, (64, 128, 4, 4, 16, False)), (False, (128, 128, 8, 4, 1, False)), (True, (64, 256, 8, 3, 1, False)),
                (True, (128, 128, 8, 3, 16, True)))  # the default; 2-D grids; paired K blocks
    for gather, (bm, bn, warps, stages, group_t, pair_k) in variants:
        k = build(fg._grouped_gemm_kernel, sig, dict(consts, GATHER=gather, BM=bm, BN=bn, SB_SCALAR=128 % bn == 0,
                                                     EVEN_K=True, GROUP_T=group_t, PAIR_K=pair_k),
                  aligned, num_warps=warps, num_stages=stages)
        ttgir = k.asm["ttgir"]
        assert "warp_group_dot" in ttgir  # Hopper wgmma
        assert re.search(rf"memdesc<{stages}x{bm}x128xf8E4M3FN", ttgir)  # A tiles multi-buffered
    sig2 = {"h": "*i16", "group_ends": "*i32", "q": "*fp8e4nv", "scales": "*fp32", "C": "i32", "I": "i32", "E": "i32",
            "stride_h": "i32", **dict.fromkeys(["GROUP", "GP", "ROWS", "POW2", "KIND", "HW_CAST"], "constexpr")}
    for pow2 in (False, True):
        build(fg._swiglu_quant_kernel, sig2, {"GROUP": 128, "GP": 128, "ROWS": 16, "POW2": pow2, "KIND": 1, "HW_CAST": True},
              ["h", "q", "scales", "I", "stride_h"], num_warps=4)
