"""DeepGEMM's grouped FP8 GEMM as the FP8 routed experts' GEMM (cpgraph/kernels/deep_gemm_experts.py).

Three layers:

* the padded ("psum") layout against a brute force written from DeepGEMM's description of it (each
  expert's rows start where the previous expert's end, rounded up to 128 rows);
* the provider end to end against the op's FP8 reference, with a stand-in ``deep_gemm`` whose GEMM
  follows that layout (runs wherever the Triton kernels run: the interpreter or a GPU);
* on an SM90 GPU with DeepGEMM installed, the real kernel: against the reference and the Triton
  grouped GEMM, replayed from a CUDA graph, without host syncs, and counted under its name.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

import cpgraph.ops  # noqa: F401  (registers the ops)
from cpgraph.kernels import deep_gemm_experts as dge
from cpgraph.kernels import deep_gemm_lib
from cpgraph.ops.fp8_linear import dequantize_weight
from cpgraph.ops.moe import dispatch_plan, moe_experts_fp8_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_env import needs_gpu, needs_kernels, kernel_device  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))
from test_moe_fp8 import make_inputs, replay_with_new_routing  # noqa: E402


def rel_l2(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm())


def brute_layout(ends: list[int], rows: int):
    """Padded row of every sorted row (-1 past the routed ones) and DeepGEMM's group ends, by walking the experts."""
    pos, psum, start, first = [-1] * rows, [], 0, 0
    for end in ends:
        start = -(-start // 128) * 128  # this expert's segment starts on a 128-row boundary
        for i in range(end - first):
            pos[first + i] = start + i
        start += end - first
        psum.append(start)
        first = end
    return pos, psum


@pytest.mark.parametrize("counts,rows", [([3, 0, 130, 128, 1], 300), ([0, 0, 0], 5), ([256], 256), ([1] * 9, 12)])
def test_padded_layout_matches_the_walk(counts, rows):
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    pos, psum, size = dge.padded_layout(ends, rows)
    want_pos, want_psum = brute_layout(ends.tolist(), rows)
    assert pos.tolist() == want_pos
    assert psum.tolist() == want_psum and psum.dtype == torch.int32
    assert size == rows + 128 * len(counts)
    used = [p for p in want_pos if p >= 0]
    assert len(set(used)) == len(used) and all(p < size for p in used)  # distinct rows inside the buffer


def fake_deep_gemm():
    """A ``deep_gemm`` whose grouped GEMM computes the psum layout's whole 128-row blocks, as the SM90 kernel does."""

    def m_grouped_fp8_gemm_nt_contiguous(a_pair, b_pair, d, psum, use_psum_layout=False):
        assert use_psum_layout and psum.dtype == torch.int32 and d.dtype == torch.bfloat16
        a, sa = a_pair
        b, sb = b_pair
        af = a.float() * sa.repeat_interleave(128, dim=1)[:, : a.shape[1]]
        start = 0
        for e, end in enumerate(psum.cpu().tolist()):
            start = -(-start // 128) * 128
            stop = min(-(-end // 128) * 128, d.shape[0])  # the last block is computed whole
            if end > start:
                w = dequantize_weight(b[e].cpu(), sb[e].cpu(), 128, 128).to(a.device)
                d[start:stop] = (af[start:stop] @ w.t()).to(d.dtype)
            start = end

    def m_grouped_bf16_gemm_nt_contiguous(a, b, d, psum, use_psum_layout=False):
        assert use_psum_layout and a.dtype == b.dtype == d.dtype == torch.bfloat16
        start = 0
        for e, end in enumerate(psum.cpu().tolist()):
            start = -(-start // 128) * 128
            stop = min(-(-end // 128) * 128, d.shape[0])
            if end > start:
                d[start:stop] = (a[start:stop].float() @ b[e].float().t()).to(d.dtype)
            start = end

    return types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=m_grouped_fp8_gemm_nt_contiguous,
                                 m_grouped_bf16_gemm_nt_contiguous=m_grouped_bf16_gemm_nt_contiguous)


@needs_kernels
@pytest.mark.parametrize("M,E,k,skew,num_valid", [(150, 4, 2, 1, None), (37, 6, 3, None, 30)])
def test_provider_layout_with_a_stand_in_gemm_matches_the_reference(monkeypatch, M, E, k, skew, num_valid):
    """Gather into the padded layout, GEMMs, SwiGLU, down, combine: the op's result (one expert spans 2+ blocks)."""
    monkeypatch.setattr(deep_gemm_lib, "_module", fake_deep_gemm())
    dev = kernel_device()
    x, ids, w, gu, d, gus, ds = make_inputs(M=M, H=256, I=128, E=E, k=k, dtype=torch.bfloat16, skew=skew,
                                            device=dev)
    nv = None if num_valid is None else torch.tensor([num_valid], device=dev)
    got = dge.moe_experts_fp8(x, ids, w, gu, d, nv, gus, ds, 128, 128, True).cpu()
    want = moe_experts_fp8_reference(*(t.cpu() for t in (x, ids, w, gu, d)), None if nv is None else nv.cpu(),
                                     gus.cpu(), ds.cpu(), 128, 128, True)
    assert rel_l2(got, want) <= 2**-7
    if num_valid is not None:
        assert torch.equal(got[num_valid:], torch.zeros_like(got[num_valid:]))


@needs_kernels
def test_bf16_provider_layout_with_a_stand_in_gemm_matches_the_reference(monkeypatch):
    from cpgraph.ops.moe import moe_experts_reference

    monkeypatch.setattr(deep_gemm_lib, "_module", fake_deep_gemm())
    dev = kernel_device()
    g = torch.Generator().manual_seed(3)
    M, H, I, E, k = 150, 256, 128, 4, 2
    x = torch.randn(M, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    ids[:, 0] = 1  # one expert spans two 128-row blocks
    ids[:, 1] = torch.where(ids[:, 1] == 1, 2, ids[:, 1])
    w = torch.rand(M, k, generator=g) + 0.1
    gu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16()
    d = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    nv = torch.tensor([140])
    got = dge.moe_experts_bf16(*(t.to(dev) for t in (x, ids, w, gu, d, nv))).cpu()
    want = moe_experts_reference(x, ids, w, gu, d, nv)
    assert rel_l2(got, want) <= 2**-7
    assert torch.equal(got[140:], torch.zeros_like(got[140:]))


def test_backend_setting_is_checked(monkeypatch):
    monkeypatch.setenv(dge.BACKEND_ENV, "cutlass")
    with pytest.raises(ValueError, match="CPGRAPH_FP8_EXPERTS must be one of auto, deep_gemm, triton"):
        dge.backend()
    monkeypatch.setenv(dge.BF16_ENV, "cutlass")
    with pytest.raises(ValueError, match="CPGRAPH_BF16_EXPERTS must be one of auto, deep_gemm, grouped_mm"):
        dge.bf16_backend()


def test_dense_deep_gemm_operand_rule():
    """DeepGEMM's dense GEMM takes N in multiples of 64 (kv_a's 576), cuBLASLt's blockwise one multiples of 128."""
    from cpgraph.kernels import fp8_linear as fl

    x = torch.zeros(4, 1024, dtype=torch.bfloat16)
    assert fl.deep_gemm_operand_reason(x.dtype, torch.zeros(576, 1024), 128, 128) is None
    assert "N=576" in fl._operand_reason(x.dtype, torch.zeros(576, 1024), 128, 128)
    assert "N=200" in fl.deep_gemm_operand_reason(x.dtype, torch.zeros(200, 1024), 128, 128)
    assert "K=1000" in fl.deep_gemm_operand_reason(x.dtype, torch.zeros(576, 1000), 128, 128)
    assert "64x128" in fl.deep_gemm_operand_reason(x.dtype, torch.zeros(576, 1024), 64, 128)
    assert "float32" in fl.deep_gemm_operand_reason(torch.float32, torch.zeros(576, 1024), 128, 128)


def test_operand_reasons_name_the_operand():
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    gu, d = torch.zeros(2, 256, 256), torch.zeros(2, 256, 128)
    assert dge.operand_reason(x, gu, d, 128, 128) is None
    assert "64x64" in dge.operand_reason(x, gu, d, 64, 64)
    assert "float32" in dge.operand_reason(x.float(), gu, d, 128, 128)
    assert "H=200" in dge.operand_reason(torch.zeros(4, 200, dtype=torch.bfloat16), gu, d, 128, 128)


def test_cpu_calls_are_not_offered_to_deep_gemm(monkeypatch):
    monkeypatch.setenv(dge.BACKEND_ENV, "deep_gemm")  # even forced: CPU tensors never reach DeepGEMM
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    assert dge.choose(x, torch.zeros(2, 256, 256), torch.zeros(2, 256, 128), 128, 128) is False


@pytest.mark.parametrize("setting,machine,hidden,want,row", [
    ("auto", None, 256, True, ("deep_gemm", None)),
    ("auto", "deep_gemm does not load", 256, False, ("triton", "deep_gemm does not load")),  # the fallback: WARNING
    ("auto", None, 200, False, ("triton", "torch.bfloat16 H=200, 2I=256 (DeepGEMM takes bf16, multiples of 128)")),
    ("grouped_mm", None, 256, False, None),
    ("deep_gemm", "deep_gemm does not load", 256, ValueError, None),
    ("deep_gemm", None, 200, ValueError, None),
])
def test_bf16_choice_follows_the_setting_machine_and_operands(monkeypatch, caplog, setting, machine, hidden, want, row):
    """``choose_bf16`` on a stand-in CUDA tensor: ``auto`` takes DeepGEMM where it applies, a machine without it is a
    counted fallback (WARNING), operands it does not take the documented split; forcing it where it cannot run raises."""
    from types import SimpleNamespace

    from cpgraph.ops import ledger

    monkeypatch.setenv(dge.BF16_ENV, setting)
    monkeypatch.setattr(dge, "interpreting", lambda: False)
    monkeypatch.setattr(dge, "machine_reason", lambda x: machine)
    x = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, shape=(8, hidden))
    gate_up = SimpleNamespace(shape=(4, 256, hidden))
    ledger.reset()
    if want is ValueError:
        with pytest.raises(ValueError, match="CPGRAPH_BF16_EXPERTS=deep_gemm but"):
            dge.choose_bf16(x, gate_up)
        return
    with caplog.at_level("INFO", logger="cpgraph"):
        assert dge.choose_bf16(x, gate_up) is want
    rows = ledger.calls("cuda").get("moe_experts", [])
    assert rows == ([] if row is None else [{"implementation": row[0], "calls": 1, "reason": row[1]}])
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "instead of deep_gemm" in r.getMessage()]
    assert len(warned) == (1 if machine else 0)  # (only "auto" gets here with a machine reason)


# ------------------------------------------------------------------ GPU with DeepGEMM
def _real_deep_gemm() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and dge.load() is not None


needs_deep_gemm = pytest.mark.skipif(not _real_deep_gemm(), reason="needs an SM90 GPU with deep_gemm installed")


@needs_gpu
@needs_deep_gemm
@pytest.mark.parametrize("num_valid", [None, 1500])
def test_gpu_deep_gemm_matches_reference_and_triton(monkeypatch, num_valid):
    from cpgraph.kernels.fp8_grouped import moe_experts_fp8 as triton_experts

    x, ids, w, gu, d, gus, ds = make_inputs(M=2048, H=1024, I=256, E=16, k=4, dtype=torch.bfloat16, skew=3,
                                            device="cuda")
    nv = None if num_valid is None else torch.tensor([num_valid], device="cuda")
    got = dge.moe_experts_fp8(x, ids, w, gu, d, nv, gus, ds, 128, 128, True)
    want = moe_experts_fp8_reference(x, ids, w, gu, d, nv, gus, ds, 128, 128, True)
    tri = triton_experts(x, ids, w, gu, d, nv, gus, ds, 128, 128, True)
    assert rel_l2(got, want) <= 2**-7
    assert rel_l2(got, tri) <= 2**-7  # two FP8 tensor-core GEMMs: same codes and scales, other sum order
    if num_valid is not None:
        assert torch.equal(got[num_valid:], torch.zeros_like(got[num_valid:]))


@needs_gpu
@needs_deep_gemm
def test_gpu_deep_gemm_is_chosen_counted_replayed_and_sync_free(monkeypatch):
    from cpgraph.ops import ledger

    def chosen_and_sync_free(call):
        names = {row["implementation"] for row in ledger.calls("cuda").get("moe_experts", [])}
        assert names == {"deep_gemm"}
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(0)

    ledger.reset()
    out, eager = replay_with_new_routing(chosen_and_sync_free)
    assert torch.equal(out, eager)
    assert torch.equal(out[256:], torch.zeros_like(out[256:]))
    monkeypatch.setenv(dge.BACKEND_ENV, "triton")
    ledger.reset()
    x, ids, w, gu, d, gus, ds = make_inputs(M=64, H=256, I=128, E=8, k=2, dtype=torch.bfloat16, device="cuda")
    torch.ops.cpgraph.moe_experts(x, ids, w, gu, d, None, gus, ds, 128, 128, True)
    names = {row["implementation"] for row in ledger.calls("cuda").get("moe_experts", [])}
    assert names == {"triton"}

@needs_gpu
@needs_deep_gemm
def test_gpu_deep_gemm_bf16_matches_grouped_mm(monkeypatch):
    from cpgraph.kernels.moe import moe_experts as kernel_moe

    g = torch.Generator().manual_seed(4)
    M, H, I, E, k = 2048, 1024, 256, 16, 4
    x = torch.randn(M, H, generator=g).bfloat16().cuda()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).cuda()
    w = (torch.rand(M, k, generator=g) + 0.1).cuda()
    gu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16().cuda()
    d = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16().cuda()
    nv = torch.tensor([1500], device="cuda")
    monkeypatch.setenv(dge.BF16_ENV, "grouped_mm")
    want = kernel_moe(x, ids, w, gu, d, nv)
    monkeypatch.setenv(dge.BF16_ENV, "deep_gemm")
    got = kernel_moe(x, ids, w, gu, d, nv)
    assert rel_l2(got, want) <= 2**-8  # two bf16 tensor-core GEMMs, fp32 accumulation, other sum order
    assert torch.equal(got[1500:], torch.zeros_like(got[1500:]))


@needs_gpu
@needs_deep_gemm
def test_gpu_deep_gemm_rows_do_not_depend_on_the_batch():
    """A token's output is the same bits alone in a smaller batch (the layout moves its row, the GEMM config may change)."""
    x, ids, w, gu, d, gus, ds = make_inputs(M=3000, H=1024, I=256, E=16, k=4, dtype=torch.bfloat16, skew=3,
                                            device="cuda")
    full = dge.moe_experts_fp8(x, ids, w, gu, d, None, gus, ds, 128, 128, True)
    part = dge.moe_experts_fp8(x[1000:1300], ids[1000:1300], w[1000:1300], gu, d, None, gus, ds, 128, 128, True)
    assert torch.equal(part, full[1000:1300])


@needs_gpu
@needs_deep_gemm
def test_gpu_deep_gemm_dense_linear_matches_scaled_mm(monkeypatch):
    """``CPGRAPH_FP8_LINEAR=deep_gemm``: DeepGEMM's dense GEMM on the same codes and scales as torch's blockwise GEMM."""
    from cpgraph.ops import ledger

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))
    from test_moe_fp8 import quantize_blocks

    cpgraph.ops.bind_providers("cuda")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1000, 1024, generator=g).bfloat16().cuda()
    wq, ws = quantize_blocks(torch.randn(1, 768, 1024, generator=g) / 32, 128, 128)
    wq, ws = wq[0].cuda(), ws[0].cuda()
    monkeypatch.setenv("CPGRAPH_FP8_LINEAR", "scaled_mm")
    want = torch.ops.cpgraph.fp8_block_linear(x, wq, ws, 128, 128, True)
    for choice in ("deep_gemm", "auto"):  # auto prefers DeepGEMM where it is installed
        monkeypatch.setenv("CPGRAPH_FP8_LINEAR", choice)
        ledger.reset()
        got = torch.ops.cpgraph.fp8_block_linear(x, wq, ws, 128, 128, True)
        assert {r["implementation"] for r in ledger.calls("cuda")["fp8_block_linear"]} == {"deep_gemm"}
        assert rel_l2(got, want) <= 2**-9  # same codes and scales, FP8 MMA sums in another order
    # N = 576 (kv_a_proj_with_mqa) ends inside a weight block: DeepGEMM takes it, against the Triton GEMM's bits
    w576, s576 = quantize_blocks(torch.randn(1, 576, 1024, generator=g) / 32, 128, 128)
    w576, s576 = w576[0].cuda(), s576[0].cuda()
    monkeypatch.setenv("CPGRAPH_FP8_LINEAR", "triton")
    want = torch.ops.cpgraph.fp8_block_linear(x, w576, s576, 128, 128, True)
    monkeypatch.setenv("CPGRAPH_FP8_LINEAR", "auto")
    ledger.reset()
    got = torch.ops.cpgraph.fp8_block_linear(x, w576, s576, 128, 128, True)
    assert {r["implementation"] for r in ledger.calls("cuda")["fp8_block_linear"]} == {"deep_gemm"}
    assert rel_l2(got, want) <= 2**-9
    # N = 200 is not a multiple of 64: even asked for, DeepGEMM is not offered (the Triton GEMM runs)
    w200, s200 = quantize_blocks(torch.randn(1, 200, 1024, generator=g) / 32, 128, 128)
    monkeypatch.setenv("CPGRAPH_FP8_LINEAR", "deep_gemm")
    ledger.reset()
    torch.ops.cpgraph.fp8_block_linear(x, w200[0].cuda(), s200[0].cuda(), 128, 128, True)
    assert {r["implementation"] for r in ledger.calls("cuda")["fp8_block_linear"]} == {"triton"}
