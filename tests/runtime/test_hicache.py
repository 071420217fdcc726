"""HiCache: owner-preserving load-back, lane/host exhaustion -> miss, payload completeness, engine second pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpgraph.runtime.hicache import DevicePages, HiCache, HostPool, LaneDeficit
from cpgraph.runtime.kv_pool import KVPool, KVPoolConfig
from cpgraph.runtime.radix import RadixCache, TokenKey

PS = 4


def _pool(rank, num_pages=12):
    return KVPool(KVPoolConfig(num_layers=3, page_size=PS, num_pages=num_pages, kv_lora_rank=8, qk_rope_dim=4,
                               index_head_dim=8, index_layers=[0, 2], dtype=torch.float32, rank=rank))


class Rig:
    """One rank's L1 + L2 + tree, with an engine-like eviction callback."""

    def __init__(self, rank, cp, num_pages=12, host_pages=12, layout="layer_page_first"):
        self.pool = _pool(rank, num_pages)
        self.dev = DevicePages(self.pool, cp)
        self.tree = RadixCache(PS, rank, cp)
        self.host = HostPool(self.pool, host_pages, cp, layout)
        self.hc = HiCache(self.dev, self.host, self.tree, evict_device=self.evict_lanes)
        g = torch.Generator().manual_seed(rank)
        for t in list(self.pool.mla) + list(self.pool.index_k.values()):
            t.copy_(torch.randn(t.shape, generator=g))

    def release(self, node):
        if node.host_pages is None:
            self.hc.backup([node])
        self.dev.free(node.device_pages, node.page_owners)
        return self.hc.usable_from_host(node)

    def evict_lanes(self, deficits):
        for lane, need in deficits.items():
            self.tree.evict(need, self.release, lane=lane, release_host=self.hc.release_host)

    def add(self, tokens, owners):
        pages = self.dev.alloc(owners)
        return self.tree.insert(TokenKey(tokens), pages, owners).last_node

    def page_bytes(self, pages):
        """Per payload, the bytes of ``pages`` (plain Python loop over pages)."""
        out = []
        for _, view in self.hc.payloads:
            out.append([view[p].clone() if p >= 0 else None for p in pages])
        return out


@pytest.mark.parametrize("layout", ["layer_page_first", "page_first"])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_load_back_preserves_owners_and_bytes(layout, rank):
    cp = 3
    rig = Rig(rank, cp, layout=layout)
    rng = np.random.default_rng(rank)
    filler = rig.dev.alloc([rank] * 3)  # fragment the free list so load-back gets other ids
    owners = rng.integers(0, cp, size=6)
    owners[:3] = [0, 1, 2]
    leaf = rig.add(list(range(24)), owners)
    before = rig.page_bytes(leaf.device_pages)
    saved = leaf.page_owners.copy()
    assert rig.tree.evict(100, rig.release, release_host=rig.hc.release_host) == 6
    assert leaf.device_pages is None and rig.hc.usable_from_host(leaf)
    rig.dev.free(filler, [rank] * 3)
    rig.dev.alloc([rank])  # page 0 taken: the reload lands on different physical pages
    m = rig.tree.match_prefix(TokenKey(list(range(24))))
    assert m.num_device_nodes == 0 and m.host_nodes == [leaf]
    handle = rig.hc.load_back(m.host_nodes)
    assert handle is not None and set(handle.layer_events) == {0, 1, 2}
    assert all(ev is None for ev in handle.layer_events.values())  # CPU: synchronous
    pages = leaf.device_pages
    assert np.array_equal(leaf.page_owners, saved)
    assert np.array_equal(pages >= 0, saved == rank)  # never a page owned by someone else
    after = rig.page_bytes(pages)
    for b0, b1 in zip(before, after):
        for x, y in zip(b0, b1):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y))


def test_lane_exhaustion_degrades_to_miss():
    cp, rank = 2, 0
    rig = Rig(rank, cp, num_pages=4)
    leaf = rig.add(list(range(16)), np.array([0, 1, 1, 0]))
    rig.tree.evict(100, rig.release, release_host=rig.hc.release_host)
    pinned = rig.add([7] * 16, np.array([1, 1, 1, 0]))  # lane 1: 3 of 4 pages, then locked
    rig.tree.inc_lock(pinned)
    used = rig.dev.ledger.used.copy()
    free_ids = rig.pool.num_free
    assert rig.hc.load_back([leaf]) is None  # lane 1 short by 1, nothing evictable there
    assert rig.hc.stats["load_misses"] == 1 and leaf.device_pages is None
    assert np.array_equal(rig.dev.ledger.used, used) and rig.pool.num_free == free_ids  # no plain allocation
    rig.tree.dec_lock(pinned)  # now the deficit lane can be evicted: evict + retry succeeds
    handle = rig.hc.load_back([leaf])
    assert handle is not None and np.array_equal(leaf.device_pages >= 0, leaf.page_owners == rank)
    assert pinned.device_pages is None  # evicted for lane 1


