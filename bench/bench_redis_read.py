"""The Redis read path against its ceiling, every figure a ratio against the
raw loopback socket measured in the same run.

  raw socket     a process sending the same bytes over P loopback TCP connections,
                 received with recv_into into one buffer (what any client can reach)
  redis-py       a pipeline of GETs per connection, P connections in threads (the old path)
  resp, no check RedisStore.read_into (kvstore/tiers/resp.py) without the value checks
  resp           RedisStore.read_into with the checks a lookup makes (header + checksum, by
                 the thread that received the value, right after it)
each over P connections (--conns: RedisConfig.read_connections), against a redis-server
this script starts on a free port, once per --io-threads value (Redis 7: `io-threads N`;
its threads only write when at least 2 N clients have replies pending, so P >= 2 N).
Beside each row: the CPU redis-server used while it ran (cores: its user + system time
over the run's wall time, from /proc), which shows when its main thread is the bound.

python bench/bench_redis_read.py [--redis-server PATH] [--mb 264] [--value-kb 512]
                                 [--conns 1 4 8] [--io-threads 1 4]
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tiers import start_redis  # noqa: E402


def best_of(fn, reps: int, pid: int | None = None) -> tuple[float, float]:
    """-> (best seconds of fn, cores process pid used over all reps: its CPU
    time over their wall time, /proc's ticks being 10 ms)."""
    best, wall, c0 = float("inf"), 0.0, cpu_seconds(pid)
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, wall = min(best, dt), wall + dt
    return best, (cpu_seconds(pid) - c0) / wall


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process pid so far (0 where /proc has none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, TypeError):
        return 0.0


SENDER = r"""
import socket, sys, threading
data = memoryview(bytearray(8 << 20))
srv = socket.create_server(("127.0.0.1", int(sys.argv[1])))

def serve(c):
    with c:
        ask = c.recv(32)
        n = int(ask) if ask else 0
        while n:
            n -= c.send(data[:min(n, len(data))])
while True:
    threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
"""


def raw_socket(total: int, conns: int, reps: int) -> float:
    """Seconds to receive total bytes over conns loopback connections (a sender process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", SENDER, str(port)])
    try:
        for _ in range(500):
            try:
                socket.create_connection(("127.0.0.1", port)).close()      # asks for nothing
                break
            except OSError:
                time.sleep(0.02)
        buf = memoryview(np.empty(total, dtype=np.uint8)).cast("B")
        share = total // conns

        def one(i):
            with socket.create_connection(("127.0.0.1", port)) as c:
                n = share if i < conns - 1 else total - share * (conns - 1)
                c.sendall(str(n).encode().ljust(32))
                view, got = buf[i * share:i * share + n], 0
                while got < n:
                    got += c.recv_into(view[got:])

        def run():
            ts = [threading.Thread(target=one, args=(i,)) for i in range(conns)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        return best_of(run, reps)[0]
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis-server", default=None, metavar="PATH")
    p.add_argument("--mb", type=int, default=264, help="bytes read per run (an 8K 4-bit prefix: 264)")
    p.add_argument("--value-kb", type=int, default=512, help="payload per value (a 4-bit Llama-3-8B block: 512)")
    p.add_argument("--conns", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--io-threads", type=int, nargs="+", default=[1, 4] if (os.cpu_count() or 1) >= 8 else [1])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    import redis

    from kvstore.tiers.redis_format import HEADER_BYTES, block_key, check, pack_value
    from kvstore.tiers.redis_store import HIT, RedisConfig, RedisStore
    width = args.value_kb << 10
    n = max(1, (args.mb << 20) // width)
    total = n * (width + HEADER_BYTES)
    fp, hashes = bytes(32), [i.to_bytes(32, "little") for i in range(n)]
    keys = [block_key(fp, h) for h in hashes]
    payloads = np.random.default_rng(0).integers(0, 256, size=(n, width), dtype=np.uint8)
    rows = [("raw socket, %d conn" % c, raw_socket(total, c, args.reps), c) for c in args.conns]
    raw = {c: t for _, t, c in rows}
    print(f"\nRedis read ceiling: {n} values of {width >> 10} KiB + {HEADER_BYTES} B ({total / 1e6:.0f} MB), "
          f"{os.cpu_count()} CPUs")
    for label, t, c in rows:
        print(f"  {label:<40} {total / t / 1e9:6.2f} GB/s")
    for io in args.io_threads:
        tmp = tempfile.mkdtemp(prefix="kvbench-redis-")
        server, url = start_redis(args.redis_server, tmp, io_threads=io)
        if server is None:
            print(f"  redis rows skipped: {url}")
            return
        try:
            r = redis.Redis.from_url(url)
            for k, h, row in zip(keys, hashes, payloads):
                r.set(k, pack_value(fp, h, row))
            print(f"  redis-server, io-threads {io}:")
            for c in args.conns:
                share = [keys[i::c] for i in range(c)]
                clients = [redis.Redis.from_url(url) for _ in range(c)]

                def redis_py():
                    def one(i):
                        pipe = clients[i].pipeline(transaction=False)
                        for k in share[i]:
                            pipe.get(k)
                        assert all(v is not None for v in pipe.execute())
                    ts = [threading.Thread(target=one, args=(i,)) for i in range(c)]
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join()
                store = RedisStore(RedisConfig(url, timeout_s=30, read_connections=c))
                heads, out = np.empty((n, HEADER_BYTES), np.uint8), np.empty((n, width), np.uint8)

                def ours(verify):
                    got = [v for _, _, f in store.read_into(keys, heads, out, verify) for v in f.result()]
                    assert got == [HIT] * n, got[:4]
                t_py = best_of(redis_py, args.reps, server.pid)
                t_nc = best_of(lambda: ours(lambda i: True), args.reps, server.pid)
                t_ck = best_of(lambda: ours(lambda i: check(heads[i], out[i], fp, hashes[i])), args.reps, server.pid)
                assert np.array_equal(out, payloads)
                store.close()
                for label, (t, cores) in (("redis-py pipeline", t_py), ("resp, no check", t_nc),
                                          ("resp (lookup path)", t_ck)):
                    print(f"    {label + ', %d conn' % c:<38} {total / t / 1e9:6.2f} GB/s  "
                          f"{raw[c] / t:.2f}x of raw socket, {c} conn; redis-server {cores:.2f} cores")
        finally:
            server.kill()
            server.wait()
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
