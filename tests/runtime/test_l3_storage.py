"""L3 page stores without a model: keys, the file backend's guarantees, spec parsing.

The file backend's faults are simulated where the machine cannot produce
them on demand (a full disk, a read-only directory when tests run as root):
the OS call that would fail is monkeypatched to raise the errno it would.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import zlib

import numpy as np
import pytest
import torch

from cpgraph.runtime.kv_pool import KVPoolConfig
from cpgraph.runtime.storage import (FileStore, SpecError, open_store, page_chain, page_key, parse_spec,
                                     store_fingerprint)
from cpgraph.runtime.storage import file_store as fs


def _obj(seed: int, sizes=(100, 60, 40)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]


def _key(i: int) -> str:
    return page_key("fp", i.to_bytes(32, "little"), 0)


def _empty(sizes=(100, 60, 40)) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=torch.uint8) for n in sizes]


# ------------------------------------------------------------------- keys
def test_chain_digest_covers_the_whole_prefix():
    a = list(range(64))
    b = list(range(64))
    b[3] = 999  # page 0 differs
    c = list(range(64))
    c[40] = 999  # page 2 differs
    da, db, dc = (page_chain(t, 16, 4) for t in (a, b, c))
    assert all(x != y for x, y in zip(da, db))  # a change in page 0 changes every later page's key
    assert da[:2] == dc[:2] and da[2] != dc[2] and da[3] != dc[3]
    # with the draft's dependency the next token is part of a page's digest
    n1 = page_chain(a + [5], 16, 4, with_next_token=True)
    n2 = page_chain(a + [6], 16, 4, with_next_token=True)
    assert n1[:3] == n2[:3] and n1[3] != n2[3]
    with pytest.raises(ValueError, match="need 65 tokens"):
        page_chain(a, 16, 4, with_next_token=True)
    assert page_key("fp", da[0], 0) != page_key("fp", da[0], 1) != page_key("fp2", da[0], 1)


def test_fingerprint_separates_models_formats_layouts():
    def fp(model=None, weights="w", page=16, dtype=torch.float32, index_format=None, payloads=None, cp=1):
        cfg = KVPoolConfig(num_layers=2, page_size=page, num_pages=4, kv_lora_rank=8, qk_rope_dim=4, index_head_dim=8,
                           index_layers=[0], dtype=dtype, index_format=index_format)
        pl = payloads or [(("mla", 0), 100), (("mla", 1), 100), (("index", 0), 50)]
        return store_fingerprint(model or {"hidden_size": 32}, weights, cfg, pl, cp)

    base = fp()
    assert fp() == base  # the same model elsewhere: the same keys
    variants = [fp(model={"hidden_size": 64}), fp(weights="other"), fp(page=32), fp(dtype=torch.bfloat16),
                fp(index_format="fp8"), fp(payloads=[(("mla", 0), 100), (("mla", 1), 100)]), fp(cp=2)]
    assert len({base, *variants}) == len(variants) + 1


def test_spec_parsing():
    assert parse_spec("file:/tmp/x,max_bytes=2K,policy=write_back") == \
        ("file", "/tmp/x", {"max_bytes": 2048, "policy": "write_back"})
    backend, loc, opts = parse_spec("mooncake:10.0.0.1:50051,metadata=http://10.0.0.1:8080/metadata,segment=1G")
    assert (backend, loc, opts["segment"]) == ("mooncake", "10.0.0.1:50051", 1 << 30)
    assert opts["metadata"] == "http://10.0.0.1:8080/metadata"
    for bad, msg in [("s3:bucket", "expected file:DIR"), ("file:", "needs a location"),
                     ("file:/x,max_bytes=lots", "expected a size"), ("file:/x,colour=red", "unknown option 'colour'"),
                     ("file:/x,max_bytes", "not NAME=VALUE"), ("file:/x,policy=lazy", "policy must be one of")]:
        with pytest.raises(SpecError, match=msg):
            parse_spec(bad)


# -------------------------------------------------------------- file store
def test_round_trip_across_part_layouts(tmp_path):
    store = open_store(f"file:{tmp_path}")
    obj = _obj(0)
    assert store.exists([_key(1)]) == [False]
    assert store.put([_key(1)], [obj]) == [True]
    assert store.exists([_key(1), _key(2)]) == [True, False]
    # the same object read as one contiguous row (a page_first L2 page) and as three parts
    whole = torch.zeros(200, dtype=torch.uint8)
    parts = _empty()
    assert store.get([_key(1), _key(2)], [[whole], _empty()]) == [True, False]
    assert store.get([_key(1)], [parts]) == [True]
    assert torch.equal(whole, torch.cat(obj)) and all(torch.equal(a, b) for a, b in zip(parts, obj))
    assert store.stats["get_pages"] == 2 and store.stats["get_misses"] == 1
    with pytest.raises(ValueError, match="uint8"):
        store.get([_key(1)], [[torch.zeros(50, dtype=torch.float32)]])


@pytest.mark.parametrize("damage", ["flip", "truncate", "renamed", "header", "format1"])
def test_corrupt_object_is_a_logged_miss_and_deleted(tmp_path, caplog, damage):
    store = FileStore(tmp_path)
    store.put([_key(1), _key(2)], [_obj(1), _obj(2)])
    path = store.path(_key(1))
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[fs.HEADER_BYTES + 17] ^= 0x40
        damaged = bytes(raw)
    elif damage == "truncate":
        damaged = bytes(raw[:-5])
    elif damage == "header":  # one bit of the stored length: caught by the header's own CRC-32
        raw[16] ^= 0x01
        damaged = bytes(raw)
    elif damage == "format1":  # an object written before the XXH3 header: version 1, checksum field a CRC-32
        from cpgraph.runtime.storage import object_header as oh

        raw[8:12] = (1).to_bytes(4, "little")
        raw[12:16] = bytes(4)
        raw[12:16] = zlib.crc32(bytes(raw[:oh.HEADER_BYTES])).to_bytes(4, "little")
        damaged = bytes(raw)
    else:  # a valid object under another key's name
        damaged = store.path(_key(2)).read_bytes()
    path.write_bytes(damaged)
    out = _empty()
    with caplog.at_level(logging.WARNING, logger="cpgraph.storage"):
        assert store.get([_key(1)], [out]) == [False]
        store.put([_key(1)], [_obj(1)])  # rewritten...
        path.write_bytes(damaged)  # ...and damaged again
        assert store.get([_key(1)], [_empty()]) == [False]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "failed verification" in warnings[0].getMessage()  # once per reason
    assert not path.exists() and store.stats["get_failures"] == 2
    assert store.get([_key(2)], [_empty()]) == [True]  # the other object is untouched


def test_size_bound_evicts_least_recently_used(tmp_path):
    one = fs.HEADER_BYTES + 200
    store = FileStore(tmp_path, max_bytes=4 * one)
    for i in range(4):
        assert store.put([_key(i)], [_obj(i)]) == [True]
        os.utime(store.path(_key(i)), ns=(10**9 * (i + 1), 10**9 * (i + 1)))  # distinct, ordered mtimes
    assert store.get([_key(0)], [_empty()]) == [True]  # 0 is now the most recently used
    assert store.put([_key(4)], [_obj(4)]) == [True]  # over the bound: evict down to 90% of it
    present = store.exists([_key(i) for i in range(5)])
    assert present == [True, False, False, True, True]
    assert store.used_bytes() <= 4 * one and store.stats["evicted_pages"] == 2
    tiny = FileStore(tmp_path / "tiny", max_bytes=100)
    assert tiny.put([_key(9)], [_obj(9)]) == [False] and tiny.stats["put_skipped"] == 1


def test_a_hit_refreshes_the_lru_clock_of_an_old_object_only(tmp_path):
    """A read hit sets the mtime of an object last used over TOUCH_NS ago to now, and leaves a recent one alone."""
    store = FileStore(tmp_path)
    assert store.put([_key(1), _key(2)], [_obj(1), _obj(2)]) == [True, True]
    old, recent = store.path(_key(1)), store.path(_key(2))
    os.utime(old, ns=(10**9, 10**9))
    stamp = recent.stat().st_mtime_ns - 1000
    os.utime(recent, ns=(stamp, stamp))
    assert store.get([_key(1), _key(2)], [_empty(), _empty()]) == [True, True]
    assert old.stat().st_mtime_ns > 10**18 and recent.stat().st_mtime_ns == stamp


def test_several_writers_of_one_key(tmp_path):
    """Threads of two store instances write the same page while a reader reads it: never a partial object."""
    stores = [FileStore(tmp_path, threads=1), FileStore(tmp_path, threads=1)]
    obj = _obj(7, sizes=(1 << 16, 1 << 15))
    errors, seen = [], []

    def writer(store):
        for _ in range(20):
            try:
                os.unlink(store.path(_key(1)))  # force a fresh write each round
            except FileNotFoundError:  # the other writer's unlink came first
                pass
            if store.put([_key(1)], [obj]) != [True]:
                errors.append("put")

    def reader():
        for _ in range(60):
            out = _empty(sizes=(1 << 16, 1 << 15))
            if stores[0].get([_key(1)], [out]) == [True]:
                seen.append(all(torch.equal(a, b) for a, b in zip(out, obj)))

    threads = [threading.Thread(target=writer, args=(s,)) for s in stores] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(seen)
    assert stores[0].stats["get_failures"] == 0  # a reader never saw a half-written file
    leftovers = [p for p in (tmp_path / fs.SUBDIR).rglob(".tmp-*")]
    assert leftovers == []


def test_disk_full_stops_writes_and_reads_go_on(tmp_path, monkeypatch, caplog):
    store = FileStore(tmp_path)
    store.put([_key(1)], [_obj(1)])
    calls = []

    def full(fd, buffers, offset):
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs.os, "pwritev", full)
    with caplog.at_level(logging.WARNING, logger="cpgraph.storage"):
        assert store.put([_key(2), _key(3)], [_obj(2), _obj(3)]) == [False, False]
        assert store.put([_key(4)], [_obj(4)]) == [False]
    assert len(calls) == 1 and not store.writable  # writes stopped after the first failure
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert "full" in caplog.records[0].getMessage()
    assert store.get([_key(1)], [_empty()]) == [True]  # serving (reads) goes on
    assert list((tmp_path / fs.SUBDIR).rglob(".tmp-*")) == []  # the failed temporary file is gone
    store._writes_off_until = 0.0  # the retry time has passed
    monkeypatch.undo()
    assert store.writable and store.put([_key(2)], [_obj(2)]) == [True]


def test_read_only_and_unusable_directories(tmp_path, monkeypatch, caplog):
    good = FileStore(tmp_path / "shared")
    good.put([_key(1)], [_obj(1)])
    real_open = os.open

    def no_create(path, flags, *a, **k):
        if flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(fs.os, "open", no_create)
    with caplog.at_level(logging.WARNING, logger="cpgraph.storage"):
        ro = FileStore(tmp_path / "shared")
        assert ro.available and not ro.writable
        assert ro.get([_key(1)], [_empty()]) == [True]  # pages already there are still served
        assert ro.put([_key(2)], [_obj(2)]) == [False]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING][0].count("not writable") == 1
    monkeypatch.undo()
    caplog.clear()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="cpgraph.storage"):
        gone = FileStore(blocker / "l3")
        assert not gone.available
        assert gone.exists([_key(1)]) == [False] and gone.get([_key(1)], [_empty()]) == [False]
        assert gone.put([_key(1)], [_obj(1)]) == [False]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_batches_use_the_thread_pool(tmp_path):
    store = FileStore(tmp_path, threads=4)
    keys = [_key(i) for i in range(16)]
    objs = [_obj(i) for i in range(16)]
    assert store.put(keys, objs) == [True] * 16
    outs = [_empty() for _ in keys]
    assert store.get(keys, outs) == [True] * 16
    assert all(torch.equal(a, b) for o, x in zip(outs, objs) for a, b in zip(o, x))
    assert store.stats["get_bytes"] == 16 * 200 == store.stats["put_bytes"]
    store.close()
    assert np.all(store.exists(keys))


def test_large_batches_run_on_the_thread_pool_in_order(tmp_path, monkeypatch):
    """A batch over PARALLEL_MIN_BYTES is cut into one run per thread; outcomes keep the keys' order."""
    monkeypatch.setattr(fs, "PARALLEL_MIN_BYTES", 1000)  # 9 objects of 200 B: the pooled path
    store = FileStore(tmp_path, threads=3)
    seen = set()
    get_one = store._get_one

    def spy(*a):
        seen.add(threading.get_ident())
        return get_one(*a)

    monkeypatch.setattr(store, "_get_one", spy)
    keys = [_key(i) for i in range(9)]
    assert store.put([k for i, k in enumerate(keys) if i != 4], [_obj(i) for i in range(9) if i != 4]) == [True] * 8
    outs = [_empty() for _ in keys]
    got = store.get(keys, outs)
    assert got == [i != 4 for i in range(9)]  # the one miss stays at its place
    for i, out in enumerate(outs):
        if i != 4:
            assert all(torch.equal(a, b) for a, b in zip(out, _obj(i)))
    assert seen and threading.get_ident() not in seen  # the pool's threads read, not the caller


