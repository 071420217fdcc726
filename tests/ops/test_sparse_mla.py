"""Tests for cpgraph::sparse_mla (cpgraph/ops/sparse_mla.py).

Compared with Python-loop brute force (tiny shapes), with an independently
built dense masked softmax over the indexer's selection (planned batches),
and at the production widths D=576 / d_v=512.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpgraph.ops.indexer  # noqa: F401  (registers the indexer ops)
import cpgraph.ops.sparse_mla as sparse_mla_mod
from cpgraph.plan import plan_prefill

ops = torch.ops.cpgraph
SETTINGS = settings(max_examples=25, deadline=None)


def brute_sparse_mla(q, kv, idx, sm_scale, d_v):
    """Plain-loop attention: each listed entry 0 <= t < N is one softmax term."""
    M, H, D = q.shape
    N = kv.shape[0]
    ql, kvl, il = q.double().tolist(), kv.double().tolist(), idx.tolist()
    out = [[[0.0] * d_v for _ in range(H)] for _ in range(M)]
    lse = [[math.inf] * H for _ in range(M)]
    for s in range(M):
        keys = [t for t in il[s] if 0 <= t < N]
        if not keys:
            continue
        for h in range(H):
            sc = [sm_scale * sum(ql[s][h][d] * kvl[t][d] for d in range(D)) for t in keys]
            top = max(sc)
            e = [math.exp(x - top) for x in sc]
            z = sum(e)
            lse[s][h] = top + math.log(z)
            for j in range(d_v):
                out[s][h][j] = sum(e[i] * kvl[t][j] for i, t in enumerate(keys)) / z
    return torch.tensor(out, dtype=torch.float64).view(M, H, d_v), torch.tensor(lse, dtype=torch.float64).view(M, H)


def random_case(seed, M, H, D, N, topk, d_v, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(M, H, D, generator=g).to(dtype)
    kv = torch.randn(N, D, generator=g).to(dtype)
    # -1, in-range, out-of-range (>= N) and duplicate entries all appear.
    idx = torch.randint(-1, N + 3, (M, topk), generator=g, dtype=torch.int32)
    return q, kv, idx


def assert_matches_brute(q, kv, idx, sm_scale, d_v, atol=1e-5):
    out, lse = ops.sparse_mla(q, kv, idx, sm_scale, d_v)
    want_out, want_lse = brute_sparse_mla(q, kv, idx, sm_scale, d_v)
    assert out.dtype == q.dtype and out.shape == want_out.shape
    assert lse.dtype == torch.float32 and lse.shape == want_lse.shape
    torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=atol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), M=st.integers(0, 4), H=st.integers(1, 3), D=st.integers(2, 10),
       N=st.integers(0, 7), topk=st.integers(0, 6), scale=st.floats(0.05, 2.0))
def test_sparse_mla_matches_loops(seed, M, H, D, N, topk, scale):
    d_v = max(1, D // 2)
    q, kv, idx = random_case(seed, M, H, D, N, topk, d_v)
    assert_matches_brute(q, kv, idx, scale, d_v)


def test_duplicates_invalid_and_empty_rows():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 2, 6, generator=g)
    kv = torch.randn(5, 6, generator=g)
    idx = torch.tensor([[2, 2, 2, -1], [-1, 5, 9, -1], [0, -1, 7, 4], [3, -1, -1, -1]], dtype=torch.int32)
    out, lse = ops.sparse_mla(q, kv, idx, 0.5, 4)
    # Row 0: three copies of one key -> softmax weight 1 on it, lse = score + log 3.
    torch.testing.assert_close(out[0], kv[2, :4].expand(2, 4))
    torch.testing.assert_close(lse[0], (q[0] @ kv[2]) * 0.5 + math.log(3))
    # Row 1: nothing valid -> exact zeros and +inf.
    assert torch.equal(out[1], torch.zeros(2, 4)) and torch.isposinf(lse[1]).all()
    # Row 2: out-of-range 7 is skipped like -1.
    ref_out, ref_lse = ops.sparse_mla(q[2:3], kv, torch.tensor([[0, 4]], dtype=torch.int32), 0.5, 4)
    torch.testing.assert_close(out[2:3], ref_out)
    torch.testing.assert_close(lse[2:3], ref_lse)
    # Row 3: a single key -> its value row exactly.
    torch.testing.assert_close(out[3], kv[3, :4].expand(2, 4))
    assert_matches_brute(q, kv, idx, 0.5, 4)


def test_no_keys_at_all():
    q = torch.randn(3, 2, 8)
    for kv, idx in ((torch.zeros(0, 8), torch.full((3, 4), 0, dtype=torch.int32)),
                    (torch.randn(4, 8), torch.zeros(3, 0, dtype=torch.int32))):
        out, lse = ops.sparse_mla(q, kv, idx, 1.0, 5)
        assert torch.equal(out, torch.zeros(3, 2, 5)) and torch.isposinf(lse).all()


def test_chunking_does_not_change_results(monkeypatch):
    q, kv, idx = random_case(3, 9, 2, 12, 10, 5, 8)
    full = ops.sparse_mla(q, kv, idx, 0.3, 8)
    assert sparse_mla_mod.sparse_mla_chunk_rows(2, 5, 12, budget=1) == 1
    monkeypatch.setattr(sparse_mla_mod, "SPARSE_MLA_GATHER_BYTES", 4 * 5 * (12 + 2) * 2)  # two rows per chunk
    assert sparse_mla_mod.sparse_mla_chunk_rows(2, 5, 12) == 2
    calls = []
    real = sparse_mla_mod._attend_chunk
    monkeypatch.setattr(sparse_mla_mod, "_attend_chunk", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    chunked = ops.sparse_mla(q, kv, idx, 0.3, 8)
    assert calls == [2, 2, 2, 2, 1]
    torch.testing.assert_close(chunked[0], full[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked[1], full[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("M,H,N,topk", [(3, 2, 20, 8), (2, 4, 9, 12)])
def test_production_widths(M, H, N, topk):
    D, d_v = 576, 512
    q, kv, idx = random_case(M + H, M, H, D, N, topk, d_v)
    q, kv = q * 0.05, kv * 0.05
    assert_matches_brute(q, kv, idx, 192**-0.5, d_v)


def test_production_widths_bf16():
    q, kv, idx = random_case(9, 3, 4, 576, 16, 8, 512, dtype=torch.bfloat16)
    out, lse = ops.sparse_mla(q, kv, idx, 576**-0.5, 512)
    ref_out, ref_lse = ops.sparse_mla(q.float(), kv.float(), idx, 576**-0.5, 512)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("rank", [0, 1])
def test_indexer_topk_then_sparse_equals_dense_masked_attention(rank):
    """Sparse MLA over the fp32 indexer's picks == dense causal attention masked to those picks."""
    H_idx, D_idx, H, D, d_v, topk = 3, 8, 2, 48, 32, 5
    plan = plan_prefill([4, 0, 8], [9, 6, 3], cp_size=2, page_size=4, row_align=4)
    rp = plan.rank(rank)
    N = int(plan.kv_lens.sum())
    M = rp.num_rows
    g = torch.Generator().manual_seed(rank)
    iq, ik = torch.randn(M, H_idx, D_idx, generator=g), torch.randn(N, D_idx, generator=g)
    w = torch.randn(M, H_idx, generator=g)
    q, kv = torch.randn(M, H, D, generator=g), torch.randn(N, D, generator=g)
    idx = ops.indexer_topk(iq, ik, w, rp.ks, rp.ke, topk, 1 << 20)
    out, lse = ops.sparse_mla(q, kv, idx, D**-0.5, d_v)

    # Dense reference: selection mask built with loops, then an ordinary masked softmax.
    allowed = torch.zeros(M, N, dtype=torch.bool)
    for s in range(rp.num_valid):
        b, pos = int(rp.req_index[s]), int(rp.positions[s])
        lo = int(plan.kv_start[b])
        picks = [t for t in idx[s].tolist() if t >= 0]
        assert len(picks) == min(topk, pos + 1) and all(lo <= t <= lo + pos for t in picks)
        for t in picks:
            allowed[s, t] = True
    scores = torch.einsum("mhd,nd->mhn", q.double(), kv.double()) * D**-0.5
    scores = scores.masked_fill(~allowed[:, None, :], -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    dense_out = probs @ kv[:, :d_v].double()
    dense_lse = torch.logsumexp(scores, dim=-1)
    valid = slice(0, rp.num_valid)
    torch.testing.assert_close(out[valid].double(), dense_out[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[valid].double(), dense_lse[valid], rtol=1e-5, atol=1e-5)
    assert rp.num_valid < M
    assert torch.equal(out[rp.num_valid :], torch.zeros_like(out[rp.num_valid :]))
    assert torch.isposinf(lse[rp.num_valid :]).all()


# ------------------------------------------------------------------ opcheck
@pytest.mark.parametrize(
    "seed,M,H,D,N,topk,d_v,dtype",
    [(0, 3, 2, 16, 7, 4, 8, torch.float32), (1, 5, 1, 48, 12, 6, 32, torch.float32),
     (2, 2, 3, 8, 3, 9, 8, torch.bfloat16), (3, 4, 2, 12, 5, 3, 4, torch.float16)],
)
def test_opcheck_sparse_mla(seed, M, H, D, N, topk, d_v, dtype):
    q, kv, idx = random_case(seed, M, H, D, N, topk, d_v, dtype)
    torch.library.opcheck(ops.sparse_mla.default, (q, kv, idx, 0.25, d_v))
    torch.library.opcheck(ops.sparse_mla.default, (q, kv, idx.long(), 1.0, d_v))


# ------------------------------------------------------------------- errors
def _good():
    return torch.randn(3, 2, 8), torch.randn(5, 8), torch.zeros(3, 4, dtype=torch.int32)


def test_error_bad_dtype():
    q, kv, idx = _good()
    with pytest.raises(ValueError, match="'kv'"):
        ops.sparse_mla(q, kv.bfloat16(), idx, 1.0, 4)
    with pytest.raises(ValueError, match="'idx'"):
        ops.sparse_mla(q, kv, idx.float(), 1.0, 4)
    with pytest.raises(ValueError, match="'q'"):
        ops.sparse_mla(q.int(), kv.int(), idx, 1.0, 4)


def test_error_bad_rank():
    q, kv, idx = _good()
    with pytest.raises(ValueError, match="'q'"):
        ops.sparse_mla(q[0], kv, idx, 1.0, 4)
    with pytest.raises(ValueError, match="'idx'"):
        ops.sparse_mla(q, kv, idx[0], 1.0, 4)


def test_error_bad_shape():
    q, kv, idx = _good()
    with pytest.raises(ValueError, match="'kv'"):
        ops.sparse_mla(q, kv[:, :6], idx, 1.0, 4)
    with pytest.raises(ValueError, match="'idx'"):
        ops.sparse_mla(q, kv, idx[:2], 1.0, 4)
    with pytest.raises(ValueError, match="'d_v'"):
        ops.sparse_mla(q, kv, idx, 1.0, 9)
    with pytest.raises(ValueError, match="'d_v'"):
        ops.sparse_mla(q, kv, idx, 1.0, 0)


def test_error_device_mix():
    q, kv, idx = _good()
    with pytest.raises(ValueError, match="one device"):
        ops.sparse_mla(q, kv.to("meta"), idx, 1.0, 4)


# ---------------------------------------------------------- sparse_mla_fp8
def fp8_records(seed, N):
    g = torch.Generator().manual_seed(seed)
    return ops.mla_fp8_pack(torch.randn(N, 512, generator=g) * 3.0, torch.randn(N, 64, generator=g))


@pytest.mark.parametrize("dtype,d_v", [(torch.float32, 512), (torch.bfloat16, 512), (torch.float32, 100)])
def test_fp8_records_equal_attention_over_unpacked_rows(dtype, d_v):
    """Keys from records == keys from mla_fp8_unpack(records, float32): dequantisation is exact."""
    records = fp8_records(0, 9)
    q, _, idx = random_case(1, 4, 2, 576, 9, 7, d_v, dtype)
    idx[3] = -1
    out, lse = ops.sparse_mla_fp8(q, records, idx, 0.05, d_v)
    want_out, want_lse = ops.sparse_mla(q.float(), ops.mla_fp8_unpack(records, torch.float32), idx, 0.05, d_v)
    torch.testing.assert_close(out.float(), want_out.to(dtype).float(), rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert torch.equal(out[3], torch.zeros_like(out[3])) and torch.isposinf(lse[3]).all()


def test_fp8_records_match_loops():
    records = fp8_records(2, 6)
    q, _, idx = random_case(3, 3, 2, 576, 6, 5, 512)
    q = q * 0.05
    out, lse = ops.sparse_mla_fp8(q, records, idx, 192**-0.5, 512)
    want_out, want_lse = brute_sparse_mla(q, ops.mla_fp8_unpack(records, torch.float32), idx, 192**-0.5, 512)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M,N,topk", [(3, 5, 4), (1, 0, 3), (2, 7, 0)])
def test_opcheck_sparse_mla_fp8(M, N, topk):
    records = fp8_records(4, N) if N else torch.zeros(0, 656, dtype=torch.uint8)
    q, _, idx = random_case(5, M, 2, 576, max(N, 1), topk, 512, torch.bfloat16)
    torch.library.opcheck(ops.sparse_mla_fp8.default, (q, records, idx, 0.1, 512))
    torch.library.opcheck(ops.sparse_mla_fp8.default, (q.float(), records, idx.long(), 0.1, 64))


def test_fp8_errors():
    records = fp8_records(6, 4)
    q = torch.randn(2, 2, 576)
    idx = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="'records'"):
        ops.sparse_mla_fp8(q, records[:, :600], idx, 1.0, 512)
    with pytest.raises(ValueError, match="'records'"):
        ops.sparse_mla_fp8(q, records.view(torch.int8), idx, 1.0, 512)
    with pytest.raises(ValueError, match="'q'"):
        ops.sparse_mla_fp8(q[:, :, :512], records, idx, 1.0, 512)
    with pytest.raises(ValueError, match="'idx'"):
        ops.sparse_mla_fp8(q, records, idx[:1], 1.0, 512)
    with pytest.raises(ValueError, match="'d_v'"):
        ops.sparse_mla_fp8(q, records, idx, 1.0, 577)
    with pytest.raises(ValueError, match="one device"):
        ops.sparse_mla_fp8(q, records.to("meta"), idx, 1.0, 512)
