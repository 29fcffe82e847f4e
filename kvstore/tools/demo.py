"""`make demo-synthetic`: start the daemon, run a synthetic multi-sequence decode workload
through the client, check every attention output against the fp64 reference,
and print the daemon's stats.

The workload is what a model worker does: prompts sharing a system prefix are
allocated (prefix hits), prefilled with one bulk append, then decoded token by
token with one AppendAttend per layer; one sequence is forked mid-way.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

from kvstore.client import KVStoreClient
from kvstore.kernels import reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wait_serving(target: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"daemon exited with {proc.returncode}")
        try:
            with grpc.insecure_channel(target) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError:
            time.sleep(0.2)
    sys.exit("daemon did not become SERVING")


@contextlib.contextmanager
def spawn_daemon(socket: str | None = None, args: tuple[str, ...] = (), quiet: bool = False):
    """Start `server.py` on a Unix socket of its own -> its target; stopped at
    exit. By default the socket is in a fresh temporary directory (removed at
    exit), never the daemon's default one: a demo must neither take over nor
    talk to a daemon someone else runs."""
    tmp = None
    if socket is None:
        tmp = tempfile.mkdtemp(prefix="kvstore-demo-")
        socket = os.path.join(tmp, "kv.sock")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "server.py"), "--socket", socket, *args],
                            stdout=subprocess.DEVNULL if quiet else None)
    target = f"unix://{socket}"
    try:
        wait_serving(target, proc)
        yield target
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def run_workload(kv: KVStoreClient, codec: str, layers=4, hq=8, hkv=2, d=32, n_seqs=4, prompt_len=200,
                 new_tokens=24, seed=0) -> dict:
    name = f"demo-{codec}"
    kv.create_cache(name, "demo/synthetic", num_layers=layers, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                    codec=codec, block_size=16, residual=32, num_blocks=512, exist_ok=True,
                    sink_tokens=32 if codec == "pq" else 0)
    g = torch.Generator().manual_seed(seed)
    if codec == "pq":
        kv.train_codebooks(name, torch.randn(layers, 4096, hkv, d, generator=g),
                           torch.randn(layers, 4096, hkv, d, generator=g), niter=10)
    system = list(range(5000, 5000 + prompt_len // 2))
    shadow, hits = {}, 0
    # Prefix K/V is a function of the tokens: the shared system prompt gives the same K/V.
    sys_k = torch.randn(layers, len(system), hkv, d, generator=g).half()
    sys_v = torch.randn(layers, len(system), hkv, d, generator=g).half()
    for i in range(n_seqs):
        sid = f"seq{i}"
        user = [100 * i + t for t in range(prompt_len - len(system))]
        prompt = system + user
        cached = kv.allocate(name, sid, prompt)
        hits += cached
        k = torch.cat([sys_k, torch.randn(layers, len(user), hkv, d, generator=g).half()], dim=1)
        v = torch.cat([sys_v, torch.randn(layers, len(user), hkv, d, generator=g).half()], dim=1)
        kv.append(name, [sid], k[:, cached:], v[:, cached:], token_ids=[prompt[cached:]])
        shadow[sid] = [k, v]
    seqs = list(shadow)
    worst = 0.0
    # The calls and the fp64 checks are timed apart: calls/s is the daemon's
    # rate, not the rate of this loop with its reference attention.
    call_s = check_s = 0.0
    calls = 0
    for step in range(new_tokens):
        if step == new_tokens // 2:
            kv.fork(name, "seq0", "seq0-fork")
            shadow["seq0-fork"] = [shadow["seq0"][0].clone(), shadow["seq0"][1].clone()]
            seqs.append("seq0-fork")
        k1 = torch.randn(layers, len(seqs), hkv, d, generator=g).half()
        v1 = torch.randn(layers, len(seqs), hkv, d, generator=g).half()
        q = torch.randn(layers, len(seqs), hq, d, generator=g).half()
        for layer in range(layers):
            t0 = time.perf_counter()
            out = kv.append_attend(name, layer, seqs, k1[layer], v1[layer], q[layer])
            t1 = time.perf_counter()
            call_s += t1 - t0
            calls += 1
            if codec == "fp16":   # exact reference over what we appended
                for b, sid in enumerate(seqs):
                    kk = torch.cat([shadow[sid][0][layer], k1[layer, b:b + 1]])
                    vv = torch.cat([shadow[sid][1][layer], v1[layer, b:b + 1]])
                    want, _ = ref.attention_dense(q[layer, b].double(), kk.double(), vv.double(), 1 / math.sqrt(d))
                    worst = max(worst, (out[b].double() - want).abs().max().item())
                check_s += time.perf_counter() - t1
        for b, sid in enumerate(seqs):
            shadow[sid][0] = torch.cat([shadow[sid][0], k1[:, b:b + 1]], dim=1)
            shadow[sid][1] = torch.cat([shadow[sid][1], v1[:, b:b + 1]], dim=1)
    if codec == "pq":   # reference over the daemon's own dequantized K/V
        t1 = time.perf_counter()
        q = torch.randn(len(seqs), hq, d, generator=g).half()
        out = kv.attend(name, layers - 1, seqs, q)
        for b, sid in enumerate(seqs):
            k, v = kv.retrieve(name, sid, 0, shadow[sid][0].shape[1], layers - 1, layers)
            want, _ = ref.attention_dense(q[b].double(), k[0].double(), v[0].double(), 1 / math.sqrt(d))
            worst = max(worst, (out[b].double() - want).abs().max().item())
        check_s += time.perf_counter() - t1
    stats = kv.stats(name).caches[0]
    kv.free(name, seqs)
    return dict(codec=codec, max_abs_err=worst, prefix_hit_tokens=hits, calls=calls, call_s=call_s,
                calls_per_s=calls / call_s, check_s=check_s, stats=stats)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", default=None,
                   help="socket of the daemon the demo starts (default: one in a fresh temporary directory)")
    args = p.parse_args(argv)
    ok = True
    with spawn_daemon(args.socket) as target, KVStoreClient(target) as kv:
        print(f"client transport: {kv.transport}")
        for codec in ("fp16", "pq"):
            r = run_workload(kv, codec)
            s = r["stats"]
            good = r["max_abs_err"] < 1e-3
            ok &= good
            print(f"\n== codec {codec}: {'OK' if good else 'MISMATCH'} (max |out - fp64 ref| = "
                  f"{r['max_abs_err']:.2e})")
            print(f"   {r['calls']} AppendAttend calls in {r['call_s']:.2f} s: {r['calls_per_s']:.0f} calls/s "
                  f"(the calls alone; the fp64 checks took {r['check_s']:.2f} s besides)")
            print(f"   prefix hits: {r['prefix_hit_tokens']} tokens; hit rate {s.prefix_hit_rate:.1%}; "
                  f"{s.sealed_tokens} of {s.tokens} tokens sealed")
            print(f"   memory: {s.used_bytes / 2**20:.2f} MiB used for {s.tokens} tokens = "
                  f"{s.effective_bytes_per_token:,.0f} B/token effective (shared prefix blocks counted once; "
                  f"fp16 K/V {s.fp16_bytes_per_token:,} B/token, a sealed block {s.bytes_per_token:,} B/token)")
            # fp16 seals by relabelling tail blocks: nothing is encoded (Stats.sealed_blocks counts encodes)
            encoded = f"; blocks encoded {s.sealed_blocks} (dedup {s.dedup_blocks})" if codec == "pq" else ""
            print(f"   main pool: used {s.main.used} cached {s.main.cached} free {s.main.free} "
                  f"of {s.main.capacity}; sequences {s.sequences}; tokens {s.tokens}{encoded}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
