"""Deterministic mode on a GPU (skips without CUDA): kernels, then a request through the whole model.

Kernels, at sizes where cuBLAS picks tiles and split-K by ``M``: a row of
the invariant GEMM (dense, batched, grouped experts, FP8 linear, FP8
experts, absorbed query) has the same bits in products of 1 to 4096 rows
at any offset, and with every other row routed elsewhere; the mode's
``aten.mm`` on CUDA is that GEMM; a CUDA-graph replay gives the eager bits.
The row-local kernels the mode keeps (indexer scoring + top-k, Triton
sparse MLA, FlashMLA where it imports) are checked the same way on random
floats.

Model: a mid-sized DSA (V3.2 attention widths: kv_lora 512, rope 64, index
dim 128; hidden 1024, 16 routed experts, 2 layers, bf16).  The followed
request alone, in five batch compositions, chunked, behind a prefix another
request cached, and through ``graphed_forward`` (CUDA graphs) gives the same
logits and KV bytes, eager in the mode and compiled with
``CPConfig(deterministic=True)`` (Inductor and ``aot_eager``); eager equals
compiled; replays are bitwise.  Run on an H200 by::

    TORCHINDUCTOR_FX_GRAPH_CACHE=0 python -m pytest -q tests/determinism/test_deterministic_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_env import needs_gpu  # noqa: E402

pytestmark = needs_gpu

DEV = "cuda"
ROWS = [1, 7, 64, 129, 1000, 4096]  # product row counts: each picks other cuBLAS kernels


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(*shape, g, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def _spans(n):
    """Row ranges of every size in ``ROWS`` at offsets 0 and 3 (bounded by ``n``)."""
    out = []
    for m in ROWS:
        for off in (0, 3):
            if off + m <= n:
                out.append((off, off + m))
    return out


# ------------------------------------------------------------------ kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(1536, 7168), (576, 7168), (7168, 2048), (129280, 512)])
def test_gemm_row_bits_do_not_depend_on_the_row_count(dtype, n, k):
    from cpgraph.kernels.invariant_gemm import matmul

    if dtype == torch.float32 and n > 8192:
        pytest.skip("fp32 LM-head size: covered by bf16")
    g = _gen(0)
    x = _randn(4099, k, g=g, dtype=dtype)
    w = _randn(n, k, g=g, scale=0.02, dtype=dtype)
    full = matmul(x, w.t())
    torch.testing.assert_close(full.float(), (x.float() @ w.float().t()), rtol=2e-2, atol=2e-2)
    for a, b in _spans(x.shape[0]):
        assert torch.equal(matmul(x[a:b].clone(), w.t()), full[a:b]), (a, b)
    from cpgraph.ops.invariant_mode import deterministic

    with deterministic():  # the mode's aten.mm / addmm on CUDA is the same kernel
        assert torch.equal(torch.nn.functional.linear(x[5:70], w), full[5:70])


def test_batched_and_absorbed_query_rows_do_not_depend_on_the_row_count():
    from cpgraph.kernels.invariant_gemm import invariant_mla_query, matmul

    g = _gen(1)
    m, h, nope, rope, lat = 4099, 128, 128, 64, 512
    q = _randn(m, h, nope + rope, g=g)
    w_uk = _randn(h, nope, lat, g=g, scale=0.05)
    ang = torch.rand(m, rope // 2, generator=g) * 6
    cos, sin = ang.cos().to(torch.bfloat16).to(DEV), ang.sin().to(torch.bfloat16).to(DEV)
    full = invariant_mla_query(q, w_uk, cos, sin)
    p = _randn(h, m, lat, g=g)
    w_uv = _randn(h, lat, 128, g=g, scale=0.05)
    o = matmul(p, w_uv)
    for a, b in _spans(m):
        assert torch.equal(invariant_mla_query(q[a:b].clone(), w_uk, cos[a:b].clone(), sin[a:b].clone()), full[a:b])
        assert torch.equal(matmul(p[:, a:b].clone(), w_uv), o[:, a:b])


def _routes(m, e, k, g):
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).to(DEV)
    return ids, torch.rand(m, k, generator=g).to(DEV)


@pytest.mark.parametrize("fp8", [False, True])
def test_expert_rows_do_not_depend_on_other_rows_or_their_routes(fp8):
    from cpgraph.kernels.invariant_gemm import invariant_moe_experts

    g = _gen(2)
    m, e, h, i, k = 4099, 32, 2048, 512, 4
    x = _randn(m, h, g=g, scale=0.5)
    gu = _randn(e, 2 * i, h, g=g, scale=0.05)
    dn = _randn(e, h, i, g=g, scale=0.05)
    extra = ()
    if fp8:
        gu = (gu.float() * 8).to(torch.float8_e4m3fn)
        dn = (dn.float() * 8).to(torch.float8_e4m3fn)
        extra = (torch.full((e, 2 * i // 128, h // 128), 0.125, device=DEV),
                 torch.full((e, h // 128, i // 128), 0.125, device=DEV), 128, 128, True)
    ids, w = _routes(m, e, k, g)

    def run(rows, rids, rw, nv=None):
        return invariant_moe_experts(rows, rids, rw, gu, dn, nv, *extra)

    full = run(x, ids, w)
    for a, b in _spans(m):
        assert torch.equal(run(x[a:b].clone(), ids[a:b].clone(), w[a:b].clone()), full[a:b]), (a, b)
    ids2, w2 = _routes(m, e, k, _gen(3))
    ids2[7], w2[7] = ids[7], w[7]
    assert torch.equal(run(x, ids2, w2, torch.tensor([2000], device=DEV))[7], full[7])
    ids3 = torch.zeros_like(ids)  # every other row on one expert: a group of thousands of rows
    ids3[:, 1:] = torch.arange(1, k, device=DEV)
    ids3[7] = ids[7]
    assert torch.equal(run(x, ids3, w)[7], full[7])


def test_fp8_linear_rows_do_not_depend_on_the_row_count():
    from cpgraph.kernels.invariant_gemm import invariant_fp8_linear

    g = _gen(4)
    x = _randn(4099, 7168, g=g)
    w = (_randn(1536, 7168, g=g).float() * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = (torch.rand(12, 56, generator=g) * 0.002 + 0.0005).to(DEV)
    full = invariant_fp8_linear(x, w, s, 128, 128, True)
    for a, b in _spans(x.shape[0]):
        assert torch.equal(invariant_fp8_linear(x[a:b].clone(), w, s, 128, 128, True), full[a:b]), (a, b)


def test_invariant_ops_replay_from_a_cuda_graph_bitwise():
    import cpgraph.kernels  # noqa: F401

    g = _gen(5)
    x = _randn(3000, 2048, g=g)
    w = _randn(1024, 2048, g=g, scale=0.02)
    eager = torch.ops.cpgraph.invariant_mm(x, w.t())
    out = torch.empty_like(eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(torch.ops.cpgraph.invariant_mm(x, w.t()))  # warm-up (compiles) off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(torch.ops.cpgraph.invariant_mm(x, w.t()))
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


# --------------------------------------------------- row-local kernels kept
def test_indexer_topk_rows_do_not_depend_on_the_batch():
    import cpgraph.kernels  # noqa: F401

    g = _gen(6)
    m, n, h, d, topk = 2048, 6000, 64, 128, 2048
    q = _randn(m, h, d, g=g)
    k = _randn(n, d, g=g)
    w = (torch.rand(m, h, generator=g) * 0.01).to(DEV)
    ke = torch.randint(1, n + 1, (m,), generator=g).to(DEV).to(torch.int32)
    ks = torch.zeros_like(ke)
    full = torch.ops.cpgraph.indexer_topk(q, k, w, ks, ke, topk, 64 << 20)
    for a, b in _spans(m):
        sub = torch.ops.cpgraph.indexer_topk(q[a:b].clone(), k, w[a:b].clone(), ks[a:b].clone(), ke[a:b].clone(),
                                             topk, 64 << 20)
        assert torch.equal(sub, full[a:b]), (a, b)
    small = torch.ops.cpgraph.indexer_topk(q, k, w, ks, ke, topk, 8 << 20)  # another row chunking
    assert torch.equal(small, full)


@pytest.mark.parametrize("provider", ["triton", "flash_mla"])
def test_sparse_mla_rows_do_not_depend_on_the_batch(provider):
    import cpgraph.kernels  # noqa: F401
    from cpgraph.ops.providers import active_provider

    if provider == "flash_mla" and active_provider("sparse_mla", "cuda") != "flash_mla":
        pytest.skip("FlashMLA is not installed here")
    if provider == "triton" and active_provider("sparse_mla", "cuda") == "flash_mla":
        from cpgraph.kernels import sparse_mla as triton_sparse

        fn = triton_sparse.sparse_mla
    else:
        fn = torch.ops.cpgraph.sparse_mla
    g = _gen(7)
    m, n, h, topk = 2048, 8192, 128, 2048
    q = _randn(m, h, 576, g=g)
    kv = _randn(n, 576, g=g)
    idx = torch.stack([torch.randperm(n, generator=g)[:topk] for _ in range(m)]).to(torch.int32).to(DEV)
    idx[::5, topk // 2 :] = -1
    full, lse = fn(q, kv, idx, 576**-0.5, 512)
    for a, b in _spans(m):
        o, l2 = fn(q[a:b].clone(), kv, idx[a:b].clone(), 576**-0.5, 512)
        assert torch.equal(o, full[a:b]) and torch.equal(l2, lse[a:b]), (a, b)


# -------------------------------------------------------------------- model
def medium_config() -> dict:
    from cpgraph.models.config import bundled_config_dict

    return dict(bundled_config_dict("tiny-deepseek-v32-fp8"), hidden_size=1024, q_lora_rank=512,
                num_attention_heads=16, qk_nope_head_dim=64, v_head_dim=64, intermediate_size=2048,
                moe_intermediate_size=256, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                index_n_heads=16, index_topk=128, vocab_size=2048, num_hidden_layers=2, max_position_embeddings=4096)


PAGE = 64


def build_medium():
    from cpgraph.models import DSAConfig, build_model, init_random
    from cpgraph.models.prefill import make_layout

    model = init_random(build_model(DSAConfig.from_hf_dict(medium_config()), torch.bfloat16), seed=0, std=0.05)
    model = model.to(DEV).eval()
    model.kv_layout = make_layout(model, "bf16", PAGE)
    return model


def _prompts():
    g = _gen(11)
    target = torch.randint(0, 2048, (700,), generator=g).tolist()
    others = [torch.randint(0, 2048, (n,), generator=g).tolist() for n in (300, 129, 1000, 64)]
    return target, others


TARGET, OTHERS = _prompts()
O0, O1, O2, O3 = OTHERS
COMPOSITIONS = [
    ([O0, TARGET, O1], [64, 0, 64], 1),
    ([TARGET, O1, O2], [0, 64, 512], 0),
    ([O3, O0, TARGET, O1], [0, 128, 0, 0], 2),
    ([O2, TARGET, O3], [896, 0, 0], 1),
    ([TARGET, TARGET], [0, 256], 1),  # behind its own cached prefix, next to itself
]


def _records(model, res, i, n):
    """Request ``i``'s KV bytes in logical order: slot rows, or whole pages for a page-major pool (FP8 index-K).

    Pools are fresh per run, so a partial last page's slack is zero on both sides.
    """
    from cpgraph.runtime.engine import pool_tensors

    table = np.asarray(res.tables[i])
    pos = np.arange(n)
    slots = torch.as_tensor(table[pos // PAGE] * PAGE + pos % PAGE, device=DEV)
    pages = torch.as_tensor(table[: -(-n // PAGE)], device=DEV)
    mla, index = pool_tensors(res.pool, model)
    out = []
    for p in mla + index:
        rows = pages if p.shape[0] == res.pool.config.num_pages else slots
        out.append(p[rows].contiguous().view(torch.uint8).cpu())
    return out


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def medium():
    return build_medium()


def _forwards(model):
    """name -> forward: eager in the mode, and compiled deterministic (Inductor, aot_eager)."""
    from cpgraph.ops.invariant_mode import deterministic_forward
    from cpgraph.passes import CPConfig, compile

    def eager(ids, meta, mla, index, **kw):
        return model(ids, meta, mla, index, **kw)

    out = {"eager": deterministic_forward(eager)}
    for backend in ("inductor", "aot_eager"):
        fn = compile(model, CPConfig(deterministic=True), backend=backend, dynamic=True)
        out[backend] = (lambda f: (lambda ids, meta, mla, index, **kw: f(ids, meta, mla, index, **kw)))(fn)
    return out


@pytest.fixture(scope="module")
def forwards(medium):
    return _forwards(medium)


@pytest.fixture(scope="module")
def alone(medium, forwards):
    """TARGET alone, eager in the mode: the bits every run must give (checked against a batch with one more)."""
    from cpgraph.runtime.engine import run_prefill

    res = run_prefill(forwards["eager"], medium, [TARGET], page_size=PAGE)
    want = res.logits[0].clone(), _records(medium, res, 0, len(TARGET))
    two = run_prefill(forwards["eager"], medium, [TARGET, O3], page_size=PAGE)
    assert torch.equal(two.logits[0], want[0]) and _same(_records(medium, two, 0, len(TARGET)), want[1])
    return want


@pytest.fixture(scope="module")
def own(medium, forwards, alone):
    """name -> the followed request's bits from that forward itself (next to ``O3``): what its batches must give.

    Batch invariance is a property of one forward; whether a compiled forward also equals eager is
    :func:`test_compiled_equals_eager`.
    """
    from cpgraph.runtime.engine import run_prefill

    out = {"eager": alone}
    for name in ("aot_eager", "inductor"):
        res = run_prefill(forwards[name], medium, [TARGET, O3], page_size=PAGE)
        out[name] = res.logits[0].clone(), _records(medium, res, 0, len(TARGET))
    return out


@pytest.mark.parametrize("name", ["eager", "aot_eager", "inductor"])
def test_model_request_bits_in_any_batch_and_chunking(medium, forwards, own, name):
    """Five compositions and three chunkings: the followed request's logits and KV bytes, bit for bit."""
    from cpgraph.runtime.engine import run_prefill

    fwd, want = forwards[name], own[name]
    # Batches of two requests at least (a compiled batch of one is a graph of its own, compiled in the timing).
    for prompts, prefix, i in COMPOSITIONS + [([TARGET, O3], [p, 0], 0) for p in (64, 320, 640)]:
        res = run_prefill(fwd, medium, prompts, prefix_lens=prefix, page_size=PAGE)
        diff = (res.logits[i].float() - want[0].float()).abs().max().item()
        assert torch.equal(res.logits[i], want[0]), f"{name} {prefix}: logits differ by up to {diff}"
        assert _same(_records(medium, res, i, len(TARGET)), want[1]), f"{name} {prefix}: KV bytes"


