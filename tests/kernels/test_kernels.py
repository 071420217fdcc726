"""Triton kernels byte-for-byte against the ops' torch references, on small shapes.

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (CI) or on CUDA when a GPU
is present; skipped otherwise.  The references themselves are checked
against independent brute force in ``tests/ops``; here every provider must
give the *same bytes* as its reference, including the ``-1`` rows, odd
widths and strided inputs the ops accept.  The interpreter's cost is per
program, so the launchers pick large tiles when interpreting.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_env import kernel_device  # noqa: E402


if kernel_device() is None:
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device", allow_module_level=True)

import cpgraph.kernels as kernels  # noqa: E402
import cpgraph.ops  # noqa: E402,F401
from cpgraph.kernels import codecs as kcodecs  # noqa: E402
from cpgraph.kernels import move  # noqa: E402
from cpgraph.ops import codecs, paged, rows  # noqa: E402
from cpgraph.ops.providers import active_provider  # noqa: E402
from cpgraph.plan import plan_prefill  # noqa: E402

DEV = kernel_device()
ops = torch.ops.cpgraph


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (NaN-safe, -0.0 distinguished)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.contiguous().cpu(), b.contiguous().cpu()
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _index(n_out: int, n_src: int, seed: int, holes: float = 0.25, dtype=torch.int64) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, max(n_src, 1), n_out)
    idx[rng.random(n_out) < holes] = -1
    if n_src == 0:
        idx[:] = -1
    return torch.from_numpy(idx).to(dtype).to(DEV)


def _random(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype).to(DEV)
    if dtype == torch.bool:
        return (torch.randint(0, 2, shape, generator=g) > 0).to(DEV)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=dtype).to(DEV)


def _row_kinds():
    """row_kind vectors from real plans: tiny extends, row_align padding, a full rank, all valid."""
    out = []
    for prefix, extend, cp, page, align in [([0], [1], 4, 4, 1), ([0, 8], [13, 6], 2, 4, 4), ([0] * 3, [9, 1, 30], 3, 2, 8)]:
        plan = plan_prefill(prefix, extend, cp_size=cp, page_size=page, row_align=align)
        out += [plan.rank(r).row_kind for r in range(cp)]
    out.append(torch.zeros(5, dtype=torch.int64))
    out.append(torch.tensor([1, 0, 2, 0, 0, 1, 0], dtype=torch.int64))  # dummies interleaved
    return [k.to(DEV) for k in out]


# ------------------------------------------------------------------ take_rows
@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((40, 7168 // 64), torch.bfloat16),
        ((33, 3, 5), torch.float32),
        ((29,), torch.float16),
        ((17, 656), torch.uint8),
        ((12, 9), torch.int64),
        ((8, 3), torch.bool),
        ((10, 1), torch.int8),
    ],
)
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_take_rows_matches_reference(device, shape, dtype, idx_dtype):
    x = _random(shape, dtype, seed=shape[0])
    idx = _index(23, shape[0], seed=1, dtype=idx_dtype)
    assert same_bytes(move.take_rows(x, idx), rows.take_rows_reference(x, idx))


@pytest.mark.parametrize("col,width,stride", [(656, 128, 788), (0, 656, 788), (784, 4, 788), (3, 5, 11), (2, 6, 10)])
def test_take_rows_on_byte_column_slice(device, col, width, stride):
    """The materialisation's placement: a byte-column slice of the gathered buffer (strided rows)."""
    buf = _random((31, stride), torch.uint8, seed=stride)
    x = buf[:, col : col + width]
    idx = _index(40, 31, seed=col)
    assert same_bytes(move.take_rows(x, idx), rows.take_rows_reference(x, idx))


def test_take_rows_edge_cases(device):
    x = _random((6, 4), torch.float32, seed=0)
    empty_idx = torch.empty(0, dtype=torch.int64, device=DEV)
    assert same_bytes(move.take_rows(x, empty_idx), rows.take_rows_reference(x, empty_idx))
    none = torch.full((5,), -1, dtype=torch.int64, device=DEV)
    got = move.take_rows(x[:0], none)  # no source rows, every row a zero row
    assert same_bytes(got, torch.zeros(5, 4, device=DEV))
    neg0 = torch.full((3, 4), -0.0, device=DEV)  # -0.0 must survive (bytes, not values)
    assert same_bytes(move.take_rows(neg0, torch.tensor([2, 0], device=DEV)), neg0[:2])


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 20),
    k=st.integers(0, 20),
    width=st.integers(1, 70),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.uint8, torch.int16]),
    seed=st.integers(0, 10_000),
)
def test_take_rows_random(n, k, width, dtype, seed):
    if DEV is None:
        pytest.skip("no kernel device")
    x = _random((n, width), dtype, seed)
    idx = _index(k, n, seed)
    assert same_bytes(move.take_rows(x, idx), rows.take_rows_reference(x, idx))


