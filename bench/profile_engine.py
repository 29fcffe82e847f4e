"""The daemon's own work in one AppendAttend on CUDA, without gRPC: the engine
call as the servicer makes it (on the daemon's stream, after the client's
ready event, the output copied into the client's buffer, done recorded).

    python bench/profile_engine.py [--calls 400] [--codec pq,fp16] [--torch-prof]

Per codec prints: host time of the call (what the RPC waits for), the same
call followed by a synchronisation (host + GPU, as bench_rpc's cuda rows),
inclusive per-stage host times (STAGES, monkeypatched timers: ~1 µs each of
their own), cProfile's top functions by own time, and with --torch-prof the
CUDA API calls and kernels of the calls (launch counts, host syncs).
Shapes are bench_rpc.py's: one token, one sequence, one layer, 32 tokens of
prefill, layers alternating as in a decode loop.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GEOM = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64)

# (module, class or None, attribute): timed where it is looked up, so a function
# imported by name is patched in the module that imported it. Missing ones are skipped.
STAGES = [
    ("kvstore.cuda.scope", "CudaScope", "__enter__"), ("kvstore.cuda.scope", "CudaScope", "__exit__"),
    ("kvstore.engine.engine", "Engine", "append_attend"), ("kvstore.engine.checks", None, "query"),
    ("kvstore.engine.engine", "Engine", "append"), ("kvstore.engine.cache", "Cache", "append_layer_batch"),
    ("kvstore.engine.storage", "Fp16Store", "write_tokens"), ("kvstore.engine.cache", "Cache", "_commit"),
    ("kvstore.engine.cache", "Cache", "attend"), ("kvstore.engine.read_path", None, "block_table"),
    ("kvstore.kernels.dispatch", None, "pq_decode_attention"),
    ("kvstore.kernels.dispatch", None, "paged_decode_attention"),
    ("kvstore.kernels.decode_attention", None, "plan_pq_decode"),
    ("kvstore.kernels.decode_attention", None, "plan_paged_decode"),
    ("kvstore.kernels.cuda_pq", None, "plan_pq_decode"),
    ("kvstore.kernels.cuda_pq", "CudaPQPlan", "run_pq"), ("kvstore.kernels.cuda_pq", None, "_launch"),
    ("kvstore.kernels.decode_attention", "DecodePlan", "run_paged"),
    ("kvstore.kernels.decode_attention", "DecodePlan", "_launch"),
    ("kvstore.cuda.pinned", "_Ring", "copy"),
    ("kvstore.engine.decode_graphs", "DecodeGraphs", "attend"), ("kvstore.engine.decode_graphs", "DecodeGraphs", "_copy_meta"),
    ("kvstore.engine.decode_graphs", "DecodeGraphs", "_run"), ("kvstore.service.handlers", None, "tensor_fields"),
    ("kvstore.protocol.wire", None, "to_proto"),
]


def patch_stages(stages=STAGES) -> dict[str, list[int]]:
    import importlib
    import inspect
    acc: dict[str, list[int]] = {}
    for mod, cls, name in stages:
        try:
            owner = importlib.import_module(mod)
        except ImportError:
            continue
        owner = getattr(owner, cls, None) if cls else owner
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            continue
        xs = acc.setdefault(f"{cls or mod.rsplit('.', 1)[-1]}.{name}", [])

        def timed(*a, _fn=fn, _xs=xs, **kw):
            t0 = time.perf_counter_ns()
            try:
                return _fn(*a, **kw)
            finally:
                _xs.append(time.perf_counter_ns() - t0)
        static = cls and isinstance(inspect.getattr_static(owner, name), staticmethod)
        setattr(owner, name, staticmethod(timed) if static else timed)
    return acc


def med(xs):
    return sorted(xs)[len(xs) // 2] / 1e3 if xs else float("nan")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--codec", default="pq,fp16")
    ap.add_argument("--torch-prof", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-cprofile", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    args = ap.parse_args(argv)

    import torch

    from kvstore.protocol import wire
    from kvstore.cuda.scope import CudaScope, Fences
    from kvstore.codec.codebooks import Codebooks
    from kvstore.core.config import CacheConfig, CodecConfig, ModelGeometry
    from kvstore.engine.engine import Engine

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    g = GEOM
    eng = Engine(args.device)
    for codec in args.codec.split(","):
        eng.create_cache(CacheConfig(name=codec, model_id="m", geometry=ModelGeometry(
            g["num_layers"], g["num_q_heads"], g["num_kv_heads"], g["head_dim"], "float16"),
            codec=CodecConfig(kind=codec), block_size=16, residual=128, num_blocks=256, max_sequences=8,
            device=args.device))
        if codec == "pq":
            gen = torch.Generator().manual_seed(0)
            m = g["head_dim"] // 2
            eng.set_codebooks("pq", Codebooks(k=torch.randn(g["num_layers"], g["num_kv_heads"], m, 256, 2,
                                                            generator=gen),
                                              v=torch.randn(g["num_layers"], g["num_kv_heads"], m, 256, 2,
                                                            generator=gen)))
    import contextlib
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    stream = torch.cuda.Stream() if cuda else None
    ready, done = (torch.cuda.Event(), torch.cuda.Event()) if cuda else (None, None)
    fences = Fences()
    k = torch.randn(1, g["num_kv_heads"], g["head_dim"], device=dev).half()
    q = torch.randn(1, g["num_q_heads"], g["head_dim"], device=dev).half()
    out_buf = torch.empty(1, g["num_q_heads"], g["head_dim"], device=dev, dtype=torch.float16)
    import inspect
    # The servicer hands the engine the client's output range where it can (later
    # checkouts): asked before patch_stages() wraps append_attend in *a, **kw.
    out_kw = {"out": out_buf} if "out" in inspect.signature(Engine.append_attend).parameters else {}
    stages = patch_stages()

    class Buffers:            # the servicer's view of a registered CUDA buffer
        def view(self, *_a):
            return out_buf

        def get(self, _bid):
            return torch.empty(1 << 20, dtype=torch.uint8)
    from kvstore.v1 import kvstore_pb2 as pb
    out_ref = pb.OutputRef(buffer_id="cuda-x", offset=0)

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'cpu'}, {args.calls} calls per codec")
    for codec in args.codec.split(","):
        state = {"i": 0, "n": 0}

        def fresh():
            sid = f"s{state['n']}"
            state["n"] += 1
            eng.allocate(codec, "default", sid, [])
            pre = torch.randn(g["num_layers"], 32, g["num_kv_heads"], g["head_dim"]).half()
            eng.append(codec, "default", [sid], pre, pre, [32])
            return sid
        sid = fresh()

        def call():
            nonlocal sid
            state["i"] += 1
            if state["i"] % 400 == 0:     # keep lengths as bench_rpc's rounds do
                eng.free(codec, "default", [sid])
                sid = fresh()
            if cuda:
                ready.record()
            with CudaScope(stream, ready, done, fences.get(dev)) if cuda else contextlib.nullcontext():
                out = eng.append_attend(codec, "default", state["i"] % g["num_layers"], [sid], k, k, q, **out_kw)
                wire.to_proto(out, Buffers(), out_ref)

        for _ in range(50):
            call()
        sync()
        for xs in stages.values():
            xs.clear()
        host, synced = [], []
        for _ in range(args.calls):
            t0 = time.perf_counter_ns()
            call()
            t1 = time.perf_counter_ns()
            sync()
            t2 = time.perf_counter_ns()
            host.append(t1 - t0)
            synced.append(t2 - t0)
        print(f"\n=== {codec}: per call, median µs: host {med(host):.0f}, host + sync {med(synced):.0f}")
        n = len(host)
        for label, xs in stages.items():
            if xs:
                print(f"  {label:<40}{med(xs):8.1f}  x{len(xs) / n:.2f}/call")
            xs.clear()
        if args.no_cprofile:
            continue
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            call()
        prof.disable()
        sync()
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(args.top)
        body = [ln for ln in s.getvalue().splitlines() if ln.strip()[:1].isdigit() or "ncalls" in ln]
        print(f"--- cProfile, own time, totals over {args.calls} calls (inflated by the profiler)")
        print("\n".join(body[:args.top + 2]))
        if args.torch_prof:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                for _ in range(50):
                    call()
                sync()
            print("--- torch.profiler, 50 calls")
            print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=50))
        for xs in stages.values():
            xs.clear()


if __name__ == "__main__":
    main()
