"""The Redis tier's whole lookup path on a CPU, in client CPU seconds per GB,
against a raw read of the same replies from the same servers in the same run.

  raw socket    per node one thread and one blocking connection: the node's GETs sent in
                chunks of GET_CHUNK_BYTES of values, one chunk ahead, as a lookup sends
                them, and their replies' exact byte count received with recv_into into
                one buffer, parsed by nobody (what any client must at least spend)
  read_into     RedisStore.read_into over read_connections per node into rows reused
                from run to run (as a GPU lookup's pinned staging is), every chunk's
                verdicts waited on: without the checks ("no check"), then with them
                (header + checksum, by the thread that received the value)
  get_prefix    RedisTier.get_prefix(hashes, device): read_into with the checks into a new
                result tensor; on --device cpu its first touch costs page faults, on
                --device cuda it is the daemon's lookup: pinned staging from torch's host
                cache, each chunk copied on to the device as it comes in
each against one redis-server this script starts on a free port, and with --shards N
against an N-node local Redis Cluster (kvstore/tools/local_redis.py), filled with values
packed by redis_format (the payloads random bytes). Per row: GB/s of values (wall), the
client's CPU seconds per GB (this process's user + system time: the servers are other
processes) and the servers' (from /proc), and wall and CPU as ratios of the raw read.
On a host with few cores the wall-clock figures mostly show the client and the servers
sharing them; the CPU seconds per GB are what carries over to a larger host. --split-cpus
runs the servers on the first CPU and this process on the others (sched_setaffinity), so
that they receive and send at the same time as on a host with cores to spare.

python bench/bench_redis_lookup.py [--redis-server PATH] [--mb 256] [--value-kb 512]
                                   [--shards 0 4] [--read-connections 1 2] [--reps 5] [--split-cpus]
                                   [--chunk-mb N] [--io-threads N] [--server-option NAME VALUE] [--device cuda]
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import sys
import tempfile
import threading
import time
from types import SimpleNamespace
from urllib.parse import urlsplit

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_redis_read import cpu_seconds  # noqa: E402
from bench_tiers import start_redis  # noqa: E402


def client_cpu() -> np.ndarray:
    """This process's [user, system] CPU seconds so far (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return np.array([r.ru_utime, r.ru_stime])


def measure(fn, reps: int, pids: list[int]) -> tuple[float, np.ndarray, float]:
    """-> (best wall seconds of fn, client [user, system] CPU seconds per run,
    servers' CPU seconds per run)."""
    fn()                                    # connections made, pages touched
    best, c0, s0 = float("inf"), client_cpu(), sum(cpu_seconds(p) for p in pids)
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best, (client_cpu() - c0) / reps, (sum(cpu_seconds(p) for p in pids) - s0) / reps


