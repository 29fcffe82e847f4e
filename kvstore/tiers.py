"""Host and disk tiers under a cache's GPU pools (DESIGN §7).

GPU pool -> pinned host pool -> LMDB. A block crosses tiers as its payload:
the bytes of every layer's K then V (codes for PQ blocks, fp16 for tail
blocks; storage.pack/unpack). Sequences move whole: in the host tier their
block ids point into the host pools; on disk they are a manifest plus block
values written in one LMDB transaction. Sealed blocks with a content hash are
stored under that hash (deduplicated, and found again after a restart).

Key layout (every key carries the cache fingerprint):
  b"B" fp hash            sealed block with a content hash
  b"S" fp tenant/seq #i   other blocks of a sequence (unhashed sealed, then tail)
  b"M" fp tenant/seq      the sequence manifest (JSON)
"""
from __future__ import annotations

import json
import struct

import numpy as np

import torch

from .block_pool import BlockPool
from .cold_store import LMDBStore


def _seq_key(fp: bytes, tenant: str, seq_id: str) -> bytes:
    t, s = tenant.encode(), seq_id.encode()
    return fp + struct.pack("<H", len(t)) + t + struct.pack("<H", len(s)) + s


def block_key(fp: bytes, h: bytes) -> bytes:
    return b"B" + fp + h


def manifest_key(fp: bytes, tenant: str, seq_id: str) -> bytes:
    return b"M" + _seq_key(fp, tenant, seq_id)


def seq_block_key(fp: bytes, tenant: str, seq_id: str, i: int) -> bytes:
    return b"S" + _seq_key(fp, tenant, seq_id) + struct.pack(">I", i)


class HostTier:
    """Pinned host copies of blocks: a main pool (codec payloads, findable by
    hash) and an fp16 tail pool. Metadata in BlockPools, bytes in two tensors."""

    def __init__(self, main_block_bytes: int, tail_block_bytes: int, host_bytes: int, pin: bool):
        per = main_block_bytes + tail_block_bytes
        # Split the budget so that both pools can hold the same number of blocks:
        # a sequence needs about one tail block for every ~8 sealed ones, but a
        # pool that can hold every block of an offloaded sequence never refuses.
        n = max(1, host_bytes // per)
        self.main_pool = BlockPool(n)
        self.tail_pool = BlockPool(n)
        self.main = torch.empty((n, main_block_bytes), dtype=torch.uint8, pin_memory=pin)
        self.tail = torch.empty((n, tail_block_bytes), dtype=torch.uint8, pin_memory=pin)

    def nbytes(self) -> int:
        return self.main.nbytes + self.tail.nbytes

    # Rows move in runs of consecutive host ids: one pinned DMA copy per run,
    # straight between GPU memory and the pinned pool, no staging.
    @staticmethod
    def put(buf: torch.Tensor, ids: list[int], payload: torch.Tensor) -> None:
        """payload [n, row bytes] (any device) -> rows ids of buf."""
        for i, a, n in _runs(ids):
            buf[a:a + n].copy_(payload[i:i + n], non_blocking=True)

    @staticmethod
    def get(buf: torch.Tensor, ids: list[int], device) -> torch.Tensor:
        """Rows ids of buf -> [n, row bytes] on device."""
        out = torch.empty((len(ids), buf.shape[1]), dtype=torch.uint8, device=device)
        for i, a, n in _runs(ids):
            out[i:i + n].copy_(buf[a:a + n], non_blocking=True)
        return out

    def settle(self) -> None:
        """Wait for copies into the pool before the CPU reads it."""
        if self.main.is_pinned() and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()


def _runs(ids: list[int]):
    """(position, first id, length) of each run of consecutive ids."""
    i = 0
    while i < len(ids):
        j = i + 1
        while j < len(ids) and ids[j] == ids[j - 1] + 1:
            j += 1
        yield i, ids[i], j - i
        i = j


class DiskTier:
    """A cache's view of the shared LMDB store."""

    def __init__(self, store: LMDBStore):
        self.store = store

    def write_sequence(self, fp: bytes, tenant: str, seq_id: str, manifest: dict,
                       hashed: list[tuple[bytes, torch.Tensor]], others: list[torch.Tensor], sync: bool) -> int:
        """One transaction: hashed blocks (skipped if present), the sequence's
        other blocks, then its manifest. Returns bytes written."""
        puts, nbytes = [], 0
        for h, payload in hashed:
            k = block_key(fp, h)
            if not self.store.contains(k):
                puts.append((k, memoryview(payload.contiguous().numpy())))
                nbytes += payload.numel()
        for i, payload in enumerate(others):
            puts.append((seq_block_key(fp, tenant, seq_id, i), memoryview(payload.contiguous().numpy())))
            nbytes += payload.numel()
        puts.append((manifest_key(fp, tenant, seq_id), json.dumps(manifest).encode()))
        self.store.write_batch(puts, [], sync=sync)
        return nbytes

    def read_sequence(self, fp: bytes, tenant: str, seq_id: str, manifest: dict, main_bytes: int,
                      tail_bytes: int, pin: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """-> (sealed rows [n, main_bytes], tail rows [t, tail_bytes]) uint8, read
        straight from LMDB's map into (pinned) host memory: one copy per block."""
        other = iter(range(manifest["n_other"]))

        def keys(hashes):
            return [block_key(fp, bytes.fromhex(h)) if h else seq_block_key(fp, tenant, seq_id, next(other))
                    for h in hashes]
        sealed_keys, tail_keys = keys(manifest["sealed_hashes"]), keys(manifest["tail_hashes"])
        out = []
        with self.store.env.begin(buffers=True) as txn:
            for ks, width in ((sealed_keys, main_bytes), (tail_keys, tail_bytes)):
                if not ks:
                    out.append(None)
                    continue
                rows = torch.empty((len(ks), width), dtype=torch.uint8, pin_memory=pin)
                arr = rows.numpy()
                for i, k in enumerate(ks):
                    v = txn.get(k)
                    if v is None or len(v) != width:
                        raise RuntimeError(f"sequence {seq_id!r} is incomplete on disk")
                    arr[i] = np.frombuffer(v, dtype=np.uint8)
                out.append(rows)
        return out[0], out[1]

    def delete_sequence(self, fp: bytes, tenant: str, seq_id: str, n_other: int) -> None:
        keys = [seq_block_key(fp, tenant, seq_id, i) for i in range(n_other)]
        self.store.write_batch([], keys + [manifest_key(fp, tenant, seq_id)])

    def manifests(self, fp: bytes):
        for k, v in self.store.scan(b"M" + fp):
            yield json.loads(v)

    def get_block(self, fp: bytes, h: bytes) -> bytes | None:
        return self.store.get_many([block_key(fp, h)])[0]

    def put_blocks(self, fp: bytes, items: list[tuple[bytes, torch.Tensor]]) -> int:
        puts = [(block_key(fp, h), memoryview(p.contiguous().numpy())) for h, p in items
                if not self.store.contains(block_key(fp, h))]
        if puts:
            self.store.write_batch(puts, [])
        return sum(v.nbytes for _, v in puts)
