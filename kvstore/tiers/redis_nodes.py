"""The Redis endpoints behind the Redis tier (redis_store.py; docs/scale.md, What
Redis Cluster shards): one Redis, or the primaries of a Redis Cluster found
through the URL's node.

Which it is, is asked of the server, not written in the URL: CLUSTER SLOTS
answers a cluster node with the slot map and any other Redis with an error
("cluster support disabled"). The same URL then works whatever the server
is, and a server turned into a cluster node is found on the first MOVED.

A key's slot is CRC16(key) mod 16384 (binascii.crc_hqx is Redis's CRC16).
Keys carry no hash tag ({...}) on purpose, so the whole key is hashed. A
node is reached with the URL's user, password and TLS options, its host and
port taken from the map (cluster nodes have database 0 only).

Each node has its own circuit breaker (a lost shard costs only its share
of the blocks) and its own idle read connections. The map is read again
(refresh) when a node answers MOVED, ASK, TRYAGAIN or CLUSTERDOWN, or fails.

How many connections a lookup reads over from a node is also asked of its
server, once (Node.server_lanes): Redis (7) serves a lookup fastest over 1, its
main thread copying every value into a reply buffer, and more connections only
interleave that work (3.4-4.1 GB/s with 1, 1.6-2.3 with 8 on the H100 host);
Valkey (8+) hands its connections' writes to its I/O threads, which version 9
makes straight from the stored values: 4 connections read a prefix 2-3x as
fast as one there (docs/scale.md, Valkey).
"""
from __future__ import annotations

import logging
import threading
import time
from binascii import crc_hqx
from urllib.parse import urlsplit

import numpy as np

from . import resp
from .redis_config import refuses_credentials

log = logging.getLogger("kvstore.redis")

SLOTS = 16384
BACKOFF_START_S = 0.5
REFRESH_EVERY_S = 0.1          # the map is read again at most this often, however many replies ask for it
REDIS_LANES, VALKEY_LANES = 1, 4   # Node.server_lanes


def key_slot(key: bytes) -> int:
    return crc_hqx(key, 0) % SLOTS


class Breaker:
    """When to try one endpoint again: up, or down with its back-off over.
    Logs one WARNING per outage and one INFO on recovery."""

    def __init__(self, name: str, backoff_s: float):
        self.name, self.backoff_s = name, backoff_s
        self._lock = threading.Lock()
        self.up, self.last_error, self.epoch = True, "", 0
        self.errors = self.outages = 0                   # calls that failed; times it went down
        self._backoff, self._retry_at, self._down_since = BACKOFF_START_S, 0.0, 0.0

    def allow(self) -> bool:
        with self._lock:
            return self.up or time.monotonic() >= self._retry_at

    def retry_in(self) -> float:
        """Seconds until a down endpoint may be tried again (<= 0: now)."""
        with self._lock:
            return self._retry_at - time.monotonic()

    def ok(self, started: float | None = None) -> None:
        """A call that began at `started` (monotonic) succeeded. One that began
        before the endpoint was last seen failing says nothing of now: lanes of one
        read finish at different times, and a lane that got its replies in before a
        kill must not mark it up again after another lane marked it down."""
        with self._lock:
            if self.up or (started is not None and started <= self._down_since):
                return
            # Logged before `up` flips: stats() reads it without the lock, and
            # whoever sees the tier up again finds the recovery in the log too.
            log.info("redis tier %s is back after %.1f s", self.name, time.monotonic() - self._down_since)
            self.epoch += 1          # what it holds may have changed (a restart without persistence)
            self._backoff = BACKOFF_START_S
            self.up = True

    def restarted(self) -> None:
        """The server answers under another run_id: it restarted, and what it held may
        be gone (without persistence), though no call failed."""
        with self._lock:
            log.info("redis tier %s restarted since it was last reached: blocks known to be there "
                     "go up again", self.name)
            self.epoch += 1

    def fail(self, e: BaseException) -> None:
        with self._lock:
            now = time.monotonic()
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            if self.up:
                self._down_since = now
                self.outages += 1
                log.warning("redis tier %s is down (%s); serving without it, trying again every %.1f-%.1f s",
                            self.name, self.last_error, BACKOFF_START_S, self.backoff_s)
                self.up = False          # after the log, as in ok()
            else:
                self._backoff = min(self._backoff * 2, self.backoff_s)
            self._retry_at = now + min(self._backoff, self.backoff_s)


