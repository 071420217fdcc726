"""Hostile or careless control-channel clients: room ownership, secrets, page checks, bounds, bind addresses.

Every test uses tiny pools and short timeouts; loops are bounded and sockets close by themselves.
"""

import json
import socket
import struct
import threading
import time

import numpy as np
import pytest
import torch

from cpgraph.transfer.engine import mooncake_available

if not mooncake_available():
    pytest.skip("the Mooncake transfer engine is not installed", allow_module_level=True)

from cpgraph.runtime.kv_pool import KVPool, KVPoolConfig  # noqa: E402
from cpgraph.transfer import DecodeSide, PrefillPeer, RoomStatus, TransferRefused  # noqa: E402
from cpgraph.transfer.control import ControlServer, request  # noqa: E402
from cpgraph.transfer.engine import MooncakeEngine, listening_sockets  # noqa: E402
from cpgraph.transfer.frames import FrameError, decode_body, encode  # noqa: E402

PS = 16


def _cfg(num_pages=16, page_size=PS):
    return KVPoolConfig(num_layers=2, page_size=page_size, num_pages=num_pages, kv_lora_rank=32, qk_rope_dim=16,
                        index_head_dim=16, index_layers=[0], dtype=torch.float32)


def _filled_pool(num_pages=16, seed=0):
    pool = KVPool(_cfg(num_pages))
    g = torch.Generator().manual_seed(seed)
    for t in pool.mla + list(pool.index_k.values()):
        t.copy_(torch.rand(t.shape, generator=g) + 1.0)  # never zero: a page left unwritten shows as zeros
    return pool


@pytest.fixture(scope="module")
def pair():
    peer = PrefillPeer(_filled_pool(), 0, timeout=5, frame_timeout=2)
    dec = DecodeSide(KVPool(_cfg(32)), max_rooms=64, timeout=2)
    yield peer, dec
    peer.close(), dec.close()


def _register_msg(dec, room, prompt_len, dst_pages, secret="ab" * 16, **over):
    lay = dec.layout
    msg = {"type": "REGISTER", "room": room, "secret": secret, "session": dec.engine.session_id,
           "fingerprint": lay.fingerprint, "page_size": lay.page_size, "mla_ptrs": list(lay.mla_ptrs),
           "mla_page_bytes": lay.mla_page_bytes, "index_layers": list(lay.index_layers),
           "index_ptrs": list(lay.index_ptrs), "index_page_bytes": lay.index_page_bytes,
           "num_pages": dec.pool.config.num_pages, "prompt_len": prompt_len, "dst_pages": list(dst_pages),
           "aux_ptr": dec.aux[room].data_ptr(), "aux_bytes": 32}
    msg.update(over)
    return msg


def _send_room(peer, room, n_pages):
    """Prefill side: send ``n_pages`` pages of the (pre-filled) pool for ``room`` in one chunk."""
    table = list(range(n_pages))
    ch = peer.begin_chunk(room, table, 0, n_pages, last=True, overlap=False)
    return peer.end_chunk(ch, first_token=5, prompt_len=n_pages * PS - 3), table


def _same_pages(peer, src_table, dec, dst_table):
    return all(torch.equal(a.view(-1, PS, a.shape[-1])[src_table], b.view(-1, PS, b.shape[-1])[dst_table])
               for a, b in zip(peer.pool.mla, dec.pool.mla))


# ---------------------------------------------------------------------------------------- ownership


def test_second_register_cannot_hijack_a_room(pair):
    peer, dec = pair
    table = dec.open_room(1, 2 * PS - 3, [peer.address])
    thief = _register_msg(dec, 1, 2 * PS - 3, [10, 11], secret="cd" * 16)  # same room, pages of the thief's choice
    reply = request(peer.address, thief, timeout=2)
    assert reply["type"] == "REFUSED" and "already registered" in reply["reason"]
    assert peer.targets[1].dst_pages.tolist() == table and peer.refused_registers >= 1
    st, src = _send_room(peer, 1, 2)
    assert st == RoomStatus.SUCCESS and dec.wait(1, 5) == RoomStatus.SUCCESS
    assert _same_pages(peer, src, dec, table[:2])  # the real decode got the KV, not zeros
    dec.release(1)


