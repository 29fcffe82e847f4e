"""The shared cold tier on Redis or Valkey (docs/design.md, Tiers): below the host and
disk tiers, so that daemons on many hosts share prefix blocks.

Only main-pool blocks with a content hash go there (sealed PQ blocks; full
blocks for codec fp16). The hash chains the block's token ids with the cache
fingerprint (core/hashing.py), so one key means one content on every host with
the same model, geometry and codebooks, and a prefix hit crosses the network
as PQ codes (storage.pack: every layer's K codes, then V codes).

Keys and values: redis_format.py (kvstore:v2:<fingerprint>:<hash>, an 88-byte
header with a checksum, then the payload). No hash tag ({...}): Redis Cluster
hashes the whole key, so one cache's blocks spread over every slot. A lookup
reads the prefix it misses in pipelines of GETs, not an MGET, which a cluster
refuses across slots (CROSSSLOT); a Cluster client must split such a pipeline
by node, one round trip per node owning keys of it.

Reads take the bulk path of resp.py: RedisConfig.read_connections
connections of its own, each a pipeline of GETs (GETEX with a TTL) of
contiguous chunks of rows, one chunk sent ahead of the one being read, every
value received straight into the caller's (pinned) rows. A chunk's values
are checked on a small pool of checking threads while its connection
receives the next chunk (docs/scale.md, What limits it). Puts and the
breaker's PING go through redis-py.

Eviction is Redis's own: run it with `maxmemory <bytes>` and
`maxmemory-policy allkeys-lru` (these blocks are a cache: any of them may go).
--redis-ttl adds an expiry to every put; every hit renews it (GETEX).

Redis down or slow never fails a request and delays one by at most one
socket timeout (--redis-timeout): no client retries, and a circuit breaker
skips a failed Redis for a back-off (0.5 s doubling up to --redis-backoff)
before it tries again, logging one WARNING per outage and one INFO on
recovery. Puts go through a bounded queue to one writer thread: a full queue
drops and counts, never waits. A block this daemon put or read is not put
again until Redis comes back from an outage (which may have emptied it).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

import numpy as np
import torch

from kvstore.errors import InvalidArgument

from . import resp
from .redis_format import block_key, pack_value

log = logging.getLogger("kvstore.redis")

GET_CHUNK_BYTES = 8 << 20         # a lookup's rows go in chunks of this much: one pipeline each
# One Redis 7 instance serves a lookup fastest over 1 connection: its main thread copies
# every value into a reply buffer, and more connections only interleave that work
# (docs/scale.md, What limits it: 3.4-4.1 GB/s with 1, 1.6-2.3 with 8 on the H100 host).
READ_CONNECTIONS = 1
# Checking runs at about 5 GB/s a core (redis_format.checksum): a few threads keep up
# with what one host receives from several shards, and take the checks off the
# connections' threads so that receiving never waits for them.
CHECK_THREADS = max(2, min(8, (os.cpu_count() or 1) // 2))
MAX_READ_CONNECTIONS = 64
PUT_BATCH_BYTES = 16 << 20        # one pipeline of the writer sends at most this much
BACKOFF_START_S = 0.5
HIT, MISS, REFUSED, SKIPPED = "hit", "miss", "refused", "skipped"     # a row's verdict (read_into)
# What a rediss:// URL may add (redis-py and resp.tls_context pass them to the TLS connection).
TLS_OPTIONS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """url: redis://[user:password@]host:port/db (rediss:// for TLS, which may
    add TLS_OPTIONS); ttl_s: expiry of each block (0: none, maxmemory-policy
    alone evicts); timeout_s: connect and socket timeout; backoff_s: the
    longest a failed Redis is skipped; queue_bytes: puts waiting for the
    writer before new ones are dropped; read_connections: connections a
    lookup reads over from one Redis (READ_CONNECTIONS)."""
    url: str
    ttl_s: int = 0
    timeout_s: float = 0.25
    backoff_s: float = 10.0
    queue_bytes: int = 64 << 20
    read_connections: int = READ_CONNECTIONS

    def __post_init__(self) -> None:
        try:
            u = urlsplit(self.url)
            u.port                      # raises on a port that is not a number in range
        except ValueError as e:
            raise InvalidArgument("redis", f"{self.redacted()}: {e}") from None
        db = u.path.strip("/")
        if u.scheme not in ("redis", "rediss"):
            raise InvalidArgument("redis", f"{self.redacted()}: scheme must be redis:// or rediss:// (TLS)")
        if not u.hostname:
            raise InvalidArgument("redis", f"{self.redacted()}: no host (redis://[user:password@]host:port/db)")
        if db and not db.isdigit():
            raise InvalidArgument("redis", f"{self.redacted()}: the path must be a database number, got {db!r}")
        opts = parse_qs(u.query, keep_blank_values=True)
        bad = sorted(set(opts) - set(TLS_OPTIONS)) if u.scheme == "rediss" else sorted(opts)
        if bad or u.fragment:
            raise InvalidArgument("redis", f"{self.redacted()}: unexpected {bad or u.fragment!r}: only a rediss:// "
                                  f"(TLS) URL takes options, {', '.join(TLS_OPTIONS)}; timeouts and TTL are flags")
        if opts.get("ssl_cert_reqs", [""])[-1] not in ("", "none", "optional", "required"):
            raise InvalidArgument("redis", f"{self.redacted()}: ssl_cert_reqs must be none, optional or required")
        if self.ttl_s < 0:
            raise InvalidArgument("redis-ttl", f"must be >= 0, got {self.ttl_s}")
        if not 0 < self.timeout_s <= 60:
            raise InvalidArgument("redis-timeout", f"must be in (0, 60] seconds, got {self.timeout_s}")
        if not 0 < self.backoff_s <= 3600:
            raise InvalidArgument("redis-backoff", f"must be in (0, 3600] seconds, got {self.backoff_s}")
        if self.queue_bytes <= 0:
            raise InvalidArgument("queue_bytes", f"must be > 0, got {self.queue_bytes}")
        if not 1 <= self.read_connections <= MAX_READ_CONNECTIONS:
            raise InvalidArgument("redis-read-connections",
                                  f"must be in [1, {MAX_READ_CONNECTIONS}], got {self.read_connections}")

    def redacted(self) -> str:
        """The URL without its password (for logs and errors)."""
        try:
            u = urlsplit(self.url)
            if u.password is None:
                return self.url
            return u._replace(netloc=u.netloc.replace(":" + u.password + "@", ":***@", 1)).geturl()
        except ValueError:
            return "<unparsable URL>"


@dataclass(slots=True)
class Put:
    tier: object                    # the RedisTier (redis.py) whose counters written() updates
    fp: bytes
    hashes: list[bytes]
    rows: torch.Tensor              # [n, block bytes] uint8 on the CPU (pinned when copied from a GPU)
    event: object = None            # CUDA event after the copy into rows, or None


class RedisStore:
    """One Redis for the whole daemon: the client, the circuit breaker and the
    put queue with its writer thread. Caches see it through RedisTier."""

    def __init__(self, cfg: RedisConfig):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        self.cfg = cfg
        self._errors = (redis.RedisError, OSError)
        # No client retries: the breaker decides when Redis is tried again.
        self.client = redis.Redis.from_url(cfg.url, socket_timeout=cfg.timeout_s,
                                           socket_connect_timeout=cfg.timeout_s, retry=Retry(NoBackoff(), 0))
        self._lock = threading.Lock()
        self.up, self.last_error, self.epoch = True, "", 0
        self.counters = dict(errors=0, outages=0)     # calls that failed; times it went down
        self._backoff, self._retry_at, self._down_since = BACKOFF_START_S, 0.0, 0.0
        self._cv = threading.Condition()
        self._queue: deque[Put] = deque()
        self._queued_bytes = 0
        self._closed = False
        self._writer = threading.Thread(target=self._run, name="kvstore-redis-writer", daemon=True)
        self._writer.start()
        # A lookup's connections each receive on a thread of their own (the caller
        # meanwhile copies the chunks that are in on to the device); the values are
        # checked on other threads, while their connection receives the next chunk.
        self._readers = ThreadPoolExecutor(cfg.read_connections, thread_name_prefix="kvstore-redis-read")
        self._checkers = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="kvstore-redis-check")
        self._idle: list[resp.RespConnection] = []       # read connections (resp.py) not in use
        self._closed_reads = False
        self.ping()

    # ---------------------------------------------------------- the breaker
    def allow(self) -> bool:
        """Whether to try Redis now: up, or down with its back-off over."""
        with self._lock:
            return self.up or time.monotonic() >= self._retry_at

    def _ok(self, started: float | None = None) -> None:
        """A call that began at `started` (monotonic) succeeded. One that began
        before Redis was last seen failing says nothing of now: lanes of one read
        finish at different times, and a lane that got its replies in before a
        kill must not mark the store up again after another lane marked it down."""
        with self._lock:
            if self.up or (started is not None and started <= self._down_since):
                return
            self.up, self._backoff = True, BACKOFF_START_S
            self.epoch += 1          # what Redis holds may have changed (a restart without persistence)
            log.info("redis tier %s is back after %.1f s", self.cfg.redacted(), time.monotonic() - self._down_since)

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            now = time.monotonic()
            self.counters["errors"] += 1
            self.last_error = f"{type(e).__name__}: {e}"
            if self.up:
                self.up, self._down_since = False, now
                self.counters["outages"] += 1
                log.warning("redis tier %s is down (%s); serving without it, trying again every %.1f-%.1f s",
                            self.cfg.redacted(), self.last_error, BACKOFF_START_S, self.cfg.backoff_s)
            else:
                self._backoff = min(self._backoff * 2, self.cfg.backoff_s)
            self._retry_at = now + min(self._backoff, self.cfg.backoff_s)

    def ping(self) -> bool:
        try:
            self.client.ping()
        except self._errors as e:
            self._fail(e)
            return False
        self._ok()
        return True

    # ---------------------------------------------------------------- reads
    def read_into(self, keys: list[bytes], heads: np.ndarray, rows: np.ndarray,
                  verify) -> list[tuple[int, int, Future]]:
        """GET keys[i] (GETEX with a TTL) into heads[i] ([n, HEADER_BYTES]
        uint8) and rows[i] ([n, payload bytes] uint8, e.g. pinned), verify(i)
        -> bool on a checking thread. -> (a, b, future) per chunk of rows
        [a, b), in order; a future gives the chunk's verdicts (HIT, MISS,
        REFUSED, or SKIPPED: not asked or not checked, past a row that was
        not a hit) or None where Redis failed. The rows of a chunk are
        written and checked before its future is done; the caller waits on
        every future before it lets heads and rows go."""
        n = len(keys)
        per = max(1, GET_CHUNK_BYTES // max(1, heads.shape[1] + rows.shape[1]))
        chunks = [(a, min(n, a + per), Future()) for a in range(0, n, per)]
        if not self.allow():
            for _, _, f in chunks:
                f.set_result(None)
            return chunks
        lanes = min(self.cfg.read_connections, len(chunks))
        stop = _Stop(n, time.monotonic())
        for p in range(lanes):        # the caller waits on the chunks in order (and copies each on)
            self._readers.submit(self._lane, keys, heads, rows, verify, chunks[p::lanes], stop)
        return chunks

    def _gets(self, keys: list[bytes]) -> bytes:
        if self.cfg.ttl_s:
            ex = str(self.cfg.ttl_s).encode()
            return b"".join(resp.command(b"GETEX", k, b"EX", ex) for k in keys)
        return b"".join(resp.command(b"GET", k) for k in keys)

    def _lane(self, keys, heads, rows, verify, chunks, stop: "_Stop") -> None:
        """One connection reads its chunks in order, the next one's GETs sent
        before the current one's replies are read (the server streams on);
        each chunk received goes to the checking threads."""
        sent = done = 0
        conn = None
        try:
            conn = self._connection()
            for a, b, fut in chunks:
                while sent < len(chunks) and sent <= done + 1 and chunks[sent][0] < stop.at:
                    conn.send(self._gets(keys[chunks[sent][0]:chunks[sent][1]]))
                    sent += 1
                if done >= sent:        # past a row that was not a hit: not asked
                    fut.set_result([SKIPPED] * (b - a))
                    done += 1
                    continue
                got = []
                for i in range(a, b):
                    r = conn.read_value(memoryview(heads[i]), memoryview(rows[i]))
                    if r != resp.HIT:
                        stop.lower(i)
                    got.append(r)
                self._checkers.submit(_check, a, got, verify, fut, stop)
                done += 1
        except self._errors as e:
            if conn is not None:
                conn.close()
            self._drop_connections()         # the idle ones are likely as dead (a restart)
            self._fail(e)
            for _, _, fut in chunks[done:]:
                fut.set_result(None)
            return
        except BaseException as e:           # a bug: the waiting lookup raises it, nothing hangs
            if conn is not None:
                conn.close()
            for _, _, fut in chunks[done:]:
                fut.set_exception(e)
            return
        self._give_back(conn)
        self._ok(stop.started)

    def _connection(self) -> resp.RespConnection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return resp.RespConnection(self.cfg.url, self.cfg.timeout_s)

    def _give_back(self, conn: resp.RespConnection) -> None:
        with self._lock:
            if not self._closed_reads and len(self._idle) < self.cfg.read_connections:
                self._idle.append(conn)
                return
        conn.close()

    def _drop_connections(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    # ---------------------------------------------------------------- puts
    def submit(self, put: Put) -> bool:
        """Queue a put for the writer; False (nothing queued) when Redis is
        down or the queue is full."""
        n = put.rows.numel()
        if not self.allow():
            return False
        with self._cv:
            if self._closed or self._queued_bytes + n > self.cfg.queue_bytes:
                return False
            self._queue.append(put)
            self._queued_bytes += n
            self._cv.notify()
        return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                batch, size = [], 0
                while self._queue and (not batch or size + self._queue[0].rows.numel() <= PUT_BATCH_BYTES):
                    batch.append(self._queue.popleft())
                    size += batch[-1].rows.numel()
                self._queued_bytes -= size
            self._write(batch)

    def _write(self, batch: list[Put]) -> None:
        if not self.allow():
            for p in batch:
                p.tier._count(dropped_puts=len(p.hashes))
            return
        pipe = self.client.pipeline(transaction=False)
        ex = self.cfg.ttl_s or None
        for p in batch:
            if p.event is not None:
                p.event.synchronize()          # the copy into p.rows is done
            rows = p.rows.numpy()
            for h, row in zip(p.hashes, rows):
                pipe.set(block_key(p.fp, h), pack_value(p.fp, h, row), ex=ex)
        try:
            res = iter(pipe.execute(raise_on_error=False))
        except self._errors as e:
            self._fail(e)
            for p in batch:
                p.tier._count(dropped_puts=len(p.hashes))
            return
        self._ok()
        for p in batch:
            results = [next(res) for _ in p.hashes]
            refused = [r for r in results if r is not True]
            if refused:      # e.g. OOM under maxmemory-policy noeviction: run Redis with allkeys-lru
                with self._lock:
                    self.last_error = f"put refused: {type(refused[0]).__name__}: {refused[0]}"
            p.tier.written([h for h, r in zip(p.hashes, results) if r is True], p.rows.shape[1], len(refused))

    def close(self, timeout: float = 2.0) -> None:
        """Stop the writer after the queued puts (at most timeout seconds)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._writer.join(timeout)
        self._readers.shutdown(wait=True)
        self._checkers.shutdown(wait=True)
        with self._lock:
            self._closed_reads = True
        self._drop_connections()
        self.client.close()

    def stats(self) -> dict:
        with self._cv:
            queued = (len(self._queue), self._queued_bytes)
        with self._lock:
            return dict(up=int(self.up), state="up" if self.up else "down", last_error=self.last_error,
                        queue_puts=queued[0], queue_bytes=queued[1], **self.counters)


def _check(a: int, got: list[int], verify, fut: Future, stop: "_Stop") -> None:
    """A checking thread: the verdicts of rows a, a + 1, ... as received (got:
    resp.HIT, MISS or OTHER) and checked (verify(i)) into fut. Rows past one
    known not to be a hit are not checked (SKIPPED): the lookup stops before them."""
    try:
        out = []
        for i, r in enumerate(got, a):
            if i > stop.at:
                v = SKIPPED
            elif r == resp.HIT:
                v = HIT if verify(i) else REFUSED
            else:
                v = MISS if r == resp.MISS else REFUSED
            if v in (MISS, REFUSED):
                stop.lower(i)
            out.append(v)
        fut.set_result(out)
    except BaseException as e:           # a bug: the waiting lookup raises it, nothing hangs
        fut.set_exception(e)


class _Stop:
    """The first row of a lookup that was not a hit: lanes ask nothing past it;
    and when the lookup started (RedisStore._ok)."""

    def __init__(self, n: int, started: float):
        self.at = n
        self.started = started
        self._lock = threading.Lock()

    def lower(self, i: int) -> None:
        with self._lock:
            self.at = min(self.at, i)
