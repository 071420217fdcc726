"""The 64-byte header every L3 object carries, and the checks a read runs against it (both backends).

Why a header in front of every object: a page's bytes are loaded into L2
and then into the KV pool, where nothing could tell a flipped bit or a page
stored under the wrong name from a good page -- the output would quietly
stop making sense.  So each object names its key and length and carries a
CRC-32 of its bytes, and a read that does not check out is a miss: the
caller never uses the bytes.

====== ===== ==================================================================
offset bytes field
====== ===== ==================================================================
0      8     magic ``CPGRL3\\0\\1``
8      4     format version (uint32 little-endian)
12     4     CRC-32 of the object bytes
16     8     object length in bytes
24     32    the key (its 32 bytes; keys are 64 hex digits)
56     4     CRC-32 of bytes 0-55
60     4     zero
====== ===== ==================================================================

CRC-32 detects accidental corruption (a bad disk, a torn copy, a transport
or memory fault), not a writer who means harm: a store must be as trusted
as the model weights (docs/security.md).
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"CPGRL3\x00\x01"
VERSION = 1
HEADER = struct.Struct("<8sIIQ32s")  # magic, version, crc, length, key
HEADER_BYTES = 64


def views(parts) -> list[memoryview]:
    """Byte views of an object's parts (contiguous 1-D uint8 host tensors), without a copy."""
    return [memoryview(t.numpy()).cast("B") for t in parts]


def crc(byte_views) -> int:
    """CRC-32 over the concatenation of ``byte_views`` (``zlib.crc32`` releases the GIL)."""
    c = 0
    for v in byte_views:
        c = zlib.crc32(v, c)
    return c


def key_bytes(key: str, where: str) -> bytes:
    """The 32 bytes a page key's 64 hex digits spell (``ValueError`` for anything else: a programming error)."""
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"{where}: keys are 64 hex digits (cpgraph.runtime.storage.keys.page_key), got {key!r}")
    return raw


def encode_header(key_raw: bytes, length: int, checksum: int) -> bytes:
    head = HEADER.pack(MAGIC, VERSION, checksum, length, key_raw)
    head += struct.pack("<I", zlib.crc32(head))
    return head + b"\x00" * (HEADER_BYTES - len(head))


def decode_header(raw: bytes) -> tuple[int, int, bytes] | None:
    """``(crc, length, key)`` of a well-formed header, else ``None``."""
    if len(raw) != HEADER_BYTES:
        return None
    magic, version, checksum, length, key = HEADER.unpack_from(raw)
    (head_crc,) = struct.unpack_from("<I", raw, HEADER.size)
    if magic != MAGIC or version != VERSION or head_crc != zlib.crc32(raw[: HEADER.size]):
        return None
    return checksum, length, key


def check_header(raw: bytes, key_raw: bytes, size: int) -> tuple[int | None, str | None]:
    """``(crc the bytes must have, None)`` when ``raw`` is a header for this key and size, else ``(None, why)``."""
    head = decode_header(raw)
    if head is None:
        return None, "bad header"
    checksum, length, stored_key = head
    if stored_key != key_raw:
        return None, "header names another key"
    if length != size:
        return None, f"{length} bytes stored, {size} expected"
    return checksum, None
