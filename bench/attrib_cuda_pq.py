"""Where the fixed per-launch cost of the CUDA PQ decode kernel goes (Session 4).

python bench/attrib_cuda_pq.py [--cases 1x4096 1x32768 8x32768] [--warps 12] [--chunk-ctas N]
  With KVSTORE_CUDA_PQ_DEFS="-DPQ_STAMPS" (debug build: lane 0 of each warp writes clock64 at
  the stage boundaries of pq_attn, its SM id and %globaltimer; see cuda_pq.cu PQ_STAMP):
  per-stage durations over the CTAs, CTA start / end skew across the grid, CTAs per SM.
  Without it: timings (same method as bench_cuda_pq.py: median over CUDA-graph replays, L2
  flushed by a read) of the whole step, the attention kernel alone, the merge kernel alone,
  the attention kernel with every item empty (launch + return), and an empty graph.
Same case as bench_cuda_pq.py (Hq 32, Hkv 8, d 128, M 64, bs 16, fp16 tail 128).
"""
import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402

from kvstore.kernels import cuda_pq  # noqa: E402
from kvstore.kernels import decode_attention as da  # noqa: E402

STAMPS = "-DPQ_STAMPS" in cuda_pq.DEFINES
# stamp slots (cuda_pq.cu): 0 entry, 1 staging issued, 2 ring prologue issued, 3 tables
# ready (after the barrier), 4 first tile done, 5 PQ loop done, 6 tail done, 7 all warps
# done (barrier), 8 partials written; 9 SM id, 10 / 11 globaltimer entry / exit, 12 tiles
STAGES = [("entry->staging issued", 0, 1), ("ring prologue issue", 1, 2),
          ("wait tables (barrier)", 2, 3), ("first tile", 3, 4), ("PQ loop", 3, 5),
          ("tail tiles", 5, 6), ("wait slowest warp", 6, 7), ("epilogue (combine+write)", 7, 8)]


def make(b, L, target_ctas=None):
    q = torch.randn(b, ba.HQ, ba.D, device="cuda", dtype=torch.float16)
    case, sl, tl_, nbytes = ba.pq_case(b, L, 16)
    plan = da.plan_pq_decode(sl, tl_, num_qo_heads=ba.HQ, num_kv_heads=ba.HKV, head_dim=ba.D,
                             block_size=16, tail_block_size=ba.TBS, device="cuda",
                             backend="cuda", target_ctas=target_ctas)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device="cuda")
    c = case

    def run():
        plan.run_pq(q, c["k_codes"], c["v_codes"], c["k_codebook"], c["v_codebook"],
                    c["sealed_tables"], c["tail_k"], c["tail_v"], c["tail_tables"], ba.D ** -0.5,
                    out=out, lse=lse)
    return plan, run, nbytes


