"""A cache's view of the shared Redis tier (docs/design.md, Tiers; the store, its key
and value format and its failure handling: redis_store.py): main-pool
blocks that got a content hash go up to it once encoded, and so do a pq
cache's sink blocks (fp16, under fp16_key: below.py) once full; its other
fp16 blocks go up when their sequence is freed, or when they spill. The part of a prefix that no tier of this
host has is asked of it, in one batch per kind."""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import numpy as np
import torch

from kvstore.core.hashing import form_key
from kvstore.cuda.pinned import to_device

from .interface import TieredCache
from .redis_format import HEADER_BYTES, block_key, check
from .redis_store import HIT, REFUSED, Put, RedisStore

log = logging.getLogger("kvstore.redis")
KNOWN_HASHES = 1 << 16                    # per cache: hashes known to be in Redis (not put again)
MAX_PENDING = 1 << 14                     # per cache: hashed blocks waiting for the next flush
REFUSED_LOG_S = 60.0                      # per cache: at most one WARNING this often for refused puts


class RedisTier:
    """A cache's view of the shared RedisStore, with its own counters.

    note() is the main pool's on_hash hook (Cache.hash_fp16 calls it for sink
    blocks): a block that got a content hash waits in `pending` until flush()
    (called once the write that hashed it has encoded it) packs the lot and
    queues one put per kind. get_prefix() serves Cache.allocate the blocks of
    a prefix that no tier of this host has."""

    def __init__(self, store: RedisStore, cache: TieredCache):
        self.store, self.c = store, cache
        self.pending: list[tuple[int, bytes, bool]] = []      # (block id, hash, a tail-pool block)
        self._known: OrderedDict[bytes, None] = OrderedDict()     # LRU; _epoch: the store's when filled
        # queued or being written: a block freed, then evicted before its put landed, is not put twice
        self._flight: set[bytes] = set()
        self._epoch = self._first_epoch = store.epoch
        self._lock = threading.Lock()           # counters and _known: the writer thread updates them too
        self.counters = dict(blocks_out=0, bytes_out=0, prefix_hits=0, bytes_in=0, misses=0, refused=0,
                             dropped_puts=0, errors=0)
        self._refused_logged = -REFUSED_LOG_S
        cache.main_pool.on_hash = self.note

    # --------------------------------------------------------------- puts
    def note(self, block_id: int, h: bytes, fp16: bool = False) -> None:
        """block_id of the main pool (of the tail pool: fp16) got hash h."""
        if self._is_known(form_key(h, fp16)):
            return
        if len(self.pending) >= MAX_PENDING:
            self._count(dropped_puts=1)
            return
        self.pending.append((block_id, h, fp16))

    def flush(self) -> None:
        """Queue the noted blocks that still hold their hash (an evicted one
        was overwritten: skipped; its spill puts it if it is still missing)."""
        todo, self.pending = self.pending, []
        for fp16 in (False, True):
            pool, io = (self.c.tail_pool, self.c.tail_io) if fp16 else (self.c.main_pool, self.c.main_io)
            seen, keep = set(), []
            for b, h, kind in todo:
                if kind == fp16 and pool.blocks[b].hash == h and h not in seen:
                    seen.add(h)
                    keep.append((b, h))
            if not keep:
                continue
            if not self.store.allow():
                self._count(dropped_puts=len(keep))
                continue
            self.put([form_key(h, fp16) for _, h in keep], io.pack([b for b, _ in keep]))

    def put(self, hashes: list[bytes], payload: torch.Tensor) -> None:
        """Queue blocks (payload [n, block bytes] uint8, any device) not known
        to be in Redis, under the keys `hashes` (below.py: an fp16 block's is
        fp16_key); also the spill paths' hook (below.py)."""
        idx = [i for i, h in enumerate(hashes) if not self._is_known(h)]
        if not idx:
            return
        if not self.store.allow():
            self._count(dropped_puts=len(idx))
            return
        if len(idx) < len(hashes):
            keep = to_device(torch.tensor(idx), payload.device)
            hashes, payload = [hashes[i] for i in idx], payload.index_select(0, keep)
        event = None
        if payload.is_cuda:       # the writer waits for the copy, the caller does not
            host = torch.empty(payload.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(payload, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(payload.device))
            payload = host
        with self._lock:
            self._flight.update(hashes)
        if not self.store.submit(Put(self, self.c.fingerprint, hashes, payload, event)):
            self.landed(hashes)
            self._count(dropped_puts=len(hashes))

    def spill(self, evicted: list[tuple[int, bytes]], fp16: bool) -> None:
        """GPU blocks (block id, hash) of the main pool (of a pq cache's tail
        pool: fp16) that a freed sequence held, or cached ones about to be reused
        that no host or disk tier keeps (below.py puts them where one does): the
        ones Redis may not have go up."""
        keys = [(b, form_key(h, fp16)) for b, h in evicted]
        keys = [(b, k) for b, k in keys if not self._is_known(k)]
        if keys:
            io = self.c.tail_io if fp16 else self.c.main_io
            self.put([k for _, k in keys], io.pack([b for b, _ in keys]))

    def written(self, hashes: list[bytes], block_bytes: int, failed: int) -> None:
        """Writer thread: hashes were stored, `failed` more refused by the server."""
        self._count(blocks_out=len(hashes), bytes_out=len(hashes) * block_bytes, dropped_puts=failed, errors=failed)
        self._remember(hashes)
        if failed and time.monotonic() - self._refused_logged >= REFUSED_LOG_S:
            # A server up but refusing writes (maxmemory under noeviction) is no outage: say so here.
            self._refused_logged = time.monotonic()
            log.warning("cache %r: Redis refused %d block puts (%s); the Redis tier keeps no copy of them "
                        "(run Redis with an allkeys-* maxmemory-policy)", self.c.cfg.name, failed,
                        self.store.stats()["last_error"])

    def landed(self, hashes: list[bytes]) -> None:
        """Writer thread: a put of hashes is done with, stored or not."""
        with self._lock:
            self._flight.difference_update(hashes)

    def knows(self, h: bytes) -> bool:
        """Block key h is in Redis, or on its way (a put queued or being written)."""
        return self._is_known(h)

    def lost_since_start(self) -> bool:
        """Redis may have lost blocks this cache put (restarted, or came back from an
        outage) since the cache began."""
        return self.store.epoch != self._first_epoch

    def _known_now(self) -> OrderedDict:
        """The hashes known to be in Redis since it last came back (under self._lock)."""
        if self._epoch != self.store.epoch:
            self._known.clear()
            self._epoch = self.store.epoch
        return self._known

    def _is_known(self, h: bytes) -> bool:
        """h is in Redis, or on its way."""
        with self._lock:
            if h in self._known_now():
                self._known.move_to_end(h)
            return h in self._known or h in self._flight

    def _remember(self, hashes: list[bytes]) -> None:
        with self._lock:
            self._known_now()
            for h in hashes:
                self._known[h] = None
                self._known.move_to_end(h)
            while len(self._known) > KNOWN_HASHES:
                self._known.popitem(last=False)

    def _forget(self, hashes: list[bytes]) -> None:
        with self._lock:
            for h in hashes:
                self._known.pop(h, None)

    # -------------------------------------------------------------- reads
    def get_prefix(self, hashes: list[bytes], device, fp16: bool = False) -> tuple[torch.Tensor, str | None]:
        """Payloads [n, block bytes] uint8 on device of the leading n blocks of
        `hashes` (chained hashes: their sealed forms, or their fp16 forms) that
        Redis holds and that check out. The values are received
        straight into pinned memory (RedisStore.read_into), checked by the
        threads that received them, and each chunk's host-to-device copy is
        queued on the current stream as soon as the chunk is in.
        -> (payloads, why they end before `hashes` do: "miss", "refused",
        "error"; None where they do not). A refused value is counted here; a
        miss by the caller (missed(): prefix.py asks a sealed block in two
        forms and counts one miss)."""
        fp, width, n = self.c.fingerprint, self._width(fp16), len(hashes)
        hashes = [form_key(h, fp16) for h in hashes]
        device = torch.device(device)
        out = torch.empty((n, width), dtype=torch.uint8, device=device)
        cuda = device.type == "cuda"
        host = torch.empty((n, width), dtype=torch.uint8, pin_memory=True) if cuda else out
        heads, rows = np.empty((n, HEADER_BYTES), dtype=np.uint8), host.numpy()
        chunks = self.store.read_into([block_key(fp, h) for h in hashes], heads, rows,
                                      lambda i: check(heads[i], rows[i], fp, hashes[i]))
        served, bad = 0, None
        try:
            for a, b, fut in chunks:
                got = fut.result()
                got = [None] * (b - a) if got is None else got      # None: Redis failed for the row
                k = next((j for j, v in enumerate(got) if v != HIT), len(got))     # hits leading the chunk
                if cuda and k:
                    out[a:a + k].copy_(host[a:a + k], non_blocking=True)
                served = a + k
                if k < len(got):
                    bad = got[k]
                    if bad is None:
                        self._count(errors=1)
                    break
        finally:
            for _, _, fut in chunks:       # every lane is done with heads and rows before they go
                fut.exception()
        ended = None if served == n else "error" if bad is None else "refused" if bad == REFUSED else "miss"
        if ended == "refused":
            self._refused(hashes[served])
        if served:
            self._remember(hashes[:served])
        if ended in ("miss", "refused"):
            # Redis evicted the block (maxmemory, a TTL) or holds a bad value under its key:
            # it and the prefix after it are put again as this prompt seals them, or the
            # hole would stop every later lookup of the prefix there for good.
            self._forget(hashes[served:])
        return out[:served], ended

    def missed(self) -> None:
        """Count a prefix's block that Redis held in no form asked."""
        self._count(misses=1)

    def served(self, n: int, fp16: int = 0) -> None:
        """Count n sealed and `fp16` fp16 prefix blocks from Redis that a sequence
        got (a lookup may return more than there is room to serve)."""
        if n or fp16:
            self._count(prefix_hits=n + fp16, bytes_in=n * self._width(False) + fp16 * self._width(True))

    def _width(self, fp16: bool) -> int:
        return (self.c.tail_io if fp16 else self.c.main_io).block_bytes()

    def _refused(self, h: bytes) -> None:
        self._count(refused=1)
        # the first one loudly: something else writes under our keys, or a value was damaged
        log.log(logging.WARNING if self.counters["refused"] == 1 else logging.DEBUG,
                "cache %r: refused the Redis value stored for block %s: not this cache's block, or damaged "
                "(its header or checksum does not check out; counted in redis_refused; served as a miss)",
                self.c.cfg.name, h.hex()[:16])

    def _count(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                self.counters[k] += v

    def stats(self) -> dict:
        st = self.store.stats()
        with self._lock:
            return dict(state=st["state"], up=st["up"], last_error=st["last_error"], **self.counters)
