"""Every fallback branch of cpgraph/kernels/ counts the implementation that computed the call, with its reason.

One test per branch.  On CPU the condition is forced (an operand the kernel does not take, the
provider registered for ``"cpu"``); a test whose call runs a Triton kernel needs the interpreter
(``TRITON_INTERPRET=1``, as CI runs).  Branches that depend on the GPU (its capability, CUDA-only
dtype rules, an NCCL group) are GPU tests and skip on CPU.  Each test drops the op's earlier counts
first (``ledger.forget``), so it sees only its own calls.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch

import cpgraph.ops  # noqa: F401  (registers the ops)
from cpgraph.ops import ledger, providers
from cpgraph.ops.providers import calls, register_provider, unregister_provider

from kernel_env import needs_gpu  # noqa: E402  (tests/ is on sys.path: tests/kernels/conftest.py)

ops = torch.ops.cpgraph
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "") != "1",
                                 reason="runs a Triton kernel on CPU: needs TRITON_INTERPRET=1")


@contextmanager
def provider(op: str, device: str, name: str, fn):
    """``fn`` as ``op``'s provider on ``device`` for the block; whatever was registered before comes back."""
    before = providers._PROVIDERS.get(op, {}).get(device)
    register_provider(op, device, name, fn)
    try:
        yield
    finally:
        if before is None:
            unregister_provider(op, device)
        else:
            register_provider(op, device, *before)


def counts(op: str, device: str) -> list[tuple[str, int, str | None]]:
    return [(r["implementation"], r["calls"], r["reason"]) for r in calls(device).get(op, [])]


@pytest.fixture
def fresh_warnings(monkeypatch):
    """A fallback warns once per process and reason: start from none logged, so this test sees its own."""
    monkeypatch.setattr(ledger, "_LOGGED", set())


def warnings_about(caplog, op: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and f"cpgraph::{op} " in r.getMessage()]


