"""Metadata-only block pool: ref counts, an LRU free queue with O(1) removal,
and the prefix-hash index. No tensors live here (the engine owns them).

A block is in exactly one state:
  used     ref_cnt > 0
  cached   ref_cnt == 0, has a hash: in the free queue AND findable by hash
  free     ref_cnt == 0, no hash: in the free queue
Freed blocks with a hash go to the back of the free queue (evicted last),
freed blocks without one to the front (reused first), as vLLM does.
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    hash: bytes | None = None
    last_use: float = 0.0


@dataclass(slots=True)
class PoolStats:
    capacity: int
    used: int
    cached: int
    free: int
    evictions: int


class BlockPool:
    def __init__(self, num_blocks: int):
        assert num_blocks > 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self.evictions = 0
        # Called with [(block id, hash)] of cached blocks allocate() is about to
        # reuse, before anything overwrites them (the tiers copy them down).
        self.on_evict = None
        # Called with (block id, hash) when a block gets its content hash
        # (the shared Redis tier queues it for other hosts: tiers/redis.py).
        self.on_hash = None

    @property
    def capacity(self) -> int:
        return len(self.blocks)

    def num_allocatable(self) -> int:
        """Blocks an allocate() can return: free plus evictable cached ones."""
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take n blocks (ref_cnt 1) from the front of the free queue, evicting
        cached ones from the hash index. None, and no change, if fewer than n."""
        if n > len(self._free):
            return None
        now = time.monotonic()
        out, evicted = [], []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            blk = self.blocks[bid]
            if blk.hash is not None:
                if self._by_hash.get(blk.hash) == bid:
                    del self._by_hash[blk.hash]
                evicted.append((bid, blk.hash))
                blk.hash = None
                self.evictions += 1
            blk.ref_cnt = 1
            blk.last_use = now
            out.append(bid)
        if evicted and self.on_evict is not None:
            try:
                self.on_evict(evicted)
            except BaseException:        # nobody holds what this took: free again (the evicted stay evicted)
                for bid in out:
                    self.blocks[bid].ref_cnt = 0
                    self._free[bid] = None
                raise
        return out

    def ref(self, block_ids: list[int]) -> None:
        """Take one more reference on each block (used or cached)."""
        now = time.monotonic()
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.ref_cnt == 0:
                assert bid in self._free, f"block {bid} has no refs but is not in the free queue"
                del self._free[bid]
            blk.ref_cnt += 1
            blk.last_use = now

    def freed_by(self, block_ids: list[int], keep: set = frozenset()) -> int:
        """Blocks that releasing these references (one per occurrence) would free; keep:
        blocks someone is about to take a reference on, which no release frees."""
        refs = Counter(block_ids)
        return sum(1 for b, n in refs.items() if n >= self.blocks[b].ref_cnt and b not in keep)

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; at zero it becomes cached or free.
        A block whose hash another block holds in the index (the same content,
        computed again) is not findable: it becomes free, not cached. One whose
        hash no block holds (the first was evicted) takes its place."""
        for bid in block_ids:
            blk = self.blocks[bid]
            assert blk.ref_cnt > 0, f"double free of block {bid}"
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self._free[bid] = None
                if blk.hash is not None and self._by_hash.setdefault(blk.hash, bid) != bid:
                    blk.hash = None
                if blk.hash is None:
                    self._free.move_to_end(bid, last=False)

    def lookup(self, h: bytes) -> int | None:
        return self._by_hash.get(h)

    def set_hash(self, block_id: int, h: bytes, announce: bool = True) -> None:
        """Mark a full, immutable block as findable by its content hash. If
        another block already holds that hash, the index keeps the first.
        on_hash hears of a new hash unless announce is False."""
        blk = self.blocks[block_id]
        assert blk.ref_cnt > 0, f"hashing unreferenced block {block_id}"
        assert blk.hash is None or blk.hash == h, f"block {block_id} already has another hash"
        new = blk.hash is None
        blk.hash = h
        self._by_hash.setdefault(h, block_id)
        if new and announce and self.on_hash is not None:
            self.on_hash(block_id, h)

    def clear_hashes(self) -> None:
        """Forget every content hash (e.g. the codebooks changed)."""
        for blk in self.blocks:
            blk.hash = None
        self._by_hash.clear()

    def stats(self) -> PoolStats:
        cached = sum(1 for bid in self._free if self.blocks[bid].hash is not None)
        return PoolStats(capacity=self.capacity, used=self.capacity - len(self._free),
                         cached=cached, free=len(self._free) - cached, evictions=self.evictions)

    def check_invariants(self, expected_refs: dict[int, int] | None = None) -> None:
        """Assert the pool is self-consistent; with expected_refs (block id ->
        references held by sequences), also that ref counts equal those."""
        s = self.stats()
        assert s.used + s.cached + s.free == s.capacity, s
        for blk in self.blocks:
            assert (blk.ref_cnt == 0) == (blk.block_id in self._free), f"block {blk.block_id} free-queue mismatch"
            assert blk.ref_cnt >= 0
            if expected_refs is not None:
                want = expected_refs.get(blk.block_id, 0)
                assert blk.ref_cnt == want, f"block {blk.block_id}: ref_cnt {blk.ref_cnt}, held {want}"
        for h, bid in self._by_hash.items():
            assert self.blocks[bid].hash == h, f"hash index points at block {bid} with another hash"
        for blk in self.blocks:        # cached means findable
            assert blk.ref_cnt > 0 or blk.hash is None or self._by_hash.get(blk.hash) == blk.block_id, \
                f"block {blk.block_id} is cached but not findable by its hash"
