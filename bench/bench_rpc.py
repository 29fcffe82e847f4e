"""Per-call overhead of one AppendAttend on a Unix socket against the floor of
a bare gRPC call of the same kind, measured in one run.

    python bench/bench_rpc.py [--calls 200] [--rounds 5] [--device cpu|cuda]

Rows (each: p50 / p99 over rounds x calls, and the overhead over its floor):
  echo       a raw generic unary handler (bytes in, bytes out) in its own
             process, served with the daemon's server options: the unary floor
  echo/stream
             the same server's bidirectional-stream echo, one stream, driven
             by the client's own CallStream (client/stream.py): the stream floor
  echo/stream-api
             the same stream echo through grpc's public sync streaming API
             (requests from a queue its consumer thread drains, replies from
             the channel's polling thread): what CallStream saves
  heartbeat  the daemon's cheapest RPC: interceptors + servicer, no engine
  <codec>/<transport>
             unary AppendAttend of one token, one sequence, one layer (tiny
             shape), shm or inline on CPU; CUDA buffers when torch.cuda is
             available (the client synchronises after every call, so the time
             is the whole round trip including the GPU work)
  <codec>/<transport>/stream
             the same over the client's AppendAttendStream; floor: echo/stream
  echo/bell  the echo server's SOCK_SEQPACKET echo of a descriptor-sized
             packet on a thread: the doorbell's floor
  <codec>/<shm|cuda>/bell
             the same by the daemon's doorbell (kvstore/service/doorbell.py; the
             client's default once it has a buffer); floor: echo/bell
  <codec>/cuda/bell+views
             the doorbell with k, v, q and out in the client's registered
             buffer (KVStoreClient.step_buffers): no staging or read-back copy
  <codec>/cuda/bell+views+hostwait
             the same with KVStoreClient(host_wait=True): the host waits for
             the daemon's done event, the client's stream does not
  <row>[daemon]
             of a bell row: the daemon's time per call, from its replies
Variants run interleaved, round by round, against one daemon process; each
round starts a fresh sequence with a short prefill so lengths stay small.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "--root" in sys.argv:        # measure another checkout's daemon and client (see --compare)
    ROOT = os.path.abspath(sys.argv[sys.argv.index("--root") + 1])
sys.path.insert(0, ROOT)

ECHO = "/bench.Echo/Echo"
BELL_PACKET = 120                 # about an AppendAttend descriptor's size
ECHO_STREAM = "/bench.Echo/Stream"
GEOM = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64)


# ---------------------------------------------------------------- the floor
def echo_server(sock: str, workers: int) -> None:
    """A bare gRPC server with the daemon's options: one generic unary echo."""
    from concurrent import futures

    import grpc

    from kvstore.protocol.channel import server_options

    def stream(requests, ctx):
        for r in requests:
            yield r

    class Echo(grpc.GenericRpcHandler):
        def service(self, details):
            if details.method == ECHO:
                return grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)
            if details.method == ECHO_STREAM:
                return grpc.stream_stream_rpc_method_handler(stream)
            return None

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=server_options(),
                         handlers=[Echo()])
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    _bell_echo(sock + ".bell")
    print("ready", flush=True)
    server.wait_for_termination()


def _bell_echo(path: str) -> None:
    """A SOCK_SEQPACKET echo, a thread per connection, as the daemon's doorbell serves."""
    import socket
    import threading

    def serve(conn):
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def accept(listener):
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(8)
    threading.Thread(target=accept, args=(listener,), daemon=True).start()


class ApiStream:
    """One bidirectional stream through grpc's public sync API, used as request -> reply."""

    def __init__(self, channel):
        import queue
        self.q = queue.SimpleQueue()
        self.call = channel.stream_stream(ECHO_STREAM)(iter(self.q.get, None))

    def __call__(self, payload: bytes) -> bytes:
        self.q.put(payload)
        return next(self.call)

    def close(self) -> None:
        self.q.put(None)
        self.call.cancel()


def _wait_socket(p: subprocess.Popen, sock: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not os.path.exists(sock):
        if p.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"server on {sock} did not start: {p.stdout.read() if p.stdout else ''}")
        time.sleep(0.05)


