"""Chained SHA-256 block hashes (docs/design.md, Prefix sharing).

h_i = sha256(h_{i-1} || token ids of block i as little-endian int64 || fingerprint)
with h_{-1} = sha256("kvstore.tenant\\0" + tenant) (b"" for caches that share prefixes across
tenants). Deterministic across processes, restarts and Python hash
seeds (never Python's `hash`).
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def _ids_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids (a list or an array('i')) as little-endian int64, the hashed form."""
    return np.asarray(token_ids, dtype="<i8").tobytes() if len(token_ids) else b""


def tenant_root(tenant: str, shared: bool) -> bytes:
    """h_{-1} of a tenant's sequences: b"" where the cache shares prefixes across tenants."""
    return b"" if shared else hashlib.sha256(b"kvstore.tenant\0" + tenant.encode()).digest()


def block_hash(parent: bytes, token_ids: Sequence[int], fingerprint: bytes) -> bytes:
    h = hashlib.sha256()
    h.update(parent)
    h.update(_ids_bytes(token_ids))
    h.update(fingerprint)
    return h.digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, fingerprint: bytes,
                 parent: bytes = b"", start_block: int = 0) -> list[bytes]:
    """Hashes of the full blocks of token_ids, from block `start_block` on,
    chained from `parent` (the hash of block start_block - 1)."""
    end = len(token_ids) // block_size
    if end <= start_block:
        return []
    raw = _ids_bytes(token_ids[start_block * block_size:end * block_size])   # converted once, not per block
    step = 8 * block_size
    out = []
    for i in range(end - start_block):
        h = hashlib.sha256(parent)
        h.update(raw[i * step:(i + 1) * step])
        h.update(fingerprint)
        parent = h.digest()
        out.append(parent)
    return out


def fp16_key(h: bytes) -> bytes:
    """The key below the GPU of block h's fp16 form (a pq cache's tail-pool block).
    Its sealed form is stored under h itself: a block of one prompt's fp16 tail
    seals in a longer prompt, so the two forms of one block need two keys."""
    return hashlib.sha256(b"kvstore.fp16\0" + h).digest()


def form_key(h: bytes, fp16: bool) -> bytes:
    """What block h is stored under below the GPU in that form."""
    return fp16_key(h) if fp16 else h