class Node:
    """One endpoint: its URL, breaker and idle read connections (resp.py)."""

    def __init__(self, url: str, name: str, timeout_s: float, backoff_s: float, idle_max: int):
        self.url, self.timeout_s, self.idle_max = url, timeout_s, idle_max
        self.breaker = Breaker(name, backoff_s)
        self._lock = threading.Lock()
        self._idle: list[resp.RespConnection] = []
        self._closed = False
        self._lanes: int | None = None
        self._run_id = ""                   # the server's, as its last new connection said

    def server_lanes(self) -> int:
        """Connections a lookup reads over from this node by its server (module
        docstring): VALKEY_LANES for Valkey, REDIS_LANES for Redis and for a server
        that does not say (an ACL user refused INFO). Raises OSError where the node
        does not answer (asked again next time)."""
        if self._lanes is None:
            conn = self.connection()        # a new connection asks (hello)
            try:
                if self._lanes is None:
                    self.hello(conn.call)
            except OSError:
                conn.close()
                raise
            self.give_back(conn)
        return self._lanes

    def connection(self) -> resp.RespConnection:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed_while_idle():
                    return conn
                conn.close()
        conn = resp.RespConnection(self.url, self.timeout_s)
        try:
            self.hello(conn.call)
        except OSError:
            conn.close()
            raise
        return conn

    def hello(self, call) -> None:
        """What the server says of itself (INFO server, through call(*args) -> reply),
        asked on every new connection and by the store's writer every second: which
        server it is (server_lanes), and its run_id, which changes when it restarts."""
        try:
            info = call(b"INFO", b"server")
        except resp.ReplyError:
            info = b""
        if isinstance(info, dict):          # redis-py parses INFO
            fields = {k: str(v) for k, v in info.items()}
        else:
            info = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
            fields = {k: v.strip() for k, v in (line.split(":", 1) for line in info.splitlines() if ":" in line)}
        run_id = fields.get("run_id", "")
        with self._lock:
            before = self._run_id
            self._run_id = run_id or before
            first = self._lanes is None
            if first:
                valkey = fields.get("server_name", "") == "valkey"
                self._lanes = VALKEY_LANES if valkey else REDIS_LANES
        if first:
            log.info("Redis tier: %s is %s %s: a lookup reads over %d connection(s) from it", self.breaker.name,
                     "valkey" if self._lanes == VALKEY_LANES else "redis",
                     fields.get("valkey_version", fields.get("redis_version", "?")), self._lanes)
        if before and run_id and run_id != before:
            self.breaker.restarted()

    def give_back(self, conn: resp.RespConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.idle_max:
                self._idle.append(conn)
                return
        conn.close()

    @staticmethod
    def set_many(conn: resp.RespConnection, items: list[tuple[bytes, bytes]], ttl_s: int) -> list:
        """SET each (key, value) in one pipeline on conn (to this node). -> per item
        True, the error reply (str), or None: not this node's (MOVED and the like)."""
        ex = (b"EX", str(ttl_s).encode()) if ttl_s else ()
        conn.send(b"".join(resp.command(b"SET", k, v, *ex) for k, v in items))
        out = []
        for _ in items:
            try:
                conn.reply("SET")
                out.append(True)
            except resp.ReplyError as e:
                out.append(None if any(f" {m}" in str(e) for m in ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN"))
                           else str(e))
        return out

    def drop_connections(self, closing: bool = False) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._closed = self._closed or closing
        for c in idle:
            c.close()


class Topology:
    """The nodes keys go to: the URL's Redis alone, or a cluster's primaries by slot.
    route() is called by lookups and the writer at once; refresh() swaps the map whole."""

    def __init__(self, url: str, redacted: str, timeout_s: float, backoff_s: float, idle_max: int, on_fail):
        self._on_fail = on_fail                        # (node, error): a node did not answer
        self._url, self._timeout_s, self._backoff_s, self._idle_max = url, timeout_s, backoff_s, idle_max
        self.seed = Node(url, redacted, timeout_s, backoff_s, idle_max)
        self.cluster = False
        # (nodes, owner): owner [SLOTS] int32, the index into nodes of each slot's primary (-1: none),
        # or None for one Redis. Swapped whole, so that route() never mixes two maps.
        self._map: tuple[list[Node], np.ndarray | None] = ([self.seed], None)
        self._lock = threading.Lock()
        self._stale, self._next_refresh = True, 0.0
        self.version = 0                               # maps read that changed the nodes
        self._warned = False

    @property
    def nodes(self) -> list[Node]:
        return self._map[0]

    def mark_stale(self) -> None:
        self._stale = True

    def refresh_if_stale(self) -> bool | None:
        """refresh() where the map is stale (and was not read in the last
        REFRESH_EVERY_S); None where it was not tried."""
        if self._stale and time.monotonic() >= self._next_refresh:
            return self.refresh()
        return None

    def refresh(self) -> bool:
        """Read the map from the first node that answers (the ones known, then
        the URL's), skipping those whose breaker says not now; False where none
        did (the map stays as it was). A node that fails is reported (on_fail)."""
        with self._lock:
            self._next_refresh = time.monotonic() + REFRESH_EVERY_S
            for node in {id(n): n for n in [*self.nodes, self.seed]}.values():
                if not node.breaker.allow():
                    continue
                try:
                    conn = resp.RespConnection(node.url, self._timeout_s)
                except OSError as e:
                    self._on_fail(node, e)
                    continue
                try:
                    slots = conn.call(b"CLUSTER", b"SLOTS")
                except resp.ReplyError as e:
                    if refuses_credentials(e):         # it refused us, not the question
                        self._on_fail(node, e)
                        continue
                    if "cluster support disabled" not in str(e) and not self._warned:
                        self._warned = True
                        log.warning("redis tier: could not read a cluster slot map (%s); reading %s as one Redis",
                                    e, node.breaker.name)
                    slots = None
                except OSError as e:
                    self._on_fail(node, e)
                    continue
                finally:
                    conn.close()
                self._install(slots)
                self._stale = False
                return True
            return False

    def _install(self, slots) -> None:
        """slots: CLUSTER SLOTS' reply ([[start, end, [host, port, id, ...], replicas...], ...]) or None."""
        if slots is None:
            changed = self.cluster
            self.cluster, self._map = False, ([self.seed], None)
        else:
            known = {n.breaker.name: n for n in self.nodes}
            nodes: dict[str, Node] = {}
            owner = np.full(SLOTS, -1, dtype=np.int32)
            for start, end, primary, *_ in slots:
                host, port = primary[0].decode() or urlsplit(self._url).hostname, int(primary[1])
                name = f"{host}:{port}"
                if name not in nodes:
                    nodes[name] = known.get(name) or Node(self._node_url(host, port), name, self._timeout_s,
                                                          self._backoff_s, self._idle_max)
                owner[int(start):int(end) + 1] = list(nodes).index(name)
            changed = not self.cluster or list(nodes) != [n.breaker.name for n in self.nodes] \
                or not np.array_equal(owner, self._map[1])
            self.cluster, self._map = True, (list(nodes.values()), owner)
            for gone in set(known) - set(nodes):
                known[gone].drop_connections(closing=True)
        if changed:
            self.version += 1
            log.info("redis tier: %s", f"a cluster of {len(self.nodes)} primaries"
                     if self.cluster else f"one Redis at {self.seed.breaker.name}")

    def _node_url(self, host: str, port: int) -> str:
        """The URL's scheme, user, password and options, for host:port, database 0."""
        u = urlsplit(self._url)
        auth = u.netloc.rpartition("@")[0]
        host = f"[{host}]" if ":" in host else host
        return u._replace(netloc=(auth + "@" if auth else "") + f"{host}:{port}", path="/0").geturl()

    def route(self, keys: list[bytes]) -> list[tuple[Node | None, list[int]]]:
        """-> (node, the indices of keys it holds, ascending) per node with keys;
        node None for keys of slots no node serves."""
        nodes, owner = self._map
        if owner is None:
            return [(nodes[0], list(range(len(keys))))]
        groups: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(int(owner[key_slot(k)]), []).append(i)
        return [(nodes[j] if j >= 0 else None, idx) for j, idx in groups.items()]

    def close(self) -> None:
        for n in {id(n): n for n in [self.seed, *self.nodes]}.values():
            n.drop_connections(closing=True)
