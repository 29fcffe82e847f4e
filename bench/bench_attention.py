"""Decode attention: the fp16 paged kernel and the router's PQ kernel vs torch SDPA flash (fp16).

python bench/bench_attention.py [--quick] [--sweep] [--bs 16 ...]
Hq=32, Hkv=8, d=128, M=64 (dsub 2), PQ tail of 128 fp16 tokens. Every time is a
median over a CUDA graph replay, L2 flushed before each rep (bench(), FLUSH), so
launch gaps are those of a captured decode step. Prints ratios against SDPA
measured in the same run, and bytes/time against a read bandwidth measured in
the same run. --sweep first times Triton configs of both kernels at B=8 (and
B=1 for PQ), L=32K, and uses the fastest. bench_cuda_pq.py uses its helpers.
"""
import argparse
import itertools
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvstore import kernels
from kvstore.kernels import reference
from kvstore.kernels.triton import encode as triton_encode

HQ, HKV, D, M, TAIL, TBS = 32, 8, 128, 64, 128, 16
DEV = "cuda"


# How L2 is flushed before each timed rep. "read": sum a 256 MB buffer, which evicts L2
# but leaves it clean. "zero": triton.testing.do_bench's own flush (cache.zero_()), which
# leaves ~50 MB of dirty lines that the timed kernel then pays to write back (about
# 17 us at 3 TB/s, whatever the kernel): an option, to compare with triton's own timing.
FLUSH = "read"
_flush_buf = {}


def _read_flush():
    buf = _flush_buf.get("x")
    if buf is None:
        buf = _flush_buf["x"] = torch.ones(128 << 20, dtype=torch.float16, device=DEV)
        _flush_buf["acc"] = torch.empty((), dtype=torch.float32, device=DEV)
    torch.sum(buf, dim=0, dtype=torch.float32, out=_flush_buf["acc"])


def bench(fn, graph=True, warmup=25, reps=200):
    """Median time of fn in us over reps, L2 flushed before each (see FLUSH)."""
    fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            fn()
            with torch.cuda.graph(g, stream=s):
                fn()
        torch.cuda.synchronize()
        fn = g.replay
    if FLUSH == "zero":
        return triton.testing.do_bench(fn, warmup=warmup, rep=reps, return_mode="median") * 1e3
    for _ in range(warmup):
        _read_flush()
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for start, end in ev:
        _read_flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return 1e3 * float(torch.tensor([s.elapsed_time(e) for s, e in ev]).median())


def read_bandwidth():
    x = torch.randn(2 << 30 >> 1, device=DEV, dtype=torch.float16)          # 2 GiB
    t_sum = bench(lambda: x.sum(dtype=torch.float32), graph=False)
    y = torch.empty_like(x)
    t_cp = bench(lambda: y.copy_(x), graph=False)
    nbytes = x.numel() * 2
    return nbytes / t_sum / 1e3, 2 * nbytes / t_cp / 1e3                       # GB/s


def pq_case(b, L, bs, dsub=2):
    """B sequences of L tokens (the last TAIL fp16): random codes (M = D / dsub: dsub 2 is
    4-bit PQ, dsub 4 2-bit), tables and codebooks; nbytes: what a decode step reads."""
    m = D // dsub
    ns = (L - TAIL) // bs * bs
    nblk = ns // bs
    kc = torch.randint(0, 256, (b * nblk, HKV, bs, m), dtype=torch.uint8, device=DEV)
    vc = torch.randint(0, 256, (b * nblk, HKV, m, bs), dtype=torch.uint8, device=DEV)
    st = torch.randperm(b * nblk, device=DEV, dtype=torch.int32).view(b, nblk)
    nt = TAIL // TBS
    tk = torch.randn(b * nt, HKV, TBS, D, device=DEV, dtype=torch.float16)
    tv = torch.randn_like(tk)
    tt = torch.randperm(b * nt, device=DEV, dtype=torch.int32).view(b, nt)
    kcb = torch.randn(HKV, m, 256, dsub, device=DEV, dtype=torch.float16)
    vcb = torch.randn_like(kcb)
    nbytes = kc.numel() + vc.numel() + 2 * tk.numel() * 2 + 2 * kcb.numel() * 2
    return dict(k_codes=kc, v_codes=vc, k_codebook=kcb, v_codebook=vcb, sealed_tables=st,
                tail_k=tk, tail_v=tv, tail_tables=tt), [ns] * b, [TAIL] * b, nbytes


