"""Host time of the daemon's per-call CUDA operations, through torch and
through cupy's runtime on the same raw handles (kvstore/cuda/runtime.py; the
"thin" column), and of
a whole CudaScope enter + exit either way. One process, no client.

    python bench/micro_cuda_calls.py [--reps 100] [--batches 50]

Per operation: the median over batches of (batch time / reps), µs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def per_call(fn, reps: int, batches: int, after=None) -> float:
    out = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            fn()
        out.append((time.perf_counter_ns() - t0) / reps / 1e3)
        if after is not None:
            after()
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--batches", type=int, default=50)
    args = ap.parse_args()
    import torch
    from cupy.cuda import runtime as rt

    from kvstore.cuda import scope as call_scope, runtime as cuda_rt

    dev = torch.device("cuda", torch.cuda.current_device())
    side, ready, done, ev = torch.cuda.Stream(), torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event()
    for e in (ready, done, ev):
        e.record(side)      # torch makes its events at their first record
    torch.cuda.synchronize()
    src = torch.zeros(256, dtype=torch.int32, pin_memory=True)
    dst = torch.zeros(256, dtype=torch.int32, device=dev)
    h, e = side.cuda_stream, ev.cuda_event
    default = torch.cuda.current_stream(dev)
    sync = torch.cuda.synchronize
    x = torch.zeros(8, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        x.add_(1)
        with torch.cuda.graph(graph, stream=side):
            x.add_(1)
    sync()
    raw_exec = getattr(graph, "raw_cuda_graph_exec", None)
    graph_exec = int(raw_exec()) if raw_exec is not None else 0

    def copy_torch():
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
    rows = [
        ("stream query (idle side stream)", side.query, lambda: rt.streamQuery(h), None),
        ("default stream query", default.query, lambda: rt.streamQuery(default.cuda_stream), None),
        ("event record", lambda: ev.record(side), lambda: rt.eventRecord(e, h), sync),
        ("stream wait event", lambda: side.wait_event(ev), lambda: rt.streamWaitEvent(h, e, 0), sync),
        ("event query", ev.query, lambda: rt.eventQuery(e), None),
        ("1 KiB pinned H2D copy (torch: + stream switch)", copy_torch,
         lambda: rt.memcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes, rt.memcpyHostToDevice, h), sync),
        ("1 KiB pinned H2D copy on the current stream", lambda: dst.copy_(src, non_blocking=True), None, sync),
        ("current stream (thin: cuda_rt.current_stream)", lambda: torch.cuda.current_stream(dev),
         lambda: cuda_rt.current_stream(dev), None),
        ("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing, None, None),
        ("graph replay, 1 kernel (thin: graphLaunch of its exec)", graph.replay,
         (lambda: rt.graphLaunch(graph_exec, default.cuda_stream)) if graph_exec else None, sync),
        ("torch.cuda.current_device()", torch.cuda.current_device, None, None),
        ("torch.cuda.set_stream(current)", lambda: torch.cuda.set_stream(default), None, None),
    ]
    fence = call_scope.Fences().get(dev)

    def scope():
        with call_scope.CudaScope(side, ready, done, fence):
            pass

    def scope_with(rt_on: bool):
        cuda_rt._rt = None if rt_on else False
        return per_call(scope, args.reps, args.batches, sync)
    print(f"torch {torch.__version__}, cupy runtime {rt.runtimeGetVersion()}, {torch.cuda.get_device_name()}")
    print(f"{'operation':52s} {'torch µs':>9s} {'thin µs':>9s}")
    for name, t_fn, c_fn, after in rows:
        t = per_call(t_fn, args.reps, args.batches, after)
        c = per_call(c_fn, args.reps, args.batches, after) if c_fn is not None else float("nan")
        print(f"{name:52s} {t:9.2f} {c:9.2f}")
    off, on = scope_with(False), scope_with(True)
    print(f"{'CudaScope enter + exit (default stream idle)':52s} {off:9.2f} {on:9.2f}")
    cuda_rt._rt = None


if __name__ == "__main__":
    main()
