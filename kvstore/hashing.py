"""Chained SHA-256 block hashes (DESIGN §6).

h_i = sha256(h_{i-1} || token ids of block i as little-endian int64 || fingerprint)
with h_{-1} = sha256(tenant) (b"" for caches that share prefixes across
tenants). Deterministic across processes, restarts and Python hash
seeds (never Python's `hash`).
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence


def block_hash(parent: bytes, token_ids: Sequence[int], fingerprint: bytes) -> bytes:
    h = hashlib.sha256()
    h.update(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(fingerprint)
    return h.digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, fingerprint: bytes,
                 parent: bytes = b"", start_block: int = 0) -> list[bytes]:
    """Hashes of the full blocks of token_ids, from block `start_block` on,
    chained from `parent` (the hash of block start_block - 1)."""
    out = []
    for i in range(start_block, len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], fingerprint)
        out.append(parent)
    return out
