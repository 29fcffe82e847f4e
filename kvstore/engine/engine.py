"""The engine: every cache of the daemon, each behind its own lock, with the
input checks shared by all callers (the gRPC servicer, tests, in-process users).

Tensors come in already decoded (torch); this layer checks shapes, dtypes,
values, layers and sequences (checks.py), then hands over to Cache. What it
hands back are the small dataclasses of results.py. It knows nothing of gRPC.

Locks: a request holds the lock of the one cache it names (Cache.lock), so a
long request in one cache never stalls another. Engine.lock guards only the
dict of caches; it is the innermost lock: taken briefly, possibly while holding
caches' locks (the lease reaper, delete_cache), never held while waiting for a
cache's lock, nor while a new cache allocates its pools (create_cache holds
its own lock then, for the pool budget). Work that must see every cache at
rest (the lease reaper) takes them all with locked_caches(). A request finds
its cache and locks it in _locked(), which also checks that the cache was not
deleted while the request waited for it.
"""
from __future__ import annotations

import contextlib
import gc
import threading

import torch

from kvstore import kernels
from kvstore.core.config import CacheConfig
from kvstore.core.sequence import Sequence
from kvstore.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, quote
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.redis_store import RedisConfig, RedisStore

from . import checks, lifecycle, results
from .cache import Cache
from .codebook_ops import CodebookOps
from .results import AllocateResult, CacheInfo, DeleteResult, PoolMap, ReserveResult, SequenceInfo


