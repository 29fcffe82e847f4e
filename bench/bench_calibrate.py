"""Calibration benchmark: the PQ training step of kvstore-calibrate (OPQ
rotation, then 256-centroid k-means per subspace, for every layer, K/V and KV
head) on random K/V of a model's geometry, with the calibration's default
sample count (32 windows x (512 + 16) rows).

  baseline (same run): faiss k-means on the CPU (kvstore-calibrate --device cpu)
  against it: the torch k-means on the CPU, and on the GPU where there is one
  (kvstore-calibrate --device cuda; faiss-gpu does not install everywhere)

Geometries: SmolLM2-135M (30 layers, 3 KV heads, d 64) and Llama-3-8B (32
layers, 8 KV heads, d 128). --layers times that many layers and scales to the
whole model (each layer trains the same way). The model's forward passes over
the calibration windows (capture) are not included.

python bench/bench_calibrate.py [--bits 4] [--layers 1] [--threads 2] [--only smollm2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvstore.tools.calibrate import train_layer  # noqa: E402

GEOMETRIES = {"smollm2": (30, 3, 64), "llama3-8b": (32, 8, 128)}


def samples(n: int, hkv: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [n, Hkv, d] fp16: anisotropic Gaussians (K's variance spread over
    dims as RoPE'd keys' is), so k-means has structure to find."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1, d)
    return ((torch.randn(n, hkv, d, generator=g) * scale).half(), torch.randn(n, hkv, d, generator=g).half())


def time_layers(layers: int, hkv: int, d: int, m: int, n: int, niter: int, device: str | None) -> float:
    """Seconds to train `layers` layers on `device` (None: faiss)."""
    k, v = samples(n, hkv, d)
    if device and device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(layers):
        train_layer(k, v, m, None, None, niter, "parametric", device=device)
    if device and device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, default=4, choices=[4, 2])
    p.add_argument("--layers", type=int, default=1, help="layers timed per geometry (scaled to the model's)")
    p.add_argument("--rows", type=int, default=32 * (512 + 16), help="sample rows per (layer, KV head)")
    p.add_argument("--niter", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", choices=sorted(GEOMETRIES), help="one geometry")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    devices: list[str | None] = [None, "cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs"
          f"{', ' + torch.cuda.get_device_name() if torch.cuda.is_available() else ''}; "
          f"{args.rows:,} rows, {args.bits}-bit, {args.niter} iterations; {args.layers} layer(s) timed", flush=True)
    print("| geometry | k-means | s per layer | whole model (s) | vs faiss CPU |")
    print("|---|---|---|---|---|")
    for name, (layers, hkv, d) in GEOMETRIES.items():
        if args.only and name != args.only:
            continue
        m = d // (2 if args.bits == 4 else 4)
        base = None
        for dev in devices:
            s = time_layers(args.layers, hkv, d, m, args.rows, args.niter, dev) / args.layers
            base = base or s
            label = "faiss (CPU)" if dev is None else f"torch ({dev})"
            print(f"| {name} ({layers} x {hkv} x {d}, M={m}) | {label} | {s:.2f} | {s * layers:.0f} "
                  f"| {base / s:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
