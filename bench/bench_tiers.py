"""Tier benchmark: every figure is a ratio against a baseline measured
in the same run.

  GPU -> host and host -> GPU GB/s of the tier moves vs a plain pinned copy of the same bytes
  LMDB spill and restore GB/s
  restoring an 8K-token prefix from host and from LMDB vs recomputing its prefill
  with a Llama-3-8B-geometry layer stack (32 layers, 32 q / 8 kv heads, d 128)

python bench/bench_tiers.py [--tokens 8192] [--layers 32] [--device cuda]
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from kvstore.codec.codebooks import Codebooks
from kvstore.core.config import CacheConfig, CodecConfig, ModelGeometry
from kvstore.engine.engine import Engine


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--skip-prefill", action="store_true")
    args = p.parse_args()
    dev, L, n = args.device, args.layers, args.tokens
    tmp = tempfile.mkdtemp(prefix="kvbench-")
    try:
        geom = ModelGeometry(L, 32, 8, 128)
        blocks = n // 16 + 64
        cfg = CacheConfig(name="b", model_id="llama-3-8b-geometry", geometry=geom, codec=CodecConfig("pq"),
                          block_size=16, residual=128, num_blocks=blocks, max_sequences=4, device=dev,
                          host_bytes=3 * blocks * (2 * L * 8 * 16 * 64 + 2 * L * 8 * 16 * 128 * 2) // 2)
        e = Engine(dev, lmdb_path=os.path.join(tmp, "lmdb"))
        e.create_cache(cfg)
        g = torch.Generator().manual_seed(0)
        e.set_codebooks("b", Codebooks(k=torch.randn(L, 8, 64, 256, 2, generator=g),
                                       v=torch.randn(L, 8, 64, 256, 2, generator=g)))
        # No token ids: no content hashes, so every move copies every block
        # (with hashes, a block already below is shared instead of copied).
        e.allocate("b", "t", "s", [])
        chunk = 1024
        for i in range(0, n, chunk):
            k = torch.randn(L, chunk, 8, 128, dtype=torch.float16, device=dev)
            e.append("b", "t", ["s"], k, k, [chunk])
        cache = e.cache("b")
        s = cache.seq("t", "s")
        moved = (len(s.sealed) * cache.main.block_bytes() + len(s.tail) * cache.tail.block_bytes())

        # Baseline: one plain copy of the same bytes, GPU -> pinned host -> GPU.
        src = torch.empty(moved, dtype=torch.uint8, device=dev)
        pinned = torch.empty(moved, dtype=torch.uint8, pin_memory=dev.startswith("cuda"))
        t_d2h_plain = timed(lambda: pinned.copy_(src, non_blocking=True), dev)
        t_h2d_plain = timed(lambda: src.copy_(pinned, non_blocking=True), dev)

        def down():
            cache.tiering.to_host(s)

        def up():
            cache.tiering.page_in(s, set())
        t_down = t_up = float("inf")
        for _ in range(3):
            sync(dev)
            t = time.perf_counter()
            down()
            sync(dev)
            t_down = min(t_down, time.perf_counter() - t)
            t = time.perf_counter()
            up()
            sync(dev)
            t_up = min(t_up, time.perf_counter() - t)
        # LMDB: Offload (durable) and restore.
        t_spill = t_restore = float("inf")
        for _ in range(2):
            sync(dev)
            t = time.perf_counter()
            e.offload("b", "t", ["s"])
            t_spill = min(t_spill, time.perf_counter() - t)
            t = time.perf_counter()
            e.prefetch("b", "t", ["s"])
            sync(dev)
            t_restore = min(t_restore, time.perf_counter() - t)
            cache.changing(s)      # as a write would: the durable copy goes, the next Offload writes again
        gb = moved / 1e9
        rows = [
            ("bytes moved (PQ sealed + fp16 tail)", f"{moved / 2**20:.1f} MiB", ""),
            ("GPU->host tier move", f"{gb / t_down:.1f} GB/s", f"{t_d2h_plain / t_down:.2f}x of plain copy "
                                                                 f"({gb / t_d2h_plain:.1f} GB/s)"),
            ("host->GPU page-in", f"{gb / t_up:.1f} GB/s", f"{t_h2d_plain / t_up:.2f}x of plain copy "
                                                            f"({gb / t_h2d_plain:.1f} GB/s)"),
            ("LMDB spill (Offload, synced)", f"{gb / t_spill:.2f} GB/s", ""),
            ("LMDB restore (Prefetch)", f"{gb / t_restore:.2f} GB/s", ""),
        ]
        if not args.skip_prefill:
            t_prefill = prefill_stack(L, n, dev)
            rows += [("recompute prefill (Llama-3-8B geometry)", f"{t_prefill * 1e3:.1f} ms", ""),
                     (f"restore {n} tokens from host", f"{t_up * 1e3:.1f} ms", f"{t_prefill / t_up:.1f}x faster"),
                     (f"restore {n} tokens from LMDB", f"{t_restore * 1e3:.1f} ms",
                      f"{t_prefill / t_restore:.1f}x faster")]
        print(f"\ntiers benchmark: device {dev} ({torch.cuda.get_device_name() if dev.startswith('cuda') else 'cpu'}),"
              f" {n} tokens, {L} layers")
        w = max(len(r[0]) for r in rows)
        for a, b, c in rows:
            print(f"  {a:<{w}}  {b:>12}  {c}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
