"""Per-rank KV pool: storage per the contract, owner-lane allocation, slot mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cpgraph.ops.codecs  # noqa: F401  (registers the ops)
import cpgraph.ops.paged  # noqa: F401
from cpgraph.plan import plan_prefill
from cpgraph.runtime.kv_pool import (
    KVPool,
    KVPoolConfig,
    KVPoolExhausted,
    OwnerLaneAllocator,
    slots_for_positions,
)

ops = torch.ops.cpgraph


def _cfg(**kw):
    base = dict(num_layers=3, page_size=4, num_pages=8, kv_lora_rank=32, qk_rope_dim=16, index_head_dim=32,
                index_layers=[0, 2], dtype=torch.float32)
    base.update(kw)
    return KVPoolConfig(**base)


# -------------------------------------------------------------- allocator
def test_alloc_free_accounting():
    alloc = OwnerLaneAllocator(6, rank=1)
    got = alloc.alloc_pages_with_owners([1, 0, 1, 2, 1])
    assert got[1] == got[3] == -1 and sorted(got[i] for i in (0, 2, 4)) == [0, 1, 2]
    assert alloc.num_free == 3
    assert alloc.alloc_pages_with_owners([0, 2]) == [-1, -1] and alloc.num_free == 3
    alloc.free([-1, got[2], -1])
    assert alloc.num_free == 4
    again = alloc.alloc_pages_with_owners([1])
    assert again == [got[2]]  # lowest free id first
    alloc.free(got[0:1] + got[4:5] + again)
    assert alloc.num_free == 6
    assert alloc.alloc_pages_with_owners(np.array([1] * 6, dtype=np.int8)) == list(range(6))


def test_alloc_deterministic():
    rng = np.random.default_rng(0)
    script = []
    for _ in range(30):
        script.append(("alloc", rng.integers(0, 3, size=int(rng.integers(0, 6))).tolist()))
        script.append(("free", int(rng.integers(0, 4))))

    def run():
        alloc, held, log = OwnerLaneAllocator(40, rank=2), [], []
        for kind, arg in script:
            if kind == "alloc":
                pages = alloc.alloc_pages_with_owners(arg)
                log.append(pages)
                held.extend(p for p in pages if p != -1)
            else:
                take, held[:] = held[:arg], held[arg:]
                alloc.free(take)
        return log, alloc.num_free

    first, second = run(), run()
    assert first == second
    assert any(p != -1 for pages in first[0] for p in pages)


def test_exhaustion_is_atomic_and_clear():
    alloc = OwnerLaneAllocator(4, rank=3)
    held = alloc.alloc_pages_with_owners([3, 3, 0])
    with pytest.raises(KVPoolExhausted) as err:
        alloc.alloc_pages_with_owners([3, 1, 3, 3])
    assert isinstance(err.value, RuntimeError)
    assert (err.value.rank, err.value.requested, err.value.free) == (3, 3, 2)
    msg = str(err.value)
    assert "rank 3" in msg and "3 page(s) requested" in msg and "2 free" in msg
    assert alloc.num_free == 2
    fresh = OwnerLaneAllocator(4, rank=3)
    fresh.alloc_pages_with_owners([3, 3, 0])
    assert alloc.alloc_pages_with_owners([3, 3]) == fresh.alloc_pages_with_owners([3, 3])
    alloc.free(held)


def test_free_rejects_bad_pages_atomically():
    alloc = OwnerLaneAllocator(4, rank=0)
    pages = alloc.alloc_pages_with_owners([0, 0])
    with pytest.raises(ValueError, match="unknown page 9"):
        alloc.free([pages[0], 9])
    with pytest.raises(ValueError, match="unknown page -2"):
        alloc.free([-2])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([pages[1], pages[1]])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([3])  # never allocated
    assert alloc.num_free == 2  # nothing was freed by the failed calls
    alloc.free(pages)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages[:1])


def test_free_refuses_non_integer_page_ids():
    alloc = OwnerLaneAllocator(4, rank=0)
    pages = alloc.alloc_pages_with_owners([0, 0])
    for bad in ([1.0], [float(pages[0]) + 0.5], np.array(pages, dtype=np.float32), [True]):
        with pytest.raises(ValueError, match=r"free: page ids of rank 0 must be integers, got dtype (float|bool)"):
            alloc.free(bad)
    assert alloc.num_free == 2  # a truncated 1.0 / 0.5 would have freed page 1 / 0
    alloc.free(np.array(pages, dtype=np.int32))
    assert alloc.num_free == 4


def test_bad_owners():
    alloc = OwnerLaneAllocator(4, rank=0)
    with pytest.raises(ValueError, match="owners"):
        alloc.alloc_pages_with_owners([[0, 1]])
    with pytest.raises(ValueError, match="owners"):
        alloc.alloc_pages_with_owners([0.5])
    with pytest.raises(ValueError, match=">= 0"):
        alloc.alloc_pages_with_owners([0, -1])


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_owner_pattern_across_ranks(cp):
    """Each rank's allocator gives a page exactly where it is the owner, from the plan's owners."""
    plan = plan_prefill([0, 8, 0], [37, 130, 5], cp_size=cp, page_size=4)
    pools = [KVPool(_cfg(num_pages=64, rank=r)) for r in range(cp)]
    for i in range(plan.num_requests):
        owners = plan.page_owners(i)
        tables = [pool.alloc_pages_with_owners(owners) for pool in pools]
        for j, owner in enumerate(owners):
            for r in range(cp):
                assert (tables[r][j] != -1) == (owner == r), (i, j, r)
    for r, pool in enumerate(pools):
        n_owned = sum(o == r for i in range(plan.num_requests) for o in plan.page_owners(i))
        assert pool.num_free == 64 - n_owned


# ---------------------------------------------------------------- storage
def test_storage_shapes_follow_contract():
    dense = KVPool(_cfg())
    assert [t.shape for t in dense.mla] == [(32, 48)] * 3 and dense.mla_pool(1).dtype == torch.float32
    assert sorted(dense.index_k) == [0, 2] and dense.index_pool(2).shape == (32, 32)
    with pytest.raises(ValueError, match="layer 1 has no indexer"):
        dense.index_pool(1)
    fp8 = KVPool(_cfg(kv_format="fp8", kv_lora_rank=512, qk_rope_dim=64, index_head_dim=128, page_size=64,
                      num_pages=2, index_layers=[1]))
    assert fp8.mla_pool(0).shape == (128, 656) and fp8.mla_pool(0).dtype == torch.uint8
    assert fp8.index_pool(1).shape == (2, 8448) and fp8.index_pool(1).dtype == torch.uint8
    mixed = KVPool(_cfg(index_format="fp8", dtype=torch.bfloat16))
    assert mixed.mla_pool(0).dtype == torch.bfloat16 and mixed.index_pool(0).shape == (8, 4 * 36)


@pytest.mark.parametrize(
    "kw,per_page",
    [
        # 3 layers of fp8 MLA (64 tokens x 656 B) + 2 index layers of 8448-B pages
        (dict(kv_format="fp8", kv_lora_rank=512, qk_rope_dim=64, index_head_dim=128, page_size=64), 3 * 64 * 656 + 2 * 8448),
        # bf16 production record 576 x 2 B, bf16 index keys 128 x 2 B
        (dict(kv_lora_rank=512, qk_rope_dim=64, index_head_dim=128, page_size=64, dtype=torch.bfloat16),
         3 * 64 * 576 * 2 + 2 * 64 * 128 * 2),
        # small fp32 test geometry, one indexer layer
        (dict(index_layers=[1]), 3 * 4 * 48 * 4 + 4 * 32 * 4),
    ],
)
def test_bytes_accounting(kw, per_page):
    pool = KVPool(_cfg(num_pages=3, **kw))
    assert pool.bytes_per_page() == per_page
    assert pool.total_bytes() == 3 * per_page


def test_rank_holds_only_its_pages():
    """Sharded: rank r's pool is sized by its owned pages; the ranks together hold each page once."""
    cp, page = 4, 4
    plan = plan_prefill([0, 0], [61, 200], cp_size=cp, page_size=page)
    owners = [o for i in range(plan.num_requests) for o in plan.page_owners(i)]
    pools = [KVPool(_cfg(num_pages=owners.count(r), page_size=page, rank=r)) for r in range(cp)]
    bpp = pools[0].bytes_per_page()
    for r, pool in enumerate(pools):
        assert pool.total_bytes() == owners.count(r) * bpp
        pool.alloc_pages_with_owners(owners)  # exactly fills the lane
        assert pool.num_free == 0
    assert sum(p.total_bytes() for p in pools) == len(owners) * bpp


