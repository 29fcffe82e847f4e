"""What learned sink logits (CacheSpec.sink_logits, gpt-oss) cost a decode step: the
engine's AppendAttend of every layer, decode graphs on, for a cache with sink logits
against the same cache without, interleaved round by round in one process.

gpt-oss-20b's attention geometry: 24 layers (every other one a 128-token window), 64 query
/ 8 KV heads, head_dim 64, B sequences of L tokens; fp16 and 4-bit PQ (random codebooks:
only the time counts). The sink logits are folded into each layer's output after the
kernels (kernels.fold_sink_logits, captured in the decode graph).

    python bench/bench_sink_logits.py [--batch 8] [--context 8192] [--steps 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import time

import torch

from kvstore.codec.codebooks import Codebooks
from kvstore.core.config import CacheConfig, CodecConfig, ModelGeometry
from kvstore.engine.engine import Engine

L, HQ, HKV, D, WINDOW = 24, 64, 8, 64, 128
TENANT = "bench"


def make(e: Engine, name: str, codec: str, sinks: bool, batch: int, context: int, steps: int) -> None:
    blocks = batch * ((context + steps) // 16 + 16)
    cfg = CacheConfig(name=name, model_id="gpt-oss-20b-like",
                      geometry=ModelGeometry(L, HQ, HKV, D, "float16"), codec=CodecConfig(kind=codec),
                      block_size=16, residual=128, num_blocks=blocks, max_sequences=batch, device="cuda",
                      layer_windows=(WINDOW, 0) * (L // 2),
                      sink_logits=tuple(torch.randn(L * HQ, generator=torch.Generator().manual_seed(1)).tolist())
                      if sinks else ())
    e.create_cache(cfg)
    if codec == "pq":
        g = torch.Generator().manual_seed(0)
        e.set_codebooks(name, Codebooks(k=torch.randn(L, HKV, D // 2, 256, 2, generator=g),
                                        v=torch.randn(L, HKV, D // 2, 256, 2, generator=g)))
    g = torch.Generator(device="cuda").manual_seed(2)
    for b in range(batch):
        e.allocate(name, TENANT, f"s{b}", [])
        k = torch.randn(L, context, HKV, D, device="cuda", generator=g, dtype=torch.float16)
        e.append(name, TENANT, [f"s{b}"], k, k.flip(1), [context])


def steps_time(e: Engine, name: str, batch: int, steps: int, bufs) -> float:
    """Seconds per decode step (every layer's AppendAttend), `steps` steps."""
    q, out, k, v = bufs
    sids = [f"s{b}" for b in range(batch)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        for layer in range(L):
            e.append_attend(name, TENANT, layer, sids, k, v, q, out=out)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; B={args.batch} L={args.context}, "
          f"{args.steps} steps a round, {args.rounds} rounds (plain / sinks interleaved)")
    bufs = (torch.randn(args.batch, HQ, D, device="cuda", dtype=torch.float16),
            torch.empty(args.batch, HQ, D, device="cuda", dtype=torch.float16),
            torch.randn(args.batch, HKV, D, device="cuda", dtype=torch.float16),
            torch.randn(args.batch, HKV, D, device="cuda", dtype=torch.float16))
    print(f"{'codec':6s} {'plain µs/step':>14s} {'sinks µs/step':>14s} {'sinks / plain':>14s}")
    for codec in ("fp16", "pq"):
        e = Engine("cuda")
        total = (args.rounds + 1) * args.steps
        for name, sinks in (("plain", False), ("sinks", True)):
            make(e, name, codec, sinks, args.batch, args.context, total)
        for name in ("plain", "sinks"):             # warm-up: compiles and graph captures
            steps_time(e, name, args.batch, args.steps, bufs)
        times = {"plain": [], "sinks": []}
        for _ in range(args.rounds):
            for name in ("plain", "sinks"):
                times[name].append(steps_time(e, name, args.batch, args.steps, bufs))
        p, s = (min(times[n]) * 1e6 for n in ("plain", "sinks"))
        print(f"{codec:6s} {p:14.1f} {s:14.1f} {s / p:14.3f}   (rounds: plain "
              f"{', '.join(f'{t * 1e6:.0f}' for t in times['plain'])}; sinks "
              f"{', '.join(f'{t * 1e6:.0f}' for t in times['sinks'])}; graph hits "
              f"{e.cache('plain').graphs.hits} / {e.cache('sinks').graphs.hits})")
        for name in ("plain", "sinks"):
            e.delete_cache(name, force=True)


if __name__ == "__main__":
    main()
