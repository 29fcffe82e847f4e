"""Where the time of one AppendAttend goes, on both sides of the socket.

    python bench/profile_rpc.py [--codec fp16] [--transport shm] [--calls 2000] [--metrics] [--stream]

Runs the daemon in a child process with an outermost server interceptor that
timestamps every call (CLOCK_MONOTONIC, comparable across processes) and
runs cProfile around the handler lookup and the handler; the client side is
timestamped around the stub call and cProfiled too. Prints the median of
each segment of a call and the top functions of both profiles.

Segments: client before stub (request build, arena copies) | stub -> server
handler (client interceptor, serialisation, socket, C-core, thread hand-off,
deserialisation) | server handler (interceptors, servicer, engine) | server
-> client return (serialisation, socket, wake-up) | client after stub
(reading the output). With --stream the calls go over the client's
AppendAttendStream; the server's segments are then per message (a request
handed to the handler -> its reply yielded), and there is no handler lookup.

With --bell the calls go by the doorbell (kvstore/service/doorbell.py): the client's
stages (CLIENT_STAGES, inclusive timers), the daemon's handler time from its
replies and its stages (--stages), and on CUDA the synchronisation after the
call (the daemon's GPU work and the wait for its done event) timed apart.
--views puts k, v, q and out in the registered buffer (step_buffers).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def serve(sock: str, out: str, extra: list[str]) -> None:
    import grpc

    prof = cProfile.Profile()
    if os.environ.get("KVPROF_OFF"):
        prof.enable = prof.disable = lambda: None
    marks: list[tuple[int, int, int, int]] = []      # lookup start, handler start, handler end, lookup ns
    lookup = {}

    class Timing(grpc.ServerInterceptor):
        def intercept_service(self, continuation, details):
            t0 = time.perf_counter_ns()
            prof.enable()
            handler = continuation(details)
            prof.disable()
            lookup["ns"] = time.perf_counter_ns() - t0
            lookup["t0"] = t0
            if handler is not None and handler.stream_stream and details.method.endswith("/AppendAttendStream"):
                return handler._replace(stream_stream=stream(handler.stream_stream))
            # the daemon's gate serves a unary method as a one-message stream (auth.py: admitted
            # from its headers before its body is read), so its handler is stream_unary
            kind = "unary_unary" if handler is not None and handler.unary_unary else "stream_unary"
            if handler is None or not getattr(handler, kind) or not details.method.endswith(
                    "/" + os.environ.get("KVPROF_METHOD", "AppendAttend")):
                return handler
            fn, l0, lns = getattr(handler, kind), t0, lookup["ns"]

            def call(request, context):
                t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
                prof.enable()
                try:
                    return fn(request, context)
                finally:
                    prof.disable()
                    marks.append((l0, t1, time.perf_counter_ns(), lns, time.thread_time_ns() - c1))
            return handler._replace(**{kind: call})

    def stream(fn):
        def call(requests, context):
            t = {}

            def timed():
                for r in requests:
                    t["t1"], t["c1"] = time.perf_counter_ns(), time.thread_time_ns()
                    prof.enable()
                    yield r
            for reply in fn(timed(), context):
                prof.disable()
                marks.append((t["t1"], t["t1"], time.perf_counter_ns(), 0, time.thread_time_ns() - t["c1"]))
                yield reply
        return call

    stages = _patch_stages() if os.environ.get("KVPROF_STAGES") else {}
    if os.environ.get("KVPROF_NULL"):      # the same request and reply, no work: the RPC layer's share
        from kvstore.service import servicer as sv
        from kvstore.v1 import kvstore_pb2 as pb
        reply = pb.AttendReply(out=pb.Tensor(shape=[1, 4, 64], dtype=pb.FLOAT16, ref=pb.BufferRef(buffer_id="x")))
        real = sv.KVStoreServicer.AppendAttend
        n = {"i": 0}

        def null(self, request, context):
            n["i"] += 1
            return real(self, request, context) if n["i"] <= 60 else reply    # setup and warm-up calls are real
        sv.KVStoreServicer.AppendAttend = null

    orig = grpc.server

    def server(pool, handlers=None, interceptors=None, options=None, **kw):
        return orig(pool, handlers=handlers, interceptors=[Timing()] + list(interceptors or []), options=options,
                    **kw)
    grpc.server = server
    from kvstore.service import daemon

    def dump():
        prof.dump_stats(out + ".prof")
        with open(out, "w") as f:
            json.dump(marks, f)
        with open(out + ".stages", "w") as f:
            json.dump(stages, f)
    real_exit = os._exit

    def _exit(code):        # a CUDA daemon leaves by os._exit: no finally runs
        dump()
        real_exit(code)
    os._exit = _exit
    try:
        daemon.main(["--socket", sock, "--device", "cpu", "--log-level", "WARNING", *extra])
    finally:
        dump()


# Functions timed (inclusive wall time per call) with --stages, as (module, class or None,
# attribute): patched where they are looked up, so a function imported by name is patched
# in the module that imported it. Ones this checkout lacks are listed as not found.
STAGES = [("kvstore.service.servicer", "KVStoreServicer", "AppendAttend"), ("kvstore.service.servicer", "KVStoreServicer", "_begin"),
          ("kvstore.service.handlers", "Handlers", "out_view"), ("kvstore.service.servicer", "KVStoreServicer", "_t"),
          ("kvstore.service.servicer", "KVStoreServicer", "_cuda"), ("kvstore.protocol.wire", None, "to_proto"),
          ("kvstore.engine.engine", "Engine", "append_attend"), ("kvstore.engine.checks", None, "query"),
          ("kvstore.engine.engine", "Engine", "append"), ("kvstore.engine.engine", "Engine", "_tensor"), ("kvstore.engine.engine", None, "_finite"),
          ("kvstore.engine.checks", None, "request_tensor"), ("kvstore.engine.checks", None, "check_values"),
          ("kvstore.engine.cache", "Cache", "append_layer_batch"), ("kvstore.engine.cache", "Cache", "attend"),
          ("kvstore.cuda.scope", "CudaScope", "__enter__"), ("kvstore.cuda.scope", "CudaScope", "__exit__"),
          ("kvstore.service.handlers", "Handlers", "doorbell_append_attend"),
          ("kvstore.service.handlers", "Handlers", "append_attend"), ("kvstore.service.leases", "LeaseManager", "touch"),
          ("kvstore.engine.engine", "Engine", "_append_checked"), ("kvstore.engine.engine", "Engine", "_seqs"),
          ("kvstore.engine.decode_graphs", "DecodeGraphs", "attend"), ("kvstore.engine.decode_graphs", "DecodeGraphs", "_run"),
          ("kvstore.engine.decode_graphs", "DecodeGraphs", "_copy_meta"), ("kvstore.engine.decode_graphs", "DecodeGraphs", "_rows_of")]
# The client's side of a doorbell call (--bell), inclusive.
CLIENT_STAGES = [("kvstore.client.client", "KVStoreClient", "append_attend"),
                 ("kvstore.client.connection", "Connection", "_append_attend_bell"),
                 ("kvstore.client.connection", None, "place"),
                 ("kvstore.client.doorbell", "Doorbell", "append_attend"),
                 ("kvstore.client.doorbell", "Doorbell", "_reply")]


def patch_stages(stages) -> dict[str, list[int] | None]:
    """Wrap each stage in a timer; per label, its calls' wall times (ns), None where not found."""
    import importlib
    import inspect
    acc: dict[str, list[int] | None] = {}
    for mod, cls, name in stages:
        label = f"{cls or mod.rsplit('.', 1)[-1]}.{name}"
        try:
            owner = importlib.import_module(mod)
        except ImportError:
            owner = None
        owner = getattr(owner, cls, None) if cls and owner is not None else owner
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            acc.setdefault(label, None)
            continue
        xs = acc[label] = acc.get(label) if acc.get(label) is not None else []

        def timed(*a, _fn=fn, _xs=xs, **kw):
            t0 = time.perf_counter_ns()
            try:
                return _fn(*a, **kw)
            finally:
                _xs.append(time.perf_counter_ns() - t0)
        static = cls and isinstance(inspect.getattr_static(owner, name), staticmethod)
        setattr(owner, name, staticmethod(timed) if static else timed)
    return acc


