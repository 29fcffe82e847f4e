"""The engine: every cache of the daemon, each behind its own lock, with the
input checks shared by all callers (the gRPC servicer, tests, in-process users).

Tensors come in already decoded (torch); this layer checks shapes, dtypes,
values, layers and sequences, then hands over to Cache. It knows nothing of gRPC.

Locks: a request holds the lock of the one cache it names (Cache.lock), so a
long request in one cache never stalls another. Engine.lock guards only the
dict of caches and what spans caches (the servicer's pool budget at
CreateCache); it is taken before, never while holding, a cache's lock. Work
that must see every cache at rest (the lease reaper) takes them all with
locked_caches().
"""
from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass

import torch

from kvstore.codec.codebooks import Codebooks, train_codebooks
from kvstore.core.config import CacheConfig
from kvstore.core.sequence import Sequence
from kvstore.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, quote
from kvstore.tiers.redis import RedisConfig, RedisStore
from .cache import AllocateResult, Cache, ReserveResult
from .checks import request_tensor

@dataclass(slots=True)
class SequenceInfo:
    seq_id: str
    length: int
    sealed_blocks: list[int]
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


class Engine:
    def __init__(self, device: str = "cpu", lmdb_path: str | None = None, lmdb_sync: bool = False,
                 lmdb_max_bytes: int = 0, redis: RedisConfig | None = None):
        """lmdb_path: the disk tier shared by every cache (keys carry each
        cache's fingerprint); lmdb_sync: make pressure spills durable too
        (Offload always is); lmdb_max_bytes: its bound (0: none); redis: the
        tier below it, shared with the daemons of other hosts (tiers/redis.py)."""
        self.device = device
        self.caches: dict[str, Cache] = {}
        self.lock = threading.RLock()      # the dict of caches (see the module docstring)
        self.cold_store = None
        if lmdb_path:
            from kvstore.tiers.lmdb_store import LMDBStore
            self.cold_store = LMDBStore(lmdb_path, sync=lmdb_sync, max_bytes=lmdb_max_bytes)
        self.redis = RedisStore(redis) if redis is not None else None

    # --------------------------------------------------------------- caches
    def create_cache(self, cfg: CacheConfig, exist_ok: bool = False) -> Cache:
        with self.lock:
            old = self.caches.get(cfg.name)
            if old is not None:
                if exist_ok and old.cfg == cfg:
                    return old
                raise AlreadyExists("name", f"cache {quote(cfg.name)} exists with another configuration"
                                    if exist_ok else f"cache {quote(cfg.name)} exists")
            cache = Cache(cfg, self.cold_store, self.redis)
            self.caches[cfg.name] = cache
            return cache

    def cache(self, name: str) -> Cache:
        c = self.caches.get(name)      # caches are never removed: no lock needed to find one
        if c is None:
            raise NotFound("cache", f"no cache named {quote(name)}")
        return c

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

    def set_codebooks(self, name: str, cb: Codebooks) -> str:
        cache = self.cache(name)
        with cache.lock:
            cache.set_codebooks(cb)
            return cb.sha256()

    def train_codebooks(self, name: str, k: torch.Tensor, v: torch.Tensor, niter: int = 20) -> str:
        cache = self.cache(name)
        g = cache.cfg.geometry
        for field, t, limit in (("k_samples", k, g.qk_limit), ("v_samples", v, None)):
            # Centroids are means of samples: samples the cache dtype holds give centroids it holds.
            request_tensor(cache.cfg, t, field, (None,) * t.dim(), limit)
        cb = train_codebooks(cache.cfg, k, v, niter=niter)   # slow: outside the lock
        return self.set_codebooks(name, cb)

    # ------------------------------------------------------------ checks
    def _seqs(self, cache: Cache, tenant: str, seq_ids: list[str], unique: bool) -> list[Sequence]:
        if not seq_ids:
            raise InvalidArgument("sequence_ids", "empty batch")
        if unique and len(set(seq_ids)) != len(seq_ids):
            raise InvalidArgument("sequence_ids", "a sequence appears twice in one batch")
        return [cache.seq(tenant, i) for i in seq_ids]

    @staticmethod
    def _layer(cache: Cache, layer: int) -> None:
        if not 0 <= layer < cache.cfg.geometry.num_layers:
            raise InvalidArgument("layer", f"{layer} outside [0, {cache.cfg.geometry.num_layers})")

    # ------------------------------------------------------------ requests
    def allocate(self, name: str, tenant: str, seq_id: str, prompt, owner: str = "",
                 pinned: bool = False, persist: bool = False) -> AllocateResult:
        """prompt: token ids (a list or a protobuf repeated field); owner: the
        session whose lease lapse frees the sequence (see service/leases.py)."""
        cache = self.cache(name)
        with cache.lock:          # the cheap refusals first, in Cache.allocate's order
            cache._require_ready()
            cache._check_new_sequence(tenant, seq_id)
        # Checking, copying and hashing a long prompt takes a while (~0.3 s for
        # 4M tokens): outside the lock. allocate() checks it all again.
        ids = cache.prompt_ids(prompt)
        hashed = cache.prompt_hashes(tenant, ids)
        with cache.lock:
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
        repeated field), optional. Validated for all sequences before any
        sequence changes. defer_write (with layer): -> (slots, k, v) of tokens
        counted but not written, for Cache.attend(new=...); None: all written."""
        cache = self.cache(name)
        with cache.lock:
            g = cache.cfg.geometry
            seqs = self._seqs(cache, tenant, seq_ids, unique=True)
            if len(counts) != len(seqs):
                raise InvalidArgument("counts", f"{len(counts)} counts for {len(seqs)} sequences")
            if any(c <= 0 for c in counts):
                raise InvalidArgument("counts", "every count must be >= 1")
            n = sum(counts)
            if layer is None:
                shape = (g.num_layers, n, g.num_kv_heads, g.head_dim)
            else:
                self._layer(cache, layer)
                shape = (n, g.num_kv_heads, g.head_dim)
            k = request_tensor(cache.cfg, k, "k", shape, g.qk_limit)
            v = request_tensor(cache.cfg, v, "v", shape)
            if token_ids is not None:
                if layer is not None:
                    raise InvalidArgument("token_ids", "token ids go with all-layer appends")
                if len(token_ids) != len(seqs):
                    raise InvalidArgument("token_ids", f"{len(token_ids)} id lists for {len(seqs)} sequences")
                for ids in token_ids:      # before any of them is copied
                    cache.check_length(len(ids), "token_ids")
            return self._append_checked(cache, seqs, k, v, counts, layer, token_ids, defer_write)

    def _append_checked(self, cache: Cache, seqs: list[Sequence], k: torch.Tensor, v: torch.Tensor,
                        counts: list[int], layer: int | None, token_ids: list | None,
                        defer_write: bool) -> tuple | None:
        """append() after its argument checks (under cache.lock): k, v already
        on the cache's device and dtype, of the shape counts and layer ask for."""
        cache.resident(seqs)
        # Batches of several sequences are checked whole before any write.
        if len(seqs) > 1:
            self._check_batch_room(cache, seqs, counts, layer, token_ids)
        deferred = None
        try:
            if layer is not None:        # decode: one scatter, one encode for the whole batch
                cache.defer_encodes()
                try:
                    slots = cache.append_layer_batch(seqs, layer, k, v, counts, defer_write=defer_write)
                    deferred = (slots, k, v) if slots is not None else None
                finally:
                    cache.flush_encodes()
            else:
                off = 0
                for i, (s, c) in enumerate(zip(seqs, counts)):
                    ids = token_ids[i] if token_ids is not None and len(token_ids[i]) else None
                    cache.append(s, k[:, off:off + c], v[:, off:off + c], ids)
                    off += c
            cache.after_write()
        except BaseException:
            if deferred is not None:     # counted tokens hold their data, whatever failed after
                cache.tail.write_tokens(layer, *deferred)
            raise
        return deferred

    @staticmethod
    def _check_batch_room(cache: Cache, seqs: list[Sequence], counts: list[int], layer: int | None,
                          token_ids: list | None = None) -> None:
        """Refuse a batch that will not fit, or that any of its sequences
        would refuse, before writing any of it."""
        main = tail = freed = 0
        for i, (s, c) in enumerate(zip(seqs, counts)):
            if (layer is None and any(s.pending)) or s.reserved:
                raise FailedPrecondition("sequence_ids", f"sequence {quote(s.seq_id)} has uncommitted tokens")
            if token_ids is not None and len(token_ids[i]):
                cache.check_token_ids(s, c, token_ids[i])
            m, t, f = cache.room_needed(s, c, layer)
            main, tail, freed = main + m, tail + t, freed + f
        cache.check_room(main, tail, freed)

    def _query(self, cache: Cache, seqs: list[Sequence], q: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, float]:
        """Checks shared by the attend paths -> (q on the cache device, scale)."""
        g = cache.cfg.geometry
        q = request_tensor(cache.cfg, q, "q", (len(seqs), g.num_q_heads, g.head_dim), g.qk_limit)
        if not 0 <= scale <= g.max_scale():      # NaN fails too; Inf is past the bound
            raise InvalidArgument("scale", f"must be in [0, {g.max_scale():.3g}] (0: 1/sqrt(head_dim); past the "
                                  f"bound, scores of {g.dtype} q and k overflow fp32), got {scale}")
        return q, scale or 1.0 / math.sqrt(g.head_dim)

    @staticmethod
    def _out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
        """out if the kernels can write the result straight into it (q's shape,
        dtype and device, contiguous), else None: the result gets its own tensor."""
        if out is None or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device \
                or not out.is_contiguous():
            return None
        return out

    def attend(self, name: str, tenant: str, layer: int, seq_ids: list[str], q: torch.Tensor,
               scale: float = 0.0, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, d] -> out [B, Hq, d] in the cache dtype; written into `out`
        when it fits (see _out), which the caller compares with the result."""
        cache = self.cache(name)
        with cache.lock:
            self._layer(cache, layer)
            seqs = self._seqs(cache, tenant, seq_ids, unique=False)
            q, scale = self._query(cache, seqs, q, scale)
            cache.check_visible(layer, seqs)     # before paging in: a refused call moves nothing
            cache.resident(seqs)
            return cache.attend(layer, seqs, q, scale, out=self._out(out, q))

    def append_attend(self, name: str, tenant: str, layer: int, seq_ids: list[str], k: torch.Tensor,
                      v: torch.Tensor, q: torch.Tensor, scale: float = 0.0,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode step of one layer: k, v [B, Hkv, d] (one new token per
        sequence), q [B, Hq, d] -> out [B, Hq, d] (`out` as in attend)."""
        cache = self.cache(name)
        with cache.lock:
            self._layer(cache, layer)
            seqs = self._seqs(cache, tenant, seq_ids, unique=True)
            q, scale = self._query(cache, seqs, q, scale)
            # append()'s checks less those done just above (errors in the same order).
            g = cache.cfg.geometry
            shape = (len(seqs), g.num_kv_heads, g.head_dim)
            k = request_tensor(cache.cfg, k, "k", shape, g.qk_limit)
            v = request_tensor(cache.cfg, v, "v", shape)
            # The new tokens' write joins the attention (its decode graph, when it has one).
            new = self._append_checked(cache, seqs, k, v, [1] * len(seqs), layer, None, defer_write=True)
            return cache.attend(layer, seqs, q, scale, out=self._out(out, q), new=new)

    def reserve(self, name: str, tenant: str, seq_id: str, n: int,
                known: tuple[int, int] = (0, 0)) -> ReserveResult:
        if n < 0 or n > 1 << 20:
            raise InvalidArgument("num_tokens", f"must be in [0, 2^20], got {n}")
        cache = self.cache(name)
        with cache.lock:
            s = cache.seq(tenant, seq_id)
            cache.resident([s])
            r = cache.reserve(s, n, known)
            cache.publish()
            return r

    def reserve_batch(self, name: str, tenant: str, seq_ids: list[str], n: int,
                      gpu_scope=contextlib.nullcontext,
                      known: list[tuple[int, int]] | None = None) -> list[ReserveResult]:
        """Reserve for a decode step of a batch, sequence by sequence.

        gpu_scope() (the caller's CUDA ordering against the client's stream) is
        entered only when the reserve may run GPU work (Cache.reserve_touches_gpu):
        the other steps of a decode loop then cost the GPU nothing, not even a
        switch to the daemon's context and back (~0.35 ms a step, measured)."""
        if n < 0 or n > 1 << 20:
            raise InvalidArgument("num_tokens", f"must be in [0, 2^20], got {n}")
        if known is not None and len(known) != len(seq_ids):
            raise InvalidArgument("known_sealed", f"{len(known)} entries for {len(seq_ids)} sequences")
        cache = self.cache(name)
        with cache.lock:
            seqs = self._seqs(cache, tenant, seq_ids, unique=True)
            for s in seqs:
                if any(s.pending):
                    raise FailedPrecondition("sequence_ids", f"sequence {quote(s.seq_id)} has uncommitted per-layer tokens")
            gpu = any(cache.reserve_touches_gpu(s, n) for s in seqs)
            with gpu_scope() if gpu else contextlib.nullcontext():
                cache.resident(seqs)
                cache.defer_encodes()
                try:
                    rs = [cache.reserve(s, n, k) for s, k in zip(seqs, known or [(0, 0)] * len(seqs))]
                finally:
                    cache.flush_encodes()
                if gpu:       # packs read the blocks: only in the client's CUDA order (else at a later flush)
                    cache.publish()
                return rs

    def pool_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The cache's pool tensors, all layers, for MapPool."""
        c = self.cache(name)
        with c.lock:
            if c.is_pq:
                if c.codebooks is None:
                    raise FailedPrecondition("codebooks", f"cache {quote(name)} has no codebooks yet")
                out = dict(k_codes=c.main.k_codes, v_codes=c.main.v_codes, k_codebook=c.main.k_cb,
                           v_codebook=c.main.v_cb, tail_k=c.tail.k, tail_v=c.tail.v)
                if c.main.cb_words is not None:      # the kernels' layout of the codebooks, kept current
                    out["codebook_image"] = c.main.cb_words
                return out
            return dict(k=c.main.k, v=c.main.v)

    def retrieve(self, name: str, tenant: str, seq_id: str, start: int, end: int,
                 layer_start: int = 0, layer_end: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.cache(name)
        with cache.lock:
            nl = cache.cfg.geometry.num_layers
            layer_end = layer_end or nl
            if not 0 <= layer_start < layer_end <= nl:
                raise InvalidArgument("layer_end", f"layers [{layer_start}, {layer_end}) outside [0, {nl})")
            s = cache.seq(tenant, seq_id)
            if not 0 <= start < end <= s.length:
                raise InvalidArgument("end", f"range [{start}, {end}) outside the {s.length} committed tokens")
            cache.resident([s])
            return cache.retrieve(s, start, end, slice(layer_start, layer_end))

    def fork(self, name: str, tenant: str, src_id: str, dst_id: str, owner: str = "") -> None:
        cache = self.cache(name)
        with cache.lock:
            src = cache.seq(tenant, src_id)
            cache._check_new_sequence(tenant, dst_id, "new_sequence_id")
            cache.resident([src])
            cache.fork(src, tenant, dst_id)
            cache.seqs[(tenant, dst_id)].owner = owner

    def free(self, name: str, tenant: str, seq_ids: list[str]) -> None:
        cache = self.cache(name)
        with cache.lock:
            seqs = self._seqs(cache, tenant, seq_ids, unique=True)
            for s in seqs:
                cache.free(s)

    def offload(self, name: str, tenant: str, seq_ids: list[str]) -> None:
        """Write sequences to the disk tier; returns once they are durable."""
        cache = self.cache(name)
        with cache.lock:
            seqs = self._seqs(cache, tenant, seq_ids, unique=True)
            if cache.tiering is None or cache.tiering.disk is None:
                raise FailedPrecondition("sequence_ids", "no disk tier: start the daemon with --lmdb PATH")
            for s in seqs:
                if any(s.pending) or s.reserved:
                    raise FailedPrecondition("sequence_ids", f"sequence {quote(s.seq_id)} has uncommitted tokens")
            cache.protect = set()
            cache.tiering.offload(seqs)

    def prefetch(self, name: str, tenant: str, seq_ids: list[str]) -> None:
        """Page sequences back into the GPU pools ahead of use."""
        cache = self.cache(name)
        with cache.lock:
            cache.resident(self._seqs(cache, tenant, seq_ids, unique=True))

    # ------------------------------------------------------------ introspection
    def sequence_info(self, name: str, tenant: str, seq_id: str) -> SequenceInfo:
        c = self.cache(name)
        with c.lock:
            s = c.seq(tenant, seq_id)
            return SequenceInfo(s.seq_id, s.length, list(s.sealed), list(s.tail), list(s.pending),
                                s.reserved, len(s.token_ids), list(s.hashes), s.owner, s.pinned, s.persist, s.tier,
                                min(len(s.tail), c.sink_blocks))

    def owned_sequences(self, tenant: str, owner: str) -> dict[str, list[tuple[str, bool]]]:
        """Lease hook: cache -> [(seq_id, persist)] of the unpinned sequences a
        session owns (each cache read under its own lock, one at a time)."""
        out: dict[str, list[tuple[str, bool]]] = {}
        if not owner:
            return out
        for c in self._all():
            with c.lock:
                ids = [(s.seq_id, s.persist) for s in c.seqs.values()
                       if s.tenant == tenant and s.owner == owner and not s.pinned]
            if ids:
                out[c.cfg.name] = ids
        return out

    def list_sequences(self, name: str, tenant: str) -> list[SequenceInfo]:
        cache = self.cache(name)
        with cache.lock:
            return [self.sequence_info(name, tenant, sid) for (t, sid) in sorted(cache.seqs) if t == tenant]

    def stats(self, name: str | None = None) -> dict[str, dict]:
        """Stats of one cache (name) or all, each read under its own lock in
        turn: a request in one cache delays only that cache's entry."""
        caches = [self.cache(name)] if name is not None else self._all()
        out = {}
        for c in caches:
            with c.lock:
                out[c.cfg.name] = c.stats()
        return out

    def check_invariants(self) -> None:
        for c in self._all():
            with c.lock:
                c.check_invariants()
