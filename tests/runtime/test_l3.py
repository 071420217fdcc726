"""HiCache L3 through the cache engine: a second engine (or process) serves the first one's prefixes from the store.

Numerics follow the same-shape rule: a warm pass computes only the rows past
its cached prefix, a cold pass all of them, so their logits are compared
with a tolerance (1e-5 absolute on the fp32 tiny model, the figure the other
cache tests use against the reference); the KV bytes restored from L3 are
compared bitwise with the bytes the first engine stored (a copy must be
exact).  Faults are simulated per test on a copy of one populated store.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import shutil
import socket
import sys
import traceback

import numpy as np
import pytest
import torch

from cpgraph.runtime.cache_engine import CacheEngine
from cpgraph.runtime.hicache import payloads_of
from cpgraph.runtime.l3 import L3Config
from cpgraph.runtime.storage import file_store as fs
from cpgraph.runtime.storage.file_store import FileStore

sys.path.insert(0, os.path.dirname(__file__))
from l3_rig import ATOL, PS, FailingGets, build_tiny, counting, prefix_bytes, same_bytes  # noqa: E402
from l3_rig import prompts as tiny_prompts  # noqa: E402
from l3_rig import engine as _engine  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dist_utils import _context as _fork_server_context  # noqa: E402


def _cli_child(argv: list[str], results) -> None:
    import contextlib
    import io

    from cpgraph.cli import main

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
        results.put((rc, out.getvalue(), err.getvalue()))
    except BaseException:  # noqa: BLE001  (report, never hang the test)
        results.put((-1, out.getvalue(), err.getvalue() + traceback.format_exc()))


def cli_in_a_fresh_process(argv: list[str], timeout: float = 300.0) -> tuple[int, str, str]:
    """``cpgraph ARGV`` in a new process: ``(exit code, stdout, stderr)``.

    The process forks from the suite's fork server (tests/dist_utils.py), so it starts with torch and the model
    code imported (a new interpreter spends seconds importing them) and with none of this process's state: its
    own store client, engine and caches.
    """
    ctx = _fork_server_context()
    results = ctx.Queue()
    proc = ctx.Process(target=_cli_child, args=(argv, results), daemon=True)
    proc.start()
    try:
        return results.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"cpgraph {' '.join(argv)}: no result within {timeout:.0f} s") from None
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


@pytest.fixture(scope="module")
def stored(tiny, tmp_path_factory):
    """A store populated by one engine (page_first L2), with that engine's cold logits and L1 page bytes."""
    root = tmp_path_factory.mktemp("l3")
    eng = _engine(tiny, f"file:{root}", host_layout="page_first")
    prompts = tiny[2]
    cold = eng.prefill(prompts)
    assert cold.totals() == {"device": 0, "host": 0, "l3": 0, "computed": sum(map(len, prompts))}
    limits = [(len(p) - 1) // PS for p in prompts]
    pages = [prefix_bytes(eng, p, n) for p, n in zip(prompts, limits)]
    assert eng.l3.stats["stored_pages"] == 2 + 2 + 1 + 4  # the shared pages once, then each prompt's own
    eng.close()
    return root, cold.logits, pages, limits


def _copy(stored, tmp_path):
    dst = tmp_path / "l3"
    shutil.copytree(stored[0], dst)
    return dst


def test_second_engine_restores_prefixes_from_l3(tiny, stored, tmp_path):
    _, cold, pages, limits = stored
    prompts = tiny[2]
    eng = _engine(tiny, f"file:{_copy(stored, tmp_path)}")  # the other L2 layout reads the same objects
    warm = eng.prefill(prompts)
    # request 0 fetches the shared pages and its own; the others find the shared pages in L1 by then
    assert [h["l3"] for h in warm.hits] == [64, 16, 48]
    assert [h["device"] for h in warm.hits] == [0, 32, 32]
    assert [h["computed"] for h in warm.hits] == [6, 1, 16]
    torch.testing.assert_close(warm.logits, cold, rtol=0, atol=ATOL)
    for p, n, want in zip(prompts, limits, pages):  # the restored KV bytes are the stored ones, bitwise
        assert same_bytes(prefix_bytes(eng, p, n), want)
    assert eng.l3.stats["fetched_pages"] == 8 and eng.l3.store.stats["get_failures"] == 0
    again = eng.prefill(prompts)
    assert again.totals()["l3"] == 0 and again.totals()["device"] == 64 + 48 + 80
    assert torch.equal(again.logits, warm.logits)  # the same shapes as the warm pass: bitwise by construction


def test_other_weights_never_read_the_pages(tiny, stored, tmp_path):
    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout

    other = from_pretrained("tiny-glm5", seed=1).eval()
    layout = make_layout(other, "bf16", PS)
    eng = CacheEngine(lambda i, m, a, b, **kw: other(i, m, a, b, layout, **kw), other, num_pages=48, page_size=PS,
                      host_pages=48, l3=f"file:{_copy(stored, tmp_path)}")
    res = eng.prefill(tiny[2])
    assert res.totals()["l3"] == 0 and eng.l3.stats["lookup_pages"] > 0
    assert eng.l3.store.stats["get_pages"] == 0


def _page_bytes(eng, pages):
    views = [v for _, v in payloads_of(eng.pool)]
    return [[v[int(p)].clone() for v in views] for p in pages]


@pytest.mark.bitexact  # the hole and the suffix compute fewer rows per GEMM than the cold pass (docs/bitwise.md)
def test_failed_pages_in_the_middle_are_the_only_ones_recomputed(tiny, tmp_path):
    """A batch get that fails partway: the pages after a failed one are still used; only the failed ones run.

    Cold engine and restoring engines in one test, under fixed-order matrix
    products, so the warm logits and the recomputed pages equal the cold
    ones bit for bit; the restored pages are copies (bitwise in any mode).
    """
    model, forward, prompts = tiny
    cold_eng = _engine(tiny, f"file:{tmp_path / 'l3'}")
    cold = cold_eng.prefill(prompts)
    limits = [(len(p) - 1) // PS for p in prompts]
    want = [prefix_bytes(cold_eng, p, n) for p, n in zip(prompts, limits)]
    cold_eng.close()

    # A batch of three: request 0 reads pages 0-3 and loses page 1 (shared with the others); request 1 then
    # reads pages 1-2 itself; request 2 finds 0-1 in L1, reads 2-4 and loses page 3.
    shutil.copytree(tmp_path / "l3", tmp_path / "a")
    rows = []
    store = FailingGets(FileStore(tmp_path / "a"), {0: {1}, 2: {1}})
    eng = CacheEngine(counting(forward, rows), model, num_pages=48, page_size=PS, host_pages=48, l3=L3Config(store))
    warm = eng.prefill(prompts)
    assert store.calls == [4, 2, 3]
    assert warm.hits == [{"device": 0, "host": 0, "l3": 48, "computed": 16 + 6},
                         {"device": 16, "host": 0, "l3": 32, "computed": 1},
                         {"device": 32, "host": 0, "l3": 32, "computed": 16 + 16}]
    assert rows == [16 + 16, 6 + 1 + 16]  # one pass over the two holes, then the three suffixes
    assert eng.l3.stats["fetched_pages"] == 7 and eng.l3.stats["fetch_failed_pages"] == 2
    assert torch.equal(warm.logits, cold.logits)
    for p, n, w in zip(prompts, limits, want):
        assert same_bytes(prefix_bytes(eng, p, n), w)  # restored: copies; recomputed: the same rows
    # No page leaked: L1 holds exactly the tree's pages; L2 only the nodes' copies (write_through).
    assert eng.device.ledger.used[0] == eng.tree.device_pages_total
    assert eng.hicache.host.ledger.used[0] == sum(n.num_pages for n in eng.tree.nodes() if n.host_pages is not None)

    # One request with two holes: pages 1 and 3 of 0-4 lost; two hole passes, each over the pages before it.
    shutil.copytree(tmp_path / "l3", tmp_path / "b")
    rows.clear()
    store = FailingGets(FileStore(tmp_path / "b"), {0: {1, 3}})
    eng = CacheEngine(counting(forward, rows), model, num_pages=48, page_size=PS, host_pages=48, l3=L3Config(store))
    res = eng.prefill(prompts[2:])
    assert res.hits == [{"device": 0, "host": 0, "l3": 48, "computed": 16 + 16 + 16}] and rows == [16, 16, 16]
    assert torch.equal(res.logits, cold.logits[2:])
    assert same_bytes(prefix_bytes(eng, prompts[2], 5), want[2])
    # A last page that fails is no hole: the suffix computation covers it.
    shutil.copytree(tmp_path / "l3", tmp_path / "c")
    rows.clear()
    store = FailingGets(FileStore(tmp_path / "c"), {0: {4}})
    eng = CacheEngine(counting(forward, rows), model, num_pages=48, page_size=PS, host_pages=48, l3=L3Config(store))
    res = eng.prefill(prompts[2:])
    assert res.hits[0]["l3"] == 64 and rows == [32]
    assert torch.equal(res.logits, cold.logits[2:])


def test_a_hole_with_no_room_to_restore_after_it_computes_from_the_prefix(tiny, stored, tmp_path):
    """The pages after a hole need L1 pages of their own; without them the request computes past its prefix."""
    _, cold, _, _ = stored
    store = FailingGets(FileStore(_copy(stored, tmp_path)), {0: {1}})
    eng = _engine(tiny, L3Config(store))
    real, calls = eng.hicache.load_pages, []

    def second_fails(host_pages, owners):  # the head's load-back, then the tail's: e.g. a lane short after eviction
        calls.append(len(owners))
        return real(host_pages, owners) if len(calls) == 1 else None

    eng.hicache.load_pages = second_fails
    res = eng.prefill(tiny[2][:1])
    assert calls == [1, 2] and res.hits[0] == {"device": 0, "host": 0, "l3": 16, "computed": 54}
    assert eng.hicache.host.ledger.used[0] == sum(n.num_pages for n in eng.tree.nodes() if n.host_pages is not None)
    torch.testing.assert_close(res.logits, cold[:1], rtol=0, atol=ATOL)


def test_corrupt_object_is_recomputed_and_logged_once(tiny, stored, tmp_path, caplog):
    _, cold, _, _ = stored
    root = _copy(stored, tmp_path)
    probe = _engine(tiny, f"file:{root}")
    digests = probe.l3.chain(tiny[2][0], 4)
    path = probe.l3.store.path(probe.l3.key(digests[1], 0))  # request 0's second page
    raw = bytearray(path.read_bytes())
    raw[fs.HEADER_BYTES + 3] ^= 1
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="cpgraph"):
        res = probe.prefill(tiny[2][:1])
    assert res.hits[0]["l3"] == 48 and res.hits[0]["computed"] == 16 + 6  # only the corrupt page is recomputed
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "failed verification (checksum mismatch)" in warnings[0]
    torch.testing.assert_close(res.logits, cold[:1], rtol=0, atol=ATOL)
    # write-through stored the recomputed pages again: a third engine gets the whole prefix
    assert path.exists()
    third = _engine(tiny, f"file:{root}").prefill(tiny[2][:1])
    assert third.hits[0]["l3"] == 64


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_unreachable_store_serves_as_misses(tiny, stored, caplog):
    """A Mooncake master that is down (nothing listens): misses, one warning, L2 unaffected.

    (An unusable directory is the file store's equivalent: test_l3_storage.py.)
    """
    _, cold, _, _ = stored
    with caplog.at_level(logging.WARNING, logger="cpgraph"):
        eng = _engine(tiny, f"mooncake:127.0.0.1:{_closed_port()}")
        first = eng.prefill(tiny[2])
        eng.evict_device()
        second = eng.prefill(tiny[2])  # L2 still works
    assert first.totals()["l3"] == 0 and second.totals()["host"] > 0
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    torch.testing.assert_close(first.logits, cold, rtol=0, atol=ATOL)


def test_full_disk_stops_writes_serving_goes_on(tiny, tmp_path, monkeypatch, caplog):
    writes = []

    def full(fd, buffers, offset):
        writes.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs.os, "pwritev", full)
    eng = _engine(tiny, f"file:{tmp_path}")
    with caplog.at_level(logging.WARNING, logger="cpgraph"):
        eng.prefill(tiny[2][:1])
        eng.prefill(tiny[2][1:])
    assert len(writes) == 1 and not eng.l3.store.writable
    assert eng.l3.stats["stored_pages"] == 0 and eng.l3.stats["store_failed_pages"] > 0
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_write_back_stores_when_l2_drops_a_node_and_at_flush(tiny, tmp_path):
    prompts = tiny[2]
    eng = _engine(tiny, f"file:{tmp_path},policy=write_back", host_pages=5)
    assert eng.l3.write_policy == "write_back"
    eng.prefill(prompts[:1])  # 4 pages in L1 and (L2 write_through) in L2; nothing in L3 yet
    eng.prefill(prompts[2:])  # 4 new pages that do not fit the 5-page L2: not backed up
    assert eng.l3.stats["stored_pages"] == 0
    eng.evict_device()  # backing L1 up makes L2 drop its least recently used leaves: stored before they go
    assert eng.l3.stats["stored_pages"] > 0
    assert eng.flush_l3() > 0 and eng.flush_l3() == 0  # flush stores every L2 copy not yet in L3, once
    fresh = _engine(tiny, f"file:{tmp_path}")
    assert fresh.prefill(prompts[:1]).hits[0]["l3"] > 0