# ----------------------------------------------------------- compaction
ROW_KINDS = _row_kinds()


@pytest.mark.parametrize("k", range(len(ROW_KINDS)))
def test_static_compaction_matches_reference(device, k):
    row_kind = ROW_KINDS[k]
    x = _random((row_kind.shape[0], 24), torch.bfloat16, seed=k)
    y, num_valid = move.compact_valid_static(x, row_kind)
    ref_y, ref_num = rows.compact_valid_static_reference(x, row_kind)
    assert same_bytes(y, ref_y) and same_bytes(num_valid, ref_num)
    z = _random((row_kind.shape[0], 24), torch.float32, seed=k + 1)
    assert same_bytes(move.restore_compute_static(z, row_kind), rows.restore_compute_static_reference(z, row_kind))


def test_scan_over_several_chunks(device):
    """More rows than one scan block on GPU (4096): the carry between chunks matters."""
    g = torch.Generator().manual_seed(3)
    row_kind = (torch.rand(9000, generator=g) < 0.3).to(torch.int64).to(DEV)
    x = _random((9000, 2), torch.float32, seed=4)
    y, num = move.compact_valid_static(x, row_kind)
    ref_y, ref_num = rows.compact_valid_static_reference(x, row_kind)
    assert same_bytes(y, ref_y) and same_bytes(num, ref_num)
    assert same_bytes(move.restore_compute_static(x, row_kind), rows.restore_compute_static_reference(x, row_kind))


@pytest.mark.parametrize("k", range(4))
def test_dynamic_compaction_matches_reference(device, k):
    plan = plan_prefill([0, 8], [13, 6 + k], cp_size=2, page_size=4, row_align=4).rank(k % 2)
    valid_rows = plan.valid_rows.to(DEV)
    x = _random((plan.num_rows, 16), torch.bfloat16, seed=k)
    y = move.compact_valid(x, valid_rows)
    assert same_bytes(y, rows.compact_valid_reference(x, valid_rows))
    assert same_bytes(
        move.restore_compute(y, valid_rows, plan.num_rows), rows.restore_compute_reference(y, valid_rows, plan.num_rows)
    )
    # valid rows need not be a prefix: a shuffled subset restores to its positions
    perm = torch.tensor([5, 0, 3], device=DEV)
    y3 = _random((3, 16), torch.float32, seed=9)
    assert same_bytes(move.restore_compute(y3, perm, 7), rows.restore_compute_reference(y3, perm, 7))


# ------------------------------------------------------------ paged ops
@pytest.mark.parametrize(
    "width,dtype", [(48, torch.float32), (656, torch.uint8), (576, torch.bfloat16), (33, torch.uint8), (3, torch.float16)]
)
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_paged_store_and_gather(device, width, dtype, idx_dtype):
    pool = _random((40, width), dtype, seed=width)
    pool_ref = pool.clone()
    rows_ = _random((15, width), dtype, seed=width + 1)
    g = np.random.default_rng(width)
    slots = torch.from_numpy(g.permutation(40)[:15]).to(idx_dtype)
    slots[torch.from_numpy(g.random(15) < 0.3)] = -1
    slots = slots.to(DEV)
    move.paged_store(pool, rows_, slots)
    paged.paged_store_reference(pool_ref, rows_, slots)
    assert same_bytes(pool, pool_ref)
    read = torch.cat([slots, torch.tensor([-1, 0, 39], dtype=idx_dtype, device=DEV)])
    assert same_bytes(move.paged_gather(pool, read), paged.paged_gather_reference(pool, read))


