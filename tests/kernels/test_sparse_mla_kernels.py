"""Sparse MLA kernels (Triton; FlashMLA where it loads) against the fp32 torch reference.

Interpreter tests (``TRITON_INTERPRET=1``, CPU tensors) use small head
counts and widths so CI stays fast; GPU tests (marked ``gpu``) run the
production widths (D 576, d_v 512, top-k 2048, 64 and 128 heads).

Tolerance, bf16 operands: the kernel's products are exact in fp32 and only
the summation order differs from the reference, so ``lse`` agrees to fp32
rounding of the sums (``atol 2e-3`` over scores of size ~10); ``out`` is
rounded to bf16 (relative 2**-9) and its ``P @ V`` takes ``P`` in bf16 (a
second 2**-9), hence ``atol = rtol = 2e-2`` for values of size ~1.  The
reference is fed the same bf16 values widened to fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

from cpgraph.ops.sparse_mla import sparse_mla_fp8_reference, sparse_mla_reference

INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"
if INTERPRET:
    DEV = "cpu"
elif torch.cuda.is_available():
    DEV = "cuda"
else:
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device", allow_module_level=True)

import cpgraph.kernels as kernels  # noqa: E402
from cpgraph.kernels import flash_mla as kflash  # noqa: E402
from cpgraph.kernels import sparse_mla as ksparse  # noqa: E402
from cpgraph.ops import ledger  # noqa: E402
from cpgraph.ops.providers import active_provider, calls, selected  # noqa: E402

ops = torch.ops.cpgraph
gpu = pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA device (and no TRITON_INTERPRET)")
OUT_TOL = dict(atol=2e-2, rtol=2e-2)
LSE_TOL = dict(atol=2e-3, rtol=1e-4)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def case(seed, M, H, D, N, topk, dtype=torch.bfloat16, scale=1.0, invalid=True):
    """Random ``q, kv, idx``; with ``invalid`` the lists hold -1, other negatives, ids >= N and duplicates."""
    g = _gen(seed)
    q = (torch.randn(M, H, D, device=DEV, generator=g) * scale).to(dtype)
    kv = (torch.randn(N, D, device=DEV, generator=g) * scale).to(dtype)
    lo, hi = (-3, N + 3) if invalid else (0, N)
    idx = torch.randint(lo, max(hi, lo + 1), (M, topk), device=DEV, generator=g, dtype=torch.int32)
    return q, kv, idx


def check_against_reference(out, lse, q, kv, idx, sm_scale, d_v):
    ref_out, ref_lse = sparse_mla_reference(q.float(), kv.float(), idx, sm_scale, d_v)
    assert out.dtype == q.dtype and out.shape == ref_out.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    torch.testing.assert_close(out.float(), ref_out, **OUT_TOL)
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)  # +inf rows compare equal


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture
def sparse_providers():
    """The op dispatches to this file's kernels on DEV (on CPU: the interpreter), undone afterwards."""
    if DEV == "cpu":
        kernels.register_sparse_mla(("cpu",))
        yield
        kernels.unregister_sparse_mla(("cpu",))
    else:
        yield


# ------------------------------------------------------------- small shapes
@pytest.mark.parametrize(
    "seed,M,H,D,d_v,N,topk",
    [(0, 4, 16, 48, 32, 40, 70), (1, 3, 20, 48, 32, 9, 33), (2, 2, 16, 80, 64, 100, 16), (3, 5, 32, 48, 32, 1, 5)],
)
def test_matches_reference(seed, M, H, D, d_v, N, topk):
    q, kv, idx = case(seed, M, H, D, N, topk)
    out, lse = ksparse.sparse_mla(q, kv, idx, D**-0.5, d_v)
    check_against_reference(out, lse, q, kv, idx, D**-0.5, d_v)
    out64, lse64 = ksparse.sparse_mla(q, kv, idx.long(), D**-0.5, d_v)
    assert same_bits(out64, out) and same_bits(lse64, lse)


@pytest.mark.parametrize("order", ["rising", "falling", "random"])
def test_wide_score_range_rescaling(order):
    """Scores spanning ~100 (log2 units) across tiles: the running max moves many times."""
    M, H, D, N = 3, 16, 48, 128
    q, kv, _ = case(14, M, H, D, N, 8)
    kv = (kv.float() * torch.linspace(0.1, 6.0, N, device=DEV)[:, None]).to(kv.dtype)
    ids = torch.arange(N, device=DEV)
    ids = {"rising": ids, "falling": ids.flip(0), "random": torch.randperm(N, device=DEV, generator=_gen(15))}[order]
    idx = ids.to(torch.int32).expand(M, N).contiguous()
    idx[1, ::5] = -1
    out, lse = ksparse.sparse_mla(q, kv, idx, 0.5, 32)
    check_against_reference(out, lse, q, kv, idx, 0.5, 32)


