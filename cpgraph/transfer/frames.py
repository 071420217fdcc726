"""Control-channel frames: length-prefixed, schema-checked JSON (never pickle).

Why: the control channel crosses process (and in production machine)
boundaries; unpickling a peer's bytes would execute them.  A frame is a
4-byte big-endian length followed by a UTF-8 JSON object whose ``"type"``
names a schema in :data:`SCHEMAS`; every field must be present with its
exact type and nothing else may be present.  Anything else -- a length over
the cap, bad UTF-8/JSON (including nesting deep enough to exhaust the parser
and integers too long to parse), a non-object, an unknown type, a missing,
extra or mistyped field, an integer outside int64, a negative pointer, a
string over :data:`MAX_STR_CHARS`, a room secret that is not
:data:`SECRET_HEX_CHARS` hex digits, a status outside :class:`RoomStatus`
-- raises :class:`FrameError` before the message reaches a handler.

Reading is bounded in time as well as size: :func:`recv_frame` takes a
deadline for the *whole* frame, so a peer trickling one byte at a time
cannot hold a connection longer than that (see ``docs/security.md``).
"""

from __future__ import annotations

import json
import socket
import struct
import time

from .status import RoomStatus

MAX_FRAME_BYTES = 1 << 20
MAX_STR_CHARS = 1024
SECRET_HEX_CHARS = 32  # 128-bit room secret, lowercase hex
_INT64 = (-(1 << 63), 1 << 63)
_LEN = struct.Struct(">I")


class FrameError(ValueError):
    """A control frame that is malformed, oversized or does not match its schema."""


INT, STR, INTS, SECRET = "int", "str", "ints", "secret"

SCHEMAS: dict[str, dict[str, str]] = {
    # decode -> prefill: where to write one room's KV (see layout.PoolLayout) and the room's secret
    "REGISTER": {
        "room": INT, "secret": SECRET, "session": STR, "fingerprint": STR, "page_size": INT,
        "mla_ptrs": INTS, "mla_page_bytes": INT, "index_layers": INTS, "index_ptrs": INTS,
        "index_page_bytes": INT, "num_pages": INT, "prompt_len": INT, "dst_pages": INTS,
        "aux_ptr": INT, "aux_bytes": INT,
    },
    "REGISTER_OK": {"room": INT, "rank": INT},
    "REFUSED": {"room": INT, "rank": INT, "reason": STR},
    "POLL": {"room": INT, "secret": SECRET},
    "STATUS": {"room": INT, "rank": INT, "status": INT, "bytes_sent": INT},
    "ABORT": {"room": INT, "secret": SECRET},
    "ABORT_ACK": {"room": INT, "rank": INT},
}
_NON_NEGATIVE = {"room", "page_size", "mla_page_bytes", "index_page_bytes", "aux_ptr", "aux_bytes", "rank",
                 "bytes_sent", "mla_ptrs", "index_ptrs", "index_layers", "num_pages", "prompt_len"}
_ENUMS = {"status": frozenset(int(s) for s in RoomStatus)}
_HEX = frozenset("0123456789abcdef")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and _INT64[0] <= v < _INT64[1]


def _type_ok(kind: str, v) -> bool:
    if kind == INT:
        return _is_int(v)
    if kind == STR:
        return isinstance(v, str) and len(v) <= MAX_STR_CHARS
    if kind == SECRET:
        return isinstance(v, str) and len(v) == SECRET_HEX_CHARS and set(v) <= _HEX
    return isinstance(v, list) and all(_is_int(x) for x in v)


def validate(msg) -> dict:
    """Check ``msg`` against its schema; returns it or raises :class:`FrameError`."""
    if not isinstance(msg, dict):
        raise FrameError(f"frame must be a JSON object, got {type(msg).__name__}")
    kind = msg.get("type")
    if not isinstance(kind, str) or kind not in SCHEMAS:
        raise FrameError(f"unknown frame type {str(kind)[:64]!r}")
    schema = SCHEMAS[kind]
    keys = set(msg) - {"type"}
    if keys != set(schema):
        missing, extra = sorted(set(schema) - keys), sorted(keys - set(schema))
        raise FrameError(f"{kind} frame: missing fields {missing}, unexpected fields {[e[:64] for e in extra[:8]]}")
    for name, t in schema.items():
        v = msg[name]
        if not _type_ok(t, v):
            want = {INT: "int64", STR: f"str of at most {MAX_STR_CHARS} chars", INTS: "list of int64",
                    SECRET: f"{SECRET_HEX_CHARS} lowercase hex digits"}[t]
            raise FrameError(f"{kind} frame: field {name!r} must be {want}, got {type(v).__name__}")
        if name in _NON_NEGATIVE and (min(v, default=0) if t == INTS else v) < 0:
            raise FrameError(f"{kind} frame: field {name!r} must be non-negative")
        if name in _ENUMS and v not in _ENUMS[name]:
            raise FrameError(f"{kind} frame: field {name!r} = {v} is not one of {sorted(_ENUMS[name])}")
    return msg


def encode(msg: dict, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    body = json.dumps(validate(msg), separators=(",", ":")).encode()
    if len(body) > max_bytes:
        raise FrameError(f"frame of {len(body)} bytes exceeds the {max_bytes}-byte cap")
    return _LEN.pack(len(body)) + body


def decode_body(body: bytes) -> dict:
    try:
        msg = json.loads(body.decode("utf-8"))
    # ValueError covers JSONDecodeError, UnicodeDecodeError and integers over the parser's digit limit;
    # RecursionError is what deeply nested arrays/objects raise.
    except (ValueError, RecursionError) as exc:
        raise FrameError(f"frame is not UTF-8 JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    return validate(msg)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:  # bounded: each recv returns >= 1 byte, EOFs, or times out at the deadline
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"control frame incomplete at its deadline ({len(buf)} of {n} bytes)")
            sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 16))
        if not chunk:
            raise ConnectionError("peer closed the control connection")
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, msg: dict, max_bytes: int = MAX_FRAME_BYTES) -> None:
    sock.sendall(encode(msg, max_bytes))


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES, timeout: float | None = None) -> dict:
    """Read one frame; ``timeout`` bounds the *whole* frame (else the socket's per-read timeout applies).

    Oversized lengths are refused before the body is read.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if n > max_bytes:
        raise FrameError(f"frame length {n} exceeds the {max_bytes}-byte cap")
    return decode_body(_recv_exact(sock, n, deadline))
