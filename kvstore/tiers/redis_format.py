"""What the Redis tier stores: its keys and values (docs/scale.md).

Key:   kvstore:v3:<cache fingerprint hex>:<content hash hex>
       (a pq cache's fp16 block: hashing.fp16_key of its block hash)
No hash tag ({...}): Redis Cluster hashes the whole key, so one cache's
blocks spread over every slot.

Value: an 88-byte header, then the payload:
  b"KVRB", version u16 (3), 0 u16, fingerprint [32], content hash [32],
  payload length u64, checksum u64 of the payload.
A value whose magic, version, fingerprint, hash, length or checksum is not
what the lookup expects is refused: counted, treated as a miss, never served.
The fingerprint, hash and length are compared whole, so the checksum only
has to catch corrupted payload bytes (and a forger is not in its scope:
whoever may write to this Redis may write blocks).

The checksum is XXH3-64 of the payload (checksum.py, as the disk tier's):
one C call a value that gives the GIL up once, where version 2's weighted
numpy sum took three numpy steps, each giving the GIL up and waiting to take
it back behind the other receiving threads. A version-2 value lives under
another key prefix: a daemon of this version never reads one (a miss, not a
refusal), and Redis's eviction ages them out.
"""
from __future__ import annotations

import struct

from .checksum import checksum

MAGIC, VERSION = b"KVRB", 3
KEY_PREFIX = b"kvstore:v3:"
_HEAD = struct.Struct("<4sHH32s32sQ")      # magic, version, 0, fingerprint, hash, payload length
HEADER_BYTES = _HEAD.size + 8              # + the checksum


def block_key(fp: bytes, h: bytes) -> bytes:
    return KEY_PREFIX + fp.hex().encode() + b":" + h.hex().encode()


def header(fp: bytes, h: bytes, payload) -> bytes:
    """The 88 bytes stored before payload (a bytes-like block payload)."""
    mv = memoryview(payload).cast("B")
    return _HEAD.pack(MAGIC, VERSION, 0, fp, h, mv.nbytes) + checksum(mv).to_bytes(8, "little")


def pack_value(fp: bytes, h: bytes, payload) -> bytes:
    """payload: a bytes-like block payload -> the stored value."""
    return header(fp, h, payload) + memoryview(payload).cast("B")


def check_head(head, fp: bytes, h: bytes, length: int) -> bool:
    """Whether the header's fixed fields are those of (fp, h) with a payload of length bytes."""
    return bytes(memoryview(head)[:_HEAD.size]) == _HEAD.pack(MAGIC, VERSION, 0, fp, h, length)


def check(head, payload, fp: bytes, h: bytes) -> bool:
    """Whether head (HEADER_BYTES) and payload are exactly a value stored for (fp, h)."""
    mv = memoryview(payload).cast("B")
    return (check_head(head, fp, h, mv.nbytes)
            and int.from_bytes(bytes(memoryview(head)[_HEAD.size:HEADER_BYTES]), "little") == checksum(mv))


def check_value(v, fp: bytes, h: bytes, length: int) -> bool:
    """Whether v (a whole value, bytes) is exactly a value stored for (fp, h)
    with a payload of length bytes (which are v[HEADER_BYTES:])."""
    if not isinstance(v, bytes) or len(v) != HEADER_BYTES + length:
        return False
    return check(v[:HEADER_BYTES], memoryview(v)[HEADER_BYTES:], fp, h)