def test_object_checksum_is_xxh3_of_the_bytes_across_parts():
    """The header's object checksum is XXH3-64 of the parts' bytes in order, however the object is cut."""
    import xxhash

    from cpgraph.runtime.storage import object_header as oh

    data = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    want = xxhash.xxh3_64(data.numpy().tobytes()).intdigest()
    assert oh.checksum(oh.views([data])) == want
    assert oh.checksum(oh.views([data[:7], data[7:500], data[500:]])) == want
    assert oh.checksum(oh.views([data[:999]])) != want
    head = oh.encode_header(bytes(range(32)), 1000, want)
    assert len(head) == oh.HEADER_BYTES and oh.check_header(head, bytes(range(32)), 1000) == (want, None)


# ------------------------------------------------- reads into L2 byte views
def _host(layout: str, pages: int = 4):
    """A small L2 host pool (two MLA payloads and one index-K payload per page) and its device pool."""
    from cpgraph.runtime.hicache import HostPool
    from cpgraph.runtime.kv_pool import KVPool

    cfg = KVPoolConfig(num_layers=2, page_size=4, num_pages=2, kv_lora_rank=8, qk_rope_dim=4, index_head_dim=8,
                       index_layers=[1], dtype=torch.bfloat16)
    host = HostPool(KVPool(cfg), pages, 1, layout)
    g = torch.Generator().manual_seed(3)
    for t in host.tensors():
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    return host


