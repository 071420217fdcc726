"""HiCache L3 under the serving engine (``PrefillEngine``, no HTTP): holes as chunks, and prefetch while queued.

The store is populated once by a ``CacheEngine`` (the tiny model, eager);
each test restores from a copy.  A served request runs other batch shapes
than the cold pass (a cached prefix, chunks), so log-probabilities agree to
``ATOL`` (the same-shape rule, docs/cache.md); the first token exactly.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import sys
import threading

import pytest
import torch

from cpgraph.runtime.l3 import L3Config
from cpgraph.runtime.prefill_engine import PrefillEngine, engine_request
from cpgraph.runtime.scheduler import SchedulerConfig
from cpgraph.runtime.storage import file_store
from cpgraph.runtime.storage.file_store import FileStore

sys.path.insert(0, os.path.dirname(__file__))
from l3_rig import ATOL, PS, FailingGets, build_tiny, counting  # noqa: E402
from l3_rig import engine as cache_engine  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


@pytest.fixture(scope="module")
def stored(tiny, tmp_path_factory):
    """A store populated by one engine, and that engine's cold log-probabilities."""
    root = tmp_path_factory.mktemp("l3")
    eng = cache_engine(tiny, f"file:{root}")
    cold = eng.prefill(tiny[2])
    eng.close()
    return root, torch.log_softmax(cold.logits, -1)


class RecordingSink:
    """A KV transfer target that records which pages each chunk sent."""

    def __init__(self):
        self.sent = []

    def registered(self, room):
        return True

    def send_chunk(self, room, table, page_start, page_end, last, first_token, prompt_len):
        assert (table[page_start:page_end] >= 0).all()  # every page sent exists (one device: all ours)
        self.sent.append((page_start, page_end, last))
        return True

    def bytes_sent(self, room):
        return 0

    def finish(self, room):
        pass

    def abort(self, room):
        pass


def _engine(tiny, store, rows=None, **kw):
    model, forward, _ = tiny
    fwd = counting(forward, rows) if rows is not None else forward
    kw.setdefault("scheduler", SchedulerConfig(token_budget=64))
    return PrefillEngine(fwd, model, num_pages=48, page_size=PS, host_pages=48, l3=store, **kw)


def _check(result, cold_row):
    assert result.status == "finished", result.error
    assert result.token == int(cold_row.argmax())
    assert abs(result.logprob - float(cold_row[result.token])) <= ATOL


def test_a_hole_runs_as_its_own_chunk_and_the_pages_after_it_are_used(tiny, stored, tmp_path):
    root, cold = stored
    shutil.copytree(root, tmp_path / "l3")
    rows, sink = [], RecordingSink()
    store = FailingGets(FileStore(tmp_path / "l3"), {0: {1}})  # page 1 of request 0's pages 0-3 fails
    eng = _engine(tiny, L3Config(store), rows, transfer=sink)
    h = eng.submit(engine_request(tiny[2][0], transfer_room=7))
    eng.run_until_idle()
    r = h.result
    _check(r, cold[0])
    assert r.cached_tokens == {"device": 0, "host": 0, "l3": 48} and r.computed_tokens == 16 + 6
    assert r.chunks == 2 and rows == [16, 6]  # the hole, then the suffix after the restored pages
    # Decode gets every page once, in order: the prefix and the hole, then the restored pages and the suffix.
    assert sink.sent == [(0, 2, False), (2, 5, True)]
    ledger = eng.cache.device.ledger
    assert ledger.used[0] == eng.cache.tree.device_pages_total  # nothing leaked
    assert eng.snapshot()["cached_tokens"]["l3"] == 48


def test_a_cancelled_request_gives_back_its_restored_pages(tiny, stored, tmp_path):
    root, _ = stored
    shutil.copytree(root, tmp_path / "l3")
    store = FailingGets(FileStore(tmp_path / "l3"), {0: {1}})
    eng = _engine(tiny, L3Config(store), scheduler=SchedulerConfig(token_budget=16))  # one page per step
    h = eng.submit(engine_request(tiny[2][0]))
    eng.step()  # admitted: head loaded back, pages 2-3 restored into the request's pages, the hole ran
    assert eng.snapshot()["running"] == 1
    eng.cancel(h)
    eng.step()
    assert h.result.status == "cancelled"
    # Only the cache's pages remain: the head (a load-back stays as cache), not the restored or computed ones.
    assert eng.cache.device.ledger.used[0] == eng.cache.tree.device_pages_total == 1


