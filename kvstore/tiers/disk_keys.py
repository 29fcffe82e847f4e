"""The disk tier's LMDB keys (disk.py).

Key layout (every key carries the cache fingerprint):
  b"B" fp hash                  sealed block with a content hash (shared by every
                                cache of that fingerprint: same model, codebooks)
  b"S" fp cache/tenant/seq #i   other blocks of a sequence (unhashed sealed, then tail)
  b"M" fp cache/tenant/seq      the sequence manifest (JSON)
"""
from __future__ import annotations

import struct

FP_BYTES = 32     # a cache fingerprint: sha256 (codebooks.fingerprint)


def part(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<H", len(b)) + b


def seq_key(fp: bytes, cache: str, tenant: str, seq_id: str) -> bytes:
    return fp + part(cache) + part(tenant) + part(seq_id)


def block_key(fp: bytes, h: bytes) -> bytes:
    return b"B" + fp + h


def manifest_key(fp: bytes, cache: str, tenant: str, seq_id: str) -> bytes:
    return b"M" + seq_key(fp, cache, tenant, seq_id)


def seq_block(seq: bytes, i: int) -> bytes:
    """The key of block i of the sequence whose seq_key is seq (its own blocks)."""
    return b"S" + seq + struct.pack(">I", i)


def seq_block_key(fp: bytes, cache: str, tenant: str, seq_id: str, i: int) -> bytes:
    return seq_block(seq_key(fp, cache, tenant, seq_id), i)


def names(mk: bytes) -> tuple[str, str, str]:
    """(cache, tenant, sequence) of a manifest key."""
    parts, at = [], 1 + FP_BYTES
    for _ in range(3):
        (n,) = struct.unpack_from("<H", mk, at)
        parts.append(mk[at + 2:at + 2 + n].decode(errors="replace"))
        at += 2 + n
    return parts[0], parts[1], parts[2]


def describe(mk: bytes) -> str:
    """A manifest key as the log names it: cache/tenant/sequence."""
    return "/".join(map(repr, names(mk)))


def refs(fp: bytes, manifest: dict) -> list[bytes]:
    """Keys of the content-hashed blocks a manifest references."""
    return [block_key(fp, bytes.fromhex(h)) for h in manifest["sealed_hashes"] + manifest["tail_hashes"] if h]
