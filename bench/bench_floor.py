"""Floors of one Python gRPC round trip on a Unix socket (issue 4): a unary
echo against a ping-pong over one long-lived bidirectional stream, each on a
sync (thread-pool) server and a grpc.aio server, measured in one run.

    python bench/bench_floor.py [--calls 500] [--rounds 5] [--payload 200]

Rows (p50 / p99 over rounds x calls, and the ratio to unary/sync):
  unary/<server>         a generic unary echo, sync client (what every RPC pays today)
  stream/<server>        one stream opened once; per call: send one message, read one reply
                         (grpc's public sync API: requests come from a queue its consumer
                         thread drains, replies come from the channel's polling thread)
  stream-core/<server>   the same stream driven from the calling thread alone (the kvstore
                         client's CallStream, client/stream.py)
  aio-unary/<server>     the same from a grpc.aio client, timed inside its event loop
  aio-stream/<server>    (an asyncio caller's floor; the kvstore client is synchronous)
Servers run in their own processes with the daemon's options; variants run
interleaved, round by round, in a rotating order.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import queue
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

UNARY, STREAM = "/bench.Echo/Unary", "/bench.Echo/Stream"


def _handlers(grpc, aio: bool):
    if aio:
        async def unary(req, ctx):
            return req

        async def stream(it, ctx):
            async for r in it:
                yield r
    else:
        def unary(req, ctx):
            return req

        def stream(it, ctx):
            for r in it:
                yield r

    class Echo(grpc.GenericRpcHandler):
        def service(self, details):
            if details.method == UNARY:
                return grpc.unary_unary_rpc_method_handler(unary)
            if details.method == STREAM:
                return grpc.stream_stream_rpc_method_handler(stream)
            return None
    return Echo()


def serve(kind: str, sock: str, workers: int) -> None:
    from concurrent import futures

    import grpc

    from kvstore.protocol.channel import server_options
    if kind == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=server_options(),
                             handlers=[_handlers(grpc, False)])
        server.add_insecure_port(f"unix:{sock}")
        server.start()
        server.wait_for_termination()
        return

    async def main():
        server = grpc.aio.server(options=server_options(), handlers=[_handlers(grpc, True)])
        server.add_insecure_port(f"unix:{sock}")
        await server.start()
        await server.wait_for_termination()
    asyncio.run(main())


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


class SyncStream:
    """One bidirectional stream of a sync channel, used as request -> reply."""

    def __init__(self, channel):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.call = channel.stream_stream(STREAM)(iter(self.q.get, None))

    def __call__(self, payload: bytes) -> bytes:
        self.q.put(payload)
        return next(self.call)

    def close(self) -> None:
        self.q.put(None)
        self.call.cancel()


def time_sync(fn, payload: bytes, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        r = fn(payload)
        out.append((time.perf_counter_ns() - t0) / 1e3)
        assert r == payload
    return out


async def time_aio(target: str, stream: bool, payload: bytes, n: int, warmup: int) -> list[float]:
    import grpc
    from kvstore.protocol.channel import client_options
    async with grpc.aio.insecure_channel(target, options=client_options()) as ch:
        if stream:
            call = ch.stream_stream(STREAM)()

            async def fn(p):
                await call.write(p)
                return await call.read()
        else:
            fn = ch.unary_unary(UNARY)
        out = []
        for i in range(warmup + n):
            t0 = time.perf_counter_ns()
            r = await fn(payload)
            if i >= warmup:
                out.append((time.perf_counter_ns() - t0) / 1e3)
            assert r == payload
        if stream:
            await call.done_writing()
            call.cancel()
        return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--payload", type=int, default=200, help="request bytes (an AppendAttend with buffer refs)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--no-aio-client", action="store_true")
    ap.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return serve(args.serve[0], args.serve[1], args.workers)

    import grpc

    from kvstore.protocol.channel import client_options
    tmp = tempfile.mkdtemp(prefix="kvfloor-")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    socks = {k: os.path.join(tmp, f"{k}.sock") for k in ("sync", "aio")}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", k, s,
                               "--workers", str(args.workers)], env=env) for k, s in socks.items()]
    try:
        deadline = time.time() + 60
        while not all(os.path.exists(s) for s in socks.values()):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("echo servers did not start")
            time.sleep(0.05)
        time.sleep(0.3)
        payload = b"x" * args.payload
        channels = {k: grpc.insecure_channel(f"unix://{s}", options=client_options()) for k, s in socks.items()}
        sync_fns = {}
        from kvstore.client.stream import CallStream
        for k, ch in channels.items():
            sync_fns[f"unary/{k}"] = ch.unary_unary(UNARY)
            sync_fns[f"stream/{k}"] = SyncStream(ch)
            sync_fns[f"stream-core/{k}"] = CallStream(ch, STREAM)
        names = list(sync_fns)
        if not args.no_aio_client:
            names += [f"aio-{m}/{k}" for m in ("unary", "stream") for k in socks]
        samples: dict[str, list[float]] = {k: [] for k in names}
        for name in names:                   # warm every path once
            if name in sync_fns:
                time_sync(sync_fns[name], payload, args.warmup)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                if name in sync_fns:
                    samples[name] += time_sync(sync_fns[name], payload, args.calls)
                else:
                    mode, k = name[4:].split("/")
                    samples[name] += asyncio.run(time_aio(f"unix://{socks[k]}", mode == "stream", payload,
                                                          args.calls, args.warmup))
        base = pct(samples["unary/sync"], 50)
        print(f"\nEcho floors on a Unix socket, {args.rounds} rounds x {args.calls} calls, {args.payload}-byte "
              f"messages, grpcio {grpc.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
        print(f"{'variant':<20}{'p50 µs':>9}{'p99 µs':>9}{'x unary/sync':>14}")
        for name, xs in samples.items():
            print(f"{name:<20}{pct(xs, 50):9.0f}{pct(xs, 99):9.0f}{pct(xs, 50) / base:14.2f}")
        for fn in sync_fns.values():
            if isinstance(fn, (SyncStream, CallStream)):
                fn.close()
        for ch in channels.values():
            ch.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


if __name__ == "__main__":
    main()
