"""The shared cold tier on Redis or Valkey (docs/design.md, Tiers): below the host and disk tiers, so
that daemons on many hosts share prefix blocks.

Only main-pool blocks with a content hash go there (sealed PQ blocks; full blocks for codec fp16).
The hash chains the block's token ids with the cache fingerprint (core/hashing.py), so one key means
one content on every host with the same model, geometry and codebooks, and a prefix hit crosses the
network as PQ codes (storage.pack: every layer's K codes, then V codes).

Keys and values: redis_format.py (kvstore:v3:<fingerprint>:<hash>, an 88-byte header with a
checksum, then the payload). The URL names one Redis or any node of a Redis Cluster (redis_nodes.py
finds out which): no hash tag ({...}), so a cluster spreads one cache's blocks over every slot, and
a lookup or a batch of puts is split by node, every node's share sent side by side.

Reads take the bulk path of resp.py: read_lanes connections per node, each a pipeline of GETs (GETEX
with a TTL) of its rows of contiguous chunks, one chunk sent ahead of the one being read, every
value received straight into the caller's (pinned) rows and checked by the thread that received it,
right after it came in (docs/scale.md, What limits it). One Redis gets its puts and PING from
redis-py, a cluster's nodes from resp.py.

Eviction is Redis's own: run it with `maxmemory <bytes>` and `maxmemory-policy allkeys-lru` (these
blocks are a cache: any of them may go). --redis-ttl adds an expiry to every put; every hit renews
it (GETEX).

Redis down or slow never fails a request and delays one by at most one socket timeout
(--redis-timeout): no client retries, and a circuit breaker per node skips a failed one for a
back-off (0.5 s doubling up to --redis-backoff) before it tries again, logging one WARNING per
outage and one INFO on recovery. Credentials Redis refuses at the start stop it instead
(CredentialsRefused). Puts go through a bounded queue to one writer thread: a full queue drops and
counts, never waits. The writer also asks every node (INFO server) once a second, and a down one
once its back-off is over, so that the books say up again without waiting for a request. A block
this daemon put or read is not put again until Redis comes back from an outage, or is found
restarted (another run_id: by that check, or by the next new connection): either may have emptied
it. Blocks evicted between a restart and its finding are not put again (as blocks Redis evicts
itself are gone).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from . import resp
from .redis_config import MAX_READ_CONNECTIONS, CredentialsRefused, RedisConfig, refuses_credentials  # noqa: F401
from .redis_format import block_key, pack_value
from .redis_lookup import HIT, MISS, REFUSED, SKIPPED, Lookup, runs  # noqa: F401 (the verdicts, for callers)
from .redis_nodes import BACKOFF_START_S, VALKEY_LANES, Node, Topology

log = logging.getLogger("kvstore.redis")

# A lookup's rows go in chunks of this much: one pipeline each, a connection's next one sent
# while it receives the current one. Redis copies every reply of a pipeline into its
# output buffers before the socket takes them, so its CPU per GB grows with the replies
# waiting there: 4 MiB chunks cost it about 0.15-0.2 s/GB, 16 MiB about 0.3
# (bench/bench_redis_lookup.py; docs/scale.md, What limits it).
GET_CHUNK_BYTES = 4 << 20
PUT_BATCH_BYTES = 16 << 20        # one pipeline of the writer sends at most this much
CHECK_EVERY_S = 1.0               # the writer asks every node whether it is up, and which run it is


@dataclass(slots=True)
class Put:
    tier: object                    # the RedisTier (redis.py) whose counters written() updates
    fp: bytes
    hashes: list[bytes]
    rows: torch.Tensor              # [n, block bytes] uint8 on the CPU (pinned when copied from a GPU)
    event: object = None            # CUDA event after the copy into rows, or None


class RedisStore:
    """The shared tier for the whole daemon: its endpoints (redis_nodes.py: one
    Redis, or a cluster's primaries, each with its circuit breaker), the
    lookups' reads and the put queue with its writer thread. Caches see it
    through RedisTier."""

    def __init__(self, cfg: RedisConfig):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        self.cfg = cfg
        self._credentials_refused: str | None = ""    # until started: what a node refusing the URL's user said
        self._errors = (redis.RedisError, OSError)
        self._refused = redis.ResponseError
        # No client retries: the breaker decides when Redis is tried again. redis-py
        # puts to one Redis and PINGs it; a cluster's nodes get both from resp.py.
        self.topology = Topology(cfg.url, cfg.redacted(), cfg.timeout_s, cfg.backoff_s, cfg.read_connections or
                                 VALKEY_LANES, self._fail)
        self.client = redis.Redis.from_url(cfg.url, socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s,
                                           retry=Retry(NoBackoff(), 0), redis_connect_func=self._connected)
        self._lock = threading.Lock()
        self._last_error = ""             # the latest failure or refusal, of any node
        self._cv = threading.Condition()
        self._queue: deque[Put] = deque()
        self._queued_bytes = 0
        self._closed = False
        self._next_check = time.monotonic() + CHECK_EVERY_S
        self._writer = threading.Thread(target=self._run, name="kvstore-redis-writer", daemon=True)
        self._writer.start()
        # A lookup's connections each receive and check on a thread of their own (module
        # docstring; docs/scale.md, What limits it), started as needed: read_connections
        # per node a lookup touches.
        self._readers = ThreadPoolExecutor(MAX_READ_CONNECTIONS, thread_name_prefix="kvstore-redis-read")
        self.ping()
        if self._credentials_refused:      # no retry mends them (down at the start is served through)
            self.close(0)
            raise CredentialsRefused.of(cfg, self._credentials_refused)
        self._credentials_refused = None

    # ---------------------------------------------------------- the breakers
    @property
    def up(self) -> bool:
        return all(n.breaker.up for n in self.topology.nodes)

    @property
    def epoch(self) -> tuple:
        """Changes when a node comes back or the map changes: what Redis holds may have changed."""
        return self.topology.version, tuple(n.breaker.epoch for n in self.topology.nodes)

    def allow(self) -> bool:
        """Whether to try Redis now: a node up, or down with its back-off over."""
        return any(n.breaker.allow() for n in self.topology.nodes)

    def _fail(self, node: Node, e: BaseException) -> None:
        if self._credentials_refused == "" and refuses_credentials(e):
            self._credentials_refused = f"{type(e).__name__}: {e}"    # the start stops: no outage to log
            return
        node.breaker.fail(e)
        with self._cv:
            self._cv.notify()           # the writer times its probe of the node
        self._error(f"{node.breaker.name}: {node.breaker.last_error}" if self.topology.cluster
                    else node.breaker.last_error)
        if self.topology.cluster:        # a failover may have moved its slots
            self.topology.mark_stale()

    def _connected(self, conn) -> None:
        """redis-py made a new connection (to one Redis): the seed node's hello."""
        conn.on_connect()

        def call(*args):
            conn.send_command(*args)
            try:
                return conn.read_response()
            except self._refused as e:          # an error reply, as resp.py raises it
                raise resp.ReplyError(str(e)) from e
        self.topology.seed.hello(call)

    def _py_call(self, *args):
        """One command through redis-py (one Redis), an error reply raised as resp.py raises it."""
        try:
            return self.client.execute_command(*args)
        except self._refused as e:
            raise resp.ReplyError(str(e)) from e

    def ping(self) -> bool:
        """Whether every node answers (INFO server: it also tells a restarted one)."""
        if self.topology.refresh_if_stale() is False:      # no node answered (counted)
            return False
        if not self.topology.cluster:
            started = time.monotonic()      # an answer sent before another thread saw it fail says nothing
            try:
                self.topology.seed.hello(self._py_call)
            except self._errors as e:
                self._fail(self.topology.seed, e)
                return False
            self.topology.seed.breaker.ok(started)
            return True
        ok = True
        for node in self.topology.nodes:
            if not node.breaker.allow():        # down, its back-off not over
                ok = False
                continue
            started = time.monotonic()
            try:
                conn = node.connection()
                node.hello(conn.call)
            except OSError as e:
                self._fail(node, e)
                ok = False
                continue
            node.give_back(conn)
            node.breaker.ok(started)
        return ok

    # ---------------------------------------------------------------- reads
    def read_into(self, keys: list[bytes], heads: np.ndarray, rows: np.ndarray,
                  verify) -> list[tuple[int, int, Future]]:
        """GET keys[i] (GETEX with a TTL) into heads[i] ([n, HEADER_BYTES]
        uint8) and rows[i] ([n, payload bytes] uint8, e.g. pinned), verify(i)
        -> bool on the thread that received row i. -> (a, b, future) per chunk of rows
        [a, b), in order; a future gives the chunk's verdicts (HIT, MISS,
        REFUSED, SKIPPED: not asked or not checked, past a row that was not
        a hit; or None: Redis failed for that row), or None where Redis
        failed for every row of the chunk. The rows of a chunk are written
        and checked before its future is done; the caller waits on every
        future before it lets heads and rows go."""
        n = len(keys)
        per = max(1, GET_CHUNK_BYTES // max(1, heads.shape[1] + rows.shape[1]))
        chunks = [(a, min(n, a + per), Future()) for a in range(0, n, per)]
        read = Lookup(chunks, verify)
        if not self.allow():
            for c, (a, b, _) in enumerate(chunks):
                read.part(c, range(a, b), None)
            return read.chunks
        self.topology.refresh_if_stale()
        lanes = []
        for node, idx in self.topology.route(keys):
            parts = [(i // per, idx[j:k]) for i, j, k in runs(idx, per)]      # its rows, chunk by chunk
            m = min(self.read_lanes(node), len(parts)) if node is not None and node.breaker.allow() else 0
            if m == 0:      # slots no node serves (misses), or a node down or that did not answer (failed)
                for c, part in parts:
                    read.part(c, part, None if node is not None else [MISS] * len(part))
                continue
            lanes += [(node, parts[p::m]) for p in range(m)]
        for node, parts in lanes:     # the caller waits on the chunks in order (and copies each on)
            self._readers.submit(self._lane, node, keys, heads, rows, parts, read)
        return read.chunks

    def read_lanes(self, node: Node) -> int:
        """Connections a lookup reads over from node: RedisConfig.read_connections, or
        (0) as many as its server serves fastest (Node.server_lanes); none (0, the node
        failed) where it did not answer that: one timeout, as a lane's failure."""
        if self.cfg.read_connections:
            return self.cfg.read_connections
        try:
            return node.server_lanes()
        except OSError as e:
            node.drop_connections()
            self._fail(node, e)
            return 0

    def _gets(self, keys: list[bytes]) -> bytes:
        if self.cfg.ttl_s:
            ex = str(self.cfg.ttl_s).encode()
            return b"".join(resp.command(b"GETEX", k, b"EX", ex) for k in keys)
        return b"".join(resp.command(b"GET", k) for k in keys)

    def _lane(self, node: Node, keys, heads, rows, parts, read: Lookup) -> None:
        """One connection reads its parts (rows of one chunk each) in order, the
        next one's GETs sent before the current one's replies are read (the
        server streams on), and checks each value as soon as it is in."""
        sent = done = 0
        conn, answered = None, False
        try:
            conn = node.connection()
            for c, idx in parts:
                while sent < len(parts) and sent <= done + 1 and parts[sent][1][0] < read.at:
                    conn.send(self._gets([keys[i] for i in parts[sent][1]]))
                    sent += 1
                if done >= sent:        # past a row that was not a hit: not asked
                    read.part(c, idx, [SKIPPED] * len(idx))
                    done += 1
                    continue
                verdicts = []
                for i in idx:
                    r = conn.read_value(memoryview(heads[i]), memoryview(rows[i]))
                    if r != resp.HIT:
                        read.lower(i)
                        if r == resp.REDIRECT:      # a cluster whose slots moved, or one that is down
                            self.topology.mark_stale()
                    verdicts.append(read.verdict(i, r))
                if not answered:     # up again before the caller, handed these rows, reads the stats
                    node.breaker.ok(read.started)
                    answered = True
                read.part(c, idx, verdicts)
                done += 1
        except self._errors as e:
            if conn is not None:
                conn.close()
            node.drop_connections()          # the idle ones are likely as dead (a restart)
            self._fail(node, e)
            for c, idx in parts[done:]:
                read.part(c, idx, None)
            return
        except BaseException as e:           # a bug: the waiting lookup raises it, nothing hangs
            if conn is not None:
                conn.close()
            for c, _ in parts[done:]:
                read.fail(c, e)
            return
        node.give_back(conn)
        node.breaker.ok(read.started)

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
                while not self._queue and not self._closed and (wait := self._check_in()) != 0:
                    self._cv.wait(wait)
                if self._closed and not self._queue:
                    return
                batch, size = [], 0
                while self._queue and (not batch or size + self._queue[0].rows.numel() <= PUT_BATCH_BYTES):
                    batch.append(self._queue.popleft())
                    size += batch[-1].rows.numel()
                self._queued_bytes -= size
            if batch:
                self._write(batch)
            if self._check_in() == 0:
                self._next_check = time.monotonic() + CHECK_EVERY_S
                try:
                    self.ping()
                except Exception:       # noqa: BLE001 - the writer must live on; never spin on the check
                    log.exception("redis tier: checking %s failed", self.cfg.redacted())
                    time.sleep(BACKOFF_START_S)

    def _check_in(self) -> float:
        """Seconds until the writer asks the nodes again (0: now): a down node once its
        back-off is over (so that the books say up without waiting for a request), every
        node every CHECK_EVERY_S (a Redis restarted empty between two calls is found,
        and the blocks known to be there go up again when they spill)."""
        waits = [n.breaker.retry_in() for n in self.topology.nodes if not n.breaker.up]
        return max(0.0, min(waits + [self._next_check - time.monotonic()]))

    def _write(self, batch: list[Put]) -> None:
        if not self.allow():
            for p in batch:
                p.tier._count(dropped_puts=len(p.hashes))
                p.tier.landed(p.hashes)
            return
        items = []
        for p in batch:
            if p.event is not None:
                p.event.synchronize()          # the copy into p.rows is done
            items += [(block_key(p.fp, h), pack_value(p.fp, h, row)) for h, row in zip(p.hashes, p.rows.numpy())]
        self.topology.refresh_if_stale()
        res = iter(self._put_cluster(items) if self.topology.cluster else self._put_one(items))
        for p in batch:
            results = [next(res) for _ in p.hashes]      # True, what refused it, or None: not tried
            refused = [r for r in results if r is not True and r is not None]
            if refused:      # e.g. OOM under maxmemory-policy noeviction: run Redis with allkeys-lru
                self._error("put refused: " + (refused[0] if isinstance(refused[0], str)
                                               else f"{type(refused[0]).__name__}: {refused[0]}"))
            p.tier.written([h for h, r in zip(p.hashes, results) if r is True], p.rows.shape[1], len(refused))
            p.tier._count(dropped_puts=results.count(None))
            p.tier.landed(p.hashes)

    def _put_one(self, items: list[tuple[bytes, bytes]]) -> list:
        """One Redis, through redis-py: per item True, or the error reply's exception; all None when it failed."""
        pipe = self.client.pipeline(transaction=False)
        for k, v in items:
            pipe.set(k, v, ex=self.cfg.ttl_s or None)
        started = time.monotonic()
        try:
            res = pipe.execute(raise_on_error=False)
        except self._errors as e:
            self._fail(self.topology.seed, e)
            return [None] * len(items)
        self.topology.seed.breaker.ok(started)
        return res

    def _put_cluster(self, items: list[tuple[bytes, bytes]]) -> list:
        """A cluster: one pipeline per node, side by side. -> per item True, the error
        reply (str), or None: not stored (its node down or failing, its slot moved)."""
        results: list = [None] * len(items)
        jobs = [self._readers.submit(self._put_node, node, items, idx, results)
                for node, idx in self.topology.route([k for k, _ in items])
                if node is not None and node.breaker.allow()]
        for j in jobs:
            j.result()
        return results

    def _put_node(self, node: Node, items, idx: list[int], results: list) -> None:
        conn, started = None, time.monotonic()
        try:
            conn = node.connection()
            for i, r in zip(idx, node.set_many(conn, [items[i] for i in idx], self.cfg.ttl_s)):
                results[i] = r
                if r is None:
                    self.topology.mark_stale()      # not stored here; the next put goes where it should
        except OSError as e:
            if conn is not None:
                conn.close()
            node.drop_connections()
            self._fail(node, e)
            return
        node.give_back(conn)
        node.breaker.ok(started)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the writer after the queued puts (at most timeout seconds)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._writer.join(timeout)
        self._readers.shutdown(wait=True)
        self.topology.close()
        self.client.close()

    def _error(self, text: str) -> None:
        with self._lock:
            self._last_error = text

    def stats(self) -> dict:
        with self._cv:
            queued = (len(self._queue), self._queued_bytes)
        nodes = self.topology.nodes
        down = [n for n in nodes if not n.breaker.up]
        with self._lock:
            return dict(up=int(not down), state="down" if down else "up", last_error=self._last_error,
                        queue_puts=queued[0], queue_bytes=queued[1], nodes=len(nodes), nodes_down=len(down),
                        errors=sum(n.breaker.errors for n in nodes), outages=sum(n.breaker.outages for n in nodes))
