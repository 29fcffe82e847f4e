"""CUDA C++ PQ decode attention and PQ encode (kernels/cuda/) against SDPA flash, the
Triton PQ kernel and the CUDA kernel's other builds, all measured in one run.

python bench/bench_cuda_pq.py [--quick] [--warps 8 12 16] [--bits 4 2] [--encode-only] [--no-encode]
                              [--shape B L] [--window W [--softcap C] [--window-shape B L]]
                              [--heads HQ HKV D]

Same case and timing as bench/bench_attention.py (whose helpers it uses): Hq 32, Hkv 8, d 128
(--heads: another geometry, e.g. Gemma-style 4 1 256, which runs the cluster build),
M 64 (4-bit, dsub 2) and/or M 32 (2-bit, dsub 4: --bits), bs 16, a 128-token fp16 tail;
median over CUDA-graph replays with L2 flushed before each (--flush read: evicted by a read, the default; zero: triton's zero_(), which adds
~50 MB of write-back to every timed kernel). The same run measures the read bandwidth
(x.sum() over 2 GiB) and the measurement floor (a 1-element add timed the same way), which
every time below contains. The encode part also times a seal's encode of every layer in one
call against one call a layer (time_seal).

Columns: cuda = the kernel as the engine runs it (codebooks staged by bulk copies for items
of up to tunables.TMA_MAX_ITEM_TOKENS tokens, through registers past that); tma = bulk copies
at every item size; reg = register staging at every size (no codebook image);
triton = the Triton PQ kernel; SDPA = torch SDPA flash over contiguous fp16 K/V,
timed once per shape for both bit widths. GB/s and %BW count each bit width's own bytes
(codes, tail, codebooks).

With more than one --warps value the warps per block are swept first (B=8 and B=1, L=32K).
--shape B L times that one shape with no correctness check, sweep or encode before it, so
that under a profiler the first pq_attn launch is that shape's default build (docs/kernels.md
gives the ncu command).

--window W adds a sliding window of the W newest tokens at --window-shape (default B=8,
L=32K; --softcap C caps the scores too): the CUDA kernel's window build and the Triton
kernel over the window, against the plain CUDA build over a sequence of W tokens (the same
tokens read; what the window build costs on top) and over all L.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402

from kvstore.kernels import tunables  # noqa: E402
from kvstore.kernels.cuda import attention as cuda_attention  # noqa: E402
from kvstore.kernels.cuda import build  # noqa: E402
from kvstore.kernels.cuda import encode as cuda_encode  # noqa: E402
from kvstore.kernels.plan import pq_window_starts  # noqa: E402
from kvstore.kernels.triton import encode as triton_encode  # noqa: E402

DEV = torch.device("cuda")
DSUB = {4: 2, 2: 4}     # PQ bits per coordinate -> subspace width (8-bit codes)


def kernel_info():
    d = ba.D
    one = cuda_attention.split(d) == 1       # d 256: the cluster build, registers only
    for nw in (8, 12, 16):
        for dsub in (2, 4):
            for gp, tma in ((4, False), (4, True)):
                if not one and tma:
                    continue
                fn = build.function("attention.cu",
                                    cuda_attention._attn_name(d, dsub, False, nw, gp, tma, False, False), DEV)
                print(f"pq_attn<{d},{dsub},f16,{nw},GP={gp},TMA={tma}>: regs {fn.num_regs}, "
                      f"local {fn.local_size_bytes} B")


def encode_info():
    for name in ("pq_encode<2, 4, 8, false, false, true>",
                 "pq_encode_cells<32, 7, false, false, true>"):
        fn = build.function("encode.cu", name, DEV)
        print(f"{name}: regs {fn.num_regs}, local {fn.local_size_bytes} B, "
              f"smem {fn.shared_size_bytes} B")


def time_encode(rd: float | None = None):
    """K + V of 32K tokens x 8 heads x d=128 (M=64, dsub 2): brute force vs cell tables."""
    n, D, M, HKV = 32768, 128, 64, 8
    x = torch.randn(n, HKV, D, device="cuda", dtype=torch.float16)
    cb = torch.randn(HKV, M, 256, 2, device="cuda")
    kc = torch.empty(n // 16, HKV, 16, M, dtype=torch.uint8, device="cuda")
    vc = torch.empty(n // 16, HKV, M, 16, dtype=torch.uint8, device="cuda")
    slots = torch.arange(n, device="cuda")
    nbytes = 2 * x.numel() * x.element_size()                  # x read for K and for V
    res = {}
    for t in (2, 4, 8):
        p = cuda_encode.plan_pq_encode(cb, tokens_per_thread=t, cells=False)
        res[f"brute T={t}"] = ba.bench(lambda: (p.run(x, slots, k_codes=kc), p.run(x, slots, v_codes=vc)))
    p = triton_encode.plan_pq_encode(cb, tile_n=128)
    res["triton tile128"] = ba.bench(lambda: (p.run(x, slots, k_codes=kc), p.run(x, slots, v_codes=vc)))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pc = cuda_encode.plan_pq_encode(cb)
    torch.cuda.synchronize()
    build_ms = 1e3 * (time.perf_counter() - t0)
    for tpb in (0, 256, 512, 2048):
        pc.cells["tokens_per_block"] = tpb
        res[f"cells tpb={tpb or 'auto'}"] = ba.bench(
            lambda: (pc.run(x, slots, k_codes=kc), pc.run(x, slots, v_codes=vc)))
    pc.cells["tokens_per_block"] = 0
    # same codes as the brute-force kernel up to its 2^-15 near-tie rounding
    pb = cuda_encode.plan_pq_encode(cb, cells=False)
    kb = torch.empty_like(kc)
    pb.run(x, slots, k_codes=kb)
    pc.run(x, slots, k_codes=kc)
    diff = (kb != kc).sum().item()
    base = min(v for k, v in res.items() if k.startswith("brute"))
    print(f"\npq_encode K+V, 32K tok x 8 heads x d=128 fp16, x read {nbytes / 1e6:.0f} MB; "
          f"us, median, CUDA graph, L2 flushed; cell tables built in {build_ms:.1f} ms "
          f"({sum(t.numel() for t in (pc.cells['recs'], pc.cells['bp'])) / 2**20:.1f} MB); "
          f"codes != brute force: {diff} of {kb.numel()}")
    print(f"{'kernel':<16} {'us':>8} {'brute/this':>10} {'GB/s':>6}" + ("  %BW" if rd else ""))
    for k, v in res.items():
        bw = nbytes / v / 1e3
        print(f"{k:<16} {v:>8.1f} {base / v:>10.2f} {bw:>6.0f}" + (f" {100 * bw / rd:>4.0f}%" if rd else ""))
    return res


def time_seal(layers: int = 32, blocks: int = 8):
    """A seal's encode as the engine runs it: `blocks` 16-token blocks of every layer
    (Llama-3-8B geometry, 4-bit), K and V, one call of kernels.pq_encode_to_slots with every
    layer's codebooks (one launch each) against one call a layer; host time (the calls
    returning) and with the GPU, median of alternated rounds; the codes must be equal."""
    from kvstore import kernels
    hkv, d, bs, nb = 8, 128, 16, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    kcb, vcb = (torch.randn(layers, hkv, d // 2, 256, 2, device="cuda", generator=g).half() for _ in range(2))
    codes = {"one call": [torch.zeros(layers, nb, hkv, bs, d // 2, dtype=torch.uint8, device="cuda"),
                          torch.zeros(layers, nb, hkv, d // 2, bs, dtype=torch.uint8, device="cuda")]}
    codes["a call a layer"] = [torch.zeros_like(c) for c in codes["one call"]]
    k = torch.randn(layers, blocks * bs, hkv, d, device="cuda", generator=g).half()
    v = torch.randn_like(k)
    slots = (torch.arange(100, 100 + blocks, device="cuda").view(-1, 1) * bs
             + torch.arange(bs, device="cuda")).view(-1).int()
    kernels.prepare_encode(kcb)
    kernels.prepare_encode(vcb)
    for i in range(layers):
        kernels.prepare_encode(kcb[i])
        kernels.prepare_encode(vcb[i])

    def one(kc, vc):
        kernels.pq_encode_to_slots(k, kcb, slots, k_codes=kc)
        kernels.pq_encode_to_slots(v, vcb, slots, v_codes=vc)

    def per_layer(kc, vc):
        for i in range(layers):
            kernels.pq_encode_to_slots(k[i], kcb[i], slots, k_codes=kc[i])
            kernels.pq_encode_to_slots(v[i], vcb[i], slots, v_codes=vc[i])
    fns = {"one call": one, "a call a layer": per_layer}
    times = {w: [] for w in fns}
    for r in range(44):
        for w in (("one call", "a call a layer"), ("a call a layer", "one call"))[r % 2]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fns[w](*codes[w])
            host = time.perf_counter() - t0
            torch.cuda.synchronize()
            if r >= 4:
                times[w].append((host, time.perf_counter() - t0))
    same = all(torch.equal(a, b) for a, b in zip(codes["one call"], codes["a call a layer"]))
    print(f"\nseal encode, {blocks} blocks x {layers} layers, K and V (Hkv {hkv}, d {d}, 4-bit): "
          f"codes equal: {same}")
    for w, ts in times.items():
        print(f"  {w:<15} host {1e3 * sorted(t[0] for t in ts)[len(ts) // 2]:.3f} ms, "
              f"with the GPU {1e3 * sorted(t[1] for t in ts)[len(ts) // 2]:.3f} ms")


def time_window(window: int, softcap: float, b: int, L: int):
    """The window of the `window` newest of L tokens (pq_case's layout: no sinks, a 128-token
    tail): the CUDA kernel's window build and Triton over it, the plain CUDA build over a
    sequence of `window` tokens and over all L."""
    q = torch.randn(b, ba.HQ, ba.D, device="cuda", dtype=torch.float16)
    case, sl, tl_, _ = ba.pq_case(b, L, 16)
    ss, ts = zip(*(pq_window_starts(n + t, window, 0, n) for n, t in zip(sl, tl_)))
    starts = (list(ss), list(ts))
    t_win = ba.time_pq(q, case, sl, tl_, 16, backend="cuda", starts=starts, softcap=softcap)
    t_tr = ba.time_pq(q, case, sl, tl_, 16, backend="triton", starts=starts, softcap=softcap)
    t_all = ba.time_pq(q, case, sl, tl_, 16, backend="cuda")
    del case
    case, sl, tl_, _ = ba.pq_case(b, window, 16)
    t_few = ba.time_pq(q, case, sl, tl_, 16, backend="cuda")
    del case
    torch.cuda.empty_cache()
    print(f"\nwindow {window} of {L} tokens, B={b}" + (f", soft-cap {softcap}" if softcap else "")
          + f" (sealed start {ss[0]}, tail start {ts[0]}); us, median, CUDA graph, L2 flushed")
    print(f"{'cuda window':>12} {'triton window':>14} {'cuda W tokens':>14} {'cuda all L':>11} "
          f"{'triton/cuda':>11} {'window/W tokens':>15}")
    print(f"{t_win:>12.1f} {t_tr:>14.1f} {t_few:>14.1f} {t_all:>11.1f} {t_tr / t_win:>11.2f} "
          f"{t_win / t_few:>15.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--warps", type=int, nargs="+", default=[8, 12, 16])
    ap.add_argument("--tiles-per-step", type=int, nargs="+", choices=(1, 2), default=[tunables.TILES_PER_STEP_2BIT],
                    help="16-token tiles a warp takes per step of the 2-bit tile loop (swept with --warps; "
                         "4-bit takes one)")
    ap.add_argument("--bits", type=int, nargs="+", choices=(4, 2), default=[4],
                    help="PQ bit widths to time beside SDPA: 4 (M = d/2) and/or 2 (M = d/4)")
    ap.add_argument("--encode-only", action="store_true")
    ap.add_argument("--no-encode", action="store_true")
    ap.add_argument("--flush", choices=("read", "zero"), default="read",
                    help="L2 flush before each rep (bench_attention.FLUSH)")
    ap.add_argument("--shape", type=int, nargs=2, metavar=("B", "L"),
                    help="time this batch and context length only (for a profiler; needs one --warps value)")
    ap.add_argument("--window", type=int, default=0,
                    help="also time a sliding window of this many tokens (time_window)")
    ap.add_argument("--softcap", type=float, default=0.0, help="with --window: soft-cap the scores")
    ap.add_argument("--window-shape", type=int, nargs=2, metavar=("B", "L"), default=(8, 32768))
    ap.add_argument("--heads", type=int, nargs=3, metavar=("HQ", "HKV", "D"), default=(32, 8, 128),
                    help="query heads, KV heads, head_dim (Gemma-style: 4 1 256)")
    args = ap.parse_args()
    ba.HQ, ba.HKV, ba.D = args.heads
    ba.M = ba.D // 2
    if args.shape and (len(args.warps) != 1 or len(args.tiles_per_step) != 1):
        ap.error("--shape needs one --warps and one --tiles-per-step value")
    ba.FLUSH = args.flush
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    rd, _ = ba.read_bandwidth()
    print(f"read bandwidth (sum) {rd:.0f} GB/s")
    one = torch.zeros(1, device="cuda")
    print(f"measurement floor (a 1-element add timed the same way) {ba.bench(lambda: one.add_(1)):.1f} us")
    if args.encode_only:
        encode_info()
        time_encode(rd)
        time_seal(8)
        time_seal(32)
        return 0
    kernel_info()
    if not args.shape:
        for bits in args.bits:
            ba.check_pq(16, DSUB[bits])
    # warps (and tiles per step) sweep at B=8 and B=1, L=32K, for each bit width
    tunables.NUM_WARPS = args.warps[0]
    tunables.TILES_PER_STEP_2BIT = args.tiles_per_step[0]
    if len(args.warps) > 1 or len(args.tiles_per_step) > 1:
        best = {}
        for bits in args.bits:
            for b in (8, 1):
                q = torch.randn(b, ba.HQ, ba.D, device="cuda", dtype=torch.float16)
                case, sl, tl_, nbytes = ba.pq_case(b, 32768, 16, DSUB[bits])
                for nw in args.warps:
                    for tps in args.tiles_per_step:
                        tunables.NUM_WARPS, tunables.TILES_PER_STEP_2BIT = nw, tps
                        t = ba.time_pq(q, case, sl, tl_, 16, backend="cuda")
                        print(f"sweep cuda {bits}-bit B={b} L=32K warps={nw} 2-bit tiles/step={tps}: {t:.1f} us "
                              f"({nbytes / t / 1e3:.0f} GB/s)", flush=True)
                        best[(bits, b, nw, tps)] = t
                del case
        conf = [(nw, tps) for nw in args.warps for tps in args.tiles_per_step]
        tunables.NUM_WARPS, tunables.TILES_PER_STEP_2BIT = min(
            conf, key=lambda c: sum(best[(bits, 8, *c)] + 4 * best[(bits, 1, *c)] for bits in args.bits))
    print(f"2-bit tiles per step used below: {tunables.TILES_PER_STEP_2BIT}")
    print(f"warps used below: {tunables.NUM_WARPS}")
    if not args.no_encode and not args.shape:
        encode_info()
        time_encode(rd)
        time_seal(32)

    def time_cuda(q, case, sl, tl_, reg=False, tma_all=False):
        lim = tunables.TMA_MAX_ITEM_TOKENS
        if tma_all:
            tunables.TMA_MAX_ITEM_TOKENS = 1 << 62
        try:
            return ba.time_pq(q, case, sl, tl_, 16, backend="cuda", image=not reg)
        finally:
            tunables.TMA_MAX_ITEM_TOKENS = lim

    rows = []
    Bs, Ls = ((1, 8), (32768,)) if args.quick else ((1, 8, 32), (4096, 32768, 131072))
    if args.shape:
        Bs, Ls = (args.shape[0],), (args.shape[1],)
    shape_only = bool(args.shape)
    for b in Bs:
        for L in Ls:
            q = torch.randn(b, ba.HQ, ba.D, device="cuda", dtype=torch.float16)
            times = {}
            for bits in args.bits:
                case, sl, tl_, nbytes = ba.pq_case(b, L, 16, DSUB[bits])
                t = dict(cuda=time_cuda(q, case, sl, tl_), nbytes=nbytes)
                if not shape_only:
                    t.update(reg=time_cuda(q, case, sl, tl_, reg=True),
                             tma=time_cuda(q, case, sl, tl_, tma_all=True),
                             triton=ba.time_pq(q, case, sl, tl_, 16, backend="triton"))
                times[bits] = t
                del case
                torch.cuda.empty_cache()
            t_sd, be = ba.time_sdpa(q, L)
            torch.cuda.empty_cache()
            rows.append((b, L, times, t_sd))
            got = {k: {n: round(x, 1) for n, x in v.items() if n != "nbytes"} for k, v in times.items()}
            print(b, L, got, f"sdpa {t_sd:.1f}", flush=True)
    if shape_only:
        return 0
    print(f"\nHq {ba.HQ}, Hkv {ba.HKV}, d {ba.D}; read BW {rd:.0f} GB/s; us, median, CUDA graph, L2 flushed ({args.flush}); warps {tunables.NUM_WARPS}")
    print(f"cuda: bulk copies up to {tunables.TMA_MAX_ITEM_TOKENS} tokens an item, else register staging; "
          f"tma: bulk copies at every size; reg: register staging at every size")
    for bits in args.bits:
        print(f"\n{bits}-bit PQ (M = {ba.D // DSUB[bits]}, dsub {DSUB[bits]})")
        print(f"{'B':>3} {'L':>7} {'cuda':>8} {'tma':>8} {'reg':>8} "
              + f"{'triton':>8} {'SDPA':>8} {'sdpa/cuda':>9} {'sdpa/tma':>8} {'sdpa/reg':>8} "
              + f"{'triton/cuda':>11} {'GB/s':>6} {'%BW':>5}")
        for b, L, times, ts in rows:
            t = times[bits]
            tc, tm, tg, tt = t["cuda"], t["tma"], t["reg"], t["triton"]
            bw = t["nbytes"] / tc / 1e3
            print(f"{b:>3} {L:>7} {tc:>8.1f} {tm:>8.1f} {tg:>8.1f} "
                  + f"{tt:>8.1f} {ts:>8.1f} {ts / tc:>9.2f} {ts / tm:>8.2f} {ts / tg:>8.2f} "
                  + f"{tt / tc:>11.2f} {bw:>6.0f} {100 * bw / rd:>4.0f}%")
    if len(args.bits) == 2:
        print("\n2-bit / 4-bit time (cuda column): "
              + ", ".join(f"B={b} L={L} {times[2]['cuda'] / times[4]['cuda']:.2f}" for b, L, times, _ in rows))
    if args.window:
        time_window(args.window, args.softcap, *args.window_shape)

if __name__ == "__main__":
    sys.exit(main())
