"""What the tiers need of a cache (engine/cache.py's Cache implements it):
its metadata, which is core's (pools, sequences, fingerprint), and its blocks
as payloads. Nothing of the tensors behind the pools: the tiers import
nothing of the engine."""
from __future__ import annotations

from typing import Protocol

import torch

from kvstore.core.block_pool import BlockPool
from kvstore.core.config import CacheConfig
from kvstore.core.sequence import Sequence


class BlockPayloads(Protocol):
    """A pool's blocks as payloads [n, block_bytes()] uint8 (engine/block_io.py)."""
    device: torch.device

    def block_bytes(self) -> int: ...

    def pack(self, ids: list[int]) -> torch.Tensor: ...

    def unpack(self, ids: list[int], payload: torch.Tensor) -> None: ...


class TieredCache(Protocol):
    cfg: CacheConfig
    fingerprint: bytes                          # part of every key below the GPU
    is_pq: bool
    sink_blocks: int
    seqs: dict[tuple[str, str], Sequence]       # (tenant, seq_id) -> sequence
    main_pool: BlockPool                        # sealed blocks (codec fp16: every block)
    tail_pool: BlockPool                        # fp16 tail blocks (codec fp16: the main pool)
    main_io: BlockPayloads
    tail_io: BlockPayloads
    null_block: int | None                      # the id holes hold (engine/window.py); None: no holes
    redis: object                               # the cache's RedisTier (redis.py), or None

    def sealed_count(self, length: int) -> int:
        """Sealed blocks (holes included) a sequence of `length` committed tokens has."""

    def out_of_window(self, s: Sequence) -> int:
        """Leading sealed blocks of s that the cache's sliding window has let go (engine/window.py)."""

    def tail_block_index(self, j: int, n_sealed: int) -> int:
        """Block index (in position order) of tail[j] when n_sealed blocks are sealed."""

    def hash_fp16(self, bid: int, i: int, h: bytes, announce: bool = True) -> None:
        """Tail-pool block bid, block i of its sequence, is findable by h (and,
        pq, kept below the GPU when evicted: below.py)."""

    def movable(self, protect: set) -> list[Sequence]:
        """GPU sequences that may move down a tier to make room (protect's ids left out)."""

    def fits_after_moves(self, main: int, tail: int, protect: set, keep: set = frozenset()) -> bool:
        """Whether the pools could give main + tail blocks with every movable sequence moved down."""

    def pools_fit(self, main: int, tail: int, free_main: int, free_tail: int) -> bool:
        """Whether main sealed and tail fp16 blocks fit pools that can give free_main and free_tail."""

    def gpu_fits(self, main: int, tail: int) -> bool:
        """Whether the GPU pools can give main + tail blocks now."""