def _not_found(stages: dict) -> None:
    missing = [label for label, xs in stages.items() if xs is None]
    if missing:
        print(f"  (not found in this checkout, not timed: {', '.join(missing)})")


def _patch_stages() -> dict:
    return patch_stages(STAGES)


def top(stats: pstats.Stats, n: int, calls: int) -> str:
    s = io.StringIO()
    stats.stream = s
    stats.sort_stats("tottime").print_stats(n)
    lines = s.getvalue().splitlines()
    body = [ln for ln in lines if ln.strip()[:1].isdigit() and "function calls" not in ln or "ncalls" in ln]
    return "\n".join(body[: n + 1]) + f"\n(times are totals over {calls} calls)"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec", default="fp16")
    ap.add_argument("--device", default="cpu", help="the daemon's device (cpu or cuda)")
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--metrics", action="store_true", help="daemon with --metrics-port 0 (metrics interceptor)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-cprofile", action="store_true", help="timestamps only (true medians)")
    ap.add_argument("--null", action="store_true", help="AppendAttend's handler returns a canned reply after "
                    "warm-up (requests and replies as usual, no servicer or engine work)")
    ap.add_argument("--heartbeat", action="store_true", help="time Heartbeat calls instead (the RPC layer alone)")
    ap.add_argument("--stages", action="store_true", help="no cProfile; time the server's stages (STAGES), "
                    "inclusive, per call")
    ap.add_argument("--stream", action="store_true", help="AppendAttend over the client's stream (AppendAttendStream)")
    ap.add_argument("--bell", action="store_true", help="AppendAttend by the doorbell (see above)")
    ap.add_argument("--views", action="store_true", help="with --bell: k, v, q, out in the registered buffer")
    ap.add_argument("--no-sync", action="store_true", help="with --bell on CUDA: no synchronisation per call")
    ap.add_argument("--host-wait", action="store_true", help="with --bell on CUDA, a diagnostic: the client's stream "
                    "does not wait on done; the host waits for it (done.synchronize()) instead of synchronising "
                    "the device")
    ap.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args(argv)
    if args.serve:      # --device is this parser's: hand it on to the daemon
        return serve(args.serve[0], args.serve[1], extra + ["--device", args.device])
    tmp = tempfile.mkdtemp(prefix="kvprof-")       # the daemon's socket and what it dumps for us
    try:
        profile(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def profile(args, tmp: str) -> None:
    import torch

    from kvstore.client import KVStoreClient
    from kvstore.codec.codebooks import Codebooks

    sock, out = os.path.join(tmp, "kv.sock"), os.path.join(tmp, "marks.json")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", sock, out] + (
        ["--metrics-port", "0"] if args.metrics else []) + ["--device", args.device]
    if args.no_cprofile or args.stages:
        env["KVPROF_OFF"] = "1"
    if args.stages:
        env["KVPROF_STAGES"] = "1"
    if args.heartbeat:
        env["KVPROF_METHOD"] = "Heartbeat"
    if args.null:
        env["KVPROF_NULL"] = "1"
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not os.path.exists(sock):
            if p.poll() is not None:
                raise RuntimeError(p.stdout.read())
            time.sleep(0.05)
        time.sleep(0.5)
        cuda = args.transport == "cuda"     # tensors on the GPU: the client's CUDA IPC buffer
        kv = KVStoreClient(f"unix://{sock}", transport="shm" if cuda else args.transport, shm_bytes=1 << 24,
                           heartbeat=False, stream=args.stream, doorbell=args.bell)
        for _ in range(100):
            try:
                kv.heartbeat()
                break
            except Exception:  # noqa: BLE001 - engine still starting
                time.sleep(0.1)
        g = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64)
        kv.create_cache("c", "m", codec=args.codec, block_size=16, residual=128, num_blocks=1024,
                        max_sequences=4, **g)
        if args.codec == "pq":
            gen = torch.Generator().manual_seed(0)
            kv.set_codebooks("c", Codebooks(k=torch.randn(2, 2, 32, 256, 2, generator=gen),
                                            v=torch.randn(2, 2, 32, 256, 2, generator=gen)).to_bytes())
        kv.allocate("c", "t", [])
        pre = torch.randn(2, 32, 2, 64).half()
        kv.append("c", ["t"], pre, pre)
        k = torch.randn(1, 2, 64, dtype=torch.float16, device="cuda" if cuda else "cpu")
        q = torch.randn(1, 4, 64, dtype=torch.float16, device="cuda" if cuda else "cpu")
        syncs: list[int] = []
        if args.bell:
            return bell(args, kv, k, q, pre, out, p)
        attr = "_raw"       # the client's stub without its metadata interceptor: what AppendAttend calls
        stub_method = getattr(kv, attr).AppendAttend
        cmarks: list[tuple[int, int, int, int]] = []
        cur = {}

        class Stub:
            def __getattr__(self, name):
                return getattr(real_stub, name)

            def AppendAttend(self, req, **kw):
                cur["s0"], c0 = time.perf_counter_ns(), time.thread_time_ns()
                r = stub_method(req, **kw)
                cur["s1"], cur["c"] = time.perf_counter_ns(), time.thread_time_ns() - c0
                return r
        real_stub = getattr(kv, attr)
        setattr(kv, attr, Stub())
        if args.stream:
            real_stream = kv._stream

            class Stream:
                def __getattr__(self, name):        # takes(), close(): the client's own
                    return getattr(real_stream, name)

                def __call__(self, *args, **kw):
                    cur["s0"], c0 = time.perf_counter_ns(), time.thread_time_ns()
                    r = real_stream(*args, **kw)
                    cur["s1"], cur["c"] = time.perf_counter_ns(), time.thread_time_ns() - c0
                    return r
            kv._stream = Stream()
        cprof = cProfile.Profile()
        from kvstore.v1 import kvstore_pb2 as pb
        hb = pb.HeartbeatRequest()
        if args.no_cprofile:
            cprof.enable = cprof.disable = lambda: None
        for i in range(args.calls + 50):
            t0, tc = time.perf_counter_ns(), time.thread_time_ns()
            if i >= 50:
                cprof.enable()
            if args.heartbeat:
                cur["s0"], c0 = time.perf_counter_ns(), time.thread_time_ns()
                real_stub.Heartbeat(hb, timeout=10, metadata=(("x-kvstore-session", kv.session_id),))
                cur["s1"], cur["c"] = time.perf_counter_ns(), time.thread_time_ns() - c0
            else:
                kv.append_attend("c", i % 2, ["t"], k, k, q)
            if cuda:        # as bench_rpc's cuda rows: the call is done once its output is
                ts = time.perf_counter_ns()
                torch.cuda.synchronize()
                if i >= 50:
                    syncs.append(time.perf_counter_ns() - ts)
            if i >= 50:
                cprof.disable()
                cmarks.append((t0, cur["s0"], cur["s1"], time.perf_counter_ns(),
                               time.thread_time_ns() - tc - cur["c"]))
            if i % 400 == 399:        # keep the sequence short: a fresh one now and then
                kv.free("c", ["t"])
                kv.allocate("c", "t", [])
                kv.append("c", ["t"], pre, pre)
        kv.close()
    finally:
        p.terminate()
        p.wait(timeout=30)
    smarks = json.load(open(out))[-args.calls:]     # warm-up calls first
    segs = {"client: build request, copy inputs": [], "stub -> server handler": [],
            "server: interceptor lookup (poll thread)": [], "server: handler": [], "server: handler, thread CPU time": [],
            "server handler end -> stub return": [], "client: read output": [], "client: build + read, CPU time": [], "total": []}
    for (c0, s0, s1, c1, cc), (l0, h0, h1, lns, hc) in zip(cmarks, smarks):
        segs["server: handler, thread CPU time"].append(hc)
        segs["client: build + read, CPU time"].append(cc)
        segs["client: build request, copy inputs"].append(s0 - c0)
        segs["stub -> server handler"].append(h0 - s0)
        segs["server: interceptor lookup (poll thread)"].append(lns)
        segs["server: handler"].append(h1 - h0)
        segs["server handler end -> stub return"].append(s1 - h1)
        segs["client: read output"].append(c1 - s1)
        segs["total"].append(c1 - c0)
    if syncs:       # the synchronisation's wait is inside "client: read output" and "total"
        segs["client: of which synchronize (GPU)"] = syncs
    med = lambda xs: sorted(xs)[len(xs) // 2] / 1e3   # noqa: E731
    print(f"\n{'Heartbeat' if args.heartbeat else args.codec + '/' + args.transport}{'/stream' if args.stream else ''}"
          f"{' +metrics' if args.metrics else ''}: medians over {len(cmarks)} calls "
          f"(µs{'' if args.no_cprofile or args.stages else '; cProfile on, so inflated'})")
    for k_, xs in segs.items():
        print(f"  {k_:<44}{med(xs):8.0f}")
    if args.stages:
        stages = json.load(open(out + ".stages"))
        n = len(smarks)
        print("\n== server stages, inclusive, per call (median over calls; sum / calls where called more often)")
        for label, xs in stages.items():
            if xs:
                per = len(xs) / max(1, len(json.load(open(out))))
                k = round(per)
                by_pos = "  (by position in the call: " + ", ".join(f"{med(xs[i::k]):.0f}" for i in range(k)) + ")" \
                    if k > 1 and len(xs) % k == 0 else ""
                print(f"  {label:<44}{med(xs):8.0f}  x{per:.0f}/call{by_pos}")
        _not_found(stages)
        del n
    if args.no_cprofile or args.stages:
        return
    print("\n== server (interceptor lookup + handler), by own time")
    print(top(pstats.Stats(out + ".prof"), args.top, len(smarks)))
    print("\n== client, by own time")
    print(top(pstats.Stats(cprof), args.top, len(cmarks)))



def bell(args, kv, k, q, pre, marks: str, p) -> None:
    """--bell: client stages, the daemon's handler time and the synchronisation, per call."""
    import torch
    stages = _client_stages()
    cuda = k.is_cuda
    host_wait = cuda and args.host_wait
    if host_wait:
        # Nothing of the client's context waits on the daemon's GPU work: is the
        # synchronisation's time the GPU switching between the two processes'
        # contexts (the client's stream blocked on done), or the work itself?
        real_wait = torch.cuda.Stream.wait_event

        def wait_event(self, ev):
            if ev is not getattr(kv._cuda_arena, "done", None):
                real_wait(self, ev)
        torch.cuda.Stream.wait_event = wait_event
    out = None
    if args.views:
        io = kv.step_buffers("c", 1, k.device)
        io.k.copy_(k)
        io.v.copy_(k)
        io.q.copy_(q)
        k, q, out = io.k, io.q, io.out
    segs = {"call (client host time, incl. handler)": [], "daemon handler (its reply's timer)": [],
            "call - handler (client Python, socket, wake-ups)": [], ("host wait for done" if host_wait else "synchronize after the call (GPU)"): [],
            "total": []}
    for i in range(args.calls + 50):
        if i == 50:
            for xs in stages.values():
                if xs is not None:
                    xs.clear()
        t0 = time.perf_counter_ns()
        kv.append_attend("c", i % 2, ["t"], k, k, q, out=out)
        t1 = time.perf_counter_ns()
        if host_wait:
            kv._cuda_arena.done.synchronize()
        elif cuda and not args.no_sync:
            torch.cuda.synchronize()
        t2 = time.perf_counter_ns()
        if i >= 50:
            h = kv.doorbell_handler_us * 1000
            for key, x in zip(segs, (t1 - t0, h, t1 - t0 - h, t2 - t1, t2 - t0)):
                segs[key].append(x)
        if i % 400 == 399:
            kv.free("c", ["t"])
            kv.allocate("c", "t", [])
            kv.append("c", ["t"], pre, pre)
    if cuda:
        torch.cuda.synchronize()
    assert kv._bell is not None, "the calls did not go by the doorbell"
    kv.close()
    p.terminate()
    p.wait(timeout=60)
    med = lambda xs: sorted(xs)[len(xs) // 2] / 1e3   # noqa: E731
    print(f"\n{args.codec}/{args.transport}/bell{'+views' if args.views else ''}"
          f"{' no-sync' if args.no_sync else ''}{' host-wait' if host_wait else ''}: medians over {args.calls} calls (µs)")
    for key, xs in segs.items():
        print(f"  {key:<52}{med(xs):8.0f}")
    print("\n== client stages, inclusive (median; timers ~1 µs each)")
    for label, xs in stages.items():
        if xs:
            print(f"  {label:<44}{med(xs):8.1f}  x{len(xs) / args.calls:.0f}/call")
    _not_found(stages)
    if args.stages:
        print("\n== daemon stages, inclusive (median over calls)")
        with open(marks + ".stages") as f:
            daemon_stages = json.load(f)
        for label, xs in daemon_stages.items():
            if xs:
                print(f"  {label:<44}{med(xs):8.1f}  x{len(xs) / (args.calls + 50):.1f}/call")
        _not_found(daemon_stages)


def _client_stages() -> dict:
    return patch_stages(CLIENT_STAGES)


if __name__ == "__main__":
    main()
