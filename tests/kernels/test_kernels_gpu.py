"""Production shapes on a CUDA device: every Triton provider bit-exact with its reference.

32K and 128K tokens, hidden 7168 bf16 rows, 656-byte MLA records, 132-byte
index-K tokens (D = 128), page 64.  Also: the ops dispatch to the Triton
providers on CUDA, and the launches replay inside a captured CUDA graph.
Run with ``python -m pytest tests/kernels -m gpu`` on a GPU machine.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "") == "1":
    pytest.skip("GPU tests need a CUDA device (and no TRITON_INTERPRET)", allow_module_level=True)

import cpgraph.kernels as kernels  # noqa: E402
from cpgraph.kernels import codecs as kcodecs  # noqa: E402
from cpgraph.kernels import move  # noqa: E402
from cpgraph.ops import codecs, paged, rows  # noqa: E402
from cpgraph.ops.providers import active_provider  # noqa: E402

DEV = "cuda"
HIDDEN = 7168
PAGE = 64
TOKENS = [32 * 1024, 128 * 1024]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _index(n_out: int, n_src: int, seed: int, holes: float = 0.05) -> torch.Tensor:
    g = _gen(seed)
    idx = torch.randperm(max(n_src, n_out), device=DEV, generator=g)[:n_out] % max(n_src, 1)
    return torch.where(torch.rand(n_out, device=DEV, generator=g) < holes, -1, idx)


def _row_kind(m: int, seed: int) -> torch.Tensor:
    kind = (torch.rand(m, device=DEV, generator=_gen(seed)) < 0.06).to(torch.int64)
    kind[-100:] = 2  # static padding at the tail
    return kind


@pytest.fixture(autouse=True)
def _free_memory():
    yield
    torch.cuda.empty_cache()


def test_providers_registered_for_cuda():
    for op in kernels.providers():
        assert active_provider(op, "cuda") == kernels.PROVIDER_NAME, op


@pytest.mark.parametrize("tokens", TOKENS)
def test_take_rows_hidden(tokens):
    x = torch.randn(tokens, HIDDEN, device=DEV, generator=_gen(0)).to(torch.bfloat16)
    idx = _index(tokens, tokens, seed=1)
    assert same_bytes(move.take_rows(x, idx), rows.take_rows_reference(x, idx))
    assert same_bytes(move.take_rows(x, idx.to(torch.int32)), rows.take_rows_reference(x, idx))


@pytest.mark.parametrize("tokens", TOKENS)
def test_compaction_hidden(tokens):
    x = torch.randn(tokens, HIDDEN, device=DEV, generator=_gen(2)).to(torch.bfloat16)
    kind = _row_kind(tokens, seed=3)
    y, nv = move.compact_valid_static(x, kind)
    ry, rnv = rows.compact_valid_static_reference(x, kind)
    assert same_bytes(y, ry) and same_bytes(nv, rnv)
    del ry
    assert same_bytes(move.restore_compute_static(y, kind), rows.restore_compute_static_reference(y, kind))
    valid_rows = torch.nonzero(kind == 0).squeeze(1)  # test-side setup, not an op body
    c = move.compact_valid(x, valid_rows)
    assert same_bytes(c, rows.compact_valid_reference(x, valid_rows))
    assert same_bytes(move.restore_compute(c, valid_rows, tokens), rows.restore_compute_reference(c, valid_rows, tokens))


@pytest.mark.parametrize("tokens", TOKENS)
def test_mla_fp8_codec(tokens):
    g = _gen(4)
    latent = (torch.randn(tokens, 512, device=DEV, generator=g) * 3).to(torch.bfloat16)
    k_pe = torch.randn(tokens, 64, device=DEV, generator=g).to(torch.bfloat16)
    rec = kcodecs.mla_fp8_pack(latent, k_pe)
    assert same_bytes(rec, codecs.mla_fp8_pack_reference(latent, k_pe))
    lat32 = torch.randn(tokens, 512, device=DEV, generator=g) * torch.logspace(-6, 6, tokens, device=DEV)[:, None]
    assert same_bytes(kcodecs.mla_fp8_pack(lat32, k_pe), codecs.mla_fp8_pack_reference(lat32, k_pe))
    for dtype in (torch.bfloat16, torch.float32):
        assert same_bytes(kcodecs.mla_fp8_unpack(rec, dtype), codecs.mla_fp8_unpack_reference(rec, dtype))


@pytest.mark.parametrize("tokens", TOKENS)
def test_index_k_pages(tokens):
    keys = (torch.randn(tokens, 128, device=DEV, generator=_gen(5)) * 5).to(torch.bfloat16)
    pages = kcodecs.index_k_page_pack(keys, PAGE)
    assert same_bytes(pages, codecs.index_k_page_pack_reference(keys, PAGE))
    slots = _index(tokens, tokens, seed=6)
    pool, pool_ref = torch.zeros_like(pages), torch.zeros_like(pages)
    kcodecs.index_k_store(pool, keys, slots, PAGE)
    paged.index_k_store_reference(pool_ref, keys, slots, PAGE)
    assert same_bytes(pool, pool_ref)
    got = move.index_k_gather(pool, slots, PAGE, 128)
    want = paged.index_k_gather_reference(pool, slots, PAGE, 128)
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("width,dtype", [(656, torch.uint8), (576, torch.bfloat16)])
def test_paged_records(tokens, width, dtype):
    g = _gen(7)
    rows_ = torch.randint(0, 256, (tokens, width * (2 if dtype == torch.bfloat16 else 1)), device=DEV, generator=g)
    rows_ = rows_.to(torch.uint8).view(dtype)
    slots = _index(tokens, tokens + 4 * PAGE, seed=8)
    pool = torch.zeros(tokens + 4 * PAGE, width, dtype=dtype, device=DEV)
    pool_ref = pool.clone()
    move.paged_store(pool, rows_, slots)
    paged.paged_store_reference(pool_ref, rows_, slots)
    assert same_bytes(pool, pool_ref)
    assert same_bytes(move.paged_gather(pool, slots), paged.paged_gather_reference(pool, slots))


@pytest.mark.parametrize("tokens", TOKENS)
def test_materialize_placement(tokens):
    """Composition step: per-kind take_rows on byte-column slices of the gathered buffer."""
    widths = [656, 128, 4]  # fp8 MLA record, index-K bytes, index-K scale
    gathered = torch.randint(0, 256, (tokens + 2048, sum(widths)), device=DEV, generator=_gen(9)).to(torch.uint8)
    source = _index(tokens, gathered.shape[0], seed=10)
    col = 0
    for w in widths:
        sl = gathered[:, col : col + w]
        assert same_bytes(move.take_rows(sl, source), rows.take_rows_reference(sl, source))
        col += w


@pytest.mark.parametrize("tokens", TOKENS)
def test_materialize_pack_and_multi_kind_placement(tokens):
    """Triton pack (prefix + current rows) and the one-launch placement of every kind, 792-B packed rows."""
    from cpgraph.kernels import materialize as kmat
    from cpgraph.ops import materialize as omat

    g = _gen(14)
    cur = [
        torch.randint(0, 256, (tokens, 656), device=DEV, generator=g).to(torch.uint8),
        torch.randint(0, 256, (tokens, 128), device=DEV, generator=g).to(torch.uint8),
        torch.rand(tokens, 1, device=DEV, generator=g),
    ]
    pre = [c[:512] for c in cur]
    columns, packed = omat.packed_columns(cur)
    send = kmat.pack_rows(pre, cur, columns, packed)
    assert same_bytes(send, omat.pack_reference(pre, cur, columns, packed))
    gathered = torch.cat([send, send.flip(0)])
    source = _index(tokens, gathered.shape[0], seed=15)
    for a, b in zip(kmat.place_rows(gathered, source, columns, cur), omat.place_reference(gathered, source, columns, cur)):
        assert same_bytes(a, b)


def test_launches_replay_in_cuda_graph():
    """No host syncs: the providers capture into a CUDA graph and replay on new data."""
    x = torch.randn(4096, HIDDEN, device=DEV).to(torch.bfloat16)
    idx = _index(4096, 4096, seed=11)
    kind = _row_kind(4096, seed=12)
    latent = torch.randn(4096, 512, device=DEV).to(torch.bfloat16)
    k_pe = torch.randn(4096, 64, device=DEV).to(torch.bfloat16)
    outs = {}

    def step():
        outs["take"] = move.take_rows(x, idx)
        outs["compact"], outs["num_valid"] = move.compact_valid_static(x, kind)
        outs["restore"] = move.restore_compute_static(outs["compact"], kind)
        outs["rec"] = kcodecs.mla_fp8_pack(latent, k_pe)
        outs["keys"] = kcodecs.index_k_page_pack(latent[:, :128], PAGE)
        outs["gathered_keys"] = move.index_k_gather(outs["keys"], idx[:1024], PAGE, 128)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x.copy_(torch.randn_like(x))
    latent.copy_(torch.randn_like(latent))
    kind.copy_(_row_kind(4096, seed=13))
    graph.replay()
    torch.cuda.synchronize()
    assert same_bytes(outs["take"], rows.take_rows_reference(x, idx))
    ry, rnv = rows.compact_valid_static_reference(x, kind)
    assert same_bytes(outs["compact"], ry) and same_bytes(outs["num_valid"], rnv)
    assert same_bytes(outs["restore"], rows.restore_compute_static_reference(ry, kind))
    assert same_bytes(outs["rec"], codecs.mla_fp8_pack_reference(latent, k_pe))
    assert same_bytes(outs["keys"], codecs.index_k_page_pack_reference(latent[:, :128], PAGE))
    for a, b in zip(outs["gathered_keys"], paged.index_k_gather_reference(outs["keys"], idx[:1024], PAGE, 128)):
        assert same_bytes(a, b)
