"""Prometheus metrics: pool and tier state read from engine.stats() at scrape
time (a custom Collector), RPC latency and status codes from a server
interceptor.

Tiers are a label, discovered from the shape of each cache's stats dict, so a
new tier shows up without touching this file:
- a value with `capacity` and `used` (a PoolStats) is a tier: its key is the
  label (`main`, `tail`, `host_main`, ...) -> kvstore_blocks{state},
  kvstore_capacity_blocks, kvstore_evictions_total;
- a dict value (e.g. `disk`) is a tier too -> kvstore_tier_<field>;
- a number whose key ends in `_<tier>` (`page_ins_host`) -> kvstore_tier_<base>;
- any other number -> kvstore_<key>.
Keys nest one level under `tiers`. Counters are the names in COUNTERS (they
get `_total`); every other number is a gauge.

A tier in SHARED_TIERS is one store under every cache (the disk tier: one LMDB
store, each cache's stats carry the whole store's figures): its dict is
daemon-wide series kvstore_<tier>_<field>, once, with no cache label, so that
sum() over caches does not multiply it. What each cache does with it (its
sequences there, offloads, page-ins, hits, bytes moved) stays per cache, as
kvstore_tier_*{cache, tier}. The daemon's shared Redis tier
(tiers/redis_store.py) also has daemon-wide series, kvstore_redis_*.
"""
from __future__ import annotations

import time

import grpc
from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest,
                               start_http_server)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import buildinfo

COUNTERS = {"prefix_query_tokens", "prefix_hit_tokens", "appended_tokens", "sealed_blocks", "dedup_blocks",
            "attend_calls", "evictions", "page_ins", "page_outs", "offloads", "prefetches", "bytes_down",
            "bytes_up", "spilled_blocks", "prefix_hit_blocks", "prefix_hits", "evicted_bytes", "skipped_spills",
            "blocks_out", "bytes_out", "bytes_in", "misses", "refused", "dropped_puts", "errors",
            "window_freed_blocks", "refused_values", "verified_opens", "dropped_entries", "moved_aside",
            "dropped_sequences"}
HIT_BLOCKS = ("prefix_hit_blocks", "prefix_hits")    # per-tier prefix hits, counted in blocks
TIER_SUFFIXES = ("gpu", "host", "disk")
SHARED_TIERS = {"disk": "the disk tier's LMDB store, shared by every cache"}
# HELP text where the name alone says too little.
DOCS = {"host_metadata_bytes": "host memory a cache's sequence metadata holds: token ids, block hashes, block tables",
        "host_bytes": "pinned host memory a cache's host tier reserves"}
SHARED_DOCS = {"entries": "keys stored", "bytes": "what the pages of its tree take",
               "used_bytes": "key and value bytes stored (not checksum records or page overhead): what the bound counts",
               "max_bytes": "its bound (--lmdb-max-bytes; 0: none)",
               "held_bytes": "of them, what sequences' disk copies hold (the rest is evictable prefix blocks)",
               "map_size": "LMDB's map size in bytes"}
POOL_STATES = ("used", "cached", "free")
LATENCY_BUCKETS = (.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30)


def _fields(obj) -> dict | None:
    """A PoolStats-like object (dataclass with slots) or a dict -> its fields."""
    if isinstance(obj, dict):
        return obj
    slots = getattr(type(obj), "__slots__", None) or getattr(type(obj), "__dataclass_fields__", None)
    return {k: getattr(obj, k) for k in slots} if slots else None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Families:
    """Metric families built in one scrape, created on first use."""

    def __init__(self):
        self.fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def add(self, name: str, labels: dict[str, str], value: float, counter: bool, doc: str = "") -> None:
        full = "kvstore_" + name
        fam = self.fams.get(full)
        if fam is None:
            cls = CounterMetricFamily if counter else GaugeMetricFamily
            fam = self.fams[full] = cls(full, doc or f"kvstore {name.replace('_', ' ')}", labels=list(labels))
        fam.add_metric(list(labels.values()), float(value))


