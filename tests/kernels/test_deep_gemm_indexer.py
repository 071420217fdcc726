"""The DeepGEMM indexer binding (cpgraph/kernels/deep_gemm_indexer.py) without DeepGEMM.

No sgl-deep-gemm wheel loads on the GPU machine's torch 2.11 (docs/ops/indexer.md), so the
binding's own logic is tested here against a stand-in ``deep_gemm`` module whose kernel follows
DeepGEMM's contract but leaves garbage outside the windows and pads the key axis: the provider
must slice, re-apply the windows, chunk rows by the byte budget and select under the tie rule.
Runs on CPU under ``TRITON_INTERPRET=1`` (the Triton selection) or on CUDA.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

import cpgraph.ops.indexer as ix
from cpgraph.kernels import deep_gemm_indexer as dg
from cpgraph.kernels import indexer as ki

DEV = "cpu" if os.environ.get("TRITON_INTERPRET", "") == "1" else ("cuda" if torch.cuda.is_available() else None)
if DEV is None:
    pytest.skip("the Triton selection needs TRITON_INTERPRET=1 (CPU) or a CUDA device", allow_module_level=True)


def _fake_deep_gemm(calls):
    """A ``deep_gemm`` whose ``fp8_mqa_logits`` pads N to a multiple of 8 and writes 7.0 outside the windows."""

    def fp8_mqa_logits(q, kv, weights, ks, ke, clean_logits=False, max_seqlen_k=0):
        k, k_scale = kv
        assert q.dtype == torch.float8_e4m3fn and k.dtype == torch.float8_e4m3fn and ks.dtype == torch.int32
        calls.append(q.shape[0])
        m, n = q.shape[0], k.shape[0]
        full = ix.indexer_logits_fp8_reference(q.view(torch.uint8), k.view(torch.uint8), k_scale, weights,
                                               torch.zeros_like(ks), torch.full_like(ke, n))
        out = torch.full((m, -(-n // 8) * 8), 7.0, device=q.device)
        inside = ix._window_mask(ks.long(), ke.long(), n)
        out[:, :n] = torch.where(inside, full, torch.full((), 7.0, device=q.device))
        return out

    return types.SimpleNamespace(fp8_mqa_logits=fp8_mqa_logits, __version__="fake")


def _fake_deep_gemm_2x(calls):
    """DeepGEMM 2.x's form: ``q`` as ``(codes, None)``, compressed rows (column j = key ks + j), 7.0 past the window."""

    def fp8_fp4_mqa_logits(q, kv, weights, ks, ke, max_seqlen_k, schedule_meta=None):
        q, q_sf = q
        k, k_scale = kv
        assert q_sf is None and q.dtype == torch.float8_e4m3fn and ks.dtype == torch.int32 and max_seqlen_k > 0
        calls.append(q.shape[0])
        m, n = q.shape[0], k.shape[0]
        full = ix.indexer_logits_fp8_reference(q.view(torch.uint8), k.view(torch.uint8), k_scale, weights,
                                               torch.zeros_like(ks), torch.full_like(ke, n))
        out = torch.full((m, max_seqlen_k), 7.0, device=q.device)
        for s in range(m):
            a, b = int(ks[s]), int(ke[s])
            out[s, : b - a] = full[s, a:b]
        return out

    return types.SimpleNamespace(fp8_fp4_mqa_logits=fp8_fp4_mqa_logits, __version__="2.8.2")


@pytest.fixture(autouse=True)
def _short_sample():
    """Under the interpreter, a 16-key selection sample: the Triton selection's tuning never changes its
    result, and there the sort of the default 256-key sample is most of a short row's cost (the sample
    sizes are tested in test_indexer_kernels.py).  On a GPU the default stays."""
    saved = ki.tuning()
    if DEV == "cpu":
        ki.set_tuning(SELECT_SAMPLE=16)
    yield
    ki.set_tuning(**saved)


@pytest.fixture(params=["1.x", "2.x"])
def fake(monkeypatch, request):
    calls = []
    make = _fake_deep_gemm if request.param == "1.x" else _fake_deep_gemm_2x
    monkeypatch.setitem(sys.modules, "deep_gemm", make(calls))
    monkeypatch.setattr(dg, "_fn", None)
    monkeypatch.setattr(dg, "_IMPORT_ERROR", None)
    return calls


def _inputs(seed, M=9, H=2, D=32, N=45):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (M, H, D), generator=g).float()
    k = torch.randint(-2, 3, (N, D), generator=g).float()
    k_scale = torch.exp2(torch.randint(-1, 2, (N,), generator=g).float())
    w = torch.randint(-2, 3, (M, H), generator=g).float()
    ks = torch.randint(0, N + 1, (M,), generator=g)
    ke = torch.minimum(ks + torch.randint(0, N + 1, (M,), generator=g), torch.full((M,), N))
    ks[::4] = ke[::4]
    q_bytes = q.to(torch.float8_e4m3fn).view(torch.uint8)
    k_bytes = k.to(torch.float8_e4m3fn).view(torch.uint8)
    return [t.to(DEV) for t in (q_bytes, k_bytes, k_scale, w, ks, ke)]


def test_logits_follow_the_op_contract(fake):
    q_bytes, k_bytes, k_scale, w, ks, ke = _inputs(0)
    assert dg.load() and dg.kernel_name() in ("fp8_mqa_logits", "fp8_fp4_mqa_logits")
    got = dg.indexer_logits_fp8(q_bytes, k_bytes, k_scale, w, ks, ke)
    assert torch.equal(got, ix.indexer_logits_fp8_reference(q_bytes, k_bytes, k_scale, w, ks, ke))


def test_topk_chunks_rows_and_keeps_the_tie_rule(fake):
    q_bytes, k_bytes, k_scale, w, ks, ke = _inputs(1)
    M, N, topk = q_bytes.shape[0], k_bytes.shape[0], 6
    want = ix.topk_ragged_reference(ix.indexer_logits_fp8_reference(q_bytes, k_bytes, k_scale, w, ks, ke), ks, ke,
                                    topk)
    got = dg.indexer_topk(q_bytes, k_bytes, w, ks, ke, topk, 4 * N * 4, k_scale)
    assert torch.equal(got, want)
    assert fake == [4, 4, 1]  # 4 rows per chunk by the budget: the kernel never sees more
    assert sum(fake) == M


def test_bf16_form_stays_on_triton(fake):
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-2, 3, (5, 2, 16), generator=g).float().to(DEV)
    k = torch.randint(-2, 3, (20, 16), generator=g).float().to(DEV)
    w = torch.randint(-2, 3, (5, 2), generator=g).float().to(DEV)
    ks, ke = torch.zeros(5, dtype=torch.long, device=DEV), torch.full((5,), 20, device=DEV)
    got = dg.indexer_topk(q, k, w, ks, ke, 3, 1 << 20)
    assert torch.equal(got, ki.indexer_topk(q, k, w, ks, ke, 3, 1 << 20)) and fake == []


def test_register_fails_fast_without_deep_gemm(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import raises ImportError
    monkeypatch.setattr(dg, "_fn", None)
    monkeypatch.setattr(dg, "_IMPORT_ERROR", None)
    with pytest.raises(RuntimeError, match="deep_gemm does not load: ModuleNotFoundError"):
        dg.register(("cpu",))
    assert "ModuleNotFoundError" in dg.import_error()