# ------------------------------------------------------------------ sparse MLA
def _mla(dtype, M=3, H=16, D=48, N=20, topk=24, device="cpu"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(M, H, D, generator=g).to(dtype).to(device)
    kv = torch.randn(N, D, generator=g).to(dtype).to(device)
    idx = torch.randint(-1, N, (M, topk), generator=g, dtype=torch.int32).to(device)
    return q, kv, idx


@interpreter
def test_flash_mla_refusals_are_counted_under_what_computed(caplog, fresh_warnings):
    """FlashMLA refuses a cpu call -> the Triton kernel; Triton refuses fp32 -> the reference: each call counted once."""
    from cpgraph.kernels import flash_mla as kflash
    from cpgraph.kernels import sparse_mla as ksparse

    q, kv, idx = _mla(torch.bfloat16)
    with provider("sparse_mla", "cpu", kflash.PROVIDER_NAME, kflash.sparse_mla), caplog.at_level("WARNING"):
        ledger.forget("sparse_mla", "cpu")
        out = [ops.sparse_mla(q, kv, idx, 0.3, 32) for _ in range(2)]
        ops.sparse_mla(q.float(), kv.float(), idx, 0.3, 32)
        got = counts("sparse_mla", "cpu")
    assert got == [("triton", 2, "a cpu device (FlashMLA runs on CUDA)"),
                   ("reference", 1, "torch.float32 operands (the kernel takes bf16/fp16)")]
    want = ksparse.sparse_mla(q, kv, idx, 0.3, 32)  # what the report says computed: the same kernel
    assert torch.equal(out[0][0], want[0]) and torch.equal(out[1][1], want[1])
    warned = warnings_about(caplog, "sparse_mla")
    assert len(warned) == 2  # one per (op, reason), not one per call
    assert "triton runs instead of flash_mla" in warned[0] and "reference runs instead of triton" in warned[1]


def test_triton_sparse_mla_refusal_counts_the_reference():
    from cpgraph.kernels import sparse_mla as ksparse
    from cpgraph.ops.sparse_mla import sparse_mla_reference

    q, kv, idx = _mla(torch.bfloat16, D=20)  # d_v = 12 is no power of two
    with provider("sparse_mla", "cpu", "triton", ksparse.sparse_mla):
        ledger.forget("sparse_mla", "cpu")
        out, lse = ops.sparse_mla(q, kv, idx, 0.5, 12)
        got = counts("sparse_mla", "cpu")
    assert got == [("reference", 1, "D=20, d_v=12 (the kernel needs d_v and D - d_v powers of two >= 16)")]
    want = sparse_mla_reference(q, kv, idx, 0.5, 12)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_sparse_mla_fp8_with_fp32_queries_counts_the_reference():
    from cpgraph.kernels import sparse_mla as ksparse

    g = torch.Generator().manual_seed(1)
    records = ops.mla_fp8_pack(torch.randn(12, 512, generator=g), torch.randn(12, 64, generator=g))
    q = torch.randn(2, 16, 576, generator=g)
    idx = torch.randint(-1, 12, (2, 8), generator=g, dtype=torch.int32)
    with provider("sparse_mla_fp8", "cpu", "triton", ksparse.sparse_mla_fp8):
        ledger.forget("sparse_mla_fp8", "cpu")
        ops.sparse_mla_fp8(q, records, idx, 0.1, 512)
        assert counts("sparse_mla_fp8", "cpu") == [("reference", 1, "torch.float32 queries (the kernel takes bf16)")]


# ------------------------------------------------------------------ MoE
def _moe(H=6, I=4, E=3, M=5, k=2, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(M, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    w = torch.rand(M, k, generator=g)
    gu = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    d = torch.randn(E, H, I, generator=g) / I**0.5
    return [t.to(device) for t in (x.to(dtype), ids, w, gu.to(dtype), d.to(dtype))]


def test_grouped_moe_counts_the_dense_reference_for_unaligned_rows(caplog, fresh_warnings):
    from cpgraph.kernels import moe as kmoe
    from cpgraph.ops.moe import moe_experts_reference

    x, ids, w, gu, d = _moe(H=6)  # fp32 rows of 24 bytes: not 16-byte aligned for torch._grouped_mm
    with provider("moe_experts", "cpu", "triton", kmoe.moe_experts), caplog.at_level("WARNING"):
        ledger.forget("moe_experts", "cpu")
        out = [ops.moe_experts(x, ids, w, gu, d) for _ in range(2)]
        got = counts("moe_experts", "cpu")
    reason = "H=6, 2I=8 torch.float32 rows are not 16-byte aligned (torch._grouped_mm needs aligned row strides)"
    assert got == [("reference", 2, reason)]
    assert len(warnings_about(caplog, "moe_experts")) == 1
    assert torch.equal(out[0], moe_experts_reference(x, ids, w, gu, d))


def test_fp8_moe_with_an_unsupported_block_counts_the_reference():
    from cpgraph.kernels import moe as kmoe

    g = torch.Generator().manual_seed(3)
    E, H, I, M, bn, bk = 2, 48, 16, 4, 16, 24  # block_k 24 is no power of two
    x = torch.randn(M, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g) for _ in range(M)])
    w = torch.rand(M, E, generator=g)
    gu = torch.randn(E, 2 * I, H, generator=g).to(torch.float8_e4m3fn)
    d = torch.randn(E, H, I, generator=g).to(torch.float8_e4m3fn)
    gus = torch.full((E, 2 * I // bn, -(-H // bk)), 0.01)
    ds = torch.full((E, -(-H // bn), -(-I // bk)), 0.01)
    with provider("moe_experts", "cpu", "triton", kmoe.moe_experts):
        ledger.forget("moe_experts", "cpu")
        ops.moe_experts(x, ids, w, gu, d, None, gus, ds, bn, bk, False)
        got = counts("moe_experts", "cpu")
    assert got == [("reference", 1, "FP8 block_k=24 is not a power of two in [32, 256]")]


# ------------------------------------------------------------------ paged store
def test_paged_store_into_a_pool_with_strided_rows_counts_the_reference():
    from cpgraph.kernels import move as kmove
    from cpgraph.ops.paged import paged_store_reference

    pool = torch.zeros(4, 9).t()  # [9 slots, 4 values], a row's values 9 elements apart
    rows, slots = torch.randn(3, 4), torch.tensor([7, -1, 2])
    want = pool.clone()
    paged_store_reference(want, rows, slots)
    with provider("paged_store", "cpu", "triton", kmove.paged_store):
        ledger.forget("paged_store", "cpu")
        ops.paged_store(pool, rows, slots)
        assert counts("paged_store", "cpu") == [("reference", 1, "a pool whose rows are not contiguous")]
    assert torch.equal(pool, want)


# ------------------------------------------------------------------ rerange
def test_p2p_rerange_without_runs_counts_the_reference():
    from dist_utils import fake_group

    from cpgraph.kernels import p2p

    with fake_group(world_size=2, rank=0) as gn, provider("cp_rerange", "cpu", p2p.PROVIDER_NAME, p2p.cp_rerange_p2p):
        ledger.forget("cp_rerange", "cpu")
        ops.cp_rerange(torch.randn(4, 3), torch.tensor([0, 1, 4, 5, 2]), gn, 2)
        got = counts("cp_rerange", "cpu")
    assert got == [("reference", 1, "no host runs attached to rerange_index (the all-gather form)")]


def test_p2p_blocks_below_min_bytes_count_the_all_gather_without_a_warning(caplog, fresh_warnings):
    """A small payload takes the all-gather by design (faster for small messages): counted, INFO only."""
    from dist_utils import fake_group

    from cpgraph.kernels import p2p

    with fake_group(world_size=2, rank=0) as gn, caplog.at_level("INFO", logger="cpgraph.ops"), \
            provider("cp_rerange_p2p", "cpu", p2p.BLOCK_PROVIDER_NAME, p2p.cp_rerange_p2p_blocks):
        ledger.forget("cp_rerange_p2p", "cpu")
        ops.cp_rerange_p2p(torch.randn(4, 3), torch.tensor([0, 1, 4, 5, 2]), gn, 2, 1 << 40)
        got = counts("cp_rerange_p2p", "cpu")
    assert got == [(p2p.ALL_GATHER, 1, "payload below min_bytes")]
    assert warnings_about(caplog, "cp_rerange_p2p") == []


# ------------------------------------------------------------------ indexer, FP8 linear
@interpreter
def test_deep_gemm_indexer_counts_triton_for_the_bf16_form():
    from cpgraph.kernels import deep_gemm_indexer as dg

    g = torch.Generator().manual_seed(4)
    M, H, D, N = 5, 2, 32, 12
    q, k = torch.randn(M, H, D, generator=g).bfloat16(), torch.randn(N, D, generator=g).bfloat16()
    w = torch.randn(M, H, generator=g)
    ks, ke = torch.zeros(M, dtype=torch.int32), torch.full((M,), N, dtype=torch.int32)
    with provider("indexer_topk", "cpu", dg.PROVIDER_NAME, dg.indexer_topk):
        ledger.forget("indexer_topk", "cpu")
        ops.indexer_topk(q, k, w, ks, ke, 4, 1 << 20)
        got = counts("indexer_topk", "cpu")
    assert got == [("triton", 1, "the bf16 form (DeepGEMM scores FP8 only)")]


@interpreter
def test_fp8_linear_counts_the_gemm_that_ran(monkeypatch, caplog, fresh_warnings):
    from cpgraph.kernels import fp8_linear as kernel

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 128, generator=g).bfloat16()
    wt = (torch.randn(128, 128, generator=g) * 50).to(torch.float8_e4m3fn)
    ws = torch.full((1, 1), 1e-3)
    with provider("fp8_block_linear", "cpu", "triton", kernel.fp8_block_linear), caplog.at_level("WARNING"):
        ledger.forget("fp8_block_linear", "cpu")
        monkeypatch.setenv(kernel.BACKEND_ENV, "auto")
        ops.fp8_block_linear(x, wt, ws, 128, 128, False)
        monkeypatch.setenv(kernel.BACKEND_ENV, "triton")
        ops.fp8_block_linear(x, wt, ws, 128, 128, False)
        got = counts("fp8_block_linear", "cpu")
    assert sorted(got) == [("triton", 1, "CPGRAPH_FP8_LINEAR=triton"), ("triton", 1, "not a CUDA tensor")]
    assert warnings_about(caplog, "fp8_block_linear") == []  # off CUDA the Triton GEMM is no fallback


# ------------------------------------------------------------------ GPU only
@needs_gpu
@pytest.mark.gpu
def test_gpu_flash_mla_refusals_count_triton(monkeypatch):
    """Production widths; a non-SM90 device (forced) and a top-k FlashMLA refuses: every call counted under triton."""
    from cpgraph.kernels import flash_mla as kflash

    q, kv, idx = _mla(torch.bfloat16, M=4, H=64, D=576, N=256, topk=128, device="cuda")
    monkeypatch.setattr(kflash, "_is_sm90", lambda device: False)
    with provider("sparse_mla", "cuda", kflash.PROVIDER_NAME, kflash.sparse_mla):
        ledger.forget("sparse_mla", "cuda")
        ops.sparse_mla(q, kv, idx, 0.04, 512)
        ops.sparse_mla(q, kv, idx[:, :100].contiguous(), 0.04, 512)
        got = counts("sparse_mla", "cuda")
    assert sorted(got) == [("triton", 1, "a non-SM90 GPU (FlashMLA's sparse prefill kernels are Hopper only)"),
                           ("triton", 1, "top-k 100 is not a positive multiple of 128")]


@needs_gpu
@pytest.mark.gpu
def test_gpu_grouped_moe_counts_the_reference_for_fp32():
    providers.bind_providers("cuda")
    x, ids, w, gu, d = _moe(H=64, I=32, dtype=torch.float32, device="cuda")
    ledger.forget("moe_experts", "cuda")
    ops.moe_experts(x, ids, w, gu, d)
    ops.moe_experts(x.bfloat16(), ids, w, gu.bfloat16(), d.bfloat16())
    assert sorted(counts("moe_experts", "cuda")) == [
        ("reference", 1, "torch.float32 operands (torch._grouped_mm takes bf16 on CUDA)"), ("triton", 1, None)]


@needs_gpu
@pytest.mark.gpu
def test_gpu_fp8_linear_counts_scaled_mm_triton_and_the_fallback(monkeypatch, caplog, fresh_warnings):
    from cpgraph.kernels import fp8_linear as kernel

    monkeypatch.setenv(kernel.BACKEND_ENV, "auto")
    # auto prefers DeepGEMM where it is installed (tests/kernels/test_deep_gemm_experts.py); this test is the
    # scaled_mm / Triton split below it.
    monkeypatch.setattr(kernel, "_deep_gemm_reason", lambda x: "DeepGEMM is left out of this test")
    x = torch.randn(64, 512, device="cuda").bfloat16()  # K / 128 = 4 weight-scale columns: no padding
    w256 = (torch.randn(256, 512, device="cuda") * 50).to(torch.float8_e4m3fn)
    w576 = (torch.randn(576, 512, device="cuda") * 50).to(torch.float8_e4m3fn)
    ws = lambda n: torch.full((-(-n // 128), 4), 1e-3, device="cuda")  # noqa: E731
    ledger.forget("fp8_block_linear", "cuda")
    ops.fp8_block_linear(x, w256, ws(256), 128, 128, False)
    ops.fp8_block_linear(x, w576, ws(576), 128, 128, False)
    machine = kernel.scaled_mm_reason(x, w256, 128, 128)
    got = counts("fp8_block_linear", "cuda")
    if machine is None:  # scaled_mm applies on this machine: N = 576 is the documented Triton split
        assert sorted(got) == [("scaled_mm", 1, None), ("triton", 1, "N=576 and K=512 must be multiples of 128")]
    else:
        assert got == [("triton", 2, machine)]
    reason = "torch has no torch.nn.functional.scaled_mm with BlockWise128x128"
    if machine == reason:
        return  # this torch has no scaled_mm: the forced case below is the one already seen
    monkeypatch.setattr(kernel, "scaled_mm_available", lambda: False)
    with caplog.at_level("WARNING"):
        ops.fp8_block_linear(x, w256, ws(256), 128, 128, False)
    assert ("triton", 1, reason) in counts("fp8_block_linear", "cuda")
    assert any(reason in m for m in warnings_about(caplog, "fp8_block_linear"))


@needs_gpu
@pytest.mark.gpu
def test_gpu_p2p_blocks_on_a_group_that_is_not_nccl_count_the_all_gather(caplog, fresh_warnings):
    from dist_utils import fake_group

    from cpgraph.kernels import p2p

    with fake_group(world_size=2, rank=0) as gn, caplog.at_level("WARNING"), \
            provider("cp_rerange_p2p", "cuda", p2p.BLOCK_PROVIDER_NAME, p2p.cp_rerange_p2p_blocks):
        ledger.forget("cp_rerange_p2p", "cuda")
        ops.cp_rerange_p2p(torch.randn(4, 3, device="cuda"), torch.tensor([0, 1, 4, 5, 2], device="cuda"), gn, 2, 0)
        got = counts("cp_rerange_p2p", "cuda")
    assert got == [(p2p.ALL_GATHER, 1, "a fake group, not NCCL")]
    assert len(warnings_about(caplog, "cp_rerange_p2p")) == 1


@needs_gpu
@pytest.mark.gpu
def test_gpu_paged_store_into_a_pool_with_strided_rows_counts_the_reference():
    providers.bind_providers("cuda")
    pool = torch.zeros(4, 9, device="cuda").t()
    ledger.forget("paged_store", "cuda")
    ops.paged_store(pool, torch.randn(3, 4, device="cuda"), torch.tensor([7, -1, 2], device="cuda"))
    assert counts("paged_store", "cuda") == [("reference", 1, "a pool whose rows are not contiguous")]


@needs_gpu
@pytest.mark.gpu
def test_gpu_graph_replays_are_not_counted():
    """What docs/kernels.md states: counts cover the warm-up and the capture; a replay runs no Python."""
    providers.bind_providers("cuda")
    x, index = torch.randn(64, 8, device="cuda"), torch.arange(32, device="cuda")
    ledger.forget("take_rows", "cuda")
    ops.take_rows(x, index)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.take_rows(x, index)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x[:32])
    assert counts("take_rows", "cuda") == [("triton", 2, None)]
