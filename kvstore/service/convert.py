"""Protobuf <-> the engine's types: cache specs and configs, and the replies
built from what the engine hands back (results.py, stats). The servicer and
the daemon build no message from engine data anywhere else."""
from __future__ import annotations

import contextlib
import dataclasses

from kvstore.core.config import CacheConfig, CodecConfig, ModelGeometry
from kvstore.engine import lifecycle
from kvstore.engine.results import CacheInfo, DeleteResult, ReserveResult, SequenceInfo
from kvstore.errors import KVStoreError
from kvstore.v1 import kvstore_pb2 as pb


def spec_to_config(spec: pb.CacheSpec, device: str) -> CacheConfig:
    g = spec.geometry
    return CacheConfig(
        name=spec.name, model_id=spec.model_id,
        geometry=ModelGeometry(g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim, g.dtype or "float16"),
        codec=CodecConfig(kind=spec.codec or "pq", num_subvectors=spec.num_subvectors),
        block_size=spec.block_size or 16,
        residual=spec.residual if spec.HasField("residual") else 128, sink_tokens=spec.sink_tokens,
        num_blocks=spec.num_blocks, pool_bytes=spec.pool_bytes,
        max_sequences=spec.max_sequences or 256, device=device, host_bytes=spec.host_bytes,
        low_watermark=spec.low_watermark, share_prefixes_across_tenants=spec.share_prefixes_across_tenants,
        layer_windows=tuple(spec.layer_windows), layer_chunks=tuple(spec.layer_chunks),
        logit_softcap=spec.logit_softcap, sink_logits=tuple(spec.sink_logits))


@contextlib.contextmanager
def spec_fields_named():
    """CreateCache's errors name CacheSpec's fields from the request's root
    (spec.geometry.head_dim, spec.codec, spec.pool_bytes), not the config's
    dataclass paths (codec.kind) that the engine raises."""
    try:
        yield
    except KVStoreError as e:
        raise type(e)(f"spec.{lifecycle.spec_name(e.field)}", e.message) from None


def config_to_spec(cfg: CacheConfig) -> pb.CacheSpec:
    g = cfg.geometry
    return pb.CacheSpec(
        name=cfg.name, model_id=cfg.model_id,
        geometry=pb.Geometry(num_layers=g.num_layers, num_q_heads=g.num_q_heads, num_kv_heads=g.num_kv_heads,
                             head_dim=g.head_dim, dtype=g.dtype),
        codec=cfg.codec.kind, num_subvectors=cfg.m if cfg.codec.kind == "pq" else 0,
        block_size=cfg.block_size, residual=cfg.residual, sink_tokens=cfg.sink_tokens,
        num_blocks=cfg.num_blocks, pool_bytes=cfg.pool_bytes,
        max_sequences=cfg.max_sequences, host_bytes=cfg.host_bytes, low_watermark=cfg.low_watermark,
        share_prefixes_across_tenants=cfg.share_prefixes_across_tenants,
        layer_windows=list(cfg.layer_windows), layer_chunks=list(cfg.layer_chunks),
        logit_softcap=cfg.logit_softcap, sink_logits=list(cfg.sink_logits))


def cache_info(i: CacheInfo) -> pb.CacheInfo:
    cfg = i.cfg
    return pb.CacheInfo(spec=config_to_spec(cfg), has_codebooks=i.has_codebooks, codebooks_sha256=i.codebooks_sha256,
                        fingerprint=i.fingerprint, capacity_blocks=i.capacity_blocks,
                        tail_capacity_blocks=i.tail_capacity_blocks, bytes_per_token=cfg.bytes_per_token(),
                        compression_ratio=cfg.fp16_bytes_per_token() / cfg.bytes_per_token())


def delete_reply(r: DeleteResult) -> pb.DeleteCacheReply:
    return pb.DeleteCacheReply(**dataclasses.asdict(r))


