"""Paged store/gather against Python loops over slots, opcheck, and compile survival."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

import cpgraph.ops.codecs  # noqa: F401  (registers the ops)
import cpgraph.ops.paged  # noqa: F401

ops = torch.ops.cpgraph


def _slots(n: int, num_slots: int, seed: int, holes: float = 0.3) -> torch.Tensor:
    """Distinct slots in ``[0, num_slots)`` with some ``-1`` (dummy rows)."""
    rng = np.random.default_rng(seed)
    s = rng.permutation(num_slots)[:n]
    s[rng.random(n) < holes] = -1
    return torch.from_numpy(s.astype(np.int64))


def _loop_store(pool: np.ndarray, rows: np.ndarray, slots) -> np.ndarray:
    """A slot outside ``[0, S)`` (-1 or any other) is skipped."""
    out = pool.copy()
    for i, s in enumerate(slots):
        if 0 <= s < pool.shape[0]:
            out[s] = rows[i]
    return out


def _loop_gather(pool: np.ndarray, slots) -> np.ndarray:
    """A slot outside ``[0, S)`` (-1 or any other) gives a zero row."""
    out = np.zeros((len(slots), pool.shape[1]), dtype=pool.dtype)
    for i, s in enumerate(slots):
        if 0 <= s < pool.shape[0]:
            out[i] = pool[s]
    return out


# Slots the index rule treats like -1 for a pool of 6 slots.
OUT_OF_RANGE = [-2, -9, 6, 7, 1000, 2**31 - 1, -(2**31), 2**40, -(2**40)]


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_out_of_range_slots_are_skipped_and_read_as_zero(monkeypatch, idx_dtype):
    """Store/gather on a pool that is a window of a larger buffer: bytes outside the window never change."""
    monkeypatch.delenv("CPGRAPH_DEBUG", raising=False)
    backing = torch.randn(10, 3)
    pool = backing[2:8]  # 6 slots; rows 0-1 and 8-9 of the backing buffer are neighbours
    before = backing.clone()
    bad = [s for s in OUT_OF_RANGE if idx_dtype == torch.int64 or -(2**31) <= s < 2**31]
    slots = torch.tensor([*bad, 1, -1, 4], dtype=idx_dtype)
    rows = torch.randn(slots.shape[0], 3)
    want = _loop_store(pool.numpy(), rows.numpy(), slots.tolist())
    ops.paged_store(pool, rows, slots)
    np.testing.assert_array_equal(pool.numpy(), want)
    assert torch.equal(backing[:2], before[:2]) and torch.equal(backing[8:], before[8:])
    np.testing.assert_array_equal(ops.paged_gather(pool, slots).numpy(), _loop_gather(pool.numpy(), slots.tolist()))
    # an empty pool: every slot is "no slot"
    empty = torch.zeros(0, 3)
    ops.paged_store(empty, rows, slots)
    assert torch.equal(ops.paged_gather(empty, slots), torch.zeros(slots.shape[0], 3))


def _pools():
    """(name, pool, rows-maker) for the three record kinds a paged pool holds."""
    def dense_mla(n):
        return ops.mla_dense_pack(torch.randn(n, 32), torch.randn(n, 16))

    def fp8_mla(n):
        return ops.mla_fp8_pack(torch.randn(n, 512), torch.randn(n, 64))

    def dense_index(n):
        return torch.randn(n, 32).to(torch.bfloat16)

    return [
        ("dense_mla", torch.randn(24, 48), dense_mla),
        ("fp8_mla", torch.randint(0, 255, (24, 656), dtype=torch.uint8), fp8_mla),
        ("dense_index", torch.randn(24, 32).to(torch.bfloat16), dense_index),
    ]


# ------------------------------------------------------- store / gather
@pytest.mark.parametrize("kind", range(3))
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_paged_store_gather_vs_loops(kind, idx_dtype):
    _, pool, make_rows = _pools()[kind]
    rows = make_rows(10)
    slots = _slots(10, pool.shape[0], seed=kind).to(idx_dtype)
    want = _loop_store(pool.numpy() if pool.dtype != torch.bfloat16 else pool.float().numpy(),
                       rows.numpy() if rows.dtype != torch.bfloat16 else rows.float().numpy(), slots.tolist())
    ops.paged_store(pool, rows, slots)
    got = pool if pool.dtype != torch.bfloat16 else pool.float()
    np.testing.assert_array_equal(got.numpy(), want)

    read = torch.cat([slots, torch.tensor([-1, 0, pool.shape[0] - 1], dtype=idx_dtype)])
    gathered = ops.paged_gather(pool, read)
    assert gathered.dtype == pool.dtype
    np.testing.assert_array_equal(gathered.float().numpy(), _loop_gather(got.numpy(), read.tolist()))


def test_paged_store_all_dummy_and_empty_is_noop():
    pool = torch.randn(8, 4)
    before = pool.clone()
    ops.paged_store(pool, torch.randn(5, 4), torch.full((5,), -1))
    ops.paged_store(pool, torch.randn(0, 4), torch.zeros(0, dtype=torch.int64))
    assert torch.equal(pool, before)


def test_paged_store_dummy_rows_never_write_even_into_slot_zero():
    """Dummy rows are redirected internally; slot 0 must keep a valid row's value."""
    pool = torch.zeros(4, 2)
    rows = torch.tensor([[9.0, 9.0], [1.0, 2.0], [7.0, 7.0]])
    ops.paged_store(pool, rows, torch.tensor([-1, 0, -1]))
    assert pool.tolist() == [[1.0, 2.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 12), num_slots=st.integers(1, 16), seed=st.integers(0, 1000), holes=st.floats(0, 1))