class EngineCollector:
    """Reads engine.stats() (and the lease table) at every scrape."""

    def __init__(self, engine=None, leases=None, buffers=None):
        self.engine, self.leases, self.buffers = engine, leases, buffers

    def describe(self):
        return []     # families depend on the stats dict; nothing to pre-register

    def collect(self):
        f = _Families()
        f.add("build_info", buildinfo.build_info(), 1, False,
              "always 1; labels: kvstore version and commit, torch, the CUDA torch was built for (none: CPU build), "
              "triton and cupy (absent: not installed)")
        if self.engine is not None:
            for cache, stats in self.engine.stats().items():
                self._cache(f, cache, stats)
            # From the engine, not a cache: the store outlives every cache (what its
            # recovery did at the start is read before any cache is made again).
            disk = self.engine.disk_stats()
            if disk is not None:
                self._shared(f, "disk", disk)
        if self.leases is not None:
            ls = self.leases.stats()
            f.add("sessions", {}, ls["sessions"], False, "client sessions holding a lease")
            f.add("lease_timeout_seconds", {}, ls["timeout_s"], False)
            for k in ("expired", "freed_sequences", "offload_requests", "offload_failed", "released_buffers"):
                f.add(f"lease_{k}", {}, ls[k], True, f"leases lapsed: {k.replace('_', ' ')}")
        if self.buffers is not None:
            f.add("registered_buffers", {}, len(self.buffers), False, "shared-memory buffers clients registered")
        if getattr(self.engine, "redis", None) is not None:
            self._redis(f, self.engine.redis.stats())
        yield from f.fams.values()

    @staticmethod
    def _redis(f: _Families, r: dict) -> None:
        f.add("redis_up", {}, r["up"], False, "1 while the shared Redis tier answers; 0 while it is skipped")
        f.add("redis_outages_total", {}, r["outages"], True, "times the shared Redis tier went down")
        f.add("redis_errors_total", {}, r["errors"], True, "Redis calls that failed")
        f.add("redis_queue_puts", {}, r["queue_puts"], False, "block batches waiting for the Redis writer")
        f.add("redis_queue_bytes", {}, r["queue_bytes"], False, "payload bytes waiting for the Redis writer")

    def _cache(self, f: _Families, cache: str, stats: dict) -> None:
        """One cache's series; a tier in SHARED_TIERS is the engine's (collect)."""
        flat = {k: v for k, v in stats.items() if k != "tiers"}
        flat.update(stats.get("tiers") or {})
        tiers = {k for k, v in flat.items() if v is not None and not _number(v) and _fields(v) is not None}
        suffixes = tuple(TIER_SUFFIXES) + tuple(tiers)
        for key, v in flat.items():
            if v is None:
                continue
            if key in SHARED_TIERS and key in tiers:
                continue
            elif key in tiers:
                self._tier(f, cache, key, _fields(v), stats)
            elif _number(v):
                base, tier = _split_tier(key, suffixes)
                if tier is None:
                    f.add(f"{key}_total" if key in COUNTERS else key, {"cache": cache}, v, key in COUNTERS,
                          DOCS.get(key, ""))
                else:
                    name = f"tier_{base}_total" if base in COUNTERS else f"tier_{base}"
                    f.add(name, {"cache": cache, "tier": tier}, v, base in COUNTERS)
                    if base in HIT_BLOCKS:
                        self._tier_hit_rate(f, cache, tier, v, stats)

    def _tier(self, f: _Families, cache: str, tier: str, fields: dict, stats: dict) -> None:
        lab = {"cache": cache, "tier": tier}
        if "capacity" in fields and "used" in fields:
            for state in POOL_STATES:
                if state in fields:
                    f.add("blocks", {**lab, "state": state}, fields[state], False,
                          "blocks per tier and state (used: referenced; cached: free but findable by prefix hash)")
            f.add("capacity_blocks", lab, fields["capacity"], False, "blocks a tier holds")
        for k, v in fields.items():
            if k in POOL_STATES or k == "capacity" or not _number(v):
                continue
            if k in HIT_BLOCKS:     # the same series as a `prefix_hits_<tier>` number's
                f.add(f"tier_{k}_total", lab, v, True)
                self._tier_hit_rate(f, cache, tier, v, stats)
                continue
            f.add(f"{k}_total" if k in COUNTERS else f"tier_{k}", lab, v, k in COUNTERS)

    @staticmethod
    def _shared(f: _Families, tier: str, fields: dict) -> None:
        for k, v in fields.items():
            if _number(v):
                f.add(f"{tier}_{k}_total" if k in COUNTERS else f"{tier}_{k}", {}, v, k in COUNTERS,
                      f"{SHARED_TIERS[tier]}: {SHARED_DOCS.get(k, k.replace('_', ' '))}")

    def _tier_hit_rate(self, f: _Families, cache: str, tier: str, blocks: float, stats: dict) -> None:
        queried = stats.get("prefix_query_tokens", 0)
        try:
            bs = self.engine.config(cache).block_size
        except Exception:  # noqa: BLE001 - the cache was dropped between stats() and here
            return
        f.add("tier_hit_rate", {"cache": cache, "tier": tier}, blocks * bs / queried if queried else 0.0, False,
              "share of queried prompt tokens served from a lower tier")


