"""HiCache L3 on a real Mooncake Store: master, metadata server and a segment holder started here, on loopback.

The processes come from the Mooncake wheel (``mooncake_master``,
``mooncake.http_metadata_server``, ``mooncake_client``) via
:class:`cpgraph.runtime.storage.mooncake_local.LocalMooncake`; the module
is skipped, with the reason, only where Mooncake is not installed.  A master
that stops answering mid-run is simulated by the transport error code a dead
master returns (``RPC_FAIL``, -900: measured with a killed master, each such
call takes ~4 s, too slow to repeat in tests); one test kills a real
master once, to pin that its calls do fail that way.  A master that is down
before a store connects (nothing listens on its port) is
``test_l3.py::test_unreachable_store_serves_as_misses``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import numpy as np
import pytest
import torch

from cpgraph.runtime.storage import MooncakeStore, page_key
from cpgraph.runtime.storage import mooncake_local
from cpgraph.runtime.storage.mooncake_store import RPC_FAIL
from cpgraph.runtime.storage.object_header import HEADER_BYTES

sys.path.insert(0, os.path.dirname(__file__))
from l3_rig import ATOL, build_tiny, engine, prefix_bytes, same_bytes  # noqa: E402
from test_l3 import cli_in_a_fresh_process  # noqa: E402

_MISSING = mooncake_local.missing()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")]


@pytest.fixture(scope="module")
def mooncake():
    with mooncake_local.LocalMooncake(segment="64MB") as mc:
        yield mc


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


def _key(i: int) -> str:
    return page_key("fp", i.to_bytes(32, "little"), 0)


def test_batch_put_get_between_two_clients(mooncake):
    a = MooncakeStore(mooncake.master, metadata=mooncake.metadata)
    b = MooncakeStore(mooncake.master, metadata=mooncake.metadata)
    try:
        src = torch.arange(3 * 700, dtype=torch.int64).to(torch.uint8)
        a.register(src)
        parts = [[src[:500], src[500:700]], [src[700:1400]], [src[1400:2100]]]  # one object in two ranges
        assert a.put([_key(1), _key(2), _key(3)], parts) == [True] * 3
        assert b.exists([_key(1), _key(9)]) == [True, False]
        dst = torch.zeros(2100, dtype=torch.uint8)
        b.register(dst)
        got = b.get([_key(1), _key(2), _key(9)], [[dst[:700]], [dst[700:1000], dst[1000:1400]], [dst[1400:2100]]])
        assert got == [True, True, False]
        assert torch.equal(dst[:1400], src[:1400])
        assert b.stats["get_misses"] == 1 and b.stats["get_bytes"] == 1400
        assert a.put([_key(1)], [parts[0]]) == [True]  # a second writer of the same page
        assert b.get([_key(3)], [[dst[:100]]]) == [False] and b.stats["get_failures"] == 1  # wrong size: refused
    finally:
        a.close()
        b.close()


def test_memoryview_parts_inside_and_outside_registered_memory(mooncake):
    """Byte memoryviews work as parts (what the tier passes: slices of the registered L2 buffers), and memory
    nobody registered is registered on first use; a read refuses a read-only view."""
    a = MooncakeStore(mooncake.master, metadata=mooncake.metadata)
    b = MooncakeStore(mooncake.master, metadata=mooncake.metadata)
    try:
        src = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
        a.register(src)
        mv = memoryview(src.numpy()).cast("B")
        assert a.put([_key(201), _key(202)], [[mv[:300], mv[300:500]], [mv[500:]]]) == [True, True]
        dst = bytearray(1000)  # never registered
        v = memoryview(dst)
        assert b.get([_key(201), _key(202)], [[v[:500]], [v[500:800], v[800:]]]) == [True, True]
        assert bytes(dst) == src.numpy().tobytes() and b.stats["get_bytes"] == 1000
        with pytest.raises(ValueError, match="writable"):
            b.get([_key(201)], [[memoryview(bytes(500))]])
    finally:
        a.close()
        b.close()


def test_second_engine_restores_from_mooncake(mooncake, tiny):
    prompts = tiny[2]
    spec = f"mooncake:{mooncake.master},metadata={mooncake.metadata}"
    first = engine(tiny, spec)
    cold = first.prefill(prompts)
    assert first.l3.stats["stored_pages"] == 9
    limits = [(len(p) - 1) // 16 for p in prompts]
    want = [prefix_bytes(first, p, n) for p, n in zip(prompts, limits)]
    first.close()  # the pages live in the holder's segment, not in the writer
    second = engine(tiny, spec)
    try:
        warm = second.prefill(prompts)
        assert [h["l3"] for h in warm.hits] == [64, 16, 48]
        torch.testing.assert_close(warm.logits, cold.logits, rtol=0, atol=ATOL)
        for p, n, w in zip(prompts, limits, want):
            assert same_bytes(prefix_bytes(second, p, n), w)
    finally:
        second.close()


def test_master_that_stops_answering_opens_the_circuit(mooncake, monkeypatch, caplog):
    store = MooncakeStore(mooncake.master, metadata=mooncake.metadata, retry_s=3600)
    try:
        calls = []

        class DeadMaster:  # the binding's methods are read-only: wrap the client instead
            def __init__(self, real):
                self.real = real

            def __getattr__(self, name):
                return getattr(self.real, name)

            def batch_get_into_multi_buffers(self, keys, ptrs, sizes):
                calls.append(len(keys))
                return [RPC_FAIL] * len(keys)

        monkeypatch.setattr(store, "_store", DeadMaster(store._store))
        buf = torch.zeros(64, dtype=torch.uint8)
        with caplog.at_level(logging.WARNING, logger="cpgraph.storage"):
            assert store.get([_key(1), _key(2)], [[buf[:32]], [buf[32:]]]) == [False, False]
            assert store.get([_key(1)], [[buf[:32]]]) == [False]
            assert store.exists([_key(1)]) == [False] and store.put([_key(5)], [[buf]]) == [False]
        assert calls == [2] and not store.available  # one failed call, then no traffic until the retry time
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "stopped answering" in warnings[0]
    finally:
        monkeypatch.undo()
        store.close()


def test_corrupt_object_is_a_logged_miss_and_removed(mooncake, caplog):
    """Every object carries a header with its key, length and CRC-32: a read that does not check out is a miss."""
    a = MooncakeStore(mooncake.master, metadata=mooncake.metadata)
    b = MooncakeStore(mooncake.master, metadata=mooncake.metadata)
    try:
        src = torch.arange(600, dtype=torch.int64).to(torch.uint8)
        a.register(src)
        keys = [_key(101), _key(102), _key(103)]
        assert a.put(keys, [[src[:200]], [src[200:400]], [src[400:600]]]) == [True] * 3
        raw = a._store  # the Mooncake client itself: write objects behind the store's back
        good = bytearray(raw.get(keys[0]))
        assert len(good) == HEADER_BYTES + 200
        flipped = bytearray(good)
        flipped[HEADER_BYTES + 17] ^= 0x40  # one bit of the page's bytes
        other = bytearray(raw.get(keys[2]))  # a whole, valid object of another key
        for key, value in ((keys[0], flipped), (keys[1], other)):
            assert raw.remove(key, True) == 0 and raw.put(key, bytes(value)) == 0  # force: a read holds a lease
        dst = torch.zeros(600, dtype=torch.uint8)
        b.register(dst)
        with caplog.at_level(logging.WARNING, logger="cpgraph.storage"):
            got = b.get(keys, [[dst[:200]], [dst[200:400]], [dst[400:600]]])
        assert got == [False, False, True] and torch.equal(dst[400:], src[400:])
        assert b.stats["get_failures"] == 2 and b.stats["get_pages"] == 1
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "failed verification (checksum mismatch)" in warnings[0]
        assert b.exists(keys) == [False, False, True]  # removed: a lookup misses them, a put can store them again
        assert a.put(keys[:1], [[src[:200]]]) == [True] and b.get(keys[:1], [[dst[:200]]]) == [True]
    finally:
        a.close()
        b.close()


def test_second_process_serves_the_first_ones_prefix(mooncake, tmp_path, capsys):
    """``cpgraph run --cache --l3 mooncake:...`` here, then in a fresh process: the pages outlive the first
    process's client (they live in the holder's segment) and the second restores them, with the cold logits."""
    from cpgraph.cli import main

    spec = f"mooncake:{mooncake.master},metadata={mooncake.metadata}"
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert main(["run", "--model", "tiny-glm5", "--cache", "--l3", spec, "--json", str(one), "--quiet"]) == 0
    capsys.readouterr()
    rc, stdout, stderr = cli_in_a_fresh_process(["run", "--model", "tiny-glm5", "--cache", "--l3", spec,
                                                 "--json", str(two), "--quiet"])
    assert rc == 0, stderr
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert a["hits"][0]["l3"] == 0 and a["l3"]["stored_pages"] == 17
    assert "L3 (store) hit 256 token(s), computed 27 token(s)" in stdout
    assert b["hits"][0] == {"device": 0, "host": 0, "l3": 256, "computed": 27}
    assert b["l3"]["fetched_pages"] == 16 and b["l3"]["store_stats"]["get_failures"] == 0
    np.testing.assert_allclose(b["logits"], a["logits"], rtol=0, atol=ATOL)


def test_a_master_killed_mid_run_leaves_misses_and_one_warning(tiny, caplog):
    """A real master that dies while an engine uses it: its calls fail with a transport error once, then the
    circuit keeps the store off (no ~4 s per call); requests run as misses, L2 keeps working."""
    prompts = tiny[2]
    with mooncake_local.LocalMooncake(segment="16MB") as mc:
        eng = engine(tiny, f"mooncake:{mc.master},metadata={mc.metadata}")
        cold = eng.prefill(prompts)
        assert eng.l3.stats["stored_pages"] == 9
        mc._stop("master")
        eng.evict_device()  # L1 -> L2; the next pass loads back from L2 and asks L3 past it
        eng.tree.evict_host(1 << 62, eng.hicache.evict_host_node)  # and L2 dropped too: every prefix is an L3 miss
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="cpgraph"):
            warm = eng.prefill(prompts)
            again = eng.prefill([prompts[0] + [1, 2, 3]])
        took = time.monotonic() - t0
        off = not eng.l3.store.available
        eng.close()
    assert warm.totals()["l3"] == 0 and warm.totals()["computed"] == sum(map(len, prompts))
    assert again.hits[0]["device"] == 64  # the recomputed pages are cached again in L1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "stopped answering" in warnings[0], warnings
    assert off and took < 30, took
    torch.testing.assert_close(warm.logits, cold.logits, rtol=0, atol=ATOL)