def test_paged_store_random(n, num_slots, seed, holes):
    n = min(n, num_slots)
    pool = torch.randn(num_slots, 3)
    rows = torch.randn(n, 3)
    slots = _slots(n, num_slots, seed, holes)
    want = _loop_store(pool.numpy(), rows.numpy(), slots.tolist())
    ops.paged_store(pool, rows, slots)
    np.testing.assert_array_equal(pool.numpy(), want)


def test_fp8_records_round_trip_through_pool():
    pool = torch.zeros(16, 656, dtype=torch.uint8)
    latent, k_pe = torch.randn(6, 512), torch.randn(6, 64)
    slots = torch.tensor([3, -1, 15, 0, 7, -1])
    ops.paged_store(pool, ops.mla_fp8_pack(latent, k_pe), slots)
    dense = ops.mla_fp8_unpack(ops.paged_gather(pool, slots), torch.float32)
    direct = ops.mla_fp8_unpack(ops.mla_fp8_pack(latent, k_pe), torch.float32)
    keep = torch.tensor([True, False, True, True, True, False])
    assert torch.equal(dense[keep], direct[keep])
    assert torch.equal(dense[~keep], torch.zeros(2, 576))


# ------------------------------------------------------ fp8 index pages
def _loop_index_store(pages: np.ndarray, key_bytes, scales, slots, page_size, d) -> np.ndarray:
    out = pages.copy()
    nb = math.ceil(d / 128)
    for i, s in enumerate(slots):
        if not 0 <= s < pages.shape[0] * page_size:
            continue
        p, o = divmod(s, page_size)
        out[p, o * d : (o + 1) * d] = key_bytes[i]
        base = page_size * d + o * 4 * nb
        out[p, base : base + 4 * nb] = np.frombuffer(scales[i].astype("<f4").tobytes(), dtype=np.uint8)
    return out


def _loop_index_gather(pages: np.ndarray, slots, page_size, d):
    nb = math.ceil(d / 128)
    kb = np.zeros((len(slots), d), dtype=np.uint8)
    sc = np.zeros((len(slots), nb), dtype=np.float32)
    for i, s in enumerate(slots):
        if not 0 <= s < pages.shape[0] * page_size:
            continue
        p, o = divmod(s, page_size)
        kb[i] = pages[p, o * d : (o + 1) * d]
        base = page_size * d + o * 4 * nb
        sc[i] = np.frombuffer(pages[p, base : base + 4 * nb].tobytes(), dtype="<f4")
    return kb, sc


