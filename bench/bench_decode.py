"""End-to-end decode benchmark, Llama-3-8B geometry (32 layers, hidden 4096,
32 q / 8 kv heads, d 128, random fp16 weights), ratios from one run:

  (a) in-process baseline: preallocated contiguous fp16 KV + torch SDPA (no torch.cat),
      launched eagerly; also its step's GPU time under a CUDA graph, the modes against it
  (b) daemon, remote AppendAttend (one RPC per layer), PQ
  (c) daemon, mapped attend (one Reserve RPC per step), PQ, the step under a CUDA graph
  (c2) (c) with 2-bit PQ (M = 32 subspaces of 4 coordinates; (c) is 4-bit, M = 64)
  (d) daemon, mapped attend, fp16 codec, likewise
  (ce), (de): (c) and (d) launched eagerly, layer by layer (no graph)

Also: p50/p99 of one AppendAttend with a tiny payload, and the control-plane
share of a mapped step: 1 - (time per step replaying the captured graph alone)
/ (time per step with Reserve + plan refill + replay), and the Reserve p50. The byte-limited ideal speedup of (c) over (a) is
computed from the measured time to read the weights and the KV bytes (PQ: 1/4 of fp16's
at 4-bit, 1/8 at 2-bit); so is each mode's own byte limit, which its step is also printed
against.

python bench/bench_decode.py [--batch 8] [--context 32768] [--new 128] [--modes a,b,c,c2,d]
One layer's weights are reused by all 32 layers: each layer still reads them
from HBM (436 MB >> L2), and the run needs 0.5 GB instead of 15 GB. Each mode
runs in a fresh process; a mode that fails leaves its output in
bench/results/decode_MODE.err.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

L, HID, HQ, HKV, D, FFN = 32, 4096, 32, 8, 128, 14336
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")      # git-ignored


class Model:
    """Random-weight decoder layer stack; attention is a callback (layer, q, k, v) -> out."""

    def __init__(self, dev):
        g = torch.Generator(device=dev).manual_seed(0)
        w = lambda *s: torch.randn(*s, device=dev, dtype=torch.float16, generator=g) * 0.02  # noqa: E731
        self.wqkv = w(HID, (HQ + 2 * HKV) * D)
        self.wo, self.w13, self.w2 = w(HQ * D, HID), w(HID, 2 * FFN), w(FFN, HID)

    def step(self, x, attend):
        """x [B, HID] -> [B, HID]; attend(layer, q [B,HQ,D], k [B,HKV,D], v) -> [B,HQ,D]."""
        B = x.shape[0]
        for layer in range(L):
            h = torch.nn.functional.rms_norm(x, (HID,))
            qkv = h @ self.wqkv
            q = qkv[:, :HQ * D].view(B, HQ, D)
            k = qkv[:, HQ * D:(HQ + HKV) * D].view(B, HKV, D)
            v = qkv[:, (HQ + HKV) * D:].view(B, HKV, D)
            a = attend(layer, q, k, v)
            x = x + a.reshape(B, HQ * D) @ self.wo
            h = torch.nn.functional.rms_norm(x, (HID,))
            gu = h @ self.w13
            x = x + (torch.nn.functional.silu(gu[:, :FFN]) * gu[:, FFN:]) @ self.w2
        return x

    def weight_read_time(self, B):
        """The step with attention left out, under a CUDA graph (no host overhead):
        weight reads plus the tiny activations."""
        x = torch.randn(B, HID, device="cuda", dtype=torch.float16)
        zero = torch.zeros(B, HQ, D, device="cuda", dtype=torch.float16)
        self.step(x, lambda *a: zero)
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
            self.step(x, lambda *a: zero)
        torch.cuda.current_stream().wait_stream(side)
        return time_steps(g.replay, 20)


def time_steps(fn, n, each=None):
    """Mean seconds a call of fn over n calls, the GPU's work included; `each`, a list:
    gets every call's host time (no sync: it shows when the host fell behind the GPU)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        t1 = time.perf_counter()
        fn()
        if each is not None:
            each.append(time.perf_counter() - t1)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def daemon_rpc_ms(port):
    """Mean daemon-side time per RPC method (its Prometheus histogram), ms."""
    import re
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    tot = {}
    for kind, meth, val in re.findall(r'kvstore_rpc_duration_seconds_(sum|count)\{method="(\w+)"\} (\S+)', text):
        tot.setdefault(meth, {})[kind] = float(val)
    return {m: round(1e3 * v["sum"] / v["count"], 3) for m, v in tot.items() if v.get("count")}


