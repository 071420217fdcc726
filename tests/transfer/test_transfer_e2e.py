"""Mooncake loopback transfer: byte identity, decode step, faults (dead peer, kill, abort, fingerprint)."""

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cpgraph.transfer.engine import mooncake_available

if not mooncake_available():
    pytest.skip("the Mooncake transfer engine is not installed", allow_module_level=True)

from cpgraph.models import from_pretrained  # noqa: E402
from cpgraph.models.batch import build_batch  # noqa: E402
from cpgraph.models.prefill import make_layout, prefill_logits  # noqa: E402
from cpgraph.plan import plan_prefill  # noqa: E402
from cpgraph.runtime.engine import pool_config  # noqa: E402
from cpgraph.runtime.kv_pool import KVPool, KVPoolConfig  # noqa: E402
from cpgraph.transfer import (DecodeSide, PrefillPeer, RoomStatus, TransferRefused, attach_layer_hooks,  # noqa: E402
                              decode_meta, decode_step, make_pool, prefill_and_send)
from cpgraph.transfer.driver import plan_passes  # noqa: E402
from cpgraph.transfer.sender import AUX_BYTES, RoomTarget  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import _context as _fork_server_context  # noqa: E402

PS = 16


@pytest.fixture(scope="module")
def model():
    m = from_pretrained("tiny-glm5").eval()
    m.kv_layout = make_layout(m, "bf16", PS)
    return m