def test_an_unreachable_store_serves_every_request_as_a_miss(tiny, stored, caplog):
    """A Mooncake master that is down (nothing listens on its port): one warning, every request answered."""
    _, cold = stored
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once the socket is closed
    with caplog.at_level(logging.WARNING, logger="cpgraph"):
        eng = _engine(tiny, f"mooncake:127.0.0.1:{port}")
        handles = [eng.submit(engine_request(p)) for p in tiny[2]]
        eng.run_until_idle()
    for h, row in zip(handles, cold):
        _check(h.result, row)
        assert h.result.cached_tokens["l3"] == 0
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_a_full_disk_stops_writes_and_serving_goes_on(tiny, stored, tmp_path, monkeypatch, caplog):
    _, cold = stored
    writes = []

    def full(fd, buffers, offset):
        writes.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file_store.os, "pwritev", full)
    with caplog.at_level(logging.WARNING, logger="cpgraph"):
        eng = _engine(tiny, f"file:{tmp_path}")
        handles = [eng.submit(engine_request(p)) for p in tiny[2]]
        eng.run_until_idle()
    for h, row in zip(handles, cold):
        _check(h.result, row)
    assert len(writes) == 1 and not eng.cache.l3.store.writable  # the first write failed; the others never tried
    assert eng.cache.l3.stats["stored_pages"] == 0 and eng.cache.l3.stats["store_failed_pages"] > 0
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


class GatedGets(FailingGets):
    """Reads that wait for ``gate`` (set by a forward) and record whether it opened and on which thread."""

    def __init__(self, inner, gate: threading.Event):
        super().__init__(inner, {})
        self.gate, self.waited, self.threads = gate, [], []

    def get(self, keys, parts):
        self.threads.append(threading.current_thread().name)
        self.waited.append(self.gate.wait(10))
        return super().get(keys, parts)


def test_a_queued_request_reads_its_prefix_from_l3_while_another_computes(tiny, stored, tmp_path):
    """Admission prefetch: a request queued behind a running one has its L3 pages read into L2 on the L3 I/O
    thread during the running one's forward; it is admitted once they landed, with its prefix from L3."""
    root, cold = stored
    shutil.copytree(root, tmp_path / "l3")
    forward_ran = threading.Event()
    model, forward, prompts = tiny

    def fwd(ids, meta, mla, index, **kw):
        forward_ran.set()
        return forward(ids, meta, mla, index, **kw)

    store = GatedGets(FileStore(tmp_path / "l3"), forward_ran)
    eng = PrefillEngine(fwd, model, num_pages=48, page_size=PS, host_pages=48, l3=L3Config(store),
                        scheduler=SchedulerConfig(token_budget=16))  # one page per step
    g = torch.Generator().manual_seed(9)
    running = eng.submit(engine_request(torch.randint(0, 512, (64,), generator=g).tolist()))
    eng.step()  # admitted, first of four chunks
    forward_ran.clear()
    queued = eng.submit(engine_request(prompts[0]))
    eng.step()  # L3 phase: the read starts in the background; the running request's chunk runs meanwhile
    assert eng.snapshot()["waiting"] == 1 and store.calls == [4]
    assert store.waited == [True] and store.threads[0].startswith("cpgraph-l3-io")
    eng.run_until_idle()
    _check(queued.result, cold[0])
    assert queued.result.cached_tokens == {"device": 0, "host": 0, "l3": 64} and queued.result.computed_tokens == 6
    assert running.result.status == "finished"
    assert eng.cache.device.ledger.used[0] == eng.cache.tree.device_pages_total


def test_a_cancelled_queued_request_gives_back_its_prefetch(tiny, stored, tmp_path):
    root, _ = stored
    shutil.copytree(root, tmp_path / "l3")
    store = FailingGets(FileStore(tmp_path / "l3"), {0: {1}})  # a hole: pages 2-3 wait outside the tree
    eng = _engine(tiny, L3Config(store), scheduler=SchedulerConfig(token_budget=16))
    g = torch.Generator().manual_seed(9)
    eng.submit(engine_request(torch.randint(0, 512, (64,), generator=g).tolist()))
    eng.step()
    queued = eng.submit(engine_request(tiny[2][0]))
    eng.step()  # prefetch started
    eng.step()  # finished: page 0 attached, pages 2-3 held for the match; not admitted yet (budget)
    assert eng.snapshot()["waiting"] == 1 and eng.cache.hicache.host.ledger.used[0] > 0
    eng.cancel(queued)
    eng.run_until_idle()
    assert queued.result.status == "cancelled" and not eng._prefetches
    host = eng.cache.hicache.host.ledger.used[0]  # only the tree's L2 copies remain
    assert host == sum(n.num_pages for n in eng.cache.tree.nodes() if n.host_pages is not None)