@pytest.mark.parametrize("layout", ["layer_page_first", "page_first"])
def test_page_views_are_the_page_parts_memory(layout):
    """``HostPool.page_views`` spans the same bytes as ``page_parts``; a write through a view lands in the pool."""
    host = _host(layout)
    (views,) = host.page_views([2])
    parts = host.page_parts(2)
    assert [v.nbytes for v in views] == [p.numel() for p in parts] and all(type(v) is memoryview for v in views)
    assert b"".join(bytes(v) for v in views) == b"".join(p.numpy().tobytes() for p in parts)
    views[-1][0] ^= 0xFF
    assert host.page_parts(2)[-1][0].item() == views[-1][0]
    assert len(host.page_views(np.arange(4))) == 4 and host.page_views([]) == []
    for bad in ([4], [-1], [0, 7]):  # a slice would clamp quietly: refused
        with pytest.raises(IndexError, match="pages must be in"):
            host.page_views(bad)
    assert _host(layout, pages=0).page_views([]) == []


@pytest.mark.parametrize("damage", ["none", "flip", "truncate", "longer", "renamed", "header", "empty"])
def test_reads_into_l2_views_verify_in_place(tmp_path, caplog, damage):
    """The in-place read path (one preadv of header + object + one byte into L2 byte views) accepts exactly
    the object stored under this key: a flipped bit, a truncated or longer file, another key's object, a
    damaged header or an empty file is a miss, logged once, deleted; the other pages of the batch arrive."""
    src, dst = _host("layer_page_first"), _host("layer_page_first")
    for t in dst.tensors():
        t.zero_()
    store = FileStore(tmp_path)
    keys = [_key(i) for i in range(3)]
    assert store.put(keys, src.page_views([0, 1, 2])) == [True] * 3
    path = store.path(keys[1])
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-1] ^= 0x01  # the last byte: in the last part
    elif damage == "truncate":
        raw = raw[:-1]
    elif damage == "longer":
        raw += b"\x00"
    elif damage == "renamed":
        raw = bytearray(store.path(keys[2]).read_bytes())
    elif damage == "header":
        raw[20] ^= 0x80  # the length field: the header's CRC-32 catches it
    elif damage == "empty":
        raw = bytearray()
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="cpgraph.storage"):
        got = store.get(keys, dst.page_views([3, 0, 1]))
    good = damage == "none"
    assert got == [True, good, True]
    for page, want in ((3, 0), (1, 2)) + (((0, 1),) if good else ()):
        assert all(torch.equal(a, b) for a, b in zip(dst.page_parts(page), src.page_parts(want)))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ([] if good else [warnings[0]]) and path.exists() == good
    if not good:
        assert "failed verification" in warnings[0] and store.stats["get_failures"] == 1
    assert store.stats["get_pages"] == 2 + good


def test_memoryview_parts_are_checked():
    """Byte memoryviews are accepted as parts; a read refuses a read-only one, and any other format is refused."""
    from cpgraph.runtime.storage import check_parts

    buf = bytearray(10)
    assert check_parts([memoryview(buf), memoryview(buf)[2:5]], "t", writable=True) == 13
    assert check_parts([memoryview(bytes(4))], "t") == 4  # a put only reads it
    with pytest.raises(ValueError, match="writable"):
        check_parts([memoryview(bytes(4))], "t", writable=True)
    with pytest.raises(ValueError, match="flat"):
        check_parts([memoryview(np.zeros(4, np.float32))], "t")
    with pytest.raises(ValueError, match="flat"):
        check_parts([memoryview(np.zeros((2, 2), np.uint8))], "t")