def test_config_validation():
    with pytest.raises(ValueError, match="page_size"):
        _cfg(page_size=6)
    with pytest.raises(ValueError, match="kv_format"):
        _cfg(kv_format="int8")
    with pytest.raises(ValueError, match="kv_lora_rank 512"):
        _cfg(kv_format="fp8")
    with pytest.raises(ValueError, match="index_layers"):
        _cfg(index_layers=[0, 3])
    with pytest.raises(ValueError, match="index_layers"):
        _cfg(index_layers=[1, 1])
    with pytest.raises(ValueError, match="dtype"):
        _cfg(dtype=torch.int32)
    with pytest.raises(ValueError, match="num_pages"):
        _cfg(num_pages=-1)


# ----------------------------------------------------------- slot mapping
def _loop_slots(table, positions, page_size):
    out = []
    for p in positions:
        if p < 0 or table[p // page_size] == -1:
            out.append(-1)
        else:
            out.append(table[p // page_size] * page_size + p % page_size)
    return out


def test_slots_for_positions_vs_loop():
    table = [5, -1, 2, 7, -1]
    positions = [0, 3, 4, 7, 8, 13, 15, 19, -1, 12]
    want = _loop_slots(table, positions, 4)
    assert slots_for_positions(table, positions, 4).tolist() == want
    got = slots_for_positions(torch.tensor(table), torch.tensor(positions, dtype=torch.int32), 4)
    assert got.dtype == torch.int64 and got.tolist() == want
    assert slots_for_positions([], [-1, -1], 4).tolist() == [-1, -1]
    assert slots_for_positions(torch.zeros(0, dtype=torch.int64), torch.tensor([-1]), 4).tolist() == [-1]
    with pytest.raises(ValueError, match="position 20"):
        slots_for_positions(table, [20], 4)
    with pytest.raises(ValueError, match="page_size"):
        slots_for_positions(table, positions, 3)


def test_rank_writes_only_its_tokens():
    """Plan -> owners -> pages -> slots -> paged_store: each rank stores exactly its own tokens."""
    cp, page = 2, 4
    plan = plan_prefill([8], [27], cp_size=cp, page_size=page)
    owners = plan.page_owners(0)
    prefix_pages = 8 // page
    for r in range(cp):
        pool = KVPool(_cfg(num_pages=16, page_size=page, rank=r))
        table = [-1] * prefix_pages + pool.alloc_pages_with_owners(owners)
        rp = plan.rank(r)
        positions = torch.where(rp.req_index >= 0, rp.positions, -1)
        slots = slots_for_positions(torch.tensor(table), positions, page)
        rows = torch.arange(1, positions.shape[0] + 1, dtype=torch.float32).unsqueeze(1).expand(-1, 48).contiguous()
        ops.paged_store(pool.mla_pool(0), rows, slots)
        written = (pool.mla_pool(0)[:, 0] != 0).sum().item()
        assert written == int((rp.req_index >= 0).sum())  # every valid row of this rank, and only those
        assert (slots >= 0).sum().item() == written
        for row, s in enumerate(slots.tolist()):
            if s != -1:
                assert pool.mla_pool(0)[s, 0].item() == row + 1
