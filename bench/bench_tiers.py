"""Tier benchmark: every figure is a ratio against a baseline measured
in the same run.

  GPU -> host and host -> GPU GB/s of the tier moves vs a plain pinned copy of the same bytes
  LMDB spill (Offload, synced) and restore (Prefetch) GB/s; the spill vs a plain write +
    fdatasync of the same bytes to a file beside the LMDB (the disk's synced sequential speed)
  Redis put and get GB/s through the store (a redis-server this script starts on a free port;
  with --redis-shards N also an N-node Redis Cluster, kvstore/tools/local_redis.py)
  restoring an 8K-token prefix (Allocate with its token ids) from host, from LMDB and from
  Redis (a second engine with empty local tiers: another host) vs recomputing its prefill
  with a Llama-3-8B-geometry layer stack (32 layers, 32 q / 8 kv heads, d 128, 4-bit PQ)

python bench/bench_tiers.py [--tokens 8192] [--layers 32] [--device cuda] [--redis-server PATH]
                            [--redis-io-threads N] [--redis-shards N] [--dir DIR]
(on a CPU: --device cpu --skip-prefill, where the prefill of the Llama-3-8B stack would take minutes)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lmdb_spill import disk_write as synced_write  # noqa: E402 (one timed write + fdatasync)

from kvstore.codec.codebooks import Codebooks  # noqa: E402
from kvstore.core.config import CacheConfig, CodecConfig, ModelGeometry  # noqa: E402
from kvstore.engine.engine import Engine  # noqa: E402


def sync(dev):
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, dev, reps=3):
    best = float("inf")
    for _ in range(reps):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        best = min(best, time.perf_counter() - t)
    return best


def prefill_stack(layers, tokens, dev, hidden=4096, hq=32, hkv=8, d=128, ffn=14336):
    """Time one prefill of `tokens` through a Llama-3-8B-shaped stack (random fp16 weights)."""
    dt = torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    w = lambda *s: (torch.randn(*s, device=dev, dtype=dt, generator=g) * 0.02)  # noqa: E731
    # One set of weights reused by every layer: the FLOPs are the same, the memory is not needed.
    wq, wk, wv, wo = w(hidden, hq * d), w(hidden, hkv * d), w(hidden, hkv * d), w(hq * d, hidden)
    w1, w3, w2 = w(hidden, ffn), w(hidden, ffn), w(ffn, hidden)
    x0 = torch.randn(1, tokens, hidden, device=dev, dtype=dt, generator=g)

    def run():
        x = x0
        for _ in range(layers):
            h = torch.nn.functional.rms_norm(x, (hidden,))
            q = (h @ wq).view(1, tokens, hq, d).transpose(1, 2)
            k = (h @ wk).view(1, tokens, hkv, d).transpose(1, 2)
            v = (h @ wv).view(1, tokens, hkv, d).transpose(1, 2)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(1, tokens, hq * d) @ wo
            h = torch.nn.functional.rms_norm(x, (hidden,))
            x = x + (torch.nn.functional.silu(h @ w1) * (h @ w3)) @ w2
        return x
    run()
    return timed(run, dev, reps=2)


def start_redis(binary: str | None, directory: str, io_threads: int = 1, extra: tuple = ()):
    """A redis-server on a free port (no persistence: a cache) with io_threads
    I/O threads (Redis >= 6) and the extra command-line options, or None with why."""
    try:
        import redis
    except ImportError:
        return None, "redis-py is not installed (pip install 'redis==8.1.0')"
    binary = binary or shutil.which("redis-server")
    if binary is None:
        return None, "no redis-server (give --redis-server PATH or put it on PATH)"
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", directory, "--maxmemory", "8gb", "--maxmemory-policy", "allkeys-lru",
                             *(["--io-threads", str(io_threads), "--io-threads-do-reads", "yes"] if io_threads > 1 else []),
                             *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port, socket_timeout=1)
    for _ in range(200):
        try:
            client.ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.RedisError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    return None, f"{binary} did not start"


def disk_write(path: str, nbytes: int, reps: int) -> float:
    """Best seconds to write nbytes to a new file at path and fdatasync it."""
    data = memoryview(os.urandom(1 << 20) * max(1, nbytes >> 20))
    return min(synced_write(path, data) for _ in range(reps))


def wait_until(cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--redis-server", default=None, metavar="PATH",
                   help="redis-server binary (or a wrapper) for the Redis rows; default: redis-server on PATH")
    p.add_argument("--redis-io-threads", type=int, default=4 if (os.cpu_count() or 1) >= 8 else 1,
                   help="the redis-server's io-threads (docs/scale.md: what to configure)")
    p.add_argument("--redis-option", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                   help="another redis-server option, e.g. --redis-option min-io-threads-avoid-copy-reply 2 "
                        "(Valkey 9; docs/scale.md)")
    p.add_argument("--redis-read-connections", type=int, default=None, metavar="N",
                   help="connections a lookup reads over from each Redis (default: the daemon's, "
                        "by the server: RedisStore.read_lanes)")
    p.add_argument("--redis-shards", type=int, default=0, metavar="N",
                   help="also read the prefix from a local Redis Cluster of N primaries (0: none)")
    p.add_argument("--dir", default=None, help="where the LMDB (and the disk baseline's file) go; default: a temp dir")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-prefill", action="store_true")
    args = p.parse_args()
    dev, L, n = args.device, args.layers, args.tokens
    tmp = tempfile.mkdtemp(prefix="kvbench-", dir=args.dir)
    options = tuple(x for name, value in args.redis_option for x in ("--" + name, value))
    server, url = start_redis(args.redis_server, tmp, io_threads=args.redis_io_threads, extra=options)
    cluster = None
    try:
        if server is not None and args.redis_shards:
            from kvstore.tools.local_redis import LocalCluster
            os.makedirs(os.path.join(tmp, "cluster"))
            cluster = LocalCluster(os.path.join(tmp, "cluster"), args.redis_shards, args.redis_server, maxmemory="8gb",
                                   extra=(("--io-threads", str(args.redis_io_threads), "--io-threads-do-reads", "yes")
                                          if args.redis_io_threads > 1 else ()) + options)
        run(args, dev, L, n, tmp, url if server is not None else None, None if server is not None else url,
            cluster.url if cluster is not None else None)
    finally:
        if cluster is not None:
            cluster.stop()
        if server is not None:
            server.kill()
            server.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def run(args, dev: str, L: int, n: int, tmp: str, url: str | None, no_redis: str | None,
        cluster_url: str | None) -> None:
    from kvstore.tiers.redis_store import RedisConfig
    geom = ModelGeometry(L, 32, 8, 128)
    blocks = n // 16 + 64
    cfg = CacheConfig(name="b", model_id="llama-3-8b-geometry", geometry=geom, codec=CodecConfig("pq"),
                      block_size=16, residual=128, num_blocks=blocks, max_sequences=4, device=dev,
                      host_bytes=3 * blocks * (2 * L * 8 * 16 * 64 + 2 * L * 8 * 16 * 128 * 2) // 2)
    # The put queue holds the whole prefix (the default 64 MiB would drop most of an
    # 8K-token prefix's 264 MB of 4-bit codes while the writer drains it).
    conns = {} if args.redis_read_connections is None else {"read_connections": args.redis_read_connections}
    redis_cfg = RedisConfig(url, timeout_s=30, queue_bytes=1 << 30, **conns) if url else None
    cluster_cfg = RedisConfig(cluster_url, timeout_s=30, queue_bytes=1 << 30, **conns) if cluster_url else None
    e = Engine(dev, lmdb_path=os.path.join(tmp, "lmdb"), redis=redis_cfg)
    g = torch.Generator().manual_seed(0)
    cb = Codebooks(k=torch.randn(L, 8, 64, 256, 2, generator=g), v=torch.randn(L, 8, 64, 256, 2, generator=g))

    def new_cache(engine, name, host=False):
        engine.create_cache(dataclasses.replace(cfg, name=name, host_bytes=cfg.host_bytes if host else 0))
        engine.set_codebooks(name, cb)
        return engine.cache(name)

    def fill(name, seq, prompt):
        e.allocate(name, "t", seq, prompt)
        chunk = min(1024, n)
        for i in range(0, n, chunk):
            k = torch.randn(L, chunk, 8, 128, dtype=torch.float16, device=dev)
            e.append(name, "t", [seq], k, k, [chunk], token_ids=[prompt[i:i + chunk]] if prompt else None)
    cache = new_cache(e, "b", host=True)
    # No token ids: no content hashes, so every move copies every block
    # (with hashes, a block already below is shared instead of copied).
    fill("b", "s", [])
    s = cache.seq("t", "s")
    moved = (len(s.sealed) * cache.main.block_bytes() + len(s.tail) * cache.tail.block_bytes())

    # Baseline: one plain copy of the same bytes, GPU -> pinned host -> GPU.
    src = torch.empty(moved, dtype=torch.uint8, device=dev)
    pinned = torch.empty(moved, dtype=torch.uint8, pin_memory=dev.startswith("cuda"))
    t_d2h_plain = timed(lambda: pinned.copy_(src, non_blocking=True), dev)
    t_h2d_plain = timed(lambda: src.copy_(pinned, non_blocking=True), dev)
    t_down = t_up = t_spill = t_restore = float("inf")
    for _ in range(args.reps):
        t_down = min(t_down, timed(lambda: cache.tiering.to_host(s), dev, reps=1))
        t_up = min(t_up, timed(lambda: cache.tiering.page_in(s, set()), dev, reps=1))
    for _ in range(args.reps):           # LMDB: Offload (durable: committed and synced) and Prefetch
        t_spill = min(t_spill, timed(lambda: e.offload("b", "t", ["s"]), dev, reps=1))
        t_restore = min(t_restore, timed(lambda: e.prefetch("b", "t", ["s"]), dev, reps=1))
        cache.changing(s)      # as a write would: the durable copy goes, the next Offload writes again
    t_disk = disk_write(os.path.join(tmp, "disk-baseline"), moved, args.reps)

    # An 8K-token prefix with token ids: its sealed blocks get content hashes.
    prompt = list(range(1, n + 1))
    fill("b", "p", prompt)
    sealed = len(cache.seq("t", "p").sealed)
    prefix_bytes = sealed * cache.main.block_bytes()
    if url:
        wait_until(lambda: cache.redis.stats()["blocks_out"] + cache.redis.stats()["dropped_puts"] >= sealed,
                   "the prefix's puts to Redis")
        if cache.redis.stats()["dropped_puts"]:
            raise RuntimeError(f"{cache.redis.stats()['dropped_puts']} of the prefix's puts were dropped")
    ec = None
    if cluster_cfg:          # the same blocks into the cluster, through a store of its own
        ec = Engine(dev, redis=cluster_cfg)
        ctier = new_cache(ec, "b").redis
        ids = cache.seq("t", "p").sealed
        ctier.put([cache.main_pool.blocks[b].hash for b in ids], cache.main_io.pack(list(ids)))
        wait_until(lambda: ctier.stats()["blocks_out"] + ctier.stats()["dropped_puts"] >= sealed,
                   "the prefix's puts to the cluster")
        if ctier.stats()["dropped_puts"]:
            raise RuntimeError(f"{ctier.stats()['dropped_puts']} of the prefix's puts to the cluster were dropped")
    cache.tiering.to_host(cache.seq("t", "p"))       # host: its blocks findable there
    e.offload("b", "t", ["p"])                        # LMDB: its blocks under their hashes
    e.free("b", "t", ["p"])                           # the sequence goes, its blocks stay below

    def prefix_hit(engine, name, want, key=None):
        """Allocate the prompt where only a tier below has it: host (cache "b"
        with its GPU pools forgetting their hashes), LMDB (a fresh cache of the
        same fingerprint, no host tier) or Redis (a fresh cache of another engine)."""
        if want == "host":
            cache.main_pool.clear_hashes()
            cache.tail_pool.clear_hashes()
            name = "b"
        else:
            new_cache(engine, name)
        before = engine.stats(name)[name]
        before = before["redis"]["prefix_hits"] if want == "redis" else before["tiers"]["prefix_hits_" + want]
        sync(dev)
        t = time.perf_counter()
        got = engine.allocate(name, "t", "x", prompt).cached_tokens
        sync(dev)
        dt = time.perf_counter() - t
        st = engine.stats(name)[name]
        hits = (st["redis"]["prefix_hits"] if want == "redis" else st["tiers"]["prefix_hits_" + want]) - before
        # every block the hit serves comes from below: the sealed ones, and the tail's full
        # fp16 blocks where the tier holds them (all but the block of the prompt's last token)
        assert hits >= sealed and got == hits * 16, f"{want}: {hits} blocks from below ({sealed} sealed), {got} tokens"
        engine.free(name, "t", ["x"])
        hit_blocks[key or want] = hits
        return dt
    hit_blocks = {}
    t_hit = {"host": float("inf"), "disk": float("inf"), "redis": float("inf"), "cluster": float("inf")}
    e2 = Engine(dev, redis=redis_cfg) if url else None       # another host: nothing local
    e3 = Engine(dev, redis=cluster_cfg) if cluster_cfg else None
    for r in range(args.reps):
        t_hit["host"] = min(t_hit["host"], prefix_hit(e, f"h{r}", "host"))
        t_hit["disk"] = min(t_hit["disk"], prefix_hit(e, f"d{r}", "disk"))
        if e2 is not None:
            t_hit["redis"] = min(t_hit["redis"], prefix_hit(e2, f"r{r}", "redis"))
        if e3 is not None:
            t_hit["cluster"] = min(t_hit["cluster"], prefix_hit(e3, f"c{r}", "redis", key="cluster"))
    t_rput = float("inf")
    if url:      # puts through the store: the prefix's blocks again, as a spill sends them
        payload = cache.main_io.pack(list(range(sealed)))
        hashes = [bytes([r]) * 32 for r in range(sealed)] if sealed < 256 else [os.urandom(32) for _ in range(sealed)]
        for _ in range(args.reps):
            tier = cache.redis
            tier._known.clear()
            before = tier.stats()["blocks_out"]
            sync(dev)
            t = time.perf_counter()
            tier.put(hashes, payload)
            wait_until(lambda: tier.stats()["blocks_out"] >= before + sealed, "Redis puts")
            t_rput = min(t_rput, time.perf_counter() - t)

    gb, pgb = moved / 1e9, prefix_bytes / 1e9

    def hit_gb(want: str) -> float:
        """The bytes one hit from the tier moved: its sealed blocks and fp16 tail blocks."""
        tails = hit_blocks.get(want, sealed) - sealed
        return (prefix_bytes + tails * cache.tail.block_bytes()) / 1e9
    rows = [
        ("bytes moved (PQ sealed + fp16 tail)", f"{moved / 2**20:.1f} MiB", ""),
        ("GPU->host tier move", f"{gb / t_down:.1f} GB/s", f"{t_d2h_plain / t_down:.2f}x of plain copy "
                                                             f"({gb / t_d2h_plain:.1f} GB/s)"),
        ("host->GPU page-in", f"{gb / t_up:.1f} GB/s", f"{t_h2d_plain / t_up:.2f}x of plain copy "
                                                        f"({gb / t_h2d_plain:.1f} GB/s)"),
        ("disk: write + fdatasync of the same bytes", f"{gb / t_disk:.2f} GB/s", f"{t_disk * 1e3:.1f} ms ({tmp})"),
        ("LMDB spill (Offload, synced)", f"{gb / t_spill:.2f} GB/s", f"{t_spill * 1e3:.1f} ms, "
                                                                    f"{t_disk / t_spill:.2f}x of the disk's speed"),
        ("LMDB restore (Prefetch, to the device)", f"{gb / t_restore:.2f} GB/s", f"{t_restore * 1e3:.1f} ms"),
        (f"prefix: {sealed} sealed blocks", f"{prefix_bytes / 2**20:.1f} MiB", ""),
    ]
    if url:
        rows += [("redis-server io-threads", str(args.redis_io_threads),
                  " ".join(f"{n} {v}" for n, v in args.redis_option) or "(--redis-io-threads)"),
                 ("Redis put (through the store, not persisted)", f"{pgb / t_rput:.2f} GB/s", f"{t_rput * 1e3:.1f} ms"),
                 ("Redis get (prefix hit, to the device)", f"{hit_gb('redis') / t_hit['redis']:.2f} GB/s",
                  f"{cache.redis.store.read_lanes(cache.redis.store.topology.seed)} connection(s), "
                  f"{hit_blocks.get('redis', sealed)} blocks")]
        if e3 is not None:
            store = ctier.store
            rows.append((f"Redis Cluster get ({args.redis_shards} shards)",
                         f"{hit_gb('cluster') / t_hit['cluster']:.2f} GB/s",
                         f"{store.read_lanes(store.topology.nodes[0])} connection(s) per shard"))
    else:
        rows += [("Redis rows", "skipped", no_redis)]
    for t, name in (("host", "host"), ("disk", "LMDB")):
        rows.append((f"prefix hit from {name} (to the device)", f"{hit_gb(t) / t_hit[t]:.2f} GB/s",
                     f"{hit_blocks.get(t, sealed)} blocks ({sealed} sealed)"))
    if not args.skip_prefill:
        t_prefill = prefill_stack(L, n, dev)
        rows.append((f"recompute prefill of {n} tokens (Llama-3-8B geometry)", f"{t_prefill * 1e3:.1f} ms", ""))
        for label, t in ((f"restore {n} tokens from host (page-in)", t_up),
                         (f"restore {n} tokens from LMDB (Prefetch)", t_restore),
                         (f"{n}-token prefix hit from host", t_hit["host"]),
                         (f"{n}-token prefix hit from LMDB", t_hit["disk"]),
                         (f"{n}-token prefix hit from Redis", t_hit["redis"]),
                         (f"{n}-token prefix hit from a {args.redis_shards}-shard Redis Cluster", t_hit["cluster"])):
            if t < float("inf"):
                rows.append((label, f"{t * 1e3:.1f} ms", f"{t_prefill / t:.1f}x faster than recompute"))
    print(f"\ntiers benchmark: device {dev} ({torch.cuda.get_device_name() if dev.startswith('cuda') else 'cpu'}),"
          f" {n} tokens, {L} layers")
    w = max(len(r[0]) for r in rows)
    for a, b, c in rows:
        print(f"  {a:<{w}}  {b:>12}  {c}")
    for engine in (e, e2, e3, ec):
        if engine is not None:
            engine.close()


if __name__ == "__main__":
    main()