def raw_read(nodes: list[tuple[str, int, list[bytes], list[int]]], chunk_bytes: int, buf: memoryview):
    """A function that GETs each node's keys over one plain blocking connection
    per node, side by side, receiving their replies' bytes into buf: the GETs
    of chunk_bytes of values per write, the next chunk's sent before the
    current one's replies are received, as a lookup's connections do (one
    write of every GET makes a server buffer every reply at once)."""
    from kvstore.tiers.resp import command
    socks = [socket.create_connection((host, port)) for host, port, _, _ in nodes]
    for s in socks:        # as resp.py's: a chunk's GETs go out at once, not after the last one's ACK
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    plans, at = [], 0
    for _, _, keys, sizes in nodes:       # sizes: each reply's bytes
        plan, a = [], 0
        while a < len(keys):
            b, size = a, 0
            while b < len(keys) and (b == a or size + sizes[b] <= chunk_bytes):
                size += sizes[b]
                b += 1
            plan.append((b"".join(command(b"GET", k) for k in keys[a:b]), buf[at:at + size]))
            at += size
            a = b
        plans.append(plan)

    def one(j):
        s, plan = socks[j], plans[j]
        s.sendall(plan[0][0])
        for c, (_, view) in enumerate(plan):
            if c + 1 < len(plan):
                s.sendall(plan[c + 1][0])
            got = 0
            while got < len(view):
                got += s.recv_into(view[got:])

    def run():
        ts = [threading.Thread(target=one, args=(j,)) for j in range(len(nodes))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return run, lambda: [s.close() for s in socks]


def bench(label: str, url: str, pids: list[int], args, fp: bytes, hashes: list[bytes], values: list[bytes]) -> None:
    import redis
    if args.split_cpus:
        for pid in pids:        # every thread of each server
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), {args.server_cpu})

    from kvstore.tiers import redis_store
    from kvstore.tiers.redis import RedisTier
    from kvstore.tiers.redis_format import HEADER_BYTES, block_key, check
    from kvstore.tiers.redis_nodes import Topology
    from kvstore.tiers.redis_store import HIT, RedisConfig, RedisStore
    keys = [block_key(fp, h) for h in hashes]
    topo = Topology(url, url, 30, 1, 1, lambda node, e: None)
    assert topo.refresh()
    for node, idx in topo.route(keys):
        r = redis.Redis.from_url(node.url)
        pipe = r.pipeline(transaction=False)
        for i in idx:
            pipe.set(keys[i], values[i])
        pipe.execute()
        r.close()
    width = len(values[0]) - HEADER_BYTES
    total = sum(len(v) for v in values)
    groups = [(node, idx) for node, idx in topo.route(keys)]
    topo.close()
    parts = []
    for node, idx in groups:
        u = urlsplit(node.url)
        parts.append((u.hostname, u.port, [keys[i] for i in idx],
                      [len(values[i]) + len(b"$%d\r\n\r\n" % len(values[i])) for i in idx]))
    buf = memoryview(np.empty(sum(sum(p[3]) for p in parts), dtype=np.uint8)).cast("B")
    run_raw, close_raw = raw_read(parts, redis_store.GET_CHUNK_BYTES, buf)
    t_raw, c_raw, s_raw = measure(run_raw, args.reps, pids)
    close_raw()
    gb = total / 1e9
    print(f"\n{label}: {len(values)} values of {width >> 10} KiB + {HEADER_BYTES} B ({total / 1e6:.0f} MB), "
          f"{len(groups)} node(s), {os.cpu_count()} CPUs{' (servers on 1, this process on the rest)' if args.split_cpus else ''}, "
          f"GET_CHUNK_BYTES {redis_store.GET_CHUNK_BYTES >> 20} MiB")
    print(f"  {'CPU seconds per GB:':<36} {'GB/s':>6} {'client':>7} {'(user':>6} {'sys)':>6} {'servers':>8} "
          f"{'wall/raw':>9} {'client/raw':>11}")

    def row(name, t, c, s):
        print(f"  {name:<36} {gb / t:6.2f} {c.sum() / gb:7.3f} {c[0] / gb:6.3f} {c[1] / gb:6.3f} {s / gb:8.3f} "
              f"{t / t_raw:9.2f} {c.sum() / c_raw.sum():11.2f}")
    row("raw socket, 1 conn per node", t_raw, c_raw, s_raw)
    cache = SimpleNamespace(fingerprint=fp, main_io=SimpleNamespace(block_bytes=lambda: width),
                            main_pool=SimpleNamespace(on_hash=None), cfg=SimpleNamespace(name="bench"))
    for conns in args.read_connections:
        store = RedisStore(RedisConfig(url, timeout_s=args.timeout, read_connections=conns))
        tier = RedisTier(store, cache)
        heads, rows = np.empty((len(keys), HEADER_BYTES), np.uint8), np.empty((len(keys), width), np.uint8)

        def read_into(verify):
            got = [v for _, _, f in store.read_into(keys, heads, rows, verify) for v in f.result()]
            assert got == [HIT] * len(keys), got[:4]
        for name, verify in (("no check", lambda i: True),
                             ("checked", lambda i: check(heads[i], rows[i], fp, hashes[i]))):
            row(f"read_into, {name}, {conns} conn/node", *measure(lambda: read_into(verify), args.reps, pids))
        assert all(bytes(rows[i]) == values[i][HEADER_BYTES:] for i in range(len(keys)))
        out = []

        def lookup():
            out[:] = [tier.get_prefix(hashes, args.device)[0]]
            if out[0].is_cuda:
                torch.cuda.synchronize()
        row(f"get_prefix to {args.device}, {conns} conn/node", *measure(lookup, args.reps, pids))
        assert out[0].shape == (len(values), width), (out[0].shape, tier.stats())
        assert all(bytes(out[0][i].cpu().numpy()) == values[i][HEADER_BYTES:] for i in (0, len(values) // 2, -1))
        assert tier.stats()["refused"] == 0 and tier.stats()["errors"] == 0, tier.stats()
        store.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis-server", default=None, metavar="PATH")
    p.add_argument("--mb", type=int, default=256, help="bytes per lookup (an 8K 4-bit Llama-3-8B prefix: 264)")
    p.add_argument("--value-kb", type=int, default=512, help="payload per value (a 4-bit Llama-3-8B block: 512)")
    p.add_argument("--shards", type=int, nargs="+", default=[0, 4], help="0: one redis-server; N: an N-node cluster")
    p.add_argument("--read-connections", type=int, nargs="+", default=[1], help="RedisConfig.read_connections")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=5.0, help="RedisConfig.timeout_s")
    p.add_argument("--chunk-mb", type=int, default=0, help="set redis_store.GET_CHUNK_BYTES (MiB; 0: as it is)")
    p.add_argument("--split-cpus", action="store_true", help="the servers on the first CPU, this process on the rest")
    p.add_argument("--io-threads", type=int, default=1, help="the servers' io-threads (Redis/Valkey >= 6)")
    p.add_argument("--server-option", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                   help="another server option, e.g. --server-option min-io-threads-avoid-copy-reply 2 (Valkey 9)")
    p.add_argument("--device", default="cpu", help="where get_prefix puts the prefix (cuda: the daemon's lookup)")
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    args.server_cpu = cpus[0]
    if args.chunk_mb:
        from kvstore.tiers import redis_store
        redis_store.GET_CHUNK_BYTES = args.chunk_mb << 20
    if args.split_cpus:
        if len(cpus) < 2:
            p.error(f"--split-cpus needs 2 CPUs or more, this process may use {len(cpus)}")
        os.sched_setaffinity(0, cpus[1:])      # before this process starts any thread: they inherit it
    from kvstore.tiers.redis_format import pack_value
    from kvstore.tools.local_redis import LocalCluster
    width = args.value_kb << 10
    n = max(1, (args.mb << 20) // width)
    rng = np.random.default_rng(0)
    fp, hashes = bytes(rng.integers(0, 256, 32, dtype=np.uint8)), [rng.bytes(32) for _ in range(n)]
    values = [pack_value(fp, h, rng.integers(0, 256, width, dtype=np.uint8)) for h in hashes]
    options = tuple(x for name, value in args.server_option for x in ("--" + name, value))
    for shards in args.shards:
        tmp = tempfile.mkdtemp(prefix="kvbench-lookup-")
        try:
            if shards == 0:
                server, url = start_redis(args.redis_server, tmp, io_threads=args.io_threads, extra=options)
                if server is None:
                    print(f"one redis-server: skipped ({url})")
                    continue
                try:
                    bench("one redis-server", url, [server.pid], args, fp, hashes, values)
                finally:
                    server.kill()
                    server.wait()
            else:
                cluster = LocalCluster(tmp, shards, args.redis_server, maxmemory="8gb",
                                       extra=(("--io-threads", str(args.io_threads)) if args.io_threads > 1 else ())
                                       + options)
                try:
                    bench(f"a {shards}-node Redis Cluster", cluster.url, [q.pid for q in cluster.procs], args,
                          fp, hashes, values)
                finally:
                    cluster.stop()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
