"""PQ decode config sweep at B=8 and B=1, L=32K: python bench/sweep_pq.py"""
import itertools

import torch

from bench_attention import D, HQ, pq_case, time_pq

sms = torch.cuda.get_device_properties(0).multi_processor_count
for b in (8, 1):
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.float16)
    case, sl, tl_, nbytes = pq_case(b, 32768, 16)
    for tile, nw, reg, mult in itertools.product((32, 64, 128), (4,), (None, 128, 96), (2, 4, 8)):
        cfg = dict(tile_pq=tile, num_warps=nw, maxnreg=reg, target_ctas=mult * sms, num_stages=1)
        try:
            t = time_pq(q, case, sl, tl_, 16, **cfg)
        except Exception as e:  # e.g. out of resources
            print(f"B={b} {cfg}: failed {type(e).__name__}")
            continue
        print(f"B={b} {cfg}: {t:.1f} us {nbytes / t / 1e3:.0f} GB/s")