def test_identical_resend_is_idempotent_other_secret_is_not(pair):
    peer, dec = pair
    pages = dec.pool.alloc_pages_with_owners([0, 0])
    msg = _register_msg(dec, 2, PS, pages, secret="12" * 16)
    assert request(peer.address, msg, timeout=2)["type"] == "REGISTER_OK"
    assert request(peer.address, msg, timeout=2)["type"] == "REGISTER_OK"  # a resend after a lost reply
    other = dict(msg, secret="34" * 16)
    assert request(peer.address, other, timeout=2)["type"] == "REFUSED"
    moved = dict(msg, dst_pages=pages[::-1])
    assert request(peer.address, moved, timeout=2)["type"] == "REFUSED"
    assert peer.targets[2].secret == "12" * 16 and peer.targets[2].dst_pages.tolist() == pages
    dec.pool.free(pages)


def test_stranger_cannot_abort_poll_or_prefail_rooms(pair):
    peer, dec = pair
    dec.open_room(3, PS, [peer.address])
    wrong = "ee" * 16
    for kind in ("ABORT", "POLL"):
        reply = request(peer.address, {"type": kind, "room": 3, "secret": wrong}, timeout=2)
        assert reply["type"] == "REFUSED" and "wrong secret" in reply["reason"]
    assert peer.statuses.get(3) == RoomStatus.WAITING
    # ABORT of a room nobody registered yet leaves no trace: its decode can still register it later
    reply = request(peer.address, {"type": "ABORT", "room": 4, "secret": wrong}, timeout=2)
    assert reply["type"] == "REFUSED" and 4 not in peer.statuses
    dec.open_room(4, PS, [peer.address])
    assert peer.statuses.get(4) == RoomStatus.WAITING
    assert dec.abort(3) and dec.abort(4)  # the owner can
    assert peer.statuses.failed(3) and peer.statuses.failed(4)


def test_refusal_by_one_rank_aborts_the_ranks_that_accepted(pair):
    peer, dec = pair
    other = PrefillPeer(KVPool(_cfg(16, page_size=2 * PS)), 1, timeout=5)  # another layout: refuses
    try:
        free = dec.pool.num_free
        with pytest.raises(TransferRefused, match="fingerprint mismatch"):
            dec.open_room(5, PS, [peer.address, other.address])
        assert peer.statuses.failed(5)  # the rank that accepted was told to stop
        assert dec.pool.num_free == free and 5 not in dec.quarantined  # freed after the first rank's ACK
    finally:
        other.close()


# ---------------------------------------------------------------------------------------- destination pages


@pytest.mark.parametrize("pages,prompt_len,why", [
    ([0, -1], 20, "must lie in"),
    ([0], 20, "needs 2"),
    ([0, 32], 20, "must lie in"),
    ([3, 3], 20, "twice"),
    ([], 0, "1..8"),
    (list(range(9)), 20, "1..8"),
])
def test_bad_destination_pages_refused_at_register(pair, pages, prompt_len, why):
    peer, dec = pair
    peer.max_room_pages, saved = 8, peer.max_room_pages
    try:
        reply = request(peer.address, _register_msg(dec, 6, prompt_len, pages), timeout=2)
    finally:
        peer.max_room_pages = saved
    assert reply["type"] == "REFUSED" and why in reply["reason"]
    assert 6 not in peer.targets and 6 not in peer.statuses


def test_session_on_another_host_refused(pair):
    peer, dec = pair
    msg = _register_msg(dec, 7, PS, [20, 21], session="10.9.8.7:4242")
    reply = request(peer.address, msg, timeout=2)
    assert reply["type"] == "REFUSED" and "not the registering peer" in reply["reason"]
    peer.allow_foreign_session = True
    try:
        assert peer._handle(msg, "127.0.0.1")["type"] == "REGISTER_OK"
    finally:
        peer.allow_foreign_session = False
        peer.release(7)