def test_device_alloc_reports_deficit_lanes():
    rig = Rig(0, 3, num_pages=2)
    with pytest.raises(LaneDeficit) as exc:
        rig.dev.alloc([0, 2, 2, 2, 1])
    assert exc.value.deficits == {2: 1}
    assert rig.dev.ledger.used.tolist() == [0, 0, 0]


def test_host_exhaustion_is_a_miss():
    rig = Rig(0, 2, host_pages=3)
    a = rig.add(list(range(16)), np.array([0, 0, 1, 0]))  # 3 rank-0 pages: fills lane 0 of L2
    b = rig.add([5] * 16, np.array([0, 1, 1, 1]))
    rig.tree.inc_lock(b)
    rig.tree.evict(100, rig.release, release_host=rig.hc.release_host)
    assert a.device_pages is None and rig.hc.usable_from_host(a)
    rig.tree.dec_lock(b)
    rig.tree.match_prefix(TokenKey(list(range(16))))  # a is now the most recently used
    # b needs 1 lane-0 host page: the only L2-only leaf is a, dropped for it (LRU of L2 leaves).
    rig.tree.evict(100, rig.release, release_host=rig.hc.release_host)
    assert rig.hc.usable_from_host(b)
    assert rig.tree.match_prefix(TokenKey(list(range(16)))).nodes == []  # a is gone: a miss
    c = rig.add([6] * 16, np.array([0, 0, 0, 0]))  # 4 lane-0 pages cannot fit an L2 of 3
    rig.tree.evict(100, rig.release, release_host=rig.hc.release_host)
    assert rig.hc.stats["backup_misses"] >= 1 and c.host_pages is None
    assert rig.tree.match_prefix(TokenKey([6] * 16)).nodes == []
    assert rig.dev.ledger.used.tolist() == [0, 0] and rig.pool.num_free == 12


def test_incomplete_payloads_not_loadable():
    rig = Rig(0, 1)
    leaf = rig.add(list(range(8)), np.array([0, 0]))
    rig.tree.evict(100, rig.release, release_host=rig.hc.release_host)
    assert ("index", 2) in rig.host.required_payloads and ("index", 1) not in rig.host.required_payloads
    leaf.host_payloads = leaf.host_payloads - {("index", 2)}
    assert not rig.hc.usable_from_host(leaf)
    with pytest.raises(ValueError, match="all payloads"):
        rig.hc.load_back([leaf])


@pytest.mark.parametrize("side", ["device", "host"])
def test_free_validates_before_touching_the_ledger(side):
    rig = Rig(0, 2)
    pool, count = (rig.dev, lambda: rig.pool.num_free) if side == "device" else (rig.host, lambda: rig.host.allocator.num_free)
    owners = np.array([0, 1, 0])
    pages = pool.alloc(owners)
    used, free = pool.ledger.used.copy(), count()
    bad_calls = [
        ([pages[0], -1, pages[0]], owners, "double free"),  # the allocator refuses: the ledger must not move
        ([pages[0], -1, 99], owners, "unknown page 99"),
        (pages.astype(np.float64), owners, "pages must hold integers, got dtype float64"),
        (pages, owners.astype(np.float64), "owners must hold integers, got dtype float64"),
        (pages, [0, 0, 0], "logical page 1 has owner 0 and page id -1 on rank 0"),
        (pages[:2], owners, "2 page\\(s\\) but 3 owner\\(s\\)"),
        (pages, [0, 2, 0], "owner outside \\[0, 2\\)"),
    ]
    for bad_pages, bad_owners, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            pool.free(bad_pages, bad_owners)
        assert pool.ledger.used.tolist() == used.tolist() and count() == free, message
    pool.free(pages, owners)
    assert pool.ledger.used.tolist() == [0, 0] and count() == free + 2
    with pytest.raises(RuntimeError, match="freeing 2 page\\(s\\) of lane 0, which holds 0"):
        pool.free(pages, owners)  # a second free of the same pages
    assert pool.ledger.used.tolist() == [0, 0] and count() == free + 2


@pytest.mark.parametrize("side", ["device", "host"])
def test_alloc_refuses_float_owners_without_side_effects(side):
    rig = Rig(0, 2)
    pool = rig.dev if side == "device" else rig.host
    with pytest.raises(ValueError, match="owners must hold integers, got dtype float64"):
        pool.alloc(np.array([0.0, 1.0]))
    assert pool.ledger.used.tolist() == [0, 0]
    assert pool.alloc([0, 1]).tolist() == [0, -1]


def test_bad_arguments():
    pool = _pool(0)
    with pytest.raises(ValueError, match="layout"):
        HostPool(pool, 4, 1, "pages")
    with pytest.raises(ValueError, match="num_pages"):
        HostPool(pool, -1, 1)
    with pytest.raises(ValueError, match="write_policy"):
        HiCache(DevicePages(pool, 1), HostPool(pool, 4, 1), RadixCache(PS), write_policy="lazy")