def time_pq(q, case, sl, tl_, bs, image=True, starts=(), **cfg):
    """cfg: plan_decode's backend, target_ctas, softcap and Triton tuning. image: pass the
    codebook image (the engine does; the CUDA plan then stages codebooks by bulk copies for
    short items), else the CUDA plan stages them through registers at every size. starts:
    a sliding window's (sealed_starts, tail_starts)."""
    plan = kernels.plan_decode("pq", sl, tl_, *starts, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                               block_size=bs, tail_block_size=TBS, device=DEV, dtype=q.dtype, **cfg)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=DEV)
    c = case
    img = codebook_image(c) if image else None     # what the engine passes
    return bench(lambda: plan.run_pq(q, c["k_codes"], c["v_codes"], c["k_codebook"],
                                     c["v_codebook"], c["sealed_tables"], c["tail_k"],
                                     c["tail_v"], c["tail_tables"], D ** -0.5, out=out, lse=lse,
                                     codebook_image=img))


def codebook_image(case):
    """The case's codebook image as the engine builds it (None where no kernel reads one)."""
    words = kernels.codebook_images(case["k_codebook"][None], case["v_codebook"][None], HQ)
    dsub = case["k_codebook"].shape[-1]
    return None if words is None else kernels.layer_images(words, HQ, dsub)[0]


def time_paged(q, kcache, vcache, tables, lens, bs, **cfg):
    plan = kernels.plan_decode("paged", lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                               block_size=bs, device=DEV, dtype=q.dtype, **cfg)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=DEV)
    return bench(lambda: plan.run_paged(q, kcache, vcache, tables, D ** -0.5, out=out, lse=lse))


def time_sdpa(q, L):
    b = q.shape[0]
    k = torch.randn(b, HKV, L, D, device=DEV, dtype=torch.float16)
    v = torch.randn_like(k)
    q4 = q.view(b, HQ, 1, D)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
        backend = "flash"
    except RuntimeError:
        backend = "default"

    def fn():
        if backend == "flash":
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
        return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
    return bench(fn), backend


def check_pq(bs, dsub=2):
    case, sl, tl_, _ = pq_case(2, 2000, bs, dsub)
    q = torch.randn(2, HQ, D, device=DEV, dtype=torch.float16)
    plan = kernels.plan_decode("pq", sl, tl_, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                               block_size=bs, tail_block_size=TBS, device=DEV, dtype=q.dtype)
    out, lse = plan.run_pq(q, *case.values(), D ** -0.5)
    c64 = {k: (v.cpu().double() if v.is_floating_point() else v.cpu()) for k, v in case.items()}
    out, lse = out.cpu(), lse.cpu()
    ro, rl = reference.pq_decode_attention(
        q.cpu().double(), c64["k_codes"], c64["v_codes"], c64["k_codebook"], c64["v_codebook"],
        c64["sealed_tables"], torch.tensor(sl), c64["tail_k"], c64["tail_v"],
        c64["tail_tables"], torch.tensor(tl_), D ** -0.5)
    err = ((out.double() - ro).norm() / ro.norm()).item()
    print(f"check pq bs={bs} dsub={dsub}: rel err {err:.2e}, lse max err {(lse.double() - rl).abs().max():.2e}")
    assert err < 3e-3