def test_fp16_operands():
    q, kv, idx = case(4, 3, 16, 48, 30, 40, dtype=torch.float16)
    out, lse = ksparse.sparse_mla(q, kv, idx, 0.2, 32)
    check_against_reference(out, lse, q, kv, idx, 0.2, 32)


def test_rows_without_keys_give_zero_and_inf():
    q, kv, idx = case(5, 4, 16, 48, 12, 20)
    idx[1] = -1
    idx[2] = torch.tensor([12, -7, 40, 13, -1] * 4, dtype=idx.dtype)  # only out-of-range / negative ids
    out, lse = ksparse.sparse_mla(q, kv, idx, 0.3, 32)
    for r in (1, 2):
        assert torch.equal(out[r], torch.zeros_like(out[r])) and torch.isposinf(lse[r]).all()
    check_against_reference(out, lse, q, kv, idx, 0.3, 32)
    for kv_empty, idx_any in ((kv[:0], idx), (kv, idx[:, :0])):
        out, lse = ksparse.sparse_mla(q, kv_empty, idx_any, 0.3, 32)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()


def test_short_rows_all_keys_with_minus_one_tail():
    """Rows that hold <= topk keys: every key selected, then -1 (what the indexer emits for early positions)."""
    M, N, topk = 6, 50, 64
    q, kv, _ = case(6, M, 16, 48, N, topk)
    idx = torch.full((M, topk), -1, dtype=torch.int32, device=DEV)
    for r, n in enumerate((1, 7, 16, 17, 50, 0)):
        idx[r, :n] = torch.arange(n, dtype=torch.int32, device=DEV)
    out, lse = ksparse.sparse_mla(q, kv, idx, 0.25, 32)
    check_against_reference(out, lse, q, kv, idx, 0.25, 32)
    assert torch.isposinf(lse[5]).all()


def test_huge_int64_ids_are_skipped():
    q, kv, idx = case(7, 3, 16, 48, 20, 24)
    idx = idx.long()
    idx[:, ::3] = 2**40
    idx[0, 5] = -(2**40)
    out, lse = ksparse.sparse_mla(q, kv, idx, 0.3, 32)
    check_against_reference(out, lse, q, kv, idx, 0.3, 32)


def test_strided_operands():
    q, kv, idx = case(8, 3, 16, 48, 20, 24)
    q_wide = torch.zeros(3, 24, 48, dtype=q.dtype, device=DEV)
    q_wide[:, 4:20] = q
    kv_wide = torch.zeros(20, 64, dtype=kv.dtype, device=DEV)
    kv_wide[:, :48] = kv
    idx_wide = torch.full((3, 40), 5, dtype=idx.dtype, device=DEV)
    idx_wide[:, :24] = idx
    out, lse = ksparse.sparse_mla(q_wide[:, 4:20], kv_wide[:, :48], idx_wide[:, :24], 0.3, 32)
    ref = ksparse.sparse_mla(q, kv, idx, 0.3, 32)
    assert same_bits(out, ref[0]) and same_bits(lse, ref[1])


def test_row_result_independent_of_batch():
    """A row's bits depend only on that row: other rows, their count and extra keys change nothing."""
    q, kv, idx = case(9, 3, 16, 48, 30, 40)
    out, lse = ksparse.sparse_mla(q, kv, idx, 0.3, 32)
    q2, kv2, idx2 = case(10, 7, 16, 48, 45, 40)
    q2[5] = q[1]
    kv2[:30] = kv
    idx2[5] = idx[1].clamp(max=29)  # ids >= 30 would name the extra keys
    idx_row = idx[1:2].clamp(max=29)
    out_a, lse_a = ksparse.sparse_mla(q[1:2], kv, idx_row, 0.3, 32)
    out_b, lse_b = ksparse.sparse_mla(q2, kv2, idx2, 0.3, 32)
    assert same_bits(out_b[5:6], out_a) and same_bits(lse_b[5:6], lse_a)
    assert out.shape == (3, 16, 32)


def test_unsupported_shapes_fall_back_to_reference(caplog):
    q, kv, idx = case(11, 3, 4, 20, 9, 6)  # d_v = 12 is no power of two
    out, lse = ksparse.sparse_mla(q, kv, idx, 0.5, 12)
    want = sparse_mla_reference(q, kv, idx, 0.5, 12)
    assert same_bits(out, want[0]) and same_bits(lse, want[1])
    qf, kvf = q.float(), kv.float()
    assert ksparse.supports(qf, 20, 4) is not None  # fp32 operands
    out, lse = ksparse.sparse_mla(qf, kvf, idx, 0.5, 4)
    want = sparse_mla_reference(qf, kvf, idx, 0.5, 4)
    assert same_bits(out, want[0]) and same_bits(lse, want[1])