@pytest.mark.parametrize("name", ["aot_eager", "inductor"])
def test_compiled_equals_eager(own, name):
    """The compiled deterministic forward gives eager's bits (logits and KV bytes) for the same request."""
    diff = (own[name][0].float() - own["eager"][0].float()).abs().max().item()
    assert torch.equal(own[name][0], own["eager"][0]), f"{name}: logits differ from eager by up to {diff}"
    assert _same(own[name][1], own["eager"][1]), f"{name}: KV bytes differ from eager"


@pytest.mark.parametrize("name", ["eager", "inductor"])
def test_model_request_bits_behind_a_cached_prefix_and_under_cuda_graphs(medium, forwards, own, name):
    from cpgraph.runtime.cache_engine import CacheEngine
    from cpgraph.runtime.graph_runner import graphed_forward

    want = own[name]
    for graphed in (False, True):
        fwd = forwards[name]
        if graphed:
            fwd = graphed_forward(fwd, max_requests=4)
        engine = CacheEngine(fwd, medium, num_pages=256, page_size=PAGE)
        other = TARGET[:384] + O2[:200]
        engine.prefill([other, O0])
        res = engine.prefill([TARGET, O3])
        assert res.hits[0]["device"] == 384
        assert torch.equal(res.logits[0], want[0]), f"{name} graphed={graphed}: behind a cached prefix"
        again = engine.prefill([TARGET, O3])  # a replay of the same bucket (full hit but the last page)
        assert torch.equal(again.logits[0], want[0]), f"{name} graphed={graphed}: second pass"