def test_paged_store_all_skipped_and_strided_pool(device):
    pool = _random((10, 8), torch.float32, seed=0)
    before = pool.clone()
    move.paged_store(pool, _random((4, 8), torch.float32, seed=1), torch.full((4,), -1, device=DEV))
    assert same_bytes(pool, before)
    # a column slice of a wider pool: rows strided but contiguous within; writes must land in place
    wide = _random((10, 12), torch.float32, seed=2)
    wide_ref = wide.clone()
    slots = torch.tensor([3, -1, 7], device=DEV)
    r = _random((3, 8), torch.float32, seed=3)
    move.paged_store(wide[:, 2:10], r, slots)
    paged.paged_store_reference(wide_ref[:, 2:10], r, slots)
    assert same_bytes(wide, wide_ref)


# ----------------------------------------------------------- index-K pages
@pytest.mark.parametrize(
    "head_dim,page_size,dtype",
    [(128, 4, torch.bfloat16), (128, 1, torch.float32), (32, 8, torch.float16), (200, 2, torch.float32), (320, 4, torch.bfloat16), (3, 2, torch.float32)],
)
def test_index_k_pack_store_gather(device, head_dim, page_size, dtype):
    pages = 8
    keys = _random((pages * page_size, head_dim), dtype, seed=head_dim)
    keys[1] = 0  # an all-zero row: the 1e-4 floor decides the scale
    got = kcodecs.index_k_page_pack(keys, page_size)
    assert same_bytes(got, codecs.index_k_page_pack_reference(keys, page_size))

    n = 7
    store_keys = _random((n, head_dim), dtype, seed=head_dim + 1) * 100
    g = np.random.default_rng(head_dim)
    slots = torch.from_numpy(g.permutation(pages * page_size)[:n])
    slots[2] = -1
    slots = slots.to(DEV)
    pool = _random(got.shape, torch.uint8, seed=5)
    pool_ref = pool.clone()
    kcodecs.index_k_store(pool, store_keys, slots, page_size)
    paged.index_k_store_reference(pool_ref, store_keys, slots, page_size)
    assert same_bytes(pool, pool_ref)

    read = torch.cat([slots, torch.tensor([-1, 0], device=DEV)])
    kb, sc = move.index_k_gather(pool, read, page_size, head_dim)
    rkb, rsc = paged.index_k_gather_reference(pool, read, page_size, head_dim)
    assert same_bytes(kb, rkb) and same_bytes(sc, rsc)


# ------------------------------------------------------------- MLA records
def _edge_latent() -> torch.Tensor:
    """Rows that exercise every branch of the scale rule and the e4m3 rounding."""
    rows_ = []
    rows_.append(torch.zeros(512))  # amax 0 -> 1e-4 floor
    rows_.append(torch.full((512,), -0.0))  # signed zeros
    r = torch.linspace(-448, 448, 512)  # amax exactly 448 -> scale 1, ties of e4m3 inside
    rows_.append(r)
    r = torch.linspace(-1, 1, 512) * 2.0**-7  # fp8 subnormals after scaling by the floor
    rows_.append(r)
    ties = torch.tensor([1.0625, 1.1875, 2**-10, 3 * 2**-10, 5 * 2**-10, 447.9, 464.0, 0.0]).repeat(64)
    ties[-1] = 448.0  # amax 448 -> scale 1: the tie values are quantised as written
    rows_.append(ties)
    rows_.append(torch.full((512,), 448.0 * 2**5))  # amax a power of two times 448
    rows_.append(torch.full((512,), 448.0 * 2**5) * (1 + 2**-23))  # just above: next exponent
    rows_.append(torch.randn(512) * 1e30)
    rows_.append(torch.randn(512) * 1e-30)
    return torch.stack(rows_)


@pytest.mark.parametrize("lat_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pe_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mla_fp8_pack_unpack(device, lat_dtype, pe_dtype):
    g = torch.Generator().manual_seed(0)
    n = 24
    latent = torch.randn(n, 512, generator=g) * torch.logspace(-5, 4, n).unsqueeze(1)
    latent = torch.cat([latent, _edge_latent()]) if lat_dtype == torch.float32 else latent
    latent = latent.to(lat_dtype).to(DEV)
    k_pe = (torch.randn(latent.shape[0], 64, generator=g) * 7).to(pe_dtype).to(DEV)
    if pe_dtype == torch.float32:
        k_pe[0, :4] = torch.tensor([1.00390625, 1.01171875, 1.0 + 2**-7 + 2**-9, -0.0])  # bf16 ties, -0
    packed = kcodecs.mla_fp8_pack(latent, k_pe)
    ref = codecs.mla_fp8_pack_reference(latent, k_pe)
    assert same_bytes(packed, ref)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = kcodecs.mla_fp8_unpack(ref, out_dtype)
        want = codecs.mla_fp8_unpack_reference(ref, out_dtype)
        assert same_bytes(got, want)


def _f32(bits: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32))


