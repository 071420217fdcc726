"""Control-channel frames: length-prefixed, schema-checked JSON (never pickle).

Why: the control channel crosses process (and in production machine)
boundaries; unpickling a peer's bytes would execute them.  A frame is a
4-byte big-endian length followed by a UTF-8 JSON object whose ``"type"``
names a schema in :data:`SCHEMAS`; every field must be present with its
exact type and nothing else may be present.  Anything else -- a length over
the cap, bad UTF-8/JSON, a non-object, an unknown type, a missing, extra or
mistyped field, a negative pointer -- raises :class:`FrameError` before the
message reaches a handler.
"""

from __future__ import annotations

import json
import socket
import struct

MAX_FRAME_BYTES = 1 << 20
_LEN = struct.Struct(">I")


class FrameError(ValueError):
    """A control frame that is malformed, oversized or does not match its schema."""


INT, STR, INTS = "int", "str", "ints"

SCHEMAS: dict[str, dict[str, str]] = {
    # decode -> prefill: where to write one room's KV (see layout.DecodeLayout)
    "REGISTER": {
        "room": INT, "session": STR, "fingerprint": STR, "page_size": INT,
        "mla_ptrs": INTS, "mla_page_bytes": INT, "index_layers": INTS, "index_ptrs": INTS,
        "index_page_bytes": INT, "dst_pages": INTS, "aux_ptr": INT, "aux_bytes": INT,
    },
    "REGISTER_OK": {"room": INT, "rank": INT},
    "REFUSED": {"room": INT, "rank": INT, "reason": STR},
    "POLL": {"room": INT},
    "STATUS": {"room": INT, "rank": INT, "status": INT, "bytes_sent": INT},
    "ABORT": {"room": INT},
    "ABORT_ACK": {"room": INT, "rank": INT},
}
_NON_NEGATIVE = {"room", "page_size", "mla_page_bytes", "index_page_bytes", "aux_ptr", "aux_bytes", "rank",
                 "bytes_sent", "mla_ptrs", "index_ptrs", "index_layers"}


def _type_ok(kind: str, v) -> bool:
    if kind == INT:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == STR:
        return isinstance(v, str)
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def validate(msg) -> dict:
    """Check ``msg`` against its schema; returns it or raises :class:`FrameError`."""
    if not isinstance(msg, dict):
        raise FrameError(f"frame must be a JSON object, got {type(msg).__name__}")
    kind = msg.get("type")
    if kind not in SCHEMAS:
        raise FrameError(f"unknown frame type {kind!r}")
    schema = SCHEMAS[kind]
    keys = set(msg) - {"type"}
    if keys != set(schema):
        missing, extra = sorted(set(schema) - keys), sorted(keys - set(schema))
        raise FrameError(f"{kind} frame: missing fields {missing}, unexpected fields {extra}")
    for name, t in schema.items():
        v = msg[name]
        if not _type_ok(t, v):
            raise FrameError(f"{kind} frame: field {name!r} must be {t}, got {type(v).__name__}")
        if name in _NON_NEGATIVE and (min(v, default=0) if t == INTS else v) < 0:
            raise FrameError(f"{kind} frame: field {name!r} must be non-negative")
    return msg


def encode(msg: dict, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    body = json.dumps(validate(msg), separators=(",", ":")).encode()
    if len(body) > max_bytes:
        raise FrameError(f"frame of {len(body)} bytes exceeds the {max_bytes}-byte cap")
    return _LEN.pack(len(body)) + body


def decode_body(body: bytes) -> dict:
    try:
        msg = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"frame is not UTF-8 JSON: {exc}") from None
    return validate(msg)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:  # bounded: each recv returns >= 1 byte or raises/EOFs
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the control connection")
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, msg: dict, max_bytes: int = MAX_FRAME_BYTES) -> None:
    sock.sendall(encode(msg, max_bytes))


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> dict:
    """Read one frame (the socket's timeout bounds the wait); oversized lengths are refused unread."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > max_bytes:
        raise FrameError(f"frame length {n} exceeds the {max_bytes}-byte cap")
    return decode_body(_recv_exact(sock, n))
