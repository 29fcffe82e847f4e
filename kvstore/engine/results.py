"""What the engine hands its callers (the service, tests, in-process users):
small dataclasses, read from a cache under its lock, so that nothing outside
the engine reaches into a Cache (as vLLM's KVCacheBlocks stands between its
block manager and the scheduler)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstore.core.config import CacheConfig
from kvstore.core.sequence import Sequence
from kvstore.errors import FailedPrecondition, quote

from . import books


@dataclass(slots=True)
class AllocateResult:
    cached_tokens: int           # prompt tokens already cached: the caller computes only the rest
    hit_blocks: int


@dataclass(slots=True)
class ReserveResult:
    slot_mapping: list[int]     # tail-pool slot (block * bs + offset) of each reserved token
    sealed_blocks: list[int]    # the sealed table from sealed_start on
    tail_blocks: list[int]      # sink blocks first: one fp16 table for the kernels
    length: int                 # tokens visible after the reservation
    sealed_start: int = 0
    table_epoch: int = 0


@dataclass(slots=True)
class SequenceInfo:
    seq_id: str
    length: int
    sealed_blocks: list[int]     # block ids in the pools of the sequence's tier
    tail_blocks: list[int]
    pending: list[int]
    reserved: int
    known_token_ids: int
    block_hashes: list[bytes]
    owner: str = ""
    pinned: bool = False
    persist: bool = False
    tier: str = "gpu"
    sink_blocks: int = 0         # tail_blocks[:sink_blocks] hold the sink tokens
    sealed_block_refs: list[int] = field(default_factory=list)   # ref count of each sealed block
    tail_block_refs: list[int] = field(default_factory=list)
    window_freed_blocks: int = 0  # sealed_blocks[:n] are holes: released after they left the sliding window


@dataclass(slots=True)
class CacheInfo:
    cfg: CacheConfig
    codebooks_sha256: str        # "" until the cache has codebooks
    fingerprint: bytes           # part of every persisted key (codec/codebooks.py)
    capacity_blocks: int         # main pool
    tail_capacity_blocks: int    # fp16 tail pool (codec pq; 0 for fp16, whose tail is the main pool)

    @property
    def has_codebooks(self) -> bool:
        return bool(self.codebooks_sha256)


@dataclass(slots=True)
class PoolMap:
    """A cache's pool tensors, all layers, for clients that map them (MapPool)."""
    cfg: CacheConfig
    device: torch.device
    tensors: dict[str, torch.Tensor]


def cache_info(c) -> CacheInfo:
    return CacheInfo(c.cfg, c.codebooks_sha, c.fingerprint,
                     c.main_pool.capacity, c.tail_pool.capacity if c.is_pq else 0)


def sequence_info(c, s: Sequence) -> SequenceInfo:
    # Block ids index the pools of the tier the sequence lives in.
    host = c.tiering.host if s.tier == "host" else None
    main, tail = (host.main_pool, host.tail_pool) if host is not None else (c.main_pool, c.tail_pool)
    return SequenceInfo(s.seq_id, s.length, list(s.sealed), list(s.tail), list(s.pending), s.reserved,
                        len(s.token_ids), list(s.hashes), s.owner, s.pinned, s.persist, s.tier,
                        min(len(s.tail), c.sink_blocks),
                        [0 if i < s.freed else main.blocks[b].ref_cnt for i, b in enumerate(s.sealed)],
                        [tail.blocks[b].ref_cnt for b in s.tail], s.freed)


def pool_map(c) -> PoolMap:
    if c.is_pq:
        if c.codebooks is None:
            raise FailedPrecondition("codebooks", f"cache {quote(c.cfg.name)} has no codebooks yet")
        out = dict(k_codes=c.main.k_codes, v_codes=c.main.v_codes, k_codebook=c.main.k_cb,
                   v_codebook=c.main.v_cb, tail_k=c.tail.k, tail_v=c.tail.v)
        if c.main.cb_words is not None:      # the kernels' layout of the codebooks, kept current
            out["codebook_image"] = c.main.cb_words
        return PoolMap(c.cfg, c.main_device, out)
    return PoolMap(c.cfg, c.main_device, dict(k=c.main.k, v=c.main.v))


def memory(c) -> dict[str, int]:
    """Reserved (allocated at creation, whatever it holds) and used bytes of
    each of a cache's pools, for Stats."""
    cfg = c.cfg
    main = books.main_pool(c).used
    out = dict(main_reserved_bytes=c.main_pool.capacity * cfg.bytes_per_block(),
               main_used_bytes=main * cfg.bytes_per_block(), tail_reserved_bytes=0, tail_used_bytes=0,
               host_used_bytes=0, reserved_bytes=pool_memory(cfg))
    if c.is_pq:
        per_block = cfg.block_size * cfg.fp16_bytes_per_token()
        out["tail_reserved_bytes"] = c.tail_pool.capacity * per_block
        out["tail_used_bytes"] = c.tail_pool.stats().used * per_block
    host = c.tiering.host if c.tiering is not None else None
    if host is not None:
        out["host_used_bytes"] = (host.main_pool.stats().used * host.main.shape[1]
                                  + host.tail_pool.stats().used * host.tail.shape[1])
    return out


def pool_memory(cfg: CacheConfig) -> int:
    """Memory a cache's pools take: main, fp16 tail (PQ) and host tier."""
    n = cfg.capacity_blocks() * cfg.bytes_per_block() + cfg.host_tier_bytes()
    if cfg.codec.kind == "pq":
        n += cfg.tail_capacity_blocks() * cfg.block_size * cfg.fp16_bytes_per_token()
    return n


@dataclass(slots=True)
class DeleteResult:
    """What a DeleteCache dropped: nothing of it is lost silently."""
    sequences: int               # every sequence of the cache, of every tenant and tier
    leased_sequences: int        # of them, held by a session whose lease was current (force)
    pinned_sequences: int        # of them, pinned (they would have outlived their session)
    disk_sequences: int          # of them, with a copy on the disk tier (deleted with it)
    main_blocks: int             # GPU main-pool blocks sequences held
    tail_blocks: int             # GPU fp16 tail-pool blocks sequences held (codec pq)
    host_blocks: int             # host-tier blocks sequences held
    cached_blocks: int           # unreferenced prefix blocks still findable in the GPU pools and host tier
    reserved_bytes: int          # GPU pools and host tier given back (results.pool_memory)