def _non_finite_rows(width: int) -> torch.Tensor:
    """Rows with +-inf / NaNs of both signs and odd payloads, alone in a tile or among finite values."""
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 3], x[0, width - 1] = float("inf"), float("-inf")
    x[1, :128] = float("inf")
    x[2, 1:4] = _f32([0xFFC00000, 0x7F800001, 0xFFFFFFFF])  # -NaN, signalling NaN, all-ones NaN
    x[3, :128] = float("nan")
    x[4, 0], x[4, 1], x[4, 2] = float("nan"), float("-inf"), 1e-30
    return x


@pytest.mark.parametrize("lat_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mla_fp8_pack_non_finite_bytes(device, lat_dtype):
    """The non-finite rule, byte for byte: the kernel writes exactly the reference's record."""
    latent = _non_finite_rows(512).to(lat_dtype).to(DEV)
    k_pe = (torch.randn(5, 64) * 7).to(DEV)
    k_pe[0, 0], k_pe[1, 1], k_pe[2, 2] = float("nan"), float("inf"), float("-inf")
    k_pe[3, 3:5] = _f32([0xFFC00001, 0x7FA00000]).to(DEV)  # NaNs that round to different bf16 payloads
    for pe in (k_pe, k_pe.to(torch.float16), k_pe.to(torch.bfloat16)):
        rec = kcodecs.mla_fp8_pack(latent, pe)
        assert same_bytes(rec, codecs.mla_fp8_pack_reference(latent, pe))
    assert rec[0, 3].item() == 0x7E and rec[0, 511].item() == 0xFE and rec[2, 1].item() == 0x7F


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_k_non_finite_bytes(device, dtype):
    keys = _non_finite_rows(160)[:4].to(dtype).to(DEV)
    assert same_bytes(kcodecs.index_k_page_pack(keys, 2), codecs.index_k_page_pack_reference(keys, 2))
    pool = _random((3, 2 * (160 + 8)), torch.uint8, seed=3)
    pool_ref = pool.clone()
    slots = torch.tensor([5, 0, -1, 2], device=DEV)
    kcodecs.index_k_store(pool, keys, slots, 2)
    paged.index_k_store_reference(pool_ref, keys, slots, 2)
    assert same_bytes(pool, pool_ref)


def test_mla_fp8_unpack_every_code(device):
    """All 256 e4m3 codes (NaNs aside) decode exactly as torch decodes them."""
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # the two NaN codes carry no value
    rec = torch.zeros(2, 656, dtype=torch.uint8)
    rec[0, :254] = codes
    rec[1, :254] = codes.flip(0)
    rec[:, 512:528] = torch.tensor([1.0, 2.0**-3, 2.0**10, 2.0**-20]).repeat(2, 1).view(torch.uint8)
    rec[:, 528:] = torch.randn(2, 64).to(torch.bfloat16).view(torch.uint8)
    rec = rec.to(DEV)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert same_bytes(kcodecs.mla_fp8_unpack(rec, out_dtype), codecs.mla_fp8_unpack_reference(rec, out_dtype))


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 9), log_scale=st.integers(-30, 30), seed=st.integers(0, 10_000))
def test_mla_fp8_pack_random_scales(n, log_scale, seed):
    if DEV is None:
        pytest.skip("no kernel device")
    g = torch.Generator().manual_seed(seed)
    latent = (torch.randn(n, 512, generator=g) * 2.0**log_scale).to(DEV)
    k_pe = torch.randn(n, 64, generator=g).to(DEV)
    assert same_bytes(kcodecs.mla_fp8_pack(latent, k_pe), codecs.mla_fp8_pack_reference(latent, k_pe))


# ------------------------------------------------------ out-of-range ids
# Ids every kernel must treat like -1 for a source of n rows: below -1, just past the end, far away.
def _bad_index(n_src: int, idx_dtype, extra=(0, -1, 4, 2)) -> torch.Tensor:
    ids = [-2, -9, n_src, n_src + 1, 1000, 2**31 - 1, -(2**31), 2**40, -(2**40), 2**62]
    if idx_dtype == torch.int32:
        ids = [i for i in ids if -(2**31) <= i < 2**31]
    return torch.tensor([*extra[:2], *ids, *extra[2:]], dtype=idx_dtype).to(DEV)


