"""The 64-byte header every L3 object carries, and the checks a read runs against it (both backends).

Why a header in front of every object: a page's bytes are loaded into L2
and then into the KV pool, where nothing could tell a flipped bit or a page
stored under the wrong name from a good page -- the output would quietly
stop making sense.  So each object names its key and length and carries a
checksum of its bytes, and a read that does not check out is a miss: the
caller never uses the bytes.

====== ===== ==================================================================
offset bytes field
====== ===== ==================================================================
0      8     magic ``CPGRL3\\0\\1``
8      4     format version (uint32 little-endian): 2
12     4     CRC-32 of the header (bytes 0-63 with these four as zero)
16     8     object length in bytes
24     8     XXH3-64 of the object bytes
32     32    the key (its 32 bytes; keys are 64 hex digits)
====== ===== ==================================================================

Why XXH3-64 for the bytes (format 2; format 1 carried a CRC-32 there): a
restore reads and verifies every byte of a cached prefix, and ``zlib``'s
CRC-32 runs at about 2 GB/s on one core -- on the H200 host it was the rate
of the whole L3 fetch (1.1-1.2 GB/s with the reads), slower than recomputing
allowed for.  XXH3 (the ``xxhash`` package) runs at about 25 GB/s and, as a
64-bit hash, misses a random corruption with probability 2**-64.  Both
detect accidental corruption (a bad disk, a torn copy, a transport or
memory fault), not a writer who means harm: a store must be as trusted as
the model weights (docs/security.md).  An object of format 1 reads as a
bad header: a miss, deleted, recomputed and stored again in format 2.
"""

from __future__ import annotations

import struct
import zlib

import xxhash

_xxh3_one = xxhash.xxh3_64_intdigest
_ZERO4 = b"\x00" * 4

MAGIC = b"CPGRL3\x00\x01"
VERSION = 2
HEADER = struct.Struct("<8sIIQQ32s")  # magic, version, header crc, length, object checksum, key
HEADER_BYTES = 64
assert HEADER.size == HEADER_BYTES
# CRC-32 state after a well-formed header's first 16 bytes with its CRC field as zero (magic and version are
# fixed): a read then runs one crc32 over the header's last 48 bytes, without building a zeroed copy.
_CRC_AFTER_PREFIX = zlib.crc32(_ZERO4, zlib.crc32(MAGIC + struct.pack("<I", VERSION)))


def views(parts) -> list[memoryview]:
    """Byte views of an object's parts (contiguous 1-D uint8 host tensors or byte memoryviews), without a copy."""
    return [t if type(t) is memoryview else memoryview(t.numpy()).cast("B") for t in parts]


def checksum(byte_views) -> int:
    """XXH3-64 over the concatenation of ``byte_views`` (module docstring: why not CRC-32)."""
    if len(byte_views) == 1:
        return _xxh3_one(byte_views[0])
    h = xxhash.xxh3_64()
    for v in byte_views:
        h.update(v)
    return h.intdigest()


def key_bytes(key: str, where: str) -> bytes:
    """The 32 bytes a page key's 64 hex digits spell (``ValueError`` for anything else: a programming error)."""
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"{where}: keys are 64 hex digits (cpgraph.runtime.storage.keys.page_key), got {key!r}")
    return raw


def encode_header(key_raw: bytes, length: int, object_checksum: int) -> bytes:
    head = bytearray(HEADER.pack(MAGIC, VERSION, 0, length, object_checksum, key_raw))
    struct.pack_into("<I", head, 12, zlib.crc32(head))
    return bytes(head)


def decode_header(raw) -> tuple[int, int, bytes] | None:
    """``(object checksum, length, key)`` of a well-formed header (64 bytes: bytes or a byte view), else ``None``."""
    if len(raw) != HEADER_BYTES:
        return None
    magic, version, head_crc, length, object_checksum, key = HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        return None
    if head_crc != zlib.crc32(raw[16:], _CRC_AFTER_PREFIX):  # bytes 0-11 are MAGIC and VERSION here
        return None
    return object_checksum, length, key


def check_header(raw, key_raw: bytes, size: int) -> tuple[int | None, str | None]:
    """``(checksum the bytes must have, None)`` when ``raw`` is a header for this key and size, else ``(None, why)``."""
    head = decode_header(raw)
    if head is None:
        return None, "bad header"
    checksum, length, stored_key = head
    if stored_key != key_raw:
        return None, "header names another key"
    if length != size:
        return None, f"{length} bytes stored, {size} expected"
    return checksum, None