# ------------------------------------------------------------ engine level
@pytest.fixture(scope="module")
def tiny():
    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout

    model = from_pretrained("tiny-glm5").eval()
    layout = make_layout(model, "bf16", 16)

    def forward(ids, meta, mla, index, **kw):
        return model(ids, meta, mla, index, layout, **kw)

    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 512, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 512, (n,), generator=g).tolist() for n in (30, 9, 56)] + [shared[:32]]
    return model, forward, prompts


def _owned_cached_pages(engine):
    return sum(int(np.count_nonzero(n.device_pages >= 0)) for n in engine.tree.nodes() if n.device_pages is not None)


@pytest.mark.bitexact  # warm passes compute fewer rows per GEMM than the cold one (docs/bitwise.md)
@pytest.mark.parametrize("layout,policy", [("layer_page_first", "write_through"), ("page_first", "write_back")])
def test_engine_second_pass_equals_first(tiny, layout, policy):
    from cpgraph.runtime.cache_engine import CacheEngine
    from cpgraph.runtime.engine import run_prefill

    model, forward, prompts = tiny
    ref = run_prefill(forward, model, prompts, page_size=16).logits
    eng = CacheEngine(forward, model, num_pages=48, page_size=16, host_pages=48, host_layout=layout,
                      write_policy=policy)
    first = eng.prefill(prompts)
    assert first.totals()["computed"] == sum(map(len, prompts))
    second = eng.prefill(prompts)
    # The 32-token prompt is an exact 2-page hit: its last page is recomputed and the duplicate freed.
    assert [h["device"] for h in second.hits] == [64, 48, 80, 16]
    assert eng.tree.device_pages_total == 9  # 2 shared pages + 2 + 1 + 4 request-specific ones
    assert eng.evict_device() == 9
    assert eng.device.ledger.used.tolist() == [0] and eng.pool.num_free == 48
    third = eng.prefill(prompts)
    assert third.hits[0]["host"] == 64 and third.totals()["host"] + third.totals()["device"] == 208
    for res in (first, second, third):
        assert torch.equal(res.logits, first.logits)
        assert torch.allclose(res.logits, ref, rtol=0, atol=1e-5)
    # No leaked pages: every allocated page is referenced by the tree.
    assert eng.device.ledger.used[0] == _owned_cached_pages(eng) == 48 - eng.pool.num_free


def test_engine_host_too_small_recomputes(tiny):
    from cpgraph.runtime.cache_engine import CacheEngine

    model, forward, prompts = tiny
    eng = CacheEngine(forward, model, num_pages=48, page_size=16, host_pages=2, write_policy="write_back")
    first = eng.prefill(prompts[:1])  # 4 whole pages cached in L1
    eng.evict_device()  # L2 holds 2 pages: the 4-page node cannot be backed up
    again = eng.prefill(prompts[:1])
    assert again.hits[0] == {"device": 0, "host": 0, "computed": 70}
    assert torch.equal(again.logits, first.logits)


@pytest.mark.bitexact  # the CLI's warm pass against its cold pass, in this process (docs/bitwise.md)
def test_cli_run_cache(capsys):
    from cpgraph.cli import main

    assert main(["run", "--model", "tiny-glm5", "--cache", "--evict", "--write-policy", "write_back",
                 "--cache-layout", "page_first", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "pass 2: L1 (device) hit 0 token(s), L2 (host) hit 256 token(s), computed 27 token(s)" in out
    assert "bit-identical" in out
    assert main(["run", "--model", "tiny-glm5", "--evict", "--quiet"]) == 2
    assert main(["run", "--model", "tiny-glm5", "--cache", "--prefix-lens", "0,0,0,0", "--quiet"]) == 2
    assert "drop --prefix-lens" in capsys.readouterr().err


def test_one_lane_alloc_fast_path_equals_the_general_path():
    """One lane, owners an int64 array of zeros (the engine's allocation without CP): same pages, same ledger,
    same deficit, as the general path (owners as a list)."""
    fast, slow = DevicePages(_pool(0, 6), 1), DevicePages(_pool(0, 6), 1)
    for n in (0, 2, 3):
        a, b = fast.alloc(np.zeros(n, dtype=np.int64)), slow.alloc([0] * n)
        assert a.dtype == b.dtype and a.tolist() == b.tolist()
        assert fast.ledger.used.tolist() == slow.ledger.used.tolist() and fast.pool.num_free == slow.pool.num_free
    for d in (fast, slow):
        with pytest.raises(LaneDeficit) as exc:
            d.alloc(np.zeros(4, dtype=np.int64))
        assert exc.value.deficits == {0: 3}
        assert d.ledger.used.tolist() == [5] and d.pool.num_free == 1  # nothing taken
    with pytest.raises(ValueError, match="owner outside"):  # not all zeros: the general path checks them
        fast.alloc(np.array([0, -1], dtype=np.int64))
    fast.free(np.array([0, 1], dtype=np.int64), np.zeros(2, dtype=np.int64))
    assert fast.alloc(np.zeros(1, dtype=np.int64)).tolist() == [0]  # lowest free id first, as before