def _window(rows: int, width: int, dtype, seed: int, before: int = 2, after: int = 2):
    """``(backing, window)``: a ``rows``-row window of a larger buffer whose outer rows are the neighbours."""
    backing = _random((before + rows + after, width), dtype, seed)
    return backing, backing[before : before + rows]


@pytest.mark.parametrize("width,dtype", [(12, torch.float32), (656, torch.uint8), (6000, torch.uint8)])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_gathers_treat_out_of_range_ids_as_minus_one(device, width, dtype, idx_dtype):
    """take_rows / compact_valid / paged_gather, narrow and wide rows: zero rows, never a neighbour's bytes."""
    _, x = _window(5, width, dtype, seed=width)
    idx = _bad_index(5, idx_dtype)
    want = torch.zeros((idx.shape[0], width), dtype=dtype, device=DEV)
    want[[0, -2, -1]] = x[[0, 4, 2]]  # the in-range ids; every other row is zero
    assert same_bytes(rows.take_rows_reference(x, idx), want)
    assert same_bytes(move.take_rows(x, idx), want)
    assert same_bytes(move.compact_valid(x, idx), want)
    assert same_bytes(move.paged_gather(x, idx), want)
    sl = _random((5, width + 7), dtype, seed=1)[:, 3 : 3 + width]  # strided rows (a byte-column slice)
    assert same_bytes(move.take_rows(sl, idx), rows.take_rows_reference(sl, idx))


def test_out_of_range_ids_into_empty_tensors(device):
    """Any id into an empty tensor is "no row": zeros out, nothing written, no crash."""
    idx = torch.tensor([0, 3, -5, 2**40], device=DEV)
    assert same_bytes(move.take_rows(_random((0, 9), torch.float32, 0), idx), torch.zeros(4, 9, device=DEV))
    wide = move.take_rows(_random((0, 5000), torch.uint8, 0), idx)
    assert same_bytes(wide, torch.zeros(4, 5000, dtype=torch.uint8, device=DEV))
    move.paged_store(torch.zeros(0, 656, dtype=torch.uint8, device=DEV), _random((4, 656), torch.uint8, 1), idx)
    empty_pages = torch.zeros(0, 4 * 132, dtype=torch.uint8, device=DEV)
    kb, sc = move.index_k_gather(empty_pages, idx, 4, 128)
    assert not kb.any() and not sc.any()
    kcodecs.index_k_store(empty_pages, _random((4, 128), torch.float32, 2), idx, 4)
    y = _random((4, 6), torch.float32, 3)
    assert same_bytes(move.restore_compute(y, idx, 0), torch.zeros(0, 6, device=DEV))


@pytest.mark.parametrize("width,dtype", [(12, torch.float32), (656, torch.uint8), (6000, torch.uint8)])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_paged_store_skips_out_of_range_slots(device, width, dtype, idx_dtype):
    """A pool that is a window of a larger buffer: rows outside the window never change."""
    backing, pool = _window(5, width, dtype, seed=width)
    before = backing.clone()
    ref_backing, ref_pool = _window(5, width, dtype, seed=width)
    slots = _bad_index(5, idx_dtype, extra=(3, -1, 0, 4))
    new = _random((slots.shape[0], width), dtype, seed=width + 1)
    move.paged_store(pool, new, slots)
    paged.paged_store_reference(ref_pool, new, slots)
    assert same_bytes(backing, ref_backing)
    assert same_bytes(backing[:2], before[:2]) and same_bytes(backing[7:], before[7:])
    assert same_bytes(pool[[1, 2]], before[[3, 4]])  # pool slots no valid row names keep their bytes
    assert same_bytes(pool[[3, 0, 4]], new[[0, -2, -1]])


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_index_k_store_and_gather_out_of_range_slots(device, idx_dtype):
    page_size, d = 4, 128
    backing, pages = _window(3, page_size * (d + 4), torch.uint8, seed=4, before=1, after=1)  # 12 slots
    before = backing.clone()
    ref_backing, ref_pages = _window(3, page_size * (d + 4), torch.uint8, seed=4, before=1, after=1)
    slots = _bad_index(12, idx_dtype, extra=(11, -1, 0, 7))
    keys = _random((slots.shape[0], d), torch.float32, seed=5)
    kcodecs.index_k_store(pages, keys, slots, page_size)
    paged.index_k_store_reference(ref_pages, keys, slots, page_size)
    assert same_bytes(backing, ref_backing)
    assert same_bytes(backing[0], before[0]) and same_bytes(backing[4], before[4])
    got = move.index_k_gather(pages, slots, page_size, d)
    want = paged.index_k_gather_reference(pages, slots, page_size, d)
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])
    assert not got[0][2:-2].any() and not got[1][2:-2].any()