def kernel_table(fn, n):
    """GPU time per step by kernel name (torch profiler over n calls of fn)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key[:60], e.device_time_total / n / 1e3, e.count // n) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])[:14]


def hbm_read_bw():
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    x.random_()
    t = time_steps(lambda: x.view(torch.int64).sum(), 10)
    return x.numel() / t


# ------------------------------------------------------------------ modes

def run_baseline(args):
    dev = torch.device("cuda")
    m = Model(dev)
    B, T = args.batch, args.context + args.new
    kc = torch.randn(L, B, HKV, T, D, device=dev, dtype=torch.float16)
    vc = torch.randn_like(kc)
    pos = [args.context]

    def attend(layer, q, k, v):
        p = pos[0]
        kc[layer, :, :, p] = k
        vc[layer, :, :, p] = v
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q.unsqueeze(2).contiguous(), kc[layer, :, :, :p + 1], vc[layer, :, :, :p + 1],
                enable_gqa=True).squeeze(2)
    x = torch.randn(B, HID, device=dev, dtype=torch.float16)

    def step():
        m.step(x, attend)
        pos[0] += 1
    t = time_steps(step, args.new - 1)
    # The same step under a CUDA graph, as a serving engine would run it: the eager step
    # above moves with the host. A graph fixes its shapes, so it is captured at one
    # position and replayed there (each replay rewrites that position's K/V): the GPU time
    # of a step, without the host.
    pos[0] = args.context
    m.step(x, attend)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        m.step(x, attend)
    torch.cuda.current_stream().wait_stream(side)
    return dict(step_s=t, tok_s=B / t, weights_s=m.weight_read_time(B), graph_s=time_steps(g.replay, 20),
                kv_bytes=2 * L * B * args.context * HKV * D * 2)


def start_daemon(sock: str, port: int) -> subprocess.Popen:
    """server.py on the GPU with metrics on `port`; returns once its health check says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "server.py"), "--socket", sock, "--device", "cuda",
                          "--log-level", "WARNING", "--metrics-port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        try:
            with grpc.insecure_channel(f"unix://{sock}") as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"), timeout=2)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return p
        except grpc.RpcError:
            time.sleep(0.2)
    p.kill()
    raise RuntimeError("daemon did not become SERVING: " + (p.communicate(timeout=10)[0] or "")[-3000:])


