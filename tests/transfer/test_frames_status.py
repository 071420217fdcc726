"""Control frames (schema, caps, rejection by the live server), room status rules, run coalescing."""

import json
import socket
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpgraph.transfer.frames import FrameError, decode_body, encode, recv_frame, validate
from cpgraph.transfer.sender import cap_batches, owned_runs
from cpgraph.transfer.status import RoomStatus, StatusTable, agree

SECRET = "0123456789abcdef" * 2
GOOD = {"type": "POLL", "room": 3, "secret": SECRET}


def test_roundtrip():
    data = encode(GOOD)
    assert struct.unpack(">I", data[:4])[0] == len(data) - 4
    assert decode_body(data[4:]) == GOOD


@pytest.mark.parametrize("body", [
    b"\xff\xfe", b"not json", b"[1, 2]", b'{"type": "NOPE", "room": 1}', b'{"room": 1}',
    b'{"type": "POLL"}', b'{"type": "POLL", "room": 1, "extra": 2}', b'{"type": "POLL", "room": "1"}',
    b'{"type": "POLL", "room": true}', b'{"type": "POLL", "room": -1}',
    b'{"type": "STATUS", "room": 1, "rank": 0, "status": 1, "bytes_sent": 1.5}',
    b'{"type": "ABORT_ACK", "room": 1, "rank": [0]}',
])
def test_malformed_rejected(body):
    with pytest.raises(FrameError):
        decode_body(body)


def test_register_lists_typed():
    msg = {"type": "REGISTER", "room": 0, "secret": SECRET, "session": "127.0.0.1:1", "fingerprint": "x",
           "page_size": 16, "mla_ptrs": [1, 2], "mla_page_bytes": 4, "index_layers": [0], "index_ptrs": [3],
           "index_page_bytes": 4, "num_pages": 8, "prompt_len": 20, "dst_pages": [0, 1], "aux_ptr": 5, "aux_bytes": 32}
    validate(msg)
    for bad in ([1, "2"], [1, True], "12", [-4]):
        with pytest.raises(FrameError, match="mla_ptrs"):
            validate(dict(msg, mla_ptrs=bad))


def test_oversized_refused_before_reading():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 1 << 30))
        with pytest.raises(FrameError, match="cap"):
            recv_frame(b, max_bytes=1 << 20)
    with pytest.raises(FrameError, match="cap"):
        encode({"type": "REFUSED", "room": 0, "rank": 0, "reason": "x" * 100}, max_bytes=50)


def test_server_rejects_and_survives():
    from cpgraph.transfer.control import ControlServer, request

    srv = ControlServer(lambda m, peer: {"type": "STATUS", "room": m["room"], "rank": 0, "status": 2, "bytes_sent": 0},
                        timeout=2.0)
    try:
        host, port = srv.address.rsplit(":", 1)
        assert host == "127.0.0.1"
        for payload in (struct.pack(">I", 2) + b"{]", struct.pack(">I", 99 << 20),
                        struct.pack(">I", 13) + json.dumps({"type": "X"}).encode()[:13]):
            with socket.create_connection((host, int(port)), timeout=2) as s:
                s.sendall(payload)
                s.settimeout(2)
                assert s.recv(16) == b""  # server closed the connection without replying
        assert srv.rejected == 3
        assert request(srv.address, GOOD, timeout=2)["status"] == 2
    finally:
        srv.close()


def test_status_monotone_failed_wins():
    t = StatusTable()
    assert t.update(1, RoomStatus.TRANSFERRING) == RoomStatus.TRANSFERRING
    assert t.update(1, RoomStatus.WAITING) == RoomStatus.TRANSFERRING  # never backwards
    t.fail(1)
    assert t.update(1, RoomStatus.SUCCESS) == RoomStatus.FAILED  # Failed is absorbing
    assert agree([RoomStatus.SUCCESS, RoomStatus.TRANSFERRING]) == RoomStatus.TRANSFERRING
    assert agree([RoomStatus.SUCCESS, RoomStatus.FAILED]) == RoomStatus.FAILED
    assert agree([RoomStatus.SUCCESS] * 3) == RoomStatus.SUCCESS and agree([]) == RoomStatus.FAILED


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(-1, 6), min_size=1, max_size=12), st.data())
def test_owned_runs_brute_force(table, data):
    n = len(table)
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    dst = data.draw(st.permutations(list(range(n))))
    runs = owned_runs(table, dst, start, end)
    expanded = [(s + k, d + k) for s, d, c in runs.tolist() for k in range(c)]
    assert expanded == [(table[p], dst[p]) for p in range(start, end) if table[p] >= 0]
    for (s0, d0, c0), (s1, d1, _) in zip(runs.tolist(), runs.tolist()[1:]):
        assert not (s1 == s0 + c0 and d1 == d0 + c0)  # maximal: neighbours never mergeable


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=0, max_size=8), st.integers(1, 64))
def test_cap_batches_brute_force(lens, cap):
    src = np.cumsum([0] + lens[:-1]) * 2 + 1000 if lens else np.zeros(0, int)
    dst = src + 7
    batches = cap_batches(src, dst, lens, cap)
    covered = []
    for s, d, n in batches:
        assert sum(n) <= cap and all(x > 0 for x in n)
        for a, b, k in zip(s, d, n):
            assert b - a == 7
            covered += list(range(a, a + k))
    assert covered == [a + k for a, n in zip(np.asarray(src).tolist(), lens) for k in range(n)]
    with pytest.raises(ValueError):
        cap_batches(src, dst, lens, 0)