def _ended(context) -> grpc.StatusCode:
    """A handler's status when it returned a reply: OK, unless the client stopped waiting
    first (its deadline passed, or it cancelled): it got that status, not the reply."""
    if context.is_active():
        return grpc.StatusCode.OK
    left = context.time_remaining()
    return grpc.StatusCode.DEADLINE_EXCEEDED if left is not None and left <= 0 else grpc.StatusCode.CANCELLED


def _split_tier(key: str, suffixes: tuple[str, ...]) -> tuple[str, str | None]:
    for t in suffixes:
        if key.endswith("_" + t) and len(key) > len(t) + 1:
            return key[:-len(t) - 1], t
    return key, None


class MetricsInterceptor(grpc.ServerInterceptor):
    """Latency per method and calls per status code. Unknown method paths are
    not recorded: a label per garbage path would grow without bound."""

    def __init__(self, registry: CollectorRegistry):
        self.latency = Histogram("kvstore_rpc_duration_seconds", "RPC latency", ["method"],
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.calls = Counter("kvstore_rpc", "RPCs by method and status code", ["method", "code"],
                             registry=registry)
        self._wrapped: dict[str, tuple] = {}     # method -> (handler, wrapped handler)
        self._counters: dict[tuple[str, str], object] = {}

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not (handler.unary_unary or handler.stream_unary or handler.stream_stream):
            return handler
        hit = self._wrapped.get(handler_call_details.method)
        if hit is not None and hit[0] is handler:   # handlers are fixed per method: wrap once
            return hit[1]
        wrapped = self._wrap(handler, handler_call_details.method.rsplit("/", 1)[-1])
        if len(self._wrapped) < 1024:
            self._wrapped[handler_call_details.method] = (handler, wrapped)
        return wrapped

    def observe(self, method: str, code: str, seconds: float) -> None:
        """A call that came another way than gRPC (the doorbell), counted as one."""
        self.latency.labels(method).observe(seconds)
        self._count(method, code).inc()

    def _count(self, method: str, code: str):
        c = self._counters.get((method, code))
        if c is None:
            c = self._counters[(method, code)] = self.calls.labels(method, code)
        return c

    def _wrap(self, handler, method: str):
        if handler.stream_stream:
            return self._wrap_stream(handler, method)
        # one reply a call: a unary RPC, which the gate (auth.py) hands on as a one-message stream
        kind = "unary_unary" if handler.unary_unary else "stream_unary"
        fn = getattr(handler, kind)
        hist = self.latency.labels(method)

        def call(request, context):
            t0 = time.perf_counter()
            code = grpc.StatusCode.UNKNOWN
            try:
                reply = fn(request, context)
                code = context.code() or _ended(context)
                return reply
            except BaseException:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            finally:
                hist.observe(time.perf_counter() - t0)
                self._count(method, code.name).inc()
        return handler._replace(**{kind: call})

    def _wrap_stream(self, handler, method: str):
        """A stream of request -> reply pairs (AppendAttendStream): each
        request is one call, timed from its arrival to its reply; the status
        that ends the stream counts as the last one's code."""
        fn = handler.stream_stream
        hist = self.latency.labels(method)
        ok = self._count(method, grpc.StatusCode.OK.name)

        def call(requests, context):
            t0 = [0.0]

            def timed():
                for r in requests:
                    t0[0] = time.perf_counter()
                    yield r
            replies = fn(timed(), context)
            while True:
                try:
                    reply = next(replies)
                except StopIteration:
                    return
                except BaseException:
                    if t0[0] or context.code() is not None:    # a request failed, or the stream was refused
                        hist.observe(time.perf_counter() - t0[0] if t0[0] else 0.0)
                        self._count(method, (context.code() or grpc.StatusCode.UNKNOWN).name).inc()
                    raise
                hist.observe(time.perf_counter() - t0[0])
                t0[0] = 0.0
                ok.inc()
                yield reply
        return handler._replace(stream_stream=call)


class Metrics:
    """The registry, its interceptor and collector. bind() once the engine
    exists; serve() starts the HTTP endpoint."""

    def __init__(self):
        disable_created_metrics()    # `_created` series double the output and no dashboard reads them
        self.registry = CollectorRegistry()
        self.interceptor = MetricsInterceptor(self.registry)
        self.collector = EngineCollector()
        self.registry.register(self.collector)
        self._httpd = None

    def bind(self, engine=None, leases=None, buffers=None) -> None:
        c = self.collector
        c.engine = engine if engine is not None else c.engine
        c.leases = leases if leases is not None else c.leases
        c.buffers = buffers if buffers is not None else c.buffers

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start /metrics on host:port (0: a free port); returns the port."""
        self._httpd, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._httpd.server_port

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def render(self) -> str:
        return generate_latest(self.registry).decode()