def test_op_dispatches_to_kernel(sparse_providers):
    """The registry names FlashMLA on CUDA where it loads, but the report names what computed the call.

    FlashMLA takes only D = 576 (and SM90, 64/128 heads, top-k a multiple of
    128): this call's D = 48 goes to the Triton kernel on every machine, and
    the call counts say so, with FlashMLA's reason where it was the provider.
    """
    flash = DEV == "cuda" and kflash.load()
    assert active_provider("sparse_mla", DEV) == (kflash.PROVIDER_NAME if flash else kernels.PROVIDER_NAME)
    assert active_provider("sparse_mla_fp8", DEV) == kernels.PROVIDER_NAME
    q, kv, idx = case(12, 2, 16, 48, 20, 24)
    ledger.forget("sparse_mla", DEV)
    out, lse = ops.sparse_mla(q, kv, idx, 0.3, 32)
    check_against_reference(out, lse, q, kv, idx, 0.3, 32)
    reason = "D=48, d_v=32 (FlashMLA takes 576 / 512)" if flash else None
    assert calls(DEV)["sparse_mla"] == [{"implementation": kernels.PROVIDER_NAME, "calls": 1, "reason": reason}]
    assert selected(DEV)["sparse_mla"] == kernels.PROVIDER_NAME


# ------------------------------------------------------------- FP8 records
def fp8_case(seed, M, H, N, topk):
    g = _gen(seed)
    latent = torch.randn(N, 512, device=DEV, generator=g) * 2.0
    k_pe = torch.randn(N, 64, device=DEV, generator=g)
    records = ops.mla_fp8_pack(latent, k_pe)
    q = (torch.randn(M, H, 576, device=DEV, generator=g) * 0.5).to(torch.bfloat16)
    idx = torch.randint(-2, N + 2, (M, topk), device=DEV, generator=g, dtype=torch.int32)
    return q, records, idx


def test_fp8_records_match_reference(sparse_providers):
    q, records, idx = fp8_case(13, 3, 16, 40, 48)
    idx[2] = -1
    out, lse = ops.sparse_mla_fp8(q, records, idx, 192**-0.5, 512)
    ref_out, ref_lse = sparse_mla_fp8_reference(q.float(), records, idx, 192**-0.5, 512)
    torch.testing.assert_close(out.float(), ref_out, **OUT_TOL)
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isposinf(lse[2]).all()
    # Same as attending over the unpacked (exact) bf16 rows.
    dense = ops.mla_fp8_unpack(records, torch.bfloat16)
    out_d, lse_d = ksparse.sparse_mla(q, dense, idx, 192**-0.5, 512)
    torch.testing.assert_close(out.float(), out_d.float(), **OUT_TOL)
    torch.testing.assert_close(lse, lse_d, **LSE_TOL)


# ------------------------------------------------------- GPU, production size
def production_case(seed, M, H, N, topk=2048, short=False):
    """Causal-prefill-like lists: row s (position s of N) picks min(s + 1, topk) keys of [0, s], -1 after."""
    g = _gen(seed)
    q = (torch.randn(M, H, 576, device=DEV, generator=g) * 0.5).to(torch.bfloat16)
    kv = torch.randn(N, 576, device=DEV, generator=g).to(torch.bfloat16)
    pos = torch.arange(N - M, N, device=DEV)[:, None] if not short else torch.arange(M, device=DEV)[:, None]
    j = torch.arange(topk, device=DEV)[None, :]
    spread = ((j + torch.rand(M, topk, device=DEV, generator=g)) * (pos + 1) / topk).long()
    idx = torch.where(pos + 1 <= topk, torch.where(j <= pos, j, -1), spread).to(torch.int32)
    return q, kv, idx


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
def test_gpu_production_widths(H):
    q, kv, idx = production_case(20, 192, H, 4096)
    idx[::7, 100:300] = -1  # holes
    idx[3] = -1  # a dummy row
    out, lse = ksparse.sparse_mla(q, kv, idx, 192**-0.5, 512)
    check_against_reference(out, lse, q, kv, idx, 192**-0.5, 512)
    assert torch.equal(out[3], torch.zeros_like(out[3])) and torch.isposinf(lse[3]).all()


