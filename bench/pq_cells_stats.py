"""Candidate-list statistics of the dsub=2 cell tables (kernels/pq_cells.py).

python bench/pq_cells_stats.py [--grids 16 32] [--mixes 0 0.5 1] [--pads 0.25]
(a) random: torch.randn codebooks [Hkv, 64, 256, 2] and torch.randn data (the benchmark's)
(b) trained: bench/cb/qaware-many-pq4.safetensors (d=64, M=32), a few layers, K and V,
    data = a uniformly chosen centroid + Gaussian noise of 0.5 x its nearest-neighbour
    distance per axis.
Per point: mean candidates (points that use a list), % outside the grid, % in FULL cells,
mean over groups of 32 points of the largest list (what a warp loops over).
Per cell: % FULL. Bytes: tables per layer at Llama-3-8B geometry (Hkv 8, M 64, K+V).
"""
import argparse
import os
import sys
import time

import torch

from kvstore.codec.codebooks import Codebooks
from kvstore.kernels import pq_cells

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CB = os.environ.get("KVSTORE_CB", "/work/main/bench/cb/qaware-many-pq4.safetensors")


def sample_near(cb: torch.Tensor, n: int, gen) -> torch.Tensor:
    """cb [Hkv, M, 256, 2] -> x [n, Hkv, 2M] near the centroids."""
    hkv, m, c, _ = cb.shape
    d2 = torch.cdist(cb.reshape(-1, c, 2), cb.reshape(-1, c, 2))
    d2.diagonal(dim1=1, dim2=2).fill_(float("inf"))
    nn = d2.amin(-1).reshape(hkv, m, c)                           # nearest-neighbour distance
    pick = torch.randint(0, c, (n, hkv, m), generator=gen)
    h = torch.arange(hkv).view(1, hkv, 1)
    j = torch.arange(m).view(1, 1, m)
    x = cb[h, j, pick] + 0.5 * nn[h, j, pick].unsqueeze(-1) * torch.randn(n, hkv, m, 2, generator=gen)
    return x.reshape(n, hkv, 2 * m)


def stats(cb, x, **kw):
    t0 = time.time()
    tb = pq_cells.build_cell_tables(cb, **kw)
    build = time.time() - t0
    hkv, m = cb.shape[:2]
    xt = x.float().reshape(x.shape[0], hkv * m, 2).transpose(0, 1)   # [S, N, 2]
    cell, fast = pq_cells.locate(tb, xt)
    cnt = torch.gather(tb.counts.reshape(hkv * m, -1), 1, cell).long()
    g = tb.grid
    bp = tb.bp.reshape(-1, 2, g + 1)
    inside = ((xt[..., 0] >= bp[:, 0, :1]) & (xt[..., 0] < bp[:, 0, g:])
              & (xt[..., 1] >= bp[:, 1, :1]) & (xt[..., 1] < bp[:, 1, g:]))
    per = torch.where(fast, cnt, 0).float()
    n32 = per.shape[1] // 32 * 32
    warp = per[:, :n32].reshape(per.shape[0], -1, 32).amax(-1)
    full_cells = (tb.counts == pq_cells.FULL).float().mean().item()
    return dict(cand=per[fast].mean().item(), outside=100 * (~inside).float().mean().item(),
                full_pts=100 * (inside & ~fast).float().mean().item(),
                warp_max=warp.mean().item(), full_cells=100 * full_cells, build_s=build)


def layer_bytes(g, cmax, hkv=8, m=64):
    return 2 * hkv * m * (g * g * (cmax + 1) + 2 * (g + 1) * 4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grids", type=int, nargs="*", default=[16, 32])
    ap.add_argument("--mixes", type=float, nargs="*", default=[0.0, 0.5, 1.0])
    ap.add_argument("--pads", type=float, nargs="*", default=[0.25])
    ap.add_argument("--cmax", type=int, default=15)
    ap.add_argument("--heads", type=int, default=2, help="random case: KV heads")
    ap.add_argument("--layers", type=int, nargs="*", default=[0, 15, 29])
    ap.add_argument("--n", type=int, default=4096)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    cases = {"random": (torch.randn(args.heads, 64, 256, 2, generator=gen),
                        torch.randn(args.n, args.heads, 128, generator=gen))}
    if os.path.exists(CB):
        cbs = Codebooks.load(CB)
        for kind, t in (("K", cbs.k), ("V", cbs.v)):
            cb = t[args.layers].reshape(-1, *t.shape[2:])          # [layers*Hkv, M, 256, 2]
            cases[f"trained {kind} L{args.layers}"] = (cb, sample_near(cb, args.n, gen))
    print(f"{'case':<24} {'G':>3} {'mix':>4} {'pad':>5} {'cand/pt':>8} {'warp max':>8} "
          f"{'%out':>6} {'%fullpt':>7} {'%fullcell':>9} {'MB/layer':>8} {'build s':>7}")
    for name, (cb, x) in cases.items():
        for g in args.grids:
            for mix in args.mixes:
                for pad in args.pads:
                    s = stats(cb, x, grid=g, cmax=args.cmax, mix=mix, pad=pad)
                    print(f"{name:<24} {g:>3} {mix:>4} {pad:>5} {s['cand']:>8.2f} "
                          f"{s['warp_max']:>8.2f} {s['outside']:>6.2f} {s['full_pts']:>7.3f} "
                          f"{s['full_cells']:>9.2f} {layer_bytes(g, args.cmax) / 2**20:>8.2f} "
                          f"{s['build_s']:>7.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