def test_chunk_past_registered_pages_fails_only_its_room(pair):
    peer, dec = pair
    short = dec.open_room(8, 20, [peer.address])  # decode registers 2 pages (a 20-token prompt + 1)...
    good = dec.open_room(9, 2 * PS - 3, [peer.address])
    ch = peer.begin_chunk(8, list(range(5)), 0, 5, last=True, overlap=False)  # ...prefill has 5 pages: no raise
    assert peer.end_chunk(ch, first_token=1) == RoomStatus.FAILED
    st, src = _send_room(peer, 9, 2)
    assert st == RoomStatus.SUCCESS and dec.wait(9, 5) == RoomStatus.SUCCESS and dec.wait(8, 5) == RoomStatus.FAILED
    assert _same_pages(peer, src, dec, good[:2]) and len(short) == 2
    dec.release(9)


# ---------------------------------------------------------------------------------------- bounds


def test_rooms_and_metrics_stay_bounded():
    peer = PrefillPeer(_filled_pool(), 0, timeout=5, max_rooms=4, room_ttl=60)
    dec = DecodeSide(KVPool(_cfg(32)), max_rooms=16, timeout=2)
    try:
        for room in range(4):
            dec.open_room(room, PS, [peer.address])
        with pytest.raises(TransferRefused, match="max_rooms"):
            dec.open_room(4, PS, [peer.address])
        _send_room(peer, 0, 1)  # room 0 finishes: it may be evicted for a new one
        dec.open_room(5, PS, [peer.address])
        assert 0 not in peer.statuses and len(peer.statuses) == 4
        for room in range(1000, 6000):  # POLLs for rooms nobody registered leave nothing behind
            assert peer._handle({"type": "POLL", "room": room, "secret": "00" * 16}, "127.0.0.1")["type"] == "REFUSED"
        assert len(peer.statuses) == 4 and 0 not in peer.sender.metrics and len(peer.sender.metrics) <= 4
        assert peer.refused_requests == 5000
        assert peer.sender.bytes_sent(99_999) == 0 and 99_999 not in peer.sender.metrics  # reading creates nothing
        peer.room_ttl = 1e-3  # registered rooms never started become evictable after room_ttl
        time.sleep(0.01)
        dec.open_room(6, PS, [peer.address])
        assert len(peer.statuses) == 4
    finally:
        peer.close(), dec.close()


def test_whole_frame_deadline_cuts_off_a_slow_sender():
    srv = ControlServer(lambda m, peer: {"type": "ABORT_ACK", "room": m["room"], "rank": 0}, timeout=0.3)
    try:
        frame = encode({"type": "ABORT", "room": 1, "secret": "ab" * 16})
        host, port = srv.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=2) as s:
            closed = False
            for i in range(len(frame)):  # 0.05 s per byte: the frame would take ~3.5 s, each read only 0.05 s
                try:
                    s.sendall(frame[i:i + 1])
                except OSError:
                    closed = True
                    break
                time.sleep(0.05)
            if not closed:
                s.settimeout(2)
                try:
                    closed = s.recv(64) == b""
                except OSError:
                    closed = True
        assert closed and srv.timed_out == 1
        assert request(srv.address, {"type": "ABORT", "room": 2, "secret": "ab" * 16}, timeout=2)["room"] == 2
    finally:
        srv.close()


def test_connection_cap():
    srv = ControlServer(lambda m, peer: {"type": "ABORT_ACK", "room": m["room"], "rank": 0}, timeout=5,
                        max_connections=2)
    host, port = srv.address.rsplit(":", 1)
    held = []
    try:
        for _ in range(2):
            held.append(socket.create_connection((host, int(port)), timeout=2))
        for _ in range(200):  # bounded wait for the server to take both
            if srv.active_connections == 2:
                break
            time.sleep(0.01)
        assert srv.active_connections == 2
        with socket.create_connection((host, int(port)), timeout=2) as extra:
            extra.settimeout(2)
            try:
                assert extra.recv(16) == b""  # closed at once, not served
            except ConnectionResetError:
                pass
        assert srv.refused_connections == 1
        held.pop().close()
        for _ in range(200):
            if srv.active_connections < 2:
                break
            time.sleep(0.01)
        assert request(srv.address, {"type": "ABORT", "room": 3, "secret": "ab" * 16}, timeout=2)["type"] == "ABORT_ACK"
    finally:
        for s in held:
            s.close()
        srv.close()