# ---------------------------------------------------------------- helpers
def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def timed(fn, n: int, sync=None) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        if sync is not None:
            sync()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def floor_of(name: str, samples: dict[str, list[float]]) -> str:
    """Stream rows (echo/stream-api included) are measured against the stream
    echo, bell rows against the bell echo, the others against the unary one."""
    if "/bell" in name and "echo/bell" in samples and not name.endswith("]"):
        return "echo/bell"
    return "echo/stream" if "/stream" in name and "echo/stream" in samples else "echo"


def table(samples: dict[str, list[float]], title: str = "") -> None:
    if title:
        print(title)
    print(f"{'variant':<28}{'p50 µs':>9}{'p99 µs':>9}{'floor':>13}{'p50-floor':>11}{'x floor':>9}{'x echo':>8}")
    echo50 = pct(samples["echo"], 50)
    for name, xs in samples.items():
        if not xs:
            continue
        p50, p99, floor = pct(xs, 50), pct(xs, 99), floor_of(name, samples)
        if name.endswith("[daemon]"):       # a part of its row's time, not a call of its own
            print(f"{name:<28}{p50:9.0f}{p99:9.0f}")
            continue
        f50 = pct(samples[floor], 50)
        print(f"{name:<28}{p50:9.0f}{p99:9.0f}{floor:>13}{p50 - f50:11.0f}{p50 / f50:9.2f}{p50 / echo50:8.2f}")
    floors = ", ".join(f"{k}: p50 {pct(samples[k], 50):.0f} µs, p99 {pct(samples[k], 99):.0f} µs"
                       for k in ("echo", "echo/stream", "echo/bell") if k in samples)
    print(f"(floors: {floors}; x echo: against the unary echo)")


