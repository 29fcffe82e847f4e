"""A cache's books: its stats, and the invariants that tie its sequences' block
tables to its pools' ref counts in every tier (Cache.stats, Cache.check_invariants)."""
from __future__ import annotations

import dataclasses


def main_pool(c):
    """The main pool's PoolStats as sequences see it. The block holes point at is the
    cache's own, not a sequence's: left out, as the capacity sequences can use
    (capacity = used + cached + free)."""
    main = c.main_pool.stats()
    if c.null_block is None:
        return main
    return dataclasses.replace(main, capacity=main.capacity - 1, used=main.used - 1)


def stats(c) -> dict:
    main = main_pool(c)
    tail = c.tail_pool.stats() if c.is_pq else None
    tokens = sum(s.length for s in c.seqs.values())
    # Tokens in sealed blocks the sequences hold, in every tier (a hole holds none: engine/window.py).
    sealed_tokens = sum(s.held_sealed_count() * c.bs for s in c.seqs.values())
    # The GPU pools' bytes over the tokens they hold: host and disk tokens take none of them.
    gpu_tokens = sum(s.length for s in c.seqs.values() if s.tier == "gpu")
    k = c.counters
    used_bytes = main.used * c.cfg.bytes_per_block()
    if c.is_pq:
        used_bytes += tail.used * c.bs * c.cfg.fp16_bytes_per_token()
    return dict(
        main=main, tail=tail, sequences=len(c.seqs), tokens=tokens, sealed_tokens=sealed_tokens,
        host_metadata_bytes=sum(s.host_bytes() for s in c.seqs.values()),
        sink_tokens=c.sinks,
        bytes_per_token=c.cfg.bytes_per_token(), fp16_bytes_per_token=c.cfg.fp16_bytes_per_token(),
        compression_ratio=c.cfg.fp16_bytes_per_token() / c.cfg.bytes_per_token(),
        used_bytes=used_bytes,
        effective_bytes_per_token=(used_bytes / gpu_tokens) if gpu_tokens else 0.0,
        prefix_hit_rate=(k["prefix_hit_tokens"] / k["prefix_query_tokens"]) if k["prefix_query_tokens"] else 0.0,
        tiers=c.tiering.stats() if c.tiering is not None else None,
        redis=c.redis.stats() if c.redis is not None else None,
        **k)


def check_invariants(c) -> None:
    """Pool accounting, and ref counts equal the references sequences hold,
    in every tier (holes hold none; the null block is the cache's own)."""
    refs = {tier: ({}, {}) for tier in ("gpu", "host")}
    if not c.is_pq:
        refs["gpu"] = (refs["gpu"][0], refs["gpu"][0])   # one pool for sealed and tail
    if c.null_block is not None:
        refs["gpu"][0][c.null_block] = 1
    for s in c.seqs.values():
        if s.tier == "disk":
            assert not s.sealed and not s.tail and s.manifest is not None, f"{s.seq_id}: disk tier holds ids"
            continue
        assert s.freed <= c.out_of_window(s), f"{s.seq_id}: a hole inside the window"
        if s.tier == "gpu":
            assert all(b == c.null_block for b in s.sealed[:s.freed]), f"{s.seq_id}: a hole holds a block"
        main_refs, tail_refs = refs[s.tier]
        assert s.tier == "gpu" or not s.seal_blocks, f"{s.seq_id}: holds seal blocks outside the GPU"
        assert len(s.seal_blocks) == (c.seals_ahead(s, s.max_length()) if c.is_pq else 0), \
            f"{s.seq_id}: holds {len(s.seal_blocks)} blocks for the seals of its uncommitted tokens"
        for b in s.held_sealed() + s.seal_blocks:
            main_refs[b] = main_refs.get(b, 0) + 1
        for b in s.tail:
            tail_refs[b] = tail_refs.get(b, 0) + 1
        assert len(s.sealed) >= c.sealed_count(s.length), f"{s.seq_id}: tail too long"
        assert (len(s.sealed) + len(s.tail)) * c.bs >= s.max_length(), f"{s.seq_id}: blocks do not cover tokens"
        if s.sealed:
            assert len(s.tail) >= c.sink_blocks, f"{s.seq_id}: sealed blocks before complete sinks"
            assert c.sinks + len(s.sealed) * c.bs <= s.length, f"{s.seq_id}: sealed beyond committed length"
    c.main_pool.check_invariants(refs["gpu"][0])
    if c.is_pq:
        c.tail_pool.check_invariants(refs["gpu"][1])
    if c.tiering is not None and c.tiering.host is not None:
        c.tiering.host.main_pool.check_invariants(refs["host"][0])
        c.tiering.host.tail_pool.check_invariants(refs["host"][1])
    if c.tiering is not None:
        c.tiering.check_invariants()