@gpu
@pytest.mark.gpu
def test_gpu_short_rows():
    q, kv, idx = production_case(21, 300, 64, 300, short=True)
    out, lse = ksparse.sparse_mla(q, kv, idx, 192**-0.5, 512)
    check_against_reference(out, lse, q, kv, idx, 192**-0.5, 512)


@gpu
@pytest.mark.gpu
def test_gpu_row_bits_independent_of_batch():
    q, kv, idx = production_case(22, 64, 128, 4096)
    out, lse = ksparse.sparse_mla(q, kv, idx, 192**-0.5, 512)
    perm = torch.randperm(64, device=DEV, generator=_gen(23))
    out_p, lse_p = ksparse.sparse_mla(q[perm], kv, idx[perm], 192**-0.5, 512)
    assert same_bits(out_p, out[perm]) and same_bits(lse_p, lse[perm])
    out_1, lse_1 = ksparse.sparse_mla(q[17:18], kv, idx[17:18], 192**-0.5, 512)
    assert same_bits(out_1, out[17:18]) and same_bits(lse_1, lse[17:18])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_cuda_graph_replay(fp8):
    q, kv, idx = production_case(24, 128, 64, 4096)
    if fp8:
        keys = ops.mla_fp8_pack(kv[:, :512].float(), kv[:, 512:])
        run = lambda: ksparse.sparse_mla_fp8(q, keys, idx, 192**-0.5, 512)  # noqa: E731
    else:
        run = lambda: ksparse.sparse_mla(q, kv, idx, 192**-0.5, 512)  # noqa: E731
    want = run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run()
    new_q, _, new_idx = production_case(25, 128, 64, 4096)
    q.copy_(new_q)
    idx.copy_(new_idx)
    graph.replay()
    torch.cuda.synchronize()
    fresh = run()
    assert same_bits(got[0], fresh[0]) and same_bits(got[1], fresh[1])
    assert not torch.equal(got[0], want[0])


@gpu
@pytest.mark.gpu
def test_gpu_fp8_records_production():
    q, kv, idx = production_case(26, 96, 128, 4096)
    records = ops.mla_fp8_pack(kv[:, :512].float(), kv[:, 512:])
    out, lse = ksparse.sparse_mla_fp8(q, records, idx, 192**-0.5, 512)
    ref_out, ref_lse = sparse_mla_fp8_reference(q.float(), records, idx, 192**-0.5, 512)
    torch.testing.assert_close(out.float(), ref_out, **OUT_TOL)
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)


# ------------------------------------------------------------------ FlashMLA
needs_flash = pytest.mark.skipif(
    DEV != "cuda" or not kflash.load(), reason=f"FlashMLA not importable ({kflash.import_error()})"
)


@gpu
@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("H", [64, 128])
def test_flash_mla_contract(H):
    """The FlashMLA provider honours the op's contract: -1, other negatives, ids >= N, empty rows, int64 ids."""
    q, kv, idx = production_case(30, 160, H, 4096)
    idx[5] = -1  # dummy row
    idx[6] = torch.where(torch.arange(2048, device=DEV) % 2 == 0, -5, 4096 + 7).to(torch.int32)  # only invalid ids
    idx[7, ::3] = -9  # other negatives mixed with valid ids
    idx[8, 1::4] = 4096  # == N: skipped
    assert kflash.refusal(q, kv, idx, 512) is None
    out, lse = kflash.sparse_mla(q, kv, idx, 192**-0.5, 512)
    check_against_reference(out, lse, q, kv, idx, 192**-0.5, 512)
    for r in (5, 6):
        assert torch.equal(out[r], torch.zeros_like(out[r])), r
        assert torch.isposinf(lse[r]).all(), r
    out64, lse64 = kflash.sparse_mla(q, kv, idx.long(), 192**-0.5, 512)
    assert same_bits(out64, out) and same_bits(lse64, lse)


@gpu
@pytest.mark.gpu
@needs_flash
def test_flash_mla_refused_shapes_use_triton():
    q, kv, idx = production_case(31, 64, 64, 2048, topk=200)  # top-k not a multiple of 128
    assert "top-k 200" in kflash.refusal(q, kv, idx, 512)
    out, lse = kflash.sparse_mla(q, kv, idx, 192**-0.5, 512)
    want = ksparse.sparse_mla(q, kv, idx, 192**-0.5, 512)
    assert same_bits(out, want[0]) and same_bits(lse, want[1])
    q32 = q[:, :32].contiguous()  # 32 heads
    assert "H=32 heads" in kflash.refusal(q32, kv, idx, 512)
    out, lse = kflash.sparse_mla(q32, kv, idx, 192**-0.5, 512)
    check_against_reference(out, lse, q32, kv, idx, 192**-0.5, 512)