@pytest.mark.parametrize("page_size,d", [(4, 32), (2, 128), (8, 160), (1, 64)])
def test_index_k_store_gather_vs_loops(page_size, d):
    num_pages = 5
    nb = math.ceil(d / 128)
    pages = torch.randint(0, 255, (num_pages, page_size * (d + 4 * nb)), dtype=torch.uint8)
    n = min(9, num_pages * page_size)
    keys = torch.randn(n, d)
    slots = _slots(n, num_pages * page_size, seed=page_size * d)
    key_bytes, scales = ops.index_k_quant(keys)
    want = _loop_index_store(pages.numpy(), key_bytes.numpy(), scales.numpy(), slots.tolist(), page_size, d)
    ops.index_k_store(pages, keys, slots, page_size)
    np.testing.assert_array_equal(pages.numpy(), want)

    read = torch.cat([slots, torch.tensor([-1, 0])]).to(torch.int32)
    got_b, got_s = ops.index_k_gather(pages, read, page_size, d)
    want_b, want_s = _loop_index_gather(pages.numpy(), read.tolist(), page_size, d)
    np.testing.assert_array_equal(got_b.numpy(), want_b)
    np.testing.assert_array_equal(got_s.numpy(), want_s)


def test_index_k_out_of_range_slots(monkeypatch):
    """Slots outside ``[0, P * page_size)`` are skipped by the store and read as zeros by the gather."""
    monkeypatch.delenv("CPGRAPH_DEBUG", raising=False)
    page_size, d = 4, 32
    backing = torch.randint(0, 255, (5, page_size * (d + 4)), dtype=torch.uint8)
    pages = backing[1:4]  # 3 pages = 12 slots; pages 0 and 4 of the backing buffer are neighbours
    before = backing.clone()
    slots = torch.tensor([12, -2, 3, 2**40, -(2**40), 11, 13, -1])
    keys = torch.randn(slots.shape[0], d)
    key_bytes, scales = ops.index_k_quant(keys)
    want = _loop_index_store(pages.numpy(), key_bytes.numpy(), scales.numpy(), slots.tolist(), page_size, d)
    ops.index_k_store(pages, keys, slots, page_size)
    np.testing.assert_array_equal(pages.numpy(), want)
    assert torch.equal(backing[0], before[0]) and torch.equal(backing[4], before[4])
    got_b, got_s = ops.index_k_gather(pages, slots, page_size, d)
    want_b, want_s = _loop_index_gather(pages.numpy(), slots.tolist(), page_size, d)
    np.testing.assert_array_equal(got_b.numpy(), want_b)
    np.testing.assert_array_equal(got_s.numpy(), want_s)
    got_b, got_s = ops.index_k_gather(pages[:0], slots, page_size, d)  # no page at all
    assert not got_b.any() and not got_s.any()


def test_index_k_store_in_order_equals_page_pack():
    """Writing tokens one slot at a time gives the bytes of packing the pages whole (64-token pages, D=128)."""
    keys = torch.randn(128, 128)
    pages = torch.zeros(2, 8448, dtype=torch.uint8)
    perm = torch.randperm(128)
    ops.index_k_store(pages, keys[perm], perm, 64)
    assert torch.equal(pages, ops.index_k_page_pack(keys, 64))
    b, s = ops.index_k_gather(pages, torch.tensor([-1, 5, 127]), 64, 128)
    assert torch.equal(ops.index_k_dequant(b, s)[0], torch.zeros(128))
    assert torch.equal(ops.index_k_dequant(b, s)[1:], ops.index_k_page_unpack(pages, 64, 128)[[5, 127]])


def test_index_k_store_all_dummy_is_noop():
    pages = torch.randint(0, 255, (2, 4 * 36), dtype=torch.uint8)
    before = pages.clone()
    ops.index_k_store(pages, torch.randn(3, 32), torch.full((3,), -1), 4)
    assert torch.equal(pages, before)


# ---------------------------------------------------------------- opcheck
def _opcheck(op, args):
    result = opcheck(op.default, args)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("case", range(3))
def test_opcheck_paged_store_gather(case):
    _, pool, make_rows = _pools()[case]
    n = (0, 5, 9)[case]
    slots = _slots(n, pool.shape[0], seed=case).to((torch.int64, torch.int32, torch.int64)[case])
    _opcheck(ops.paged_store, (pool, make_rows(n), slots))
    _opcheck(ops.paged_gather, (pool, slots))


