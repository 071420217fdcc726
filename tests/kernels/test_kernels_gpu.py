"""Production shapes on a CUDA device: every Triton provider bit-exact with its reference.

32K and 128K tokens, hidden 7168 bf16 rows, 656-byte MLA records, 132-byte
index-K tokens (D = 128), page 64.  Also: the ops dispatch to the Triton
providers on CUDA, and the launches replay inside a captured CUDA graph.
Out-of-range ids (below -1, past the end, 2**40, into empty tensors, inside a
replayed CUDA graph) must behave like -1 and never touch a neighbouring
buffer; offsets past 2**31 bytes must address the right rows.
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


# ------------------------------------------------------------ out-of-range ids
def _with_bad_ids(idx: torch.Tensor, n_src: int, seed: int, frac: float = 0.05) -> torch.Tensor:
    """``idx`` with a fraction of entries replaced by ids the index rule treats like -1."""
    g = _gen(seed)
    bad = torch.tensor([-2, -7, n_src, n_src + 1, n_src + 4096, 2**31 - 1, -(2**31), 2**40, -(2**40), 2**62], device=DEV)
    pick = bad[torch.randint(0, bad.numel(), idx.shape, device=DEV, generator=g)]
    return torch.where(torch.rand(idx.shape, device=DEV, generator=g) < frac, pick, idx.to(torch.int64))


def _window(rows: int, width: int, dtype, pad: int = 64):
    """A ``rows``-row window of a larger random buffer (``pad`` neighbour rows on each side)."""
    raw = torch.randint(0, 256, (rows + 2 * pad, width * torch.empty(0, dtype=dtype).element_size()), device=DEV,
                        generator=_gen(21), dtype=torch.uint8)  # fmt: skip
    backing = raw.view(dtype)
    return backing, backing[pad : pad + rows]


@pytest.mark.parametrize("tokens", TOKENS[:1])
def test_out_of_range_ids_gather_zero_rows(tokens):
    """take_rows / compact_valid / paged_gather at production widths: out-of-range ids give zero rows."""
    _, x = _window(tokens, HIDDEN, torch.bfloat16)
    idx = _with_bad_ids(_index(tokens, tokens, seed=22), tokens, seed=23)
    ok = ((idx >= 0) & (idx < tokens)).unsqueeze(1)
    want = torch.where(ok, x[idx.clamp(0, tokens - 1)], torch.zeros((), dtype=x.dtype, device=DEV))
    assert same_bytes(rows.take_rows_reference(x, idx), want)
    assert same_bytes(move.take_rows(x, idx), want)
    assert same_bytes(move.compact_valid(x, idx), want)
    idx32 = torch.where((idx >= -(2**31)) & (idx < 2**31), idx, -5).to(torch.int32)
    assert same_bytes(move.take_rows(x, idx32), rows.take_rows_reference(x, idx32))
    _, pool = _window(tokens, 656, torch.uint8)
    assert same_bytes(move.paged_gather(pool, idx), paged.paged_gather_reference(pool, idx))


@pytest.mark.parametrize("width,dtype", [(656, torch.uint8), (576, torch.bfloat16), (HIDDEN, torch.bfloat16)])
def test_out_of_range_slots_never_write_outside_the_pool(width, dtype):
    tokens = TOKENS[0]
    backing, pool = _window(tokens, width, dtype)
    ref_backing = backing.clone()
    ref_pool = ref_backing[64 : 64 + tokens]
    slots = _with_bad_ids(_index(tokens, tokens, seed=24), tokens, seed=25)
    new = torch.randint(0, 256, (tokens, width * pool.element_size()), device=DEV, generator=_gen(26)).to(torch.uint8)
    new = new.view(dtype)
    before = backing.clone()
    move.paged_store(pool, new, slots)
    paged.paged_store_reference(ref_pool, new, slots)
    assert same_bytes(backing, ref_backing)
    assert same_bytes(backing[:64], before[:64]) and same_bytes(backing[64 + tokens :], before[64 + tokens :])


def test_out_of_range_slots_index_k_pages():
    tokens = TOKENS[0]
    num_pages = tokens // PAGE
    backing, pages = _window(num_pages, PAGE * 132, torch.uint8, pad=4)
    before = backing.clone()
    ref_backing = backing.clone()
    ref_pages = ref_backing[4 : 4 + num_pages]
    keys = (torch.randn(tokens, 128, device=DEV, generator=_gen(27)) * 5).to(torch.bfloat16)
    slots = _with_bad_ids(_index(tokens, tokens, seed=28), tokens, seed=29)
    kcodecs.index_k_store(pages, keys, slots, PAGE)
    paged.index_k_store_reference(ref_pages, keys, slots, PAGE)
    assert same_bytes(backing, ref_backing)
    assert same_bytes(backing[:4], before[:4]) and same_bytes(backing[4 + num_pages :], before[4 + num_pages :])
    got = move.index_k_gather(pages, slots, PAGE, 128)
    want = paged.index_k_gather_reference(pages, slots, PAGE, 128)
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])


def test_any_id_into_empty_tensors():
    idx = torch.tensor([0, 1, 5, -3, 2**40], device=DEV)
    assert not move.take_rows(torch.empty(0, HIDDEN, dtype=torch.bfloat16, device=DEV), idx).any()
    ones = torch.ones(5, 656, dtype=torch.uint8, device=DEV)
    move.paged_store(torch.empty(0, 656, dtype=torch.uint8, device=DEV), ones, idx)
    kb, sc = move.index_k_gather(torch.empty(0, PAGE * 132, dtype=torch.uint8, device=DEV), idx, PAGE, 128)
    torch.cuda.synchronize()
    assert not kb.any() and not sc.any()


def test_out_of_range_ids_inside_a_cuda_graph():
    """Ids change between replays (as in production): bad ids written into the captured index are masked too."""
    x = torch.randn(4096, HIDDEN, device=DEV).to(torch.bfloat16)
    idx = _index(4096, 4096, seed=30)
    pool = torch.zeros(4096 + 128, 656, dtype=torch.uint8, device=DEV)
    window = pool[64 : 64 + 4096]
    rec = torch.randint(0, 256, (4096, 656), device=DEV, generator=_gen(31)).to(torch.uint8)
    outs = {}

    def step():
        outs["take"] = move.take_rows(x, idx)
        move.paged_store(window, rec, idx)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    idx.copy_(_with_bad_ids(idx, 4096, seed=32, frac=0.3))
    pool.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert same_bytes(outs["take"], rows.take_rows_reference(x, idx))
    ref = torch.zeros_like(pool)
    paged.paged_store_reference(ref[64 : 64 + 4096], rec, idx)
    assert same_bytes(pool, ref) and not pool[:64].any() and not pool[64 + 4096 :].any()


# ------------------------------------------------------- offsets past 2**31
BIG = 2**31 + 2**24  # bytes: every buffer below is a little larger than an int32 offset can address


@pytest.mark.parametrize("width", [4095, 4097])  # odd widths: 1-byte words, offsets in bytes (narrow / wide kernel)
def test_row_offsets_past_int32(width):
    n = BIG // width + 1
    x = torch.empty(n, width, dtype=torch.uint8, device=DEV)
    x[-64:] = torch.randint(0, 256, (64, width), device=DEV, generator=_gen(33), dtype=torch.uint8)
    idx = torch.arange(n - 64, n, device=DEV).flip(0)
    assert same_bytes(move.take_rows(x, idx), x[idx])
    pool = torch.zeros_like(x)
    move.paged_store(pool, x[-64:], idx)
    assert same_bytes(pool[-64:], x[-64:].flip(0))
    del x, pool


def test_codec_offsets_past_int32():
    """MLA records and index pages whose last rows lie past 2**31 bytes (row-local results on the tail)."""
    n = BIG // 656 + 1
    g = _gen(34)
    latent = torch.randn(n, 512, device=DEV, generator=g).to(torch.bfloat16)
    k_pe = torch.randn(n, 64, device=DEV, generator=g).to(torch.bfloat16)
    rec = kcodecs.mla_fp8_pack(latent, k_pe)
    assert same_bytes(rec[-256:], codecs.mla_fp8_pack_reference(latent[-256:], k_pe[-256:]))
    del latent, k_pe
    dense = kcodecs.mla_fp8_unpack(rec, torch.bfloat16)
    assert same_bytes(dense[-256:], codecs.mla_fp8_unpack_reference(rec[-256:], torch.bfloat16))
    del dense, rec
    num_pages = BIG // (PAGE * 132) + 1
    pages = torch.zeros(num_pages, PAGE * 132, dtype=torch.uint8, device=DEV)
    keys = torch.randn(PAGE, 128, device=DEV, generator=g).to(torch.bfloat16)
    slots = torch.arange((num_pages - 1) * PAGE, num_pages * PAGE, device=DEV)
    kcodecs.index_k_store(pages, keys, slots, PAGE)
    assert same_bytes(pages[-1:], codecs.index_k_page_pack_reference(keys, PAGE))
    got = move.index_k_gather(pages, slots.flip(0), PAGE, 128)
    want = paged.index_k_gather_reference(pages, slots.flip(0), PAGE, 128)
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])