def test_fp8_model_request_bits_in_any_batch(tmp_path):
    """FP8 weights (``fp8_block_linear`` and FP8 experts) and FP8 KV, compiled deterministic: batch invariance."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from test_fp8_gpu import write_checkpoint

    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout
    from cpgraph.passes import CPConfig, compile
    from cpgraph.runtime.engine import run_prefill

    cfg = dict(medium_config(), moe_intermediate_size=256)
    write_checkpoint(tmp_path, cfg)
    torch._dynamo.reset()  # the bf16 model's graphs share the forward's code object and its recompile budget
    model = from_pretrained(tmp_path, dtype=torch.bfloat16, device=DEV, weights="fp8").eval()
    model.kv_layout = make_layout(model, "fp8", PAGE)
    fn = compile(model, CPConfig(deterministic=True), backend="inductor", dynamic=True)

    def fwd(ids, meta, mla, index, **kw):
        return fn(ids, meta, mla, index, **kw)

    first = run_prefill(fwd, model, [TARGET, O3], kv_format="fp8", page_size=PAGE)
    want = first.logits[0].clone(), _records(model, first, 0, len(TARGET))
    for prompts, prefix, i in COMPOSITIONS:
        res = run_prefill(fwd, model, prompts, prefix_lens=prefix, kv_format="fp8", page_size=PAGE)
        assert torch.equal(res.logits[i], want[0]), f"fp8 {prefix}: logits"
        assert _same(_records(model, res, i, len(TARGET)), want[1]), f"fp8 {prefix}: KV bytes"