@pytest.mark.parametrize("page_size,d,n", [(4, 32, 6), (2, 128, 0), (1, 160, 3)])
def test_opcheck_index_k_store_gather(page_size, d, n):
    nb = math.ceil(d / 128)
    pages = torch.zeros(4, page_size * (d + 4 * nb), dtype=torch.uint8)
    slots = _slots(n, 4 * page_size, seed=d)
    _opcheck(ops.index_k_store, (pages, torch.randn(n, d), slots, page_size))
    _opcheck(ops.index_k_gather, (pages, slots.to(torch.int32), page_size, d))


# ------------------------------------------------- mutation under compile
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_store_survives_compile(backend):
    """A compiled function that only stores must still write (no DCE of the mutation)."""
    torch._dynamo.reset()

    def store(pool, rows, slots, pages, keys, index_slots):
        ops.paged_store(pool, rows, slots)
        ops.index_k_store(pages, keys, index_slots, 4)

    compiled = torch.compile(store, backend=backend, fullgraph=True)
    pool, rows = torch.zeros(8, 6), torch.randn(3, 6)
    pages, keys = torch.zeros(2, 4 * 36, dtype=torch.uint8), torch.randn(3, 32)
    slots, index_slots = torch.tensor([5, -1, 1]), torch.tensor([-1, 6, 2])
    compiled(pool, rows, slots, pages, keys, index_slots)

    want_pool, want_pages = torch.zeros(8, 6), torch.zeros(2, 4 * 36, dtype=torch.uint8)
    store(want_pool, rows, slots, want_pages, keys, index_slots)
    assert pool.abs().sum() > 0 and torch.equal(pool, want_pool)
    assert pages.sum() > 0 and torch.equal(pages, want_pages)


# -------------------------------------------------------------- bad input
def test_bad_dtype():
    with pytest.raises(ValueError, match="'rows'"):
        ops.paged_store(torch.zeros(4, 3), torch.zeros(2, 3, dtype=torch.float64), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="'slots'"):
        ops.paged_gather(torch.zeros(4, 3), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="'pages'"):
        ops.index_k_store(torch.zeros(2, 144), torch.zeros(2, 32), torch.tensor([0, 1]), 4)
    with pytest.raises(ValueError, match="'keys'"):
        ops.index_k_store(torch.zeros(2, 144, dtype=torch.uint8), torch.zeros(2, 32, dtype=torch.int32),
                          torch.tensor([0, 1]), 4)


def test_bad_rank():
    with pytest.raises(ValueError, match="'pool'"):
        ops.paged_store(torch.zeros(4), torch.zeros(2, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="'slots'"):
        ops.paged_gather(torch.zeros(4, 3), torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="'pages'"):
        ops.index_k_gather(torch.zeros(144, dtype=torch.uint8), torch.tensor([0]), 4, 32)


def test_bad_shape():
    with pytest.raises(ValueError, match="'rows'"):
        ops.paged_store(torch.zeros(4, 3), torch.zeros(2, 5), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="'slots'"):
        ops.paged_store(torch.zeros(4, 3), torch.zeros(2, 3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="'pages'"):
        ops.index_k_store(torch.zeros(2, 128, dtype=torch.uint8), torch.zeros(2, 32), torch.tensor([0, 1]), 4)
    with pytest.raises(ValueError, match="'pages'"):
        ops.index_k_gather(torch.zeros(2, 144, dtype=torch.uint8), torch.tensor([0]), 4, 64)
    with pytest.raises(ValueError, match="'page_size'"):
        ops.index_k_gather(torch.zeros(2, 108, dtype=torch.uint8), torch.tensor([0]), 3, 32)


def test_device_mix():
    with pytest.raises(ValueError, match="one device"):
        ops.paged_gather(torch.zeros(4, 3), torch.tensor([0], device="meta"))
    with pytest.raises(ValueError, match="one device"):
        ops.paged_store(torch.zeros(4, 3), torch.zeros(1, 3, device="meta"), torch.tensor([0]))


def test_debug_range_check(monkeypatch):
    monkeypatch.setenv("CPGRAPH_DEBUG", "1")
    with pytest.raises(ValueError, match="'slots'"):
        ops.paged_store(torch.zeros(4, 3), torch.zeros(1, 3), torch.tensor([4]))
    with pytest.raises(ValueError, match="'slots'"):
        ops.index_k_gather(torch.zeros(2, 144, dtype=torch.uint8), torch.tensor([-2]), 4, 32)
