"""The host tier (docs/design.md, Tiers): pinned host copies of a cache's blocks, below
its GPU pools and above the disk tier (disk.py). A block crosses as its
payload (BlockIO: every layer's K then V)."""
from __future__ import annotations

import torch

from kvstore.core.block_pool import BlockPool


class HostTier:
    """Pinned host copies of blocks: a main pool (codec payloads, findable by
    hash) and an fp16 tail pool. Metadata in BlockPools, bytes in two tensors."""

    def __init__(self, main_block_bytes: int, tail_block_bytes: int, n: int, pin: bool):
        # n blocks in each pool (CacheConfig.host_blocks). Both hold the same number:
        # a sequence needs about one tail block for every ~8 sealed ones, but a pool
        # that can hold every block of an offloaded sequence never refuses.
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