def compare(args, argv: list[str]) -> None:
    """Alternate one-round runs of this checkout and args.compare; pool the samples."""
    import json
    rest = []
    skip = False
    for a in argv:          # drop --compare DIR and --rounds N: each child runs one round
        if skip:
            skip = False
        elif a in ("--compare", "--rounds"):
            skip = True
        elif not a.startswith(("--compare=", "--rounds=")):
            rest.append(a)
    trees = {"before": os.path.abspath(args.compare), "after": ROOT}
    pooled: dict[str, dict[str, list[float]]] = {k: {} for k in trees}
    tmp = tempfile.mkdtemp(prefix="kvbench-")
    out = os.path.join(tmp, "round.json")       # one child's samples, read back at once
    try:
        for r in range(args.rounds):
            for label in (("before", "after") if r % 2 == 0 else ("after", "before")):
                root = trees[label]
                env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
                subprocess.run([sys.executable, os.path.abspath(__file__), "--root", root, "--rounds", "1",
                                "--json", out, *rest], env=env, check=True)
                with open(out) as f:
                    for k, xs in json.load(f).items():
                        pooled[label].setdefault(k, []).extend(xs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for label, root in trees.items():
        table(pooled[label], f"\n{label}: {root} ({args.rounds} rounds x {args.calls} calls, interleaved)")
    b, a = pooled["before"], pooled["after"]
    print(f"\n{'variant':<28}{'p50 before':>11}{'p50 after':>10}{'p99 before':>11}{'p99 after':>10}"
          f"{'overhead before':>16}{'overhead after':>15}")

    def cols(d, k, width):      # p50, p99, p50 over the floor; blanks for a row the tree lacks
        if not d.get(k):
            return ("-".rjust(width),) * 3
        over = "" if k.endswith("]") else f"{pct(d[k], 50) - pct(d[floor_of(k, d)], 50):.0f}"
        return f"{pct(d[k], 50):.0f}".rjust(width), f"{pct(d[k], 99):.0f}".rjust(width), over.rjust(width)
    for k in a:
        (b50, b99, bo), (a50, a99, ao) = cols(b, k, 10), cols(a, k, 10)
        print(f"{k:<28} {b50}{a50} {b99}{a99}      {bo}     {ao}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200, help="timed calls per variant per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--prefill", type=int, default=32, help="tokens appended to each round's sequence first")
    ap.add_argument("--device", default=None, help="daemon device (default: cuda if available)")
    ap.add_argument("--workers", type=int, default=8, help="server thread pool (daemon --workers and echo)")
    ap.add_argument("--only", default="", help="comma list of variants to run (e.g. echo,fp16/shm)")
    ap.add_argument("--compare", metavar="DIR", help="also measure the checkout in DIR (e.g. `git archive BASE | "
                    "tar -x -C DIR`), round by round interleaved with this one, and print both tables")
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--echo-server", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.echo_server:
        return echo_server(args.echo_server, args.workers)
    if args.compare:
        return compare(args, argv if argv is not None else sys.argv[1:])

    import inspect

    import grpc
    import torch

    from kvstore.client import KVStoreClient
    from kvstore.codec.codebooks import Codebooks
    from kvstore.protocol.channel import client_options
    from kvstore.v1 import kvstore_pb2 as pb

    cuda = torch.cuda.is_available()
    device = args.device or ("cuda" if cuda else "cpu")
    tmp = tempfile.mkdtemp(prefix="kvbench-")
    echo_sock, kv_sock = os.path.join(tmp, "echo.sock"), os.path.join(tmp, "kv.sock")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--echo-server", echo_sock,
                               "--workers", str(args.workers)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True),
             subprocess.Popen([sys.executable, os.path.join(ROOT, "server.py"), "--socket", kv_sock, "--device",
                               device, "--log-level", "WARNING", "--workers", str(args.workers)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    try:
        _wait_socket(procs[0], echo_sock)
        _wait_socket(procs[1], kv_sock)
        time.sleep(0.5)
        echo_ch = grpc.insecure_channel(f"unix://{echo_sock}", options=client_options())
        echo = echo_ch.unary_unary(ECHO)
        payload = b"x" * 200          # about an AppendAttend request's size with buffer refs
        target = f"unix://{kv_sock}"
        # Checkouts from before AppendAttendStream (--compare) measure the unary rows only.
        streams = "stream" in inspect.signature(KVStoreClient).parameters
        echo_stream = api_stream = None
        if streams:
            from kvstore.client.stream import CallStream
            echo_stream = CallStream(echo_ch, ECHO_STREAM)
            api_stream = ApiStream(echo_ch)
        bells = "doorbell" in inspect.signature(KVStoreClient).parameters
        host_waits = "host_wait" in inspect.signature(KVStoreClient).parameters
        mk = lambda transport, stream, bell=False, **kw: KVStoreClient(    # noqa: E731
            target, transport=transport, shm_bytes=1 << 24, heartbeat=False, **({"stream": stream} if streams else {}),
            **({"doorbell": bell} if bells else {}), **kw)
        clients = {"shm": mk("shm", False), "inline": mk("inline", False)}
        if streams:
            clients.update({"shm/stream": mk("shm", True), "inline/stream": mk("inline", True)})
        if bells:
            clients["shm/bell"] = mk("shm", False, True)
            import socket
            bell_echo = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            bell_echo.connect(echo_sock + ".bell")
            bell_payload = b"x" * BELL_PACKET

            def bell_echo_call():
                bell_echo.sendall(bell_payload)
                return bell_echo.recv(1 << 16)
        if host_waits:
            clients["shm/bell+hostwait"] = mk("shm", False, True, host_wait=True)
        kv = clients["shm"]
        for i in range(100):      # wait for the daemon's engine
            try:
                kv.heartbeat()
                break
            except grpc.RpcError:
                time.sleep(0.1)
        g = GEOM
        for codec in ("pq", "fp16"):
            kv.create_cache(codec, "bench", codec=codec, block_size=16, residual=128, num_blocks=256,
                            max_sequences=8, **g)
        m = g["head_dim"] // 2
        gen = torch.Generator().manual_seed(0)
        kv.set_codebooks("pq", Codebooks(k=torch.randn(g["num_layers"], g["num_kv_heads"], m, 256, 2, generator=gen),
                                         v=torch.randn(g["num_layers"], g["num_kv_heads"], m, 256, 2,
                                                       generator=gen)).to_bytes())

        variants: dict[str, tuple] = {"echo": ("echo",), "heartbeat": ("heartbeat",)}
        if streams:
            variants["echo/stream"] = ("echo/stream",)
            variants["echo/stream-api"] = ("echo/stream-api",)
        if bells:
            variants["echo/bell"] = ("echo/bell",)
        for codec in ("pq", "fp16"):
            for transport in ("shm", "inline") + (("cuda",) if cuda and device.startswith("cuda") else ()):
                for stream in (False, True) if streams else (False,):
                    variants[f"{codec}/{transport}" + ("/stream" if stream else "")] = ("aa", codec, transport, stream)
                if bells and transport != "inline":
                    variants[f"{codec}/{transport}/bell"] = ("aa", codec, transport, "bell")
                if bells and transport == "cuda":
                    variants[f"{codec}/{transport}/bell+views"] = ("aa", codec, transport, "views")
                if host_waits and transport == "cuda":
                    variants[f"{codec}/{transport}/bell+views+hostwait"] = ("aa", codec, transport, "hostwait")
        if args.only:
            keep = set(args.only.split(","))
            keep |= {"echo"} | ({"echo/stream"} if any("/stream" in k for k in keep) else set())
            keep |= {"echo/bell"} if any("/bell" in k for k in keep) else set()
            variants = {k: v for k, v in variants.items() if k in keep}
        samples: dict[str, list[float]] = {k: [] for k in variants}
        for k, v in variants.items():
            if v[0] == "aa" and v[3] in ("bell", "views", "hostwait"):
                samples[k + "[daemon]"] = []
        sync = torch.cuda.synchronize if cuda else None

        for r in range(args.rounds):
            names = list(variants)
            names = names[r % len(names):] + names[:r % len(names)]     # rotate the order per round
            for name in names:
                v = variants[name]
                if v[0] == "echo":
                    fn, sy = (lambda: echo(payload, timeout=10)), None
                    timed(fn, args.warmup)
                elif v[0] == "echo/stream":
                    fn, sy = (lambda: echo_stream(payload, timeout=10)), None
                    timed(fn, args.warmup)
                elif v[0] == "echo/stream-api":
                    fn, sy = (lambda: api_stream(payload)), None
                    timed(fn, args.warmup)
                elif v[0] == "echo/bell":
                    fn, sy = bell_echo_call, None
                    timed(fn, args.warmup)
                elif v[0] == "heartbeat":
                    fn, sy = (lambda: kv.stub.Heartbeat(pb.HeartbeatRequest(), timeout=10)), None
                    timed(fn, args.warmup)
                else:
                    _, codec, transport, stream = v
                    lane = {"bell": "/bell", "views": "/bell", "hostwait": "/bell+hostwait", True: "/stream",
                            False: ""}[stream]
                    c = clients[("inline" if transport == "inline" else "shm") + lane]
                    dev = "cuda" if transport == "cuda" else "cpu"
                    seq = f"r{r}-{transport}" + ({"bell": "-bell", "views": "-views", "hostwait": "-hostwait",
                                                  True: "-stream", False: ""}[stream])
                    c.allocate(codec, seq, [])
                    pre = torch.randn(g["num_layers"], args.prefill, g["num_kv_heads"], g["head_dim"],
                                      generator=gen).half()
                    c.append(codec, [seq], pre, pre)
                    k = torch.randn(1, g["num_kv_heads"], g["head_dim"], generator=gen).half().to(dev)
                    q = torch.randn(1, g["num_q_heads"], g["head_dim"], generator=gen).half().to(dev)
                    state = {"i": 0}
                    out = None
                    if stream in ("views", "hostwait"):       # the model writes k, v, q into these; here: once
                        io = c.step_buffers(codec, 1, dev)
                        io.k.copy_(k)
                        io.v.copy_(k)
                        io.q.copy_(q)
                        k, q, out = io.k, io.q, io.out

                    def fn(c=c, codec=codec, seq=seq, k=k, q=q, state=state, out=out):
                        state["i"] += 1
                        return c.append_attend(codec, state["i"] % g["num_layers"], [seq], k, k, q, out=out) \
                            if out is not None else c.append_attend(codec, state["i"] % g["num_layers"], [seq], k, k, q)
                    sy = sync if transport == "cuda" else None
                    timed(fn, args.warmup, sy)
                    if stream in ("bell", "views", "hostwait"):
                        daemon = samples[name + "[daemon]"]
                        run = fn

                        def fn(run=run, c=c, daemon=daemon):
                            run()
                            daemon.append(float(c.doorbell_handler_us))
                samples[name] += timed(fn, args.calls, sy)
                if v[0] == "aa":
                    c.free(v[1], [seq])

        if args.json:
            import json
            with open(args.json, "w") as f:
                json.dump(samples, f)
        else:
            print(f"\nAppendAttend overhead, {args.rounds} rounds x {args.calls} calls, daemon on {device}, "
                  f"torch {torch.__version__}, grpcio {grpc.__version__}, Python {sys.version.split()[0]}")
            table(samples)
        for c in clients.values():
            c.close()
        if bells:
            bell_echo.close()
        if echo_stream is not None:
            echo_stream.close()
            api_stream.close()
        echo_ch.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