def test_restore_compute_drops_out_of_range_targets(device):
    y = _random((8, 10), torch.bfloat16, seed=6)
    valid_rows = torch.tensor([4, -1, 0, 9, -(2**40), 2, 2**40, 6], device=DEV)
    got = move.restore_compute(y, valid_rows, 7)
    assert same_bytes(got, rows.restore_compute_reference(y, valid_rows, 7))
    assert same_bytes(got[[4, 0, 2, 6]], y[[0, 2, 5, 7]]) and not got[[1, 3, 5]].any()


def test_skip_ranges_mask_out_of_range_ids(device):
    """The folded rerange's gather with ``skip``: an id past the source is a zero row, not a read."""
    width = 40
    src = _random((12, width), torch.uint8, seed=7)
    index = torch.tensor([5, 12, 3, 2**40, -3, 11], device=DEV)
    out = _random((6, width), torch.uint8, seed=8)
    move.move_rows(move.byte_rows(src), out, index, 6, width, move.Layout(width), move.Layout(width), gather=True,
                   skip=(4, 8))  # fmt: skip
    assert same_bytes(out[[1, 3, 4]], torch.zeros(3, width, dtype=torch.uint8, device=DEV))
    assert same_bytes(out[[2, 5]], src[[3, 11]])


def test_launchers_reject_shapes_that_would_overrun(device):
    """Host-side shape checks: positional rows and row bytes a launch would address must exist."""
    from cpgraph.kernels import segments

    src = _random((6, 16), torch.uint8, seed=9)
    short = torch.empty(3, 16, dtype=torch.uint8, device=DEV)
    idx = torch.zeros(6, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="rows"):
        move.move_rows(src, short, idx, 6, 16, move.Layout(16), move.Layout(16), gather=True)
    wide_src, wide_dst = _random((6, 5000), torch.uint8, 1), torch.empty(3, 5000, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="rows"):  # the column-block kernel's launcher
        move.move_rows(wide_src, wide_dst, idx, 6, 5000, move.Layout(5000), move.Layout(5000), gather=True)
    with pytest.raises(ValueError, match="overrun"):
        move.move_rows(src, short, idx, 3, 16, move.Layout(16, base=4), move.Layout(16), gather=True)
    with pytest.raises(ValueError, match="index"):
        move.move_rows(src, src.clone(), idx[:2], 6, 16, move.Layout(16), move.Layout(16), gather=True)
    seg = segments.Segment(src, short, move.Layout(16), 16, 16, dst_base=8)
    with pytest.raises(ValueError, match="overrun"):
        segments.move_segments([seg], idx, 3, segments.GATHER)
    with pytest.raises(ValueError, match="pages"):
        kcodecs.index_k_store(torch.zeros(2, 100, dtype=torch.uint8, device=DEV), _random((2, 128), torch.float32, 0),
                              torch.zeros(2, dtype=torch.int64, device=DEV), 4)  # fmt: skip


# ------------------------------------------------- materialisation placement
def test_materialize_placement_per_kind(device):
    """Composition step of ``cp_materialize_kv``: per-kind take_rows on the gathered byte buffer."""
    kinds = [(656, torch.uint8), (128, torch.uint8), (1, torch.float32)]
    row_bytes = [w * torch.empty(0, dtype=d).element_size() for w, d in kinds]
    gathered = _random((2 * (6 + 10), sum(row_bytes)), torch.uint8, seed=11)
    source = _index(50, gathered.shape[0], seed=12, holes=0.2)
    col = 0
    for (w, dtype), nbytes in zip(kinds, row_bytes):
        sl = gathered[:, col : col + nbytes]
        got = move.take_rows(sl, source).view(dtype)
        want = rows.take_rows_reference(sl, source).contiguous().view(dtype)
        assert same_bytes(got, want)
        col += nbytes