def time_encode():
    n = 32768
    x = torch.randn(n, HKV, D, device=DEV, dtype=torch.float16)
    cb = torch.randn(HKV, M, 256, 2, device=DEV)
    bs = 16
    kc = torch.empty(n // bs, HKV, bs, M, dtype=torch.uint8, device=DEV)
    vc = torch.empty(n // bs, HKV, M, bs, dtype=torch.uint8, device=DEV)
    slots = torch.arange(n, device=DEV)
    res = {}
    for cfg in ({}, dict(tile_n=128), dict(tile_n=32), dict(num_warps=8, tile_n=128)):
        plan = triton_encode.plan_pq_encode(cb, **cfg)
        res[str(cfg)] = bench(lambda: (plan.run(x, slots, k_codes=kc), plan.run(x, slots, v_codes=vc)))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--bs", type=int, nargs="*", default=[16])
    args = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    rd, cp = read_bandwidth()
    print(f"read bandwidth (sum) {rd:.0f} GB/s, copy (read+write) {cp:.0f} GB/s")
    for bs in args.bs:
        check_pq(bs)
    sms = props.multi_processor_count
    pq_cfg, fp_cfg = {}, {}
    if args.sweep:
        for b, L in ((8, 32768), (1, 32768)):
            q = torch.randn(b, HQ, D, device=DEV, dtype=torch.float16)
            case, sl, tl_, nbytes = pq_case(b, L, 16)
            best = None
            for tile, nw, st, ctas in itertools.product((32, 64), (4, 8), (1, 2), (sms, 2 * sms)):
                if True:
                    if True:
                        cfg = dict(tile_pq=tile, num_warps=nw, num_stages=st, target_ctas=ctas)
                        t = time_pq(q, case, sl, tl_, 16, **cfg)
                        print(f"sweep pq B={b} L={L} {cfg}: {t:.1f} us "
                              f"({nbytes / t / 1e3:.0f} GB/s)")
                        best = min(best or (t, cfg), (t, cfg), key=lambda z: z[0])
            print(f"best pq B={b}: {best}")
            pq_cfg.setdefault(b, best[1])
            del case
    if args.sweep:
        b, L, bs = 8, 32768, 16
        q = torch.randn(b, HQ, D, device=DEV, dtype=torch.float16)
        kcache = torch.randn(b * L // bs, HKV, bs, D, device=DEV, dtype=torch.float16)
        vcache = torch.randn_like(kcache)
        tables = torch.randperm(b * L // bs, device=DEV, dtype=torch.int32).view(b, L // bs)
        best = None
        for tile, st, ctas in itertools.product((32, 64), (2, 3), (sms, 2 * sms)):
            cfg = dict(tile=tile, num_stages=st, target_ctas=ctas)
            t = time_paged(q, kcache, vcache, tables, [L] * b, bs, **cfg)
            print(f"sweep fp16 paged B={b} L={L} {cfg}: {t:.1f} us")
            best = min(best or (t, cfg), (t, cfg), key=lambda z: z[0])
        print(f"best fp16 paged: {best}")
        fp_cfg = best[1]
        del kcache, vcache
    print("pq_encode 32K tok x 8 heads x d=128, K+V (us):", time_encode())
    rows = []
    Bs, Ls = ((1, 8), (32768,)) if args.quick else ((1, 8, 32), (4096, 32768, 131072))
    for bs in args.bs:
        for b in Bs:
            for L in Ls:
                q = torch.randn(b, HQ, D, device=DEV, dtype=torch.float16)
                case, sl, tl_, nbytes = pq_case(b, L, bs)
                t_pq = time_pq(q, case, sl, tl_, bs, **pq_cfg.get(b, pq_cfg.get(8, {})))
                del case
                nblk = L // bs
                kcache = torch.randn(b * nblk, HKV, bs, D, device=DEV, dtype=torch.float16)
                vcache = torch.randn_like(kcache)
                tables = torch.randperm(b * nblk, device=DEV, dtype=torch.int32).view(b, nblk)
                t_fp = time_paged(q, kcache, vcache, tables, [L] * b, bs, **fp_cfg)
                fp_bytes = 2 * kcache.numel() * 2
                del kcache, vcache, tables
                t_sd, backend = time_sdpa(q, L)
                torch.cuda.empty_cache()
                rows.append((bs, b, L, t_pq, t_fp, t_sd, backend, nbytes / t_pq / 1e3,
                             fp_bytes / t_fp / 1e3))
                print(rows[-1])
    print(f"\nread BW {rd:.0f} GB/s; times in us (median, CUDA graph, L2 flushed)")
    print(f"{'bs':>3} {'B':>3} {'L':>7} {'PQ':>8} {'fp16pg':>8} {'SDPA':>8} {'sdpa/PQ':>8} "
          f"{'sdpa/fp16':>9} {'PQ GB/s':>8} {'PQ %BW':>7} {'fp16 %BW':>8} backend")
    for bs, b, L, tp, tf, ts, be, bwp, bwf in rows:
        print(f"{bs:>3} {b:>3} {L:>7} {tp:>8.1f} {tf:>8.1f} {ts:>8.1f} {ts / tp:>8.2f} "
              f"{ts / tf:>9.2f} {bwp:>8.0f} {100 * bwp / rd:>6.0f}% {100 * bwf / rd:>7.0f}% {be}")


if __name__ == "__main__":
    sys.exit(main())