class Engine(CodebookOps):
    def __init__(self, device: str = "cpu", lmdb_path: str | None = None, lmdb_sync: bool = False,
                 lmdb_max_bytes: int = 0, redis: RedisConfig | None = None):
        """lmdb_path: the disk tier shared by every cache (keys carry each
        cache's fingerprint); lmdb_sync: make pressure spills durable too
        (Offload always is); lmdb_max_bytes: its bound (0: none); redis: the
        tier below it, shared with the daemons of other hosts (tiers/redis_store.py)."""
        self.device = device
        self.caches: dict[str, Cache] = {}
        self.lock = threading.RLock()      # the dict of caches (see the module docstring)
        self._creating = threading.Lock()  # one create_cache at a time: its budget holds till its cache is in
        from kvstore.tiers.lmdb_store import LMDBStore
        self.cold_store = LMDBStore(lmdb_path, sync=lmdb_sync, max_bytes=lmdb_max_bytes) if lmdb_path else None
        self.disk = DiskTier.of(self.cold_store) if self.cold_store is not None else None   # recovery at the start
        self.redis = RedisStore(redis) if redis is not None else None
        self.mappers = lifecycle.Mappers()   # who maps each cache's pool (MapPool)

    # --------------------------------------------------------------- caches
    def create_cache(self, cfg: CacheConfig, exist_ok: bool = False, max_pool_bytes: int = 0) -> CacheInfo:
        """exist_ok: an existing cache of the same configuration is no error;
        max_pool_bytes: memory all caches' pools may take together (lifecycle.check_budget).
        The pools are allocated outside Engine.lock (seconds for a large one), which every
        Heartbeat, Stats and lease sweep takes."""
        cfg, d = lifecycle.filled(cfg), cfg.geometry.head_dim
        if torch.device(cfg.device).type == "cuda" and d not in kernels.HEAD_DIMS:
            # Refused here, not at the first attend: the GPU decode plans take only these.
            raise InvalidArgument("geometry.head_dim", f"head_dim {d}: the GPU decode kernels take head_dim "
                                  f"{', '.join(map(str, kernels.HEAD_DIMS))} (a CPU cache takes any)")
        with self._creating:
            old = self.caches.get(cfg.name)
            if old is not None:
                if not (exist_ok and lifecycle.same(old.cfg, cfg)):
                    raise AlreadyExists("name", lifecycle.exists_message(old.cfg, cfg, exist_ok))
            else:
                lifecycle.check_budget([c.cfg for c in self._all()], cfg, max_pool_bytes)
                cache = Cache(cfg, self.cold_store, self.redis)
                with self.lock:
                    self.caches[cfg.name] = cache
        return self.cache_info(cfg.name)

    def config(self, name: str) -> CacheConfig:
        """A cache's configuration (frozen: read without its lock)."""
        return self.cache(name).cfg

    def cache_info(self, name: str) -> CacheInfo:
        with self._locked(name) as c:        # codebooks and fingerprint change together
            return results.cache_info(c)

    def cache(self, name: str) -> Cache:
        c = self.caches.get(name)      # one dict lookup: atomic, no lock needed to find one
        if c is None:
            raise NotFound("cache", f"no cache named {quote(name)}")
        return c

    @contextlib.contextmanager
    def _locked(self, name: str):
        """The cache `name`, its lock held. NotFound if it is deleted before the
        lock is ours: a request that waited on a deleted cache touches nothing of it."""
        c = self.cache(name)
        with c.lock:
            if self.caches.get(name) is not c:
                raise NotFound("cache", f"no cache named {quote(name)} (deleted)")
            yield c

    def delete_cache(self, name: str, force: bool = False, live=None) -> DeleteResult:
        """Drop a cache, its sequences of every tenant and tier, its pools: see
        lifecycle.drop (live(tenant, session): whether that lease is current)."""
        with self._locked(name) as cache:
            r = lifecycle.drop(cache, self.mappers.count(name), force, live)
            with self.lock:
                del self.caches[name]
        if cache.main_device.type == "cuda":
            del cache
            # Its pools' hooks and tiers refer back to it: collected, its pools go to the GPU's other users.
            gc.collect()
            torch.cuda.empty_cache()
        return r

    def _all(self) -> list[Cache]:
        with self.lock:
            return list(self.caches.values())

    @contextlib.contextmanager
    def locked_caches(self):
        """Hold every cache's lock at once -> the caches held. It never waits
        for one lock while holding another (it backs off and waits for the busy
        one alone), so a long request in one cache stalls no other meanwhile."""
        caches = self._all()
        first = 0
        while True:
            order = caches[first:] + caches[:first]
            held = []
            for c in order:
                if not c.lock.acquire(blocking=not held):
                    break
                held.append(c)
            if len(held) == len(order):
                break
            for c in held:
                c.lock.release()
            first = caches.index(order[len(held)])     # wait for the busy one first next time
        try:
            yield caches
        finally:
            for c in held:
                c.lock.release()

    # ------------------------------------------------------------ requests
    def allocate(self, name: str, tenant: str, seq_id: str, prompt, owner: str = "",
                 pinned: bool = False, persist: bool = False) -> AllocateResult:
        """prompt: token ids (a list or a protobuf repeated field); owner: the
        session whose lease lapse frees the sequence (see service/leases.py)."""
        with self._locked(name) as cache:          # the cheap refusals first, in Cache.allocate's order
            cache._require_ready()
            cache._check_new_sequence(tenant, seq_id)
            if persist and (cache.tiering is None or cache.tiering.disk is None):
                raise FailedPrecondition("persist", "the daemon has no disk tier (--lmdb) to offload to when the "
                                         "lease lapses; pin the sequence instead, or run the daemon with --lmdb")
        # Checking, copying and hashing a long prompt takes a while (~0.3 s for
        # 4M tokens): outside the lock. allocate() checks it all again.
        ids = cache.prompt_ids(prompt)
        hashed = cache.prompt_hashes(tenant, ids)
        with self._locked(name) as cache:     # allocate() rehashes if the cache changed meanwhile
            r = cache.allocate(tenant, seq_id, ids, hashed)
            s = cache.seqs[(tenant, seq_id)]
            s.owner, s.pinned, s.persist = owner, pinned, persist
            return r

    def append(self, name: str, tenant: str, seq_ids: list[str], k: torch.Tensor, v: torch.Tensor,
               counts: list[int], layer: int | None = None,
               token_ids: list | None = None, defer_write: bool = False) -> tuple | None:
        """k, v: [L, sum(counts), Hkv, d] (all layers) or [sum(counts), Hkv, d]
        (layer given); tokens of seq_ids[i] are the counts[i] rows after those
        of the earlier sequences; token_ids[i]: their ids (a list or a protobuf
        repeated field), optional; with `layer`, the ids of the tokens this
        layer adds (any layer may carry them; they must agree). Validated for all sequences before any
        sequence changes. defer_write (with layer): -> (slots, k, v) of tokens
        counted but not written, for Cache.attend(new=...); None: all written."""
        with self._locked(name) as cache:
            g = cache.cfg.geometry
            seqs = checks.sequences(cache, tenant, seq_ids, unique=True)
            if len(counts) != len(seqs):
                raise InvalidArgument("counts", f"{len(counts)} counts for {len(seqs)} sequences")
            if any(c <= 0 for c in counts):
                raise InvalidArgument("counts", "every count must be >= 1")
            n = sum(counts)
            if layer is None:
                shape = (g.num_layers, n, g.num_kv_heads, g.head_dim)
            else:
                checks.check_layer(cache.cfg, layer)
                shape = (n, g.num_kv_heads, g.head_dim)
            k = checks.request_tensor(cache.cfg, k, "k", shape, g.qk_limit)
            v = checks.request_tensor(cache.cfg, v, "v", shape)
            if token_ids is not None:
                if len(token_ids) != len(seqs):
                    raise InvalidArgument("token_ids", f"{len(token_ids)} id lists for {len(seqs)} sequences")
                for s, c, ids in zip(seqs, counts, token_ids):      # before any of them is copied
                    if len(ids) == c:       # as many ids as tokens: what is too long is the count
                        cache.check_count(s, c)
                    cache.check_length(len(ids), "token_ids")
            return self._append_checked(cache, seqs, k, v, counts, layer, token_ids, defer_write)

    def _append_checked(self, cache: Cache, seqs: list[Sequence], k: torch.Tensor, v: torch.Tensor,
                        counts: list[int], layer: int | None, token_ids: list | None,
                        defer_write: bool) -> tuple | None:
        """append() after its argument checks (under cache.lock): k, v already
        on the cache's device and dtype, of the shape counts and layer ask for."""
        checks.refusals(cache, seqs, counts, layer, token_ids)
        cache.resident(seqs, room=lambda: checks.write_room(cache, seqs, counts, layer))
        # Batches of several sequences are checked whole before any write.
        if len(seqs) > 1:
            checks.batch_room(cache, seqs, counts, layer, token_ids)
        deferred = None
        try:
            if layer is not None:        # decode: one scatter, one encode for the whole batch
                cache.defer_encodes()
                try:
                    slots = cache.append_layer_batch(seqs, layer, k, v, counts, defer_write=defer_write,
                                                     token_ids=token_ids)
                    deferred = (slots, k, v) if slots is not None else None
                finally:
                    cache.flush_encodes()
            else:
                off = 0
                for i, (s, c) in enumerate(zip(seqs, counts)):
                    ids = token_ids[i] if token_ids is not None and len(token_ids[i]) else None
                    cache.append(s, k[:, off:off + c], v[:, off:off + c], ids)
                    off += c
            cache.after_write(publish=deferred is None)     # else the attention publishes, after its write
        except BaseException:
            if deferred is not None:     # counted tokens hold their data, whatever failed after
                cache.tail.write_tokens(layer, *deferred)
            raise
        return deferred

    def attend(self, name: str, tenant: str, layer: int, seq_ids: list[str], q: torch.Tensor,
               scale: float = 0.0, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, d] -> out [B, Hq, d] in the cache dtype; written into `out`
        when it fits (see _out), which the caller compares with the result."""
        with self._locked(name) as cache:
            checks.check_layer(cache.cfg, layer)
            seqs = checks.sequences(cache, tenant, seq_ids, unique=False)
            q, scale = checks.query(cache.cfg, len(seqs), q, scale)
            cache.check_visible(layer, seqs)     # before paging in: a refused call moves nothing
            cache.resident(seqs)
            return cache.attend(layer, seqs, q, scale, out=checks.output_into(out, q))

    def append_attend(self, name: str, tenant: str, layer: int, seq_ids: list[str], k: torch.Tensor,
                      v: torch.Tensor, q: torch.Tensor, scale: float = 0.0,
                      out: torch.Tensor | None = None, token_ids=None, query_tokens: int = 1) -> torch.Tensor:
        """Decode step of one layer: k, v [B, Hkv, d] (one new token per
        sequence), q [B, Hq, d] -> out [B, Hq, d] (`out` as in attend).
        token_ids: optional, the new tokens' ids [B] (a list or a protobuf
        repeated field), so that generated tokens are hashed as they seal.
        query_tokens T in 2..128: k, v [B * T, Hkv, d], q [B * T, Hq, d], token_ids
        B * T, sequence b's in rows b*T.., attended causally (read_path.attend_multi)."""
        with self._locked(name) as cache:
            checks.check_layer(cache.cfg, layer)
            t = checks.query_tokens(cache.cfg, layer, query_tokens)
            seqs = checks.sequences(cache, tenant, seq_ids, unique=True)
            rows = len(seqs) * t
            q, scale = checks.query(cache.cfg, rows, q, scale)
            # append()'s checks less those done just above (errors in the same order).
            g = cache.cfg.geometry
            shape = (rows, g.num_kv_heads, g.head_dim)
            k = checks.request_tensor(cache.cfg, k, "k", shape, g.qk_limit)
            v = checks.request_tensor(cache.cfg, v, "v", shape)
            ids = checks.step_ids(token_ids, len(seqs), t)
            # The new tokens' write joins the attention (its decode graph, when it has one).
            new = self._append_checked(cache, seqs, k, v, [t] * len(seqs), layer, ids, defer_write=True)
            if t == 1:
                return cache.attend(layer, seqs, q, scale, out=checks.output_into(out, q), new=new)
            return cache.attend_multi(layer, seqs, q.reshape(len(seqs), t, g.num_q_heads, g.head_dim), scale,
                                      out=checks.output_into(out, q), new=new)

    def reserve(self, name: str, tenant: str, seq_id: str, n: int,
                known: tuple[int, int] = (0, 0)) -> ReserveResult:
        if n < 0 or n > 1 << 20:
            raise InvalidArgument("num_tokens", f"must be in [0, 2^20], got {n}")
        with self._locked(name) as cache:
            s = cache.seq(tenant, seq_id)
            cache.check_reservations_kept([s])
            cache.resident([s], "sequence_id", room=lambda: (*cache.reserve_room(s, n), 0))
            r = cache.reserve(s, n, known)
            cache.publish()
            return r

    def reserve_batch(self, name: str, tenant: str, seq_ids: list[str], n: int,
                      gpu_scope=contextlib.nullcontext,
                      known: list[tuple[int, int]] | None = None) -> list[ReserveResult]:
        """Reserve for a decode step of a batch, sequence by sequence. gpu_scope() (the
        caller's CUDA ordering against the client's stream) is entered only when the reserve
        may run GPU work (Cache.reserve_touches_gpu): the other steps of a decode loop then
        cost the GPU nothing, not even a switch to the daemon's context (~0.35 ms a step)."""
        if n < 0 or n > 1 << 20:
            raise InvalidArgument("num_tokens", f"must be in [0, 2^20], got {n}")
        if known is not None and len(known) != len(seq_ids):
            raise InvalidArgument("known_sealed", f"{len(known)} entries for {len(seq_ids)} sequences")
        with self._locked(name) as cache:
            seqs = checks.sequences(cache, tenant, seq_ids, unique=True)
            checks.reserve_refusals(cache, seqs)
            gpu = any(cache.reserve_touches_gpu(s, n) for s in seqs)
            with gpu_scope() if gpu else contextlib.nullcontext():
                cache.resident(seqs, room=lambda: checks.reserve_need(cache, seqs, n))
                checks.reserve_room(cache, seqs, n)
                cache.defer_encodes()
                try:
                    rs = [cache.reserve(s, n, k) for s, k in zip(seqs, known or [(0, 0)] * len(seqs))]
                finally:
                    cache.flush_encodes()
                if gpu:       # packs read the blocks: only in the client's CUDA order (else at a later flush)
                    cache.publish()
                return rs

    def map_pool(self, name: str, holder: tuple[str, str] = ("", "")) -> PoolMap:
        """The cache's pool tensors, all layers, for MapPool. holder: the (tenant,
        session) that maps them: the pool is not deleted until its lease lapses."""
        with self._locked(name) as c:       # under the lock delete_cache counts mappers under
            pm = results.pool_map(c)
            self.mappers.add(name, holder)
            return pm

    def release_mappings(self, tenant: str, session: str) -> int:
        """The session's lease lapsed: its mappings end -> how many."""
        return self.mappers.release(tenant, session)

    def retrieve(self, name: str, tenant: str, seq_id: str, start: int, end: int,
                 layer_start: int = 0, layer_end: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """fp16 K, V [layers, end - start, Hkv, d] of committed tokens [start,
        end); end 0: the sequence's length; layer_end 0: every layer."""
        with self._locked(name) as cache:
            layer_end = checks.layer_range(cache.cfg, layer_start, layer_end)
            s = cache.seq(tenant, seq_id)
            end = end or s.length          # 0: to the end
            checks.token_range(seq_id, start, end, s.length)
            cache.check_held(s, start, end)          # before paging in: a refused call moves nothing
            cache.resident([s], "sequence_id")
            return cache.retrieve(s, start, end, slice(layer_start, layer_end))

    def fork(self, name: str, tenant: str, src_id: str, dst_id: str, owner: str = "") -> None:
        with self._locked(name) as cache:
            src = cache.seq(tenant, src_id)
            cache._check_new_sequence(tenant, dst_id, "new_sequence_id")
            cache.resident([src], "sequence_id", room=lambda: (0, cache.fork_room(src), 0))
            cache.fork(src, tenant, dst_id)
            cache.seqs[(tenant, dst_id)].owner = owner

    def free(self, name: str, tenant: str, seq_ids: list[str]) -> None:
        with self._locked(name) as cache:
            seqs = checks.sequences(cache, tenant, seq_ids, unique=True, all_held=True)
            for s in seqs:
                cache.free(s)

    def offload(self, name: str, tenant: str, seq_ids: list[str], drop_uncommitted: bool = False) -> int:
        """Write sequences to the disk tier, durable once it returns -> tokens dropped (Cache.offload)."""
        with self._locked(name) as cache:
            seqs = checks.sequences(cache, tenant, seq_ids, unique=True, all_held=True)
            if cache.tiering is None or cache.tiering.disk is None:
                raise FailedPrecondition("sequence_ids", "no disk tier: start the daemon with --lmdb PATH")
            return cache.offload(seqs, drop_uncommitted)

    def prefetch(self, name: str, tenant: str, seq_ids: list[str]) -> None:
        """Page sequences back into the GPU pools ahead of use."""
        with self._locked(name) as cache:
            cache.resident(checks.sequences(cache, tenant, seq_ids, unique=True))

    # ------------------------------------------------------------ introspection
    def length(self, name: str, tenant: str, seq_id: str) -> int:
        """A sequence's committed tokens."""
        with self._locked(name) as c:
            return c.seq(tenant, seq_id).length

    def sequence_info(self, name: str, tenant: str, seq_id: str) -> SequenceInfo:
        with self._locked(name) as c:        # the ref counts match the block ids
            return results.sequence_info(c, c.seq(tenant, seq_id))

    def owned_sequences(self, tenant: str, owner: str, wait: bool = True) -> dict[str, list[tuple[str, bool]]]:
        """Lease hook: cache -> [(seq_id, persist)] of the unpinned sequences a
        session owns (each cache under its lock in turn). wait=False (a Heartbeat's count)
        takes no lock: every client beats, and a beat queued behind a long request (a
        SetCodebooks builds tables for seconds) holds a server thread; list() copies a
        cache's dict in one step under the GIL."""
        out: dict[str, list[tuple[str, bool]]] = {}
        if not owner:
            return out
        for c in self._all():
            with c.lock if wait else contextlib.nullcontext():
                ids = [(s.seq_id, s.persist) for s in list(c.seqs.values())
                       if s.tenant == tenant and s.owner == owner and not s.pinned]
            if ids:
                out[c.cfg.name] = ids
        return out

    def list_sequences(self, name: str, tenant: str) -> list[SequenceInfo]:
        with self._locked(name) as c:
            return [results.sequence_info(c, s) for (t, _), s in sorted(c.seqs.items()) if t == tenant]

    def stats(self, name: str | None = None) -> dict[str, dict]:
        """Stats of one cache (name) or all, by name, each under its lock in turn (a busy cache delays its entry only)."""
        caches = [self.cache(name)] if name is not None else sorted(self._all(), key=lambda c: c.cfg.name)
        out = {}
        for c in caches:
            with c.lock:
                out[c.cfg.name] = {**c.stats(), **results.memory(c)}
        return out

    def disk_stats(self) -> dict | None:     # one store under every cache; None without --lmdb
        return self.disk.stats() if self.disk is not None else None

    def check_invariants(self) -> None:
        for c in self._all():
            with c.lock:
                c.check_invariants()

    def close(self) -> None:
        """Before the process exits: persist sequences offloaded and prefix blocks kept on disk
        (lifecycle.at_stop), what LMDB holds synced, and queued Redis puts get a moment to go."""
        lifecycle.at_stop(self._all())
        if self.cold_store is not None:
            self.cold_store.sync()      # a clean shutdown: nothing in flight, the store's marker goes
        if self.redis is not None:
            self.redis.close()