def stamps(b, L, target_ctas=None):
    import cupy
    plan, run, _ = make(b, L, target_ctas)
    run()
    torch.cuda.synchronize()
    gp = cuda_pq._group(ba.HQ // ba.HKV, 2, plan.conflict_free)
    nw = plan.num_warps
    mod = cuda_pq._raw[(0, cuda_pq._attn_name(ba.D, 2, False, nw, gp, plan._tma(gp), plan._bs_pow2()))]
    ptr = mod.get_global("pq_stamps")
    buf = cupy.ndarray((1 << 21,), dtype=cupy.uint64, memptr=ptr)
    reps = []
    for rep in range(3):
        ba._read_flush()
        buf.fill(0)
        cupy.cuda.Device().synchronize()
        run()
        torch.cuda.synchronize()
        reps.append(buf.get())
    n_items = plan.items.shape[0]
    ncta = n_items * ba.HKV
    items = plan.items.cpu().numpy()
    print(f"\n== B={b} L={L}: {n_items} items x {ba.HKV} heads = {ncta} CTAs of {nw} warps; "
          f"tokens per item {items[0, 2] - items[0, 1]} (+tail {items[:, 4].max()}); "
          f"PQ tiles per CTA max {(items[:, 2] - items[:, 1]).max() // 16}")
    for rep, a in enumerate(reps[1:]):
        s = a[: ncta * nw * 16].reshape(ncta, nw, 16).astype(np.int64)
        live = s[:, 0, 10] > 0
        s = s[live]
        smid = s[:, 0, 9]
        g0, g1 = s[:, :, 10].min(1), s[:, :, 11].max(1)
        c0 = s[:, :, 0].min(1)
        c8 = s[:, :, 8].max(1)
        mhz = np.median((c8 - c0) / np.maximum(g1 - g0, 1)) * 1e3
        us = lambda cyc: cyc / mhz          # noqa: E731
        t0 = g0.min()
        per_sm = np.bincount(smid, minlength=132)
        print(f"rep {rep}: {live.sum()} CTAs live, clock {mhz:.0f} MHz, CTAs per SM max "
              f"{per_sm.max()} (SMs used {(per_sm > 0).sum()}); grid span {1e-3 * (g1.max() - t0):.2f} us; "
              f"CTA start after first: p50 {1e-3 * np.median(g0 - t0):.2f} max {1e-3 * (g0.max() - t0):.2f} us; "
              f"CTA end: min {1e-3 * (g1.min() - t0):.2f} p50 {1e-3 * np.median(g1 - t0):.2f} "
              f"max {1e-3 * (g1.max() - t0):.2f} us; CTA duration p50 {us(np.median(c8 - c0)):.2f} "
              f"max {us((c8 - c0).max()):.2f} us")
        rows = []
        for name, i, j in STAGES:
            if name == "first tile":
                d = s[:, :, j] - s[:, :, i]
                ok = s[:, :, 12] > 0
                d = np.where(ok, d, 0).max(1)
            elif name in ("wait tables (barrier)", "wait slowest warp"):
                d = s[:, :, j].max(1) - s[:, :, i].max(1)
            else:           # the CTA's slowest warp for the stage
                d = (s[:, :, j] - s[:, :, i]).max(1)
            rows.append((name, us(np.median(d)), us(np.percentile(d, 90)), us(d.max())))
        tiles = s[:, :, 12]
        for name, p50, p90, mx in rows:
            print(f"   {name:<26} p50 {p50:7.2f}  p90 {p90:7.2f}  max {mx:7.2f} us")
        loop = (s[:, :, 5] - s[:, :, 3]).astype(float)
        tpw = np.maximum(tiles, 1)
        print(f"   tiles per warp: max {tiles.max()} min {tiles.min()}; loop per tile "
              f"p50 {us(np.median(loop[tiles > 0] / tpw[tiles > 0])):.3f} us")


def timings(b, L, target_ctas=None):
    plan, run, nbytes = make(b, L, target_ctas)
    t_full = ba.bench(run)
    cuda_pq.SKIP.clear(); cuda_pq.SKIP.add("merge")
    t_attn = ba.bench(run)
    cuda_pq.SKIP.clear(); cuda_pq.SKIP.add("attn")
    t_merge = ba.bench(run)
    cuda_pq.SKIP.clear(); cuda_pq.SKIP.add("merge")
    items = plan.items.clone()
    plan.items.zero_()
    t_empty = ba.bench(run)
    plan.items.copy_(items)
    cuda_pq.SKIP.clear()
    x = torch.zeros(1, device="cuda")
    t_floor = ba.bench(lambda: x.add_(1))
    print(f"time B={b} L={L} ({plan.items.shape[0]} items): full {t_full:.1f}  attn only "
          f"{t_attn:.1f}  merge only {t_merge:.1f}  attn, all items empty {t_empty:.1f}  "
          f"1-elem add {t_floor:.1f} us; {nbytes / t_full / 1e3:.0f} GB/s", flush=True)
    return t_full


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=["1x4096", "1x32768", "8x4096", "8x32768"])
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--target-ctas", type=int, default=None)
    args = ap.parse_args()
    if args.warps:
        cuda_pq.NUM_WARPS = args.warps
    torch.manual_seed(0)
    print(f"defines {cuda_pq.DEFINES}, warps {cuda_pq.NUM_WARPS}, target_ctas {args.target_ctas}")
    for c in args.cases:
        b, L = map(int, c.split("x"))
        (stamps if STAMPS else timings)(b, L, args.target_ctas)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