def reservation(r: ReserveResult) -> dict:
    """The fields of a Reservation (and of a single-sequence ReserveReply)."""
    return dict(slot_mapping=r.slot_mapping, sealed_blocks=r.sealed_blocks, tail_blocks=r.tail_blocks,
                length=r.length, sealed_start=r.sealed_start, table_epoch=r.table_epoch)


def sequence_info(i: SequenceInfo, owner_live: bool = True) -> pb.SequenceInfoReply:
    """owner_live: whether i.owner's lease is current (a lapsed one holds nothing: "")."""
    return pb.SequenceInfoReply(
        sequence_id=i.seq_id, length=i.length, sealed_blocks=i.sealed_blocks, sealed_block_refs=i.sealed_block_refs,
        tail_blocks=i.tail_blocks, tail_block_refs=i.tail_block_refs, pending=i.pending, reserved=i.reserved,
        known_token_ids=i.known_token_ids, block_hashes=i.block_hashes, tier=i.tier,
        owner_session=i.owner if owner_live else "", pinned=i.pinned, persist=i.persist, sink_blocks=i.sink_blocks,
        window_freed_blocks=i.window_freed_blocks)


def stats_reply(stats: dict[str, dict], operator: bool = True, disk: dict | None = None) -> pb.StatsReply:
    """Engine.stats() (and disk_stats()) -> StatsReply. operator: the caller is the daemon's own
    tenant; another gets no Redis error text (it names the Redis host, which tenants need not know)."""
    out = pb.StatsReply()
    if disk is not None:
        out.disk.CopyFrom(pb.DiskStats(bytes=disk["bytes"], entries=disk["entries"], used_bytes=disk["used_bytes"],
                                       max_bytes=disk["max_bytes"], held_bytes=disk["held_bytes"]))
    for name, s in stats.items():
        msg = out.caches.add(cache=name, **{k: v for k, v in s.items() if k not in ("main", "tail", "tiers", "redis")})
        msg.main.CopyFrom(_pool(s["main"]))
        if s["tail"] is not None:
            msg.tail.CopyFrom(_pool(s["tail"]))
        if s["tiers"] is not None:
            _tier_stats(msg, s["tiers"])
        if s["redis"] is not None:
            _redis_stats(msg, s["redis"])
            if not operator:
                msg.redis_last_error = ""
    return out


def _tier_stats(msg: pb.CacheStats, t: dict) -> None:
    for key in ("sequences_host", "sequences_disk", "offloads_host", "offloads_disk", "page_ins_host",
                "page_ins_disk", "bytes_down", "bytes_up", "spilled_blocks", "bytes_down_host", "bytes_down_disk",
                "bytes_up_host", "bytes_up_disk"):
        setattr(msg, key, t[key])
    msg.prefix_hit_blocks_host = t["prefix_hits_host"]
    msg.prefix_hit_blocks_disk = t["prefix_hits_disk"]
    msg.host_tier_bytes = t.get("host_bytes", 0)
    if "host_main" in t:
        msg.host.CopyFrom(_pool(t["host_main"]))
        msg.host_tail.CopyFrom(_pool(t["host_tail"]))
    if "disk" in t:
        d = t["disk"]
        msg.disk_bytes = d["bytes"]
        msg.disk_entries = d["entries"]
        msg.disk_used_bytes, msg.disk_max_bytes, msg.disk_held_bytes = d["used_bytes"], d["max_bytes"], d["held_bytes"]
        msg.disk_evictions, msg.disk_evicted_bytes = d["evictions"], d["evicted_bytes"]
        msg.disk_skipped_spills = d["skipped_spills"]


def _redis_stats(msg: pb.CacheStats, r: dict) -> None:
    msg.redis_state, msg.redis_last_error, msg.prefix_hit_blocks_redis = r["state"], r["last_error"], r["prefix_hits"]
    for key in ("blocks_out", "bytes_out", "bytes_in", "misses", "refused", "dropped_puts", "errors"):
        setattr(msg, "redis_" + key, r[key])


def _pool(p) -> pb.PoolStats:
    return pb.PoolStats(capacity=p.capacity, used=p.used, cached=p.cached, free=p.free, evictions=p.evictions)