def run_daemon(args, codec, plane, bits=4):
    import shutil
    import signal
    import socket
    tmp = tempfile.mkdtemp(prefix="kvdecode-")
    sock = os.path.join(tmp, "kv.sock")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = start_daemon(sock, port)
    try:
        out = _run_daemon(args, codec, plane, f"unix://{sock}", bits)
        out["daemon_rpc_ms"] = daemon_rpc_ms(port)
        return out
    except BaseException:
        import traceback
        traceback.print_exc()
        p.kill()
        print("daemon output:", (p.communicate(timeout=10)[0] or "")[-3000:], file=sys.stderr)
        raise
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _run_daemon(args, codec, plane, target, bits=4):
    from kvstore.client import KVStoreClient
    from kvstore.client.mapped import MappedCache
    if True:
        kv = KVStoreClient(target, shm_bytes=1 << 30)
        B, ctx = args.batch, args.context
        blocks = B * ((ctx + args.new) // 16 + 4)
        msub = D // 2 if bits == 4 else D // 4       # 8-bit codes of 2 or 4 coordinates
        kv.create_cache("b", "llama-3-8b-geometry", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                        codec=codec, num_subvectors=msub if codec == "pq" else 0, block_size=16, residual=128,
                        num_blocks=blocks, max_sequences=B + 1)
        if codec == "pq":
            g = torch.Generator().manual_seed(0)
            from kvstore.codec.codebooks import Codebooks
            kv.set_codebooks("b", Codebooks(k=torch.randn(L, HKV, msub, 256, D // msub, generator=g),
                                            v=torch.randn(L, HKV, msub, 256, D // msub, generator=g)).to_bytes())
        ids = [f"s{i}" for i in range(B)]
        t0 = time.perf_counter()
        chunk = 2048
        for sid in ids:
            kv.allocate("b", sid, [])
            for c in range(0, ctx, chunk):
                k = torch.randn(L, chunk, HKV, D, device="cuda", dtype=torch.float16)
                kv.append("b", [sid], k, k)
        torch.cuda.synchronize()
        fill_s = time.perf_counter() - t0
        m = Model(torch.device("cuda"))
        x = torch.randn(B, HID, device="cuda", dtype=torch.float16)
        ctrl = None
        if plane == "remote":
            step = lambda: m.step(x, lambda layer, q, k, v: kv.append_attend("b", layer, ids, k, v, q))  # noqa: E731
        elif plane == "mapped":
            mc = MappedCache(kv, "b")
            plan = [None]
            ctrl = []

            def step():
                t = time.perf_counter()
                plan[0] = mc.step(ids)
                ctrl.append(time.perf_counter() - t)

                def attend(layer, q, k, v):
                    mc.write(plan[0], layer, k, v)
                    return mc.attend(plan[0], layer, q)
                m.step(x, attend)
        else:       # mapped, one CUDA graph per step over all layers (as vLLM decodes)
            mc = MappedCache(kv, "b")
            plan = mc.step(ids, max_tokens=ctx + args.new + 16)

            def attend(layer, q, k, v):
                mc.write(plan, layer, k, v)
                return mc.attend(plan, layer, q)
            m.step(x, attend)                      # warm-up: kernels compiled and loaded
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
                m.step(x, attend)                  # redoes the warm-up's slot: same token
            torch.cuda.current_stream().wait_stream(side)
            ctrl = []

            rpc, launch = [], []

            def step():
                t = time.perf_counter()
                mc.step(ids, into=plan)
                ctrl.append(time.perf_counter() - t)
                rpc.append(mc.last_rpc_s)
                t = time.perf_counter()
                graph.replay()
                launch.append(time.perf_counter() - t)
        each = []
        t = time_steps(step, args.new - 2, each)
        each.sort()
        out = dict(step_s=t, tok_s=B / t, fill_s=fill_s,
                   each_ms=[round(each[int(p * (len(each) - 1))] * 1e3, 2) for p in (0.5, 0.9, 1.0)])
        if ctrl:
            out["reserve_s"] = sorted(ctrl)[len(ctrl) // 2]
        if plane == "graph":     # the same graph without Reserve/refill: GPU time of a step
            out["rpc_s"] = sorted(rpc)[len(rpc) // 2]
            out["launch_s"] = sorted(launch)[len(launch) // 2]
            out["replay_s"] = time_steps(graph.replay, 20)
            # the step without the Reserve RPC: same refills (host copies), then the replay
            from kvstore.cuda.pinned import copy_into
            host_slots = plan.slots.cpu()

            def refill_replay():
                copy_into(plan.slots, host_slots)
                plan.kernel_plan.update(*mc.last_lens)
                graph.replay()
            out["refill_replay_s"] = time_steps(refill_replay, 20)
            if args.profile:
                out["kernels"] = kernel_table(graph.replay, 5)
        if plane == "remote":   # latency of one tiny AppendAttend (B=1, L=1 worth of data)
            lat = []
            k1 = torch.randn(1, HKV, D, device="cuda", dtype=torch.float16)
            q1 = torch.randn(1, HQ, D, device="cuda", dtype=torch.float16)
            kv.allocate("b", "tiny", [])
            for i in range(300):
                t1 = time.perf_counter()
                kv.append_attend("b", i % L, ["tiny"], k1, k1, q1)
                torch.cuda.synchronize()
                lat.append(time.perf_counter() - t1)
            lat.sort()
            out["append_attend_p50_us"] = lat[len(lat) // 2] * 1e6
            out["append_attend_p99_us"] = lat[int(len(lat) * 0.99)] * 1e6
        if plane != "remote":
            del plan
            mc.close()
        kv.close()
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--modes", default="a,b,c,d")
    ap.add_argument("--profile", action="store_true", help="GPU time per kernel of a graph step")
    ap.add_argument("--batches", default="", help="per-mode batch, e.g. a=18,c=64 (the largest that fits "
                    "for each); others use --batch")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:      # a single mode in a fresh process, so each starts with an empty GPU
        fn = {"a": run_baseline, "b": lambda a: run_daemon(a, "pq", "remote"),
              "c": lambda a: run_daemon(a, "pq", "graph"), "d": lambda a: run_daemon(a, "fp16", "graph"),
              "c2": lambda a: run_daemon(a, "pq", "graph", bits=2),
              "ce": lambda a: run_daemon(a, "pq", "mapped"), "de": lambda a: run_daemon(a, "fp16", "mapped")}
        print("RESULT " + json.dumps(dict(fn[args.one](args), batch=args.batch)))
        return
    res = {}
    batches = dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in args.batches.split(",") if kv)
    for mode in args.modes.split(","):
        r = subprocess.run([sys.executable, __file__, "--one", mode, "--batch", str(batches.get(mode, args.batch)),
                            "--context",
                            str(args.context), "--new", str(args.new)] + (["--profile"] if args.profile else []), capture_output=True, text=True,
                           cwd=ROOT, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                               [ROOT, os.environ.get("PYTHONPATH", "")])))
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            print(f"mode {mode} failed:\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}")
            os.makedirs(RESULTS, exist_ok=True)
            with open(os.path.join(RESULTS, f"decode_{mode}.err"), "w") as f:
                f.write(r.stdout + "\n" + r.stderr)
            continue
        res[mode] = json.loads(line[0][7:])
    bw = hbm_read_bw()
    print(f"\ndecode benchmark, Llama-3-8B geometry, B={args.batch} {batches or ''}, context {args.context}, "
          f"{args.new} new tokens, {torch.cuda.get_device_name()}; HBM read {bw / 1e12:.2f} TB/s")
    names = {"a": "(a) in-process fp16 + SDPA", "b": "(b) daemon remote AppendAttend, PQ",
             "c": "(c) daemon mapped, PQ, graph", "d": "(d) daemon mapped, fp16, graph",
             "c2": "(c2) daemon mapped, PQ 2-bit, graph",
             "ce": "(c) daemon mapped, PQ, eager", "de": "(d) daemon mapped, fp16, eager"}
    for mode, r in res.items():
        ratio = f"{r['tok_s'] / res['a']['tok_s']:.2f}x (a)" if "a" in res else ""
        extra = f", fill {r['fill_s']:.1f}s" if "fill_s" in r else ""
        if "replay_s" in r:
            extra += (f", control plane {100 * max(0.0, 1 - r['replay_s'] / r['step_s']):.1f}% of a step "
                      f"(graph alone {r['replay_s'] * 1e3:.2f} ms; host p50: step() {r['reserve_s'] * 1e3:.2f} ms "
                      f"of which Reserve RPC {r['rpc_s'] * 1e3:.2f} ms, graph launch {r['launch_s'] * 1e3:.2f} ms; "
                      f"refills + replay without the RPC {r['refill_replay_s'] * 1e3:.2f} ms; "
                      f"a step's host time p50 / p90 / max {' / '.join(map(str, r['each_ms']))} ms)")
        elif "reserve_s" in r:
            extra += f", Reserve p50 {r['reserve_s'] * 1e3:.2f} ms = {100 * r['reserve_s'] / r['step_s']:.1f}% of a step"
        print(f"  {names[mode]:<38} B={r['batch']:<3} {r['tok_s']:8.1f} tok/s  {r['step_s'] * 1e3:7.2f} ms/step  {ratio}{extra}")
    for mode, r in res.items():
        if r.get("daemon_rpc_ms"):
            print(f"    {mode}: daemon-side mean ms per RPC: {r['daemon_rpc_ms']}")
        for name, ms, count in r.get("kernels", []):
            print(f"    {mode}: {ms:7.3f} ms/step  x{count:<4} {name}")
    if "a" in res:
        a = res["a"]
        kv_fp16 = a["kv_bytes"]
        shrink = {"c": 4, "c2": 8, "d": 1}          # KV bytes of fp16's over the mode's

        def floor(m):      # a step of m at the read bandwidth: the weights, then its KV bytes
            return a["weights_s"] + kv_fp16 / shrink.get(m, 1) / bw
        same = [m for m in ("c", "c2") if m in res and res[m]["batch"] == a["batch"]]
        print(f"  weights read {a['weights_s'] * 1e3:.2f} ms/step; fp16 KV {kv_fp16 / 1e9:.1f} GB, PQ 1/4 of it; "
              f"byte-limited ideal (c)/(a) = {floor('a') / floor('c'):.2f}x; (a) runs at "
              f"{floor('a') / a['step_s']:.2f} of its own byte limit ({floor('a') * 1e3:.2f} ms)")
        print(f"  (a) under a CUDA graph (replayed at one position): {a['graph_s'] * 1e3:.2f} ms/step, "
              f"{floor('a') / a['graph_s']:.2f} of its byte limit; the modes against it:")
        for m in same:
            got, ideal = a["graph_s"] / res[m]["step_s"], floor("a") / floor(m)
            print(f"    ({m}) {got:.2f}x = {got / ideal:.2f} of its ideal {ideal:.2f}x")
        for m in same:
            got, ideal = res[m]["tok_s"] / a["tok_s"], floor("a") / floor(m)
            print(f"  byte-limited ideal ({m})/(a) = {ideal:.2f}x; ({m}) reaches {got:.2f}x = {got / ideal:.2f} of it")
        # (a)'s eager step moves with the host (0.68-0.90 of its byte limit in one device
        # call), and the ratios over it with it; a mode's step against its own byte limit
        # does not depend on (a)
        for m in ("c", "c2", "d"):
            if m in res and res[m]["batch"] == a["batch"]:
                print(f"  ({m}) runs at {floor(m) / res[m]['step_s']:.2f} of its own byte limit "
                      f"({floor(m) * 1e3:.2f} ms)")
        for m in ("c", "c2", "d"):
            if m in res and res[m]["batch"] != a["batch"]:
                print(f"  ({m}) at B={res[m]['batch']} vs (a) at B={a['batch']}: "
                      f"{res[m]['tok_s'] / a['tok_s']:.2f}x tokens/s")
    if "b" in res:
        print(f"  AppendAttend tiny payload: p50 {res['b']['append_attend_p50_us']:.0f} us, "
              f"p99 {res['b']['append_attend_p99_us']:.0f} us")


if __name__ == "__main__":
    main()
