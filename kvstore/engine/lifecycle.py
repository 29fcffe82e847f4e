"""A cache's life beyond its requests: what CreateCache refuses (a name taken,
a pool past the daemon's budget), what DeleteCache drops (Engine.create_cache,
Engine.delete_cache hold the locks; these run under them), and what the daemon's
stop keeps (at_stop, which takes each cache's lock itself)."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

from kvstore.core.config import CacheConfig
from kvstore.errors import FailedPrecondition, KVStoreError, ResourceExhausted, quote

from . import results
from .results import DeleteResult

log = logging.getLogger("kvstore.engine")
STOP_LOCK_S = 5.0       # how long the stop waits for a cache a cut-off call still holds
STOP_KEEP_S = 5.0       # how long the stop writes prefix blocks only memory holds to disk, all caches together


def spec_name(path: str) -> str:
    """A CacheConfig field's path (codec.kind, geometry.head_dim, block_size) as the
    CacheSpec field a client sets (codec, geometry.head_dim, block_size): the codec's
    fields sit at the spec's top level, `kind` as `codec`."""
    head, _, rest = path.partition(".")
    return ("codec" if rest == "kind" else rest) if head == "codec" else path


def spec_fields(cfg: CacheConfig) -> dict[str, object]:
    """A configuration as flat CacheSpec field names -> values."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.name in ("geometry", "codec"):
            out.update({spec_name(f"{f.name}.{g.name}"): getattr(v, g.name) for g in dataclasses.fields(v)})
        else:
            out[f.name] = v
    return out


def filled(cfg: CacheConfig) -> CacheConfig:
    """cfg with its codec's default made explicit (num_subvectors 0: head_dim / 2 for
    pq; unused by fp16), so that a CreateCache naming the default and one leaving it
    unset ask for the same cache (exist_ok), and GetCache shows the M it runs."""
    m = cfg.m if cfg.codec.kind == "pq" else 0
    if cfg.codec.num_subvectors == m:
        return cfg
    return dataclasses.replace(cfg, codec=dataclasses.replace(cfg.codec, num_subvectors=m))


def _sized(cfg: CacheConfig) -> CacheConfig:
    """cfg with its pool given in blocks: pool_bytes and the num_blocks it holds ask for one pool."""
    return dataclasses.replace(cfg, num_blocks=cfg.capacity_blocks(), pool_bytes=0)


def same(old: CacheConfig, new: CacheConfig) -> bool:
    """A CreateCache asking for the cache that exists (exist_ok returns it)."""
    return _sized(old) == _sized(new)


def exists_message(old: CacheConfig, new: CacheConfig, exist_ok: bool) -> str:
    """Why a CreateCache of an existing name is refused: each field whose value
    differs, with both values (the pools' sizes in blocks)."""
    a, b = spec_fields(_sized(old)), spec_fields(_sized(new))
    # quoted: a per-layer or per-head field (sink_logits) can be thousands of values long
    diff = [f"{k} {quote(a[k])} (existing) vs {quote(b[k])} (requested)" for k in a if a[k] != b[k]]
    if not diff:
        return f"cache {quote(old.name)} exists with this configuration (exist_ok returns it)"
    return f"cache {quote(old.name)} exists with another configuration: " + ", ".join(diff)


# Caches one daemon holds at once. Any tenant may create one, and each adds about 30
# series to every metrics scrape and a lock, a pool and books to the daemon: a bound
# far past the handful of models (and their window groups) one GPU serves.
MAX_CACHES = 1024


def check_budget(held: list[CacheConfig], cfg: CacheConfig, max_pool_bytes: int) -> None:
    """Refuse a cache whose pools, with those of the caches held, pass max_pool_bytes
    (0: no bound), before anything is allocated: a pool past the machine's memory
    would get the daemon OOM-killed; and one past MAX_CACHES."""
    if len(held) >= MAX_CACHES:
        raise ResourceExhausted("name", f"the daemon holds {len(held)} caches, its most (delete one first)")
    if max_pool_bytes:
        used, need = sum(results.pool_memory(c) for c in held), results.pool_memory(cfg)
        if used + need > max_pool_bytes:
            # named: the field of the largest part (the main pool's size, or the host tier)
            host = cfg.host_tier_bytes()
            main = need - host
            field = "host_bytes" if host > main else "pool_bytes" if cfg.pool_bytes else "num_blocks"
            raise ResourceExhausted(field, f"the cache needs {need} bytes ({main} for its main and tail pools, "
                                    f"{host} for its host tier); {max(0, max_pool_bytes - used)} of "
                                    "the daemon's --max-pool-bytes are left")


class Mappers:
    """cache name -> the (tenant, session)s that mapped its pool (MapPool).
    While any holds the handles, the pool's memory must stay where it is; a
    mapping ends with its session's lease (a session of "" never lapses)."""

    def __init__(self):
        self._by_cache: dict[str, set[tuple[str, str]]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, holder: tuple[str, str]) -> None:
        with self._lock:
            self._by_cache.setdefault(name, set()).add(holder)

    def count(self, name: str) -> int:
        with self._lock:
            return len(self._by_cache.get(name, ()))

    def release(self, tenant: str, session: str) -> int:
        with self._lock:
            held = [s for s in self._by_cache.values() if (tenant, session) in s]
            for s in held:
                s.discard((tenant, session))
            return len(held)


def drop(cache, mappers: int, force: bool, live) -> DeleteResult:
    """Free every sequence of `cache` (under its lock) through the normal
    path, which deletes their disk copies and host blocks too -> what was
    dropped. Refuses, changing nothing, while `mappers` sessions map the pool,
    or (unless force) while sequences are held by a current lease
    (live(tenant, session))."""
    name = quote(cache.cfg.name)
    if mappers:
        raise FailedPrecondition("cache", f"cache {name} is mapped by {mappers} client session(s) (MapPool); "
                                 "their handles would read freed memory: it can be deleted once they stop "
                                 "(their lease lapses), whatever force says")
    seqs = list(cache.seqs.values())
    leased = [s for s in seqs if s.owner and live is not None and live(s.tenant, s.owner)]
    if leased and not force:
        raise FailedPrecondition("force", f"cache {name}: {len(leased)} of its {len(seqs)} sequences are held "
                                 "by live client leases; free them first, or pass force=true to drop them too")
    gpu = [s for s in seqs if s.tier == "gpu"]
    host = [s for s in seqs if s.tier == "host"]
    main_blocks = len({b for s in gpu for b in s.held_sealed() + s.seal_blocks})
    tail_blocks = len({b for s in gpu for b in s.tail}) if cache.is_pq else 0
    if not cache.is_pq:     # one pool: sealed and tail ids index the same blocks
        main_blocks = len({b for s in gpu for b in s.held_sealed() + s.tail})
    host_blocks = len({("m", b) for s in host for b in s.held_sealed()} | {("t", b) for s in host for b in s.tail})
    r = DeleteResult(sequences=len(seqs), leased_sequences=len(leased),
                     pinned_sequences=sum(1 for s in seqs if s.pinned),
                     disk_sequences=sum(1 for s in seqs if s.manifest is not None),
                     main_blocks=main_blocks, tail_blocks=tail_blocks, host_blocks=host_blocks,
                     cached_blocks=0, reserved_bytes=results.pool_memory(cache.cfg))
    # before the frees, which turn the blocks sequences held (counted above) into cached ones
    pools = [cache.main_pool] + ([cache.tail_pool] if cache.is_pq else [])
    if cache.tiering is not None and cache.tiering.host is not None:
        pools += [cache.tiering.host.main_pool, cache.tiering.host.tail_pool]
    r.cached_blocks = sum(p.stats().cached for p in pools)
    for s in seqs:
        cache.free(s)
    if cache.tiering is not None and cache.tiering.disk is not None and r.disk_sequences:
        cache.tiering.disk.sync()    # a restart must not bring the deleted sequences back
    cache.graphs.clear()         # captured over the pool's addresses
    if cache.is_pq:
        cache.main.release()     # the encoder's tables of its codebooks
    return r


def at_stop(caches) -> int:
    """The daemon stops, and every session's lease ends with it: each `persist`
    sequence not yet durable on disk is offloaded, as a lapsed lease offloads it,
    past the disk tier's byte bound if it must (once every prefix block there is
    evicted; logged: nothing else could keep it); one that the store cannot take
    at all (its map full, an I/O error) is named in a WARNING: it is gone. Then, for at most
    STOP_KEEP_S in all, the blocks with a content hash only memory holds go to disk
    (below.keep_on_disk), so that prompts after a restart hit them. -> sequences offloaded."""
    done, kept, deadline = 0, 0, time.monotonic() + STOP_KEEP_S
    for c in caches:
        if c.tiering is None or c.tiering.disk is None:
            continue
        if not c.lock.acquire(timeout=STOP_LOCK_S):
            log.warning("cache %s: still busy at the stop: its persist sequences are not offloaded", quote(c.cfg.name))
            continue
        try:
            for s in [s for s in c.seqs.values() if s.persist and not (s.manifest or {}).get("durable")]:
                try:
                    # a step the stop cut off is dropped: its committed tokens go
                    cut = c.offload([s], drop_uncommitted=True, past_bound=True)
                    done += 1
                    store = c.tiering.disk.store
                    if store.max_bytes and store.used_bytes > store.max_bytes:
                        log.warning("cache %s: persist sequence %s/%s offloaded at the stop past the disk tier's "
                                    "bound: it holds %d bytes of its %d (--lmdb-max-bytes) until sequences on it are "
                                    "freed", quote(c.cfg.name), s.tenant, s.seq_id, store.used_bytes, store.max_bytes)
                    if cut:
                        log.info("cache %s: persist sequence %s/%s offloaded at the stop without the %d tokens of "
                                 "its unfinished step", quote(c.cfg.name), s.tenant, s.seq_id, cut)
                except (KVStoreError, OSError) as e:
                    log.warning("cache %s: persist sequence %s/%s not offloaded at the stop (%s): it is gone",
                                quote(c.cfg.name), s.tenant, s.seq_id, e)
            try:
                kept += c.tiering.keep_on_disk(deadline)
            except (KVStoreError, OSError) as e:     # prefix copies only: the next cache's sequences still go
                log.warning("cache %s: cached prefix blocks not written to the disk tier at the stop (%s)",
                            quote(c.cfg.name), e)
        finally:
            c.lock.release()
    if done or kept:
        log.info("stop: %d persist sequences offloaded, %d prefix blocks written to the disk tier", done, kept)
    return done