# ------------------------------------------------------------- provider wiring
@pytest.fixture
def providers_on_device(device):
    from provider_state import registry_restored

    with registry_restored(device):  # on CUDA these are the process's default providers: put them back
        registered = kernels.register_triton_providers((device,))
        yield registered
        kernels.unregister_triton_providers((device,))


def test_ops_dispatch_to_triton(providers_on_device, device):
    """The custom ops call the Triton providers with the ops' own argument lists."""
    assert set(providers_on_device) == set(kernels.providers())
    for op in providers_on_device:
        assert active_provider(op, device) == kernels.PROVIDER_NAME
    x = _random((9, 20), torch.bfloat16, seed=0)
    idx = _index(6, 9, seed=0)
    assert same_bytes(ops.take_rows(x, idx), rows.take_rows_reference(x, idx))
    vr = torch.tensor([0, 2, 5], device=DEV)
    y = ops.compact_valid(x, vr)
    assert same_bytes(ops.restore_compute(y, vr, 9), rows.restore_compute_reference(y, vr, 9))
    kind = torch.tensor([0, 1, 0, 0, 2, 0, 1, 0, 0], device=DEV)
    yy, nv = ops.compact_valid_static(x, kind)
    assert same_bytes(nv, rows.compact_valid_static_reference(x, kind)[1])
    assert same_bytes(ops.restore_compute_static(yy, kind), rows.restore_compute_static_reference(yy, kind))
    lat, pe = _random((5, 512), torch.bfloat16, 1), _random((5, 64), torch.bfloat16, 2)
    rec = ops.mla_fp8_pack(lat, pe)
    assert same_bytes(rec, codecs.mla_fp8_pack_reference(lat, pe))
    assert same_bytes(ops.mla_fp8_unpack(rec, torch.bfloat16), codecs.mla_fp8_unpack_reference(rec, torch.bfloat16))
    pool = torch.zeros(8, 656, dtype=torch.uint8, device=DEV)
    slots = torch.tensor([3, -1, 0, 7, 6], device=DEV)
    ops.paged_store(pool, rec, slots)
    assert same_bytes(ops.paged_gather(pool, slots), paged.paged_gather_reference(pool, slots))
    keys = _random((8, 128), torch.float32, 3)
    pages = ops.index_k_page_pack(keys, 4)
    assert same_bytes(pages, codecs.index_k_page_pack_reference(keys, 4))
    ops.index_k_store(pages, keys[:3] * 2, torch.tensor([1, -1, 6], device=DEV), 4)
    got = ops.index_k_gather(pages, torch.tensor([1, 6, -1], device=DEV), 4, 128)
    want = paged.index_k_gather_reference(pages, torch.tensor([1, 6, -1], device=DEV), 4, 128)
    assert all(same_bytes(a, b) for a, b in zip(got, want))


def test_forced_reference_wins(providers_on_device, device, monkeypatch):
    monkeypatch.setenv("CPGRAPH_PROVIDERS", "take_rows:reference")
    assert active_provider("take_rows", device) == "reference"
    assert active_provider("paged_gather", device) == kernels.PROVIDER_NAME


@pytest.mark.parametrize("width", [3, 40, 6000])
def test_gather_skip_and_keep_ranges(device, width):
    """``move_rows(..., skip=(lo, hi))``: rows sourced from [lo, hi) untouched; ``keep``: only those, shifted."""
    src = _random((12, width), torch.uint8, seed=width)
    index = torch.tensor([5, 0, 11, 3, 4, 7, 6, 2, 9, 1], dtype=torch.int64).to(DEV)
    lo, hi = 4, 8
    s, n = move.byte_rows(src), index.shape[0]
    base = _random((n, width), torch.uint8, seed=width + 1)
    skipped = base.clone()
    move.move_rows(s, skipped, index, n, width, move.Layout(width), move.Layout(width), gather=True, skip=(lo, hi))
    kept = base.clone()
    move.move_rows(s[lo:hi], kept, index, n, width, move.Layout(width), move.Layout(width), gather=True,
                   skip=(lo, hi), keep=True)  # fmt: skip
    src_l, base_l = src.cpu().tolist(), base.cpu().tolist()
    for t, g in enumerate(index.tolist()):
        inside = lo <= g < hi
        assert skipped[t].cpu().tolist() == (base_l[t] if inside else src_l[g])
        assert kept[t].cpu().tolist() == (src_l[g] if inside else base_l[t])