@pytest.mark.parametrize("body", [
    b"[" * 200_000 + b"]" * 200_000,  # RecursionError in the parser
    b'{"type": "POLL", "room": ' + b"9" * 5000 + b', "secret": "x"}',  # ValueError: too many digits
    json.dumps({"type": "POLL", "room": 1 << 64, "secret": "ab" * 16}).encode(),  # outside int64
    json.dumps({"type": "STATUS", "room": 1, "rank": 0, "status": 9, "bytes_sent": 0}).encode(),  # not a RoomStatus
    json.dumps({"type": "POLL", "room": 1, "secret": "AB" * 16}).encode(),  # secret not lowercase hex
    json.dumps({"type": "REFUSED", "room": 1, "rank": 0, "reason": "x" * 5000}).encode(),  # string over the cap
])
def test_hostile_json_is_a_frame_error(body):
    with pytest.raises(FrameError):
        decode_body(body)


def test_server_survives_hostile_json():
    srv = ControlServer(lambda m, peer: {"type": "ABORT_ACK", "room": m["room"], "rank": 0}, timeout=2)
    try:
        host, port = srv.address.rsplit(":", 1)
        body = b"[" * 200_000
        with socket.create_connection((host, int(port)), timeout=2) as s:
            s.sendall(struct.pack(">I", len(body)) + body)
            s.settimeout(2)
            assert s.recv(16) == b""
        assert srv.rejected == 1
        assert request(srv.address, {"type": "ABORT", "room": 1, "secret": "ab" * 16}, timeout=2)["type"] == "ABORT_ACK"
    finally:
        srv.close()


def _raw_server(reply: dict):
    """A fake prefill that answers one frame with ``reply`` unchecked (as a broken or hostile peer would)."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    lsock.settimeout(3)

    def serve():
        try:
            conn, _ = lsock.accept()
            with conn:
                conn.settimeout(3)
                (n,) = struct.unpack(">I", conn.recv(4))
                while n > 0:
                    n -= len(conn.recv(n))
                body = json.dumps(reply).encode()
                conn.sendall(struct.pack(">I", len(body)) + body)
        except OSError:
            pass
        finally:
            lsock.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{lsock.getsockname()[1]}"


def test_status_outside_enum_counts_as_failed(pair):
    _, dec = pair
    addr = _raw_server({"type": "STATUS", "room": 40, "rank": 0, "status": 77, "bytes_sent": 0})
    dec.rooms[40] = {"table": [], "peers": [addr], "len": 1, "secret": "ab" * 16}
    try:
        assert dec.wait(40, 2) == RoomStatus.FAILED
    finally:
        dec.rooms.pop(40, None)


# ---------------------------------------------------------------------------------------- bind addresses


def test_control_port_binds_the_configured_host(pair):
    peer, _ = pair
    port = int(peer.address.rsplit(":", 1)[1])
    assert ("127.0.0.1", port) in listening_sockets()
    assert not any(p == port and ip != "127.0.0.1" for ip, p in listening_sockets())


def test_engine_reports_what_it_listens_on_and_strict_bind_refuses_exposure():
    eng = MooncakeEngine("127.0.0.1")
    try:
        rpc = int(eng.session_id.rsplit(":", 1)[1])
        assert rpc in [p for _, p in eng.listeners] and len(eng.listeners) >= 2  # handshake + TCP data
        assert eng.exposed == [(ip, p) for ip, p in eng.listeners if ip != "127.0.0.1"]
    finally:
        eng.close()
    if eng.exposed:  # this Mooncake listens beyond the host: strict mode must refuse, never run exposed
        with pytest.raises(RuntimeError, match="strict_bind"):
            MooncakeEngine("127.0.0.1", strict_bind=True)
    else:
        MooncakeEngine("127.0.0.1", strict_bind=True).close()


@pytest.mark.xfail(strict=True, reason="Mooncake 0.3.13.post1 binds its handshake and TCP data listeners to the "
                                       "wildcard address whatever host is given (docs/security.md)")
def test_every_engine_listener_on_the_configured_host():
    eng = MooncakeEngine("127.0.0.1")
    try:
        assert eng.listeners and all(ip == "127.0.0.1" for ip, _ in eng.listeners)
    finally:
        eng.close()


def test_engine_start_prints_nothing_at_default_level(capfd):
    capfd.readouterr()
    MooncakeEngine("127.0.0.1").close()
    assert capfd.readouterr().err == ""
