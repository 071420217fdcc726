"""HiCache L3 on a real Mooncake Store: master, metadata server and a segment holder started here, on loopback.

The processes come from the Mooncake wheel (``mooncake_master``,
``mooncake.http_metadata_server``, ``mooncake_client``) via
:class:`cpgraph.runtime.storage.mooncake_local.LocalMooncake`; the module
is skipped, with the reason, only where Mooncake is not installed.  A master
that stops answering mid-run is simulated by the transport error code a dead
master returns (``RPC_FAIL``, -900: measured with a killed master, each such
call takes ~4 s, too slow to repeat in tests).  A master that is down before
a store connects (nothing listens on its port) is
``test_l3.py::test_unreachable_store_serves_as_misses``.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

from cpgraph.runtime.storage import MooncakeStore, page_key
from cpgraph.runtime.storage import mooncake_local
from cpgraph.runtime.storage.mooncake_store import RPC_FAIL

sys.path.insert(0, os.path.dirname(__file__))
from l3_rig import ATOL, build_tiny, engine, prefix_bytes, same_bytes  # noqa: E402

_MISSING = mooncake_local.missing()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")]


@pytest.fixture(scope="module")
def mooncake():
    with mooncake_local.LocalMooncake(segment="64MB") as mc:
        yield mc


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


def test_second_engine_restores_from_mooncake(mooncake):
    tiny = build_tiny()
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