def _prompts(vocab, lens, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _fwd(model):
    return lambda ids, meta, mla, index: model(ids, meta, mla, index, model.kv_layout)


def _pages(pool, table, n, layer):
    t = pool.mla[layer]
    return t.view(-1, PS, t.shape[1])[list(table[:n])]


def _index_pages(pool, table, n, layer):
    t = pool.index_k[layer]
    return t.view(-1, PS, t.shape[1])[list(table[:n])]


def _assert_same_logical(model, pool_a, tables_a, pool_b, tables_b, lens):
    for i, n_tok in enumerate(lens):
        n = -(-n_tok // PS)
        for layer in range(model.config.num_hidden_layers):
            assert torch.equal(_pages(pool_a, tables_a[i], n, layer), _pages(pool_b, tables_b[i], n, layer)), (i, layer)
        for layer in model.config.indexer_layers:
            assert torch.equal(_index_pages(pool_a, tables_a[i], n, layer), _index_pages(pool_b, tables_b[i], n, layer))


@pytest.mark.parametrize("chunk,prefix,overlap", [(None, [0, 0], True), (32, [16, 32], True), (16, [0, 48], False)])
def test_cp1_transfer_and_decode(model, chunk, prefix, overlap):
    prompts = _prompts(model.config.vocab_size, (40, 70))
    dec = DecodeSide(KVPool(pool_config(model, "bf16", PS, 16, 0)))
    pool = make_pool(model, prompts, prefix_lens=prefix, chunk_tokens=chunk, page_size=PS)
    peer = PrefillPeer(pool, 0, group=2)
    hooks = attach_layer_hooks(model, peer.manager, pool) if overlap else []
    try:
        tabs = [dec.open_room(r, len(p), [peer.address]) for r, p in enumerate(prompts)]
        res = prefill_and_send(_fwd(model), model, prompts, prefix_lens=prefix, chunk_tokens=chunk, page_size=PS,
                               pool=pool, peer=peer, rooms=[0, 1], overlap=overlap)
        assert [dec.wait(r, 10) for r in range(2)] == [RoomStatus.SUCCESS] * 2
        _assert_same_logical(model, pool, res.tables, dec.pool, tabs, [len(p) for p in prompts])
        toks = [dec.first_token(r) for r in range(2)]
        assert toks == [int(res.logits[i].argmax()) for i in range(2)]
        for r, p in enumerate(prompts):  # bytes actually sent: every page once (chunks never overlap) + aux
            assert peer.sender.metric(r).bytes_sent == -(-len(p) // PS) * pool.bytes_per_page() + AUX_BYTES
        sends = peer.layers_per_layer + peer.layers_after_forward  # eager hooks: every layer went per layer
        assert sends > 0 and (peer.layers_after_forward == 0 if overlap else peer.layers_per_layer == 0)
        got = decode_step(model, model.kv_layout, dec.pool, toks, [len(p) for p in prompts], tabs)
        ref = prefill_logits(model, [p + [t] for p, t in zip(prompts, toks)])
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    finally:
        for h in hooks:
            h.remove()
        peer.close(), dec.close()


def test_cp2_owned_pages_byte_identical_to_single_device(model):
    """Two CP 'ranks' send only their owned pages, chunk by chunk with absolute positions; decode == one device."""
    prompts = _prompts(model.config.vocab_size, (70, 50), seed=5)
    prefix, chunk = [16, 0], 32
    single = prefill_and_send(_fwd(model), model, prompts, prefix_lens=prefix, chunk_tokens=chunk, page_size=PS)
    lists, passes, _, _, owners = plan_passes(prompts, prefix, chunk, PS, 2, model.config.vocab_size)
    dec = DecodeSide(KVPool(pool_config(model, "bf16", PS, 16, 0)))
    peers = []
    try:
        for rank in range(2):
            pool = KVPool(pool_config(model, "bf16", PS, sum(o.count(rank) for o in owners), rank))
            tables = [pool.alloc_pages_with_owners(o) for o in owners]
            for i, t in enumerate(tables):  # this rank's pages hold what the single device computed
                for pos, page in enumerate(t):
                    if page >= 0:
                        src = single.tables[i][pos]
                        for a, b in zip(pool.mla + list(pool.index_k.values()),
                                        single.pool.mla + list(single.pool.index_k.values())):
                            a.view(-1, PS, a.shape[-1])[page] = b.view(-1, PS, b.shape[-1])[src]
            peers.append((PrefillPeer(pool, rank), tables))
        tabs = [dec.open_room(r, len(p), [pe.address for pe, _ in peers]) for r, p in enumerate(prompts)]
        for p in passes[1:]:  # the chunk passes (pass 0 is the cached prefix)
            for i, s, e in zip(p.requests, p.starts, p.ends):
                first = 0 if s == prefix[i] else s // PS
                for pe, tables in peers:
                    ch = pe.begin_chunk(i, tables[i], first, -(-e // PS), last=e == len(lists[i]), overlap=False)
                    pe.end_chunk(ch, first_token=7, prompt_len=len(lists[i]))
        assert [dec.wait(r, 10) for r in range(2)] == [RoomStatus.SUCCESS] * 2
        _assert_same_logical(model, single.pool, single.tables, dec.pool, tabs, [len(p) for p in prompts])
        sent = sum(pe.sender.metric(r).bytes_sent for pe, _ in peers for r in range(2))
        assert sent == sum(len(o) for o in owners) * single.pool.bytes_per_page() + 2 * AUX_BYTES
    finally:
        for pe, _ in peers:
            pe.close()
        dec.close()


def test_decode_meta_matches_build_batch(model):
    prompts = _prompts(model.config.vocab_size, (32, 48), seed=9)
    lens = [len(p) for p in prompts]
    res = prefill_and_send(_fwd(model), model, prompts, page_size=PS)
    pool = KVPool(pool_config(model, "bf16", PS, 8, 0))
    tables = [pool.alloc_pages_with_owners([0] * (n // PS + 1)) for n in lens]
    for i, n in enumerate(lens):
        for a, b in zip(pool.mla, res.pool.mla):
            a.view(-1, PS, a.shape[-1])[tables[i][: n // PS]] = b.view(-1, PS, b.shape[-1])[res.tables[i][: n // PS]]
        for a, b in zip(pool.index_k.values(), res.pool.index_k.values()):
            a.view(-1, PS, a.shape[-1])[tables[i][: n // PS]] = b.view(-1, PS, b.shape[-1])[res.tables[i][: n // PS]]
    toks = [3, 5]
    got = decode_step(model, model.kv_layout, pool, toks, lens, tables)
    ids, meta = build_batch(plan_prefill(lens, [1, 1], cp_size=1, page_size=PS), [[t] for t in toks], tables)
    ref = model(ids, meta, pool.mla, [pool.index_pool(i) for i in model.config.indexer_layers], model.kv_layout).logits
    assert torch.equal(got, ref)
    with pytest.raises(ValueError, match="does not cover"):
        decode_meta([40], [[0, 1]], PS)


def test_fingerprint_mismatch_refused(model):
    prompts = _prompts(model.config.vocab_size, (20,))
    pool = make_pool(model, prompts, page_size=PS)
    peer = PrefillPeer(pool, 0)
    dec = DecodeSide(KVPool(pool_config(model, "bf16", 2 * PS, 4, 0)))  # other page size
    try:
        free = dec.pool.num_free
        with pytest.raises(TransferRefused, match="fingerprint mismatch"):
            dec.open_room(0, 20, [peer.address])
        assert dec.pool.num_free == free and 0 not in peer.targets
    finally:
        peer.close(), dec.close()


def test_dead_and_unregistered_peers_fail_not_crash(model):
    prompts = _prompts(model.config.vocab_size, (40,))
    pool = make_pool(model, prompts, page_size=PS)
    peer = PrefillPeer(pool, 0, timeout=2)
    dec = DecodeSide(KVPool(pool_config(model, "bf16", PS, 8, 0)), timeout=1)
    try:
        res = prefill_and_send(_fwd(model), model, prompts, page_size=PS)  # fill pages to send
        table = res.tables[0]
        lay = dec.layout
        # unregistered remote memory: a target whose addresses no buffer covers
        from dataclasses import replace

        bogus = replace(lay, mla_ptrs=tuple(p + (1 << 40) for p in lay.mla_ptrs))
        peer.targets[5] = RoomTarget(5, dec.engine.session_id, bogus, np.arange(4), dec.aux[5].data_ptr(), AUX_BYTES)
        ch = peer.begin_chunk(5, table, 0, 3, last=True, overlap=False)
        assert peer.end_chunk(ch, first_token=1) == RoomStatus.FAILED
        # dead peer: nothing listens on the session
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"
        peer.targets[6] = RoomTarget(6, dead, lay, np.arange(4), 1, AUX_BYTES)
        ch = peer.begin_chunk(6, table, 0, 3, last=True, overlap=True)
        assert peer.end_chunk(ch, first_token=1) == RoomStatus.FAILED
        # decode polling a dead control address: Failed within the timeout
        dec.rooms[9] = {"table": [], "peers": [dead], "len": 1, "secret": "0" * 32}
        t0 = time.monotonic()
        assert dec.wait(9, 2) == RoomStatus.FAILED and time.monotonic() - t0 < 5
        # prefill whose decode never registers: Failed after the register timeout, no hang
        assert not peer.wait_registered(11, timeout=0.2) and peer.statuses.failed(11)
    finally:
        peer.close(), dec.close()


def test_abort_acked_room_failed_no_later_chunk(model):
    prompts = _prompts(model.config.vocab_size, (70,))
    pool = make_pool(model, prompts, chunk_tokens=32, page_size=PS)
    peer = PrefillPeer(pool, 0)
    dec = DecodeSide(KVPool(pool_config(model, "bf16", PS, 8, 0)))
    try:
        dec.open_room(0, 70, [peer.address])
        free_before = dec.pool.num_free
        sent = []

        def on_pass(p):
            sent.append(peer.sender.metric(0).bytes_sent)
            if len(sent) == 1:
                assert dec.abort(0)  # ABORT -> ACK after the first chunk
        prefill_and_send(_fwd(model), model, prompts, chunk_tokens=32, page_size=PS, pool=pool, peer=peer,
                         rooms=[0], on_pass=on_pass)
        assert peer.statuses.failed(0) and dec.statuses.failed(0)
        assert sent[0] > 0 and sent[1:] == [sent[0]] * (len(sent) - 1)  # nothing written after the abort
        assert dec.pool.num_free == free_before + 5  # decode freed its pages after the ACK
    finally:
        peer.close(), dec.close()


def decode_child(prefill_address: str, ready) -> None:
    """A decode process that registers one room of 1024 pages with the prefill peer, then waits to be killed."""
    os.environ["MC_LOG_LEVEL"] = "ERROR"  # before Mooncake loads in this process
    cfg = KVPoolConfig(num_layers=4, page_size=16, num_pages=1024, kv_lora_rank=480, qk_rope_dim=32,
                       index_head_dim=64, index_layers=[0, 2], dtype=torch.float32)
    dec = DecodeSide(KVPool(cfg))
    dec.open_room(0, 1024 * 16 - 1, [prefill_address])
    ready.put("registered")
    time.sleep(60)


def test_decode_killed_mid_transfer(tmp_path):
    cfg = KVPoolConfig(num_layers=4, page_size=16, num_pages=1024, kv_lora_rank=480, qk_rope_dim=32,
                       index_head_dim=64, index_layers=[0, 2], dtype=torch.float32)
    pool = KVPool(cfg)  # 4 x 32 MiB MLA + index: ~136 MiB to send, in 256 KiB batches
    peer = PrefillPeer(pool, 0, max_batch_bytes=256 << 10, timeout=10)
    # A process of its own (forked from the suite's fork server: torch comes imported), killed with SIGKILL.
    ctx = _fork_server_context()
    ready = ctx.Queue()
    child = ctx.Process(target=decode_child, args=(peer.address, ready), daemon=True)
    child.start()
    try:
        assert ready.get(timeout=120) == "registered"
        table = pool.alloc_pages_with_owners([0] * 1024)
        ch = peer.begin_chunk(0, table, 0, 1024, last=True, overlap=False)
        out = {}
        th = threading.Thread(target=lambda: out.update(st=peer.end_chunk(ch, first_token=1)), daemon=True)
        t0 = time.monotonic()
        th.start()
        while peer.sender.metric(0).bytes_sent < (1 << 20) and time.monotonic() - t0 < 20:
            time.sleep(0.001)
        child.kill()
        child.join(timeout=10)
        assert child.exitcode == -9
        th.join(timeout=15)
        assert not th.is_alive(), "sender hung after decode died"
        assert out["st"] == RoomStatus.FAILED and peer.statuses.failed(0)
        assert 0 < peer.sender.metric(0).bytes_sent < sum(t.nbytes for t in pool.mla)
        assert pool.num_free == 0  # pages still held: the caller frees only after release() drained
        assert peer.release(0)
        pool.free(table)
        assert pool.num_free == 1024
    finally:
        child.kill()
        peer.close()