def test_l2_too_small_for_the_run_fetches_what_fits(tiny, stored, tmp_path):
    _, cold, _, _ = stored
    eng = _engine(tiny, f"file:{_copy(stored, tmp_path)}", host_pages=2)
    res = eng.prefill(tiny[2][:1])  # 4 pages in L3, room for 2 in L2
    assert res.hits[0] == {"device": 0, "host": 0, "l3": 32, "computed": 38}
    torch.testing.assert_close(res.logits, cold[:1], rtol=0, atol=ATOL)


def test_prefetch_fills_l2_before_admission(tiny, stored, tmp_path):
    eng = _engine(tiny, f"file:{_copy(stored, tmp_path)}")
    assert eng.prefetch([tiny[2][0], list(range(20))]) == [64, 0]
    assert eng.prefetch([tiny[2][0]]) == [0]  # already in L2: nothing more to fetch
    res = eng.prefill(tiny[2][:1])
    assert res.hits[0] == {"device": 0, "host": 64, "l3": 0, "computed": 6}


def test_engine_refuses_l3_without_l2(tiny, tmp_path):
    with pytest.raises(ValueError, match="host_pages > 0"):
        _engine(tiny, f"file:{tmp_path}", host_pages=0)


def test_draft_pages_are_keyed_by_their_continuation(tmp_path):
    """With the MTP draft layer a page's last draft row depends on the next token: another continuation misses it."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
    import mtp_reference as ref

    model = ref.build()

    def forward(ids, meta, mla, index, **kw):
        return model(ids, meta, mla, index, **kw)

    draft = model.draft_module()
    g = torch.Generator().manual_seed(3)
    vocab = ref.CONFIG["vocab_size"]
    head = torch.randint(0, vocab, (2 * ref.PAGE,), generator=g).tolist()
    a = head + [1] + torch.randint(0, vocab, (5,), generator=g).tolist()
    b = head + [2] + torch.randint(0, vocab, (5,), generator=g).tolist()

    def engine():
        return CacheEngine(forward, model, num_pages=24, page_size=ref.PAGE, host_pages=24, draft=draft,
                           l3=f"file:{tmp_path}")

    first = engine().prefill([a])
    warm = engine().prefill([a])
    assert warm.hits[0]["l3"] == 2 * ref.PAGE
    torch.testing.assert_close(warm.draft_logits, first.draft_logits, rtol=0, atol=1e-6)
    other = engine().prefill([b])  # page 1's continuation differs: only page 0 may come from L3
    assert other.hits[0]["l3"] == ref.PAGE
    # A hole under the draft: the hole pass runs the draft too (its last row takes the next page's first token).
    c = head + torch.randint(0, vocab, (2 * ref.PAGE + 3,), generator=g).tolist()
    cold = engine().prefill([c])
    rows = []
    holed = CacheEngine(counting(forward, rows), model, num_pages=24, page_size=ref.PAGE, host_pages=24, draft=draft,
                        l3=L3Config(FailingGets(FileStore(tmp_path), {0: {2}})))
    res = holed.prefill([c])  # pages 0-3 in L3, page 2 lost
    assert res.hits[0] == {"device": 0, "host": 0, "l3": 3 * ref.PAGE, "computed": ref.PAGE + 3}
    assert rows == [ref.PAGE, 3]
    torch.testing.assert_close(res.logits, cold.logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(res.draft_logits, cold.draft_logits, rtol=0, atol=ATOL)


@pytest.mark.slow
def test_cli_second_process_serves_the_first_ones_prefix(tmp_path, capsys):
    """``cpgraph run --cache --l3 file:DIR`` twice: here, then in a fresh process; tiers printed and in --json."""
    from cpgraph.cli import main

    spec = f"file:{tmp_path / 'l3'}"
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert main(["run", "--model", "tiny-glm5", "--cache", "--l3", spec, "--json", str(one), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "pass 1: L1 (device) hit 0 token(s), L2 (host) hit 0 token(s), L3 (store) hit 0 token(s)" in out
    rc, stdout, stderr = cli_in_a_fresh_process(["run", "--model", "tiny-glm5", "--cache", "--l3", spec,
                                                 "--json", str(two), "--quiet"])
    assert rc == 0, stderr
    assert "pass 1: L1 (device) hit 0 token(s), L2 (host) hit 0 token(s), L3 (store) hit 256 token(s), " \
           "computed 27 token(s)" in stdout
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert b["hits"][0] == {"device": 0, "host": 0, "l3": 256, "computed": 27}
    assert b["l3"]["fetched_pages"] == 16 and a["l3"]["stored_pages"] == 17  # every whole page; an exact hit
    # (the 16-token prompt of one page) is limited to (len - 1) // page_size pages, so one page is never fetched
    np.testing.assert_allclose(b["logits"], a["logits"], rtol=0, atol=ATOL)  # warm (L3) vs cold, other shapes
    assert main(["run", "--model", "tiny-glm5", "--l3", spec, "--quiet"]) == 2
    assert "--l3 applies to --cache runs" in capsys.readouterr().err
    assert main(["run", "--model", "tiny-glm5", "--cache", "--l3", "s3:bucket", "--quiet"]) == 2
    assert "expected file:DIR or mooncake:HOST:PORT" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned L2, side-stream load-back)")
@pytest.mark.parametrize("layout", ["layer_page_first", "page_first"])
def test_gpu_restore_through_pinned_l2(tmp_path, layout):
    """On CUDA: pages come from L3 into pinned L2 rows, then back to the device per layer on the side stream."""
    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout

    model = from_pretrained("tiny-glm5", device="cuda").eval()
    layout_kv = make_layout(model, "bf16", PS)
    tiny = (model, lambda i, m, a, b, **kw: model(i, m, a, b, layout_kv, **kw), tiny_prompts())
    prompts = tiny[2]
    first = _engine(tiny, f"file:{tmp_path}", host_layout=layout)
    cold = first.prefill(prompts)
    limits = [(len(p) - 1) // PS for p in prompts]
    want = [prefix_bytes(first, p, n) for p, n in zip(prompts, limits)]
    assert first.hicache.host.tensors()[0].is_pinned()
    second = _engine(tiny, f"file:{tmp_path}", host_layout=layout)
    warm = second.prefill(prompts)
    assert [h["l3"] for h in warm.hits] == [64, 16, 48]
    torch.testing.assert_close(warm.logits, cold.logits, rtol=0, atol=1e-4)
    for p, n, w in zip(prompts, limits, want):
        assert same_bytes(prefix_bytes(second, p, n), w)
