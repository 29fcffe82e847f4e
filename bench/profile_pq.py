"""One PQ decode step (B=8, L=32K) for ncu: python bench/profile_pq.py [tile warps stages ctas]."""
import sys

import torch

from bench_attention import D, HKV, HQ, TBS, pq_case
from kvstore.kernels import decode_attention as da

tile, nw, st, ctas = (int(a) for a in (sys.argv[1:] or [64, 8, 1, 132]))
case, sl, tl_, nbytes = pq_case(8, 32768, 16)
q = torch.randn(8, HQ, D, device="cuda", dtype=torch.float16)
plan = da.plan_pq_decode(sl, tl_, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=16,
                         tail_block_size=TBS, device="cuda", tile_pq=tile, num_warps=nw, num_stages=st,
                         target_ctas=ctas)
for _ in range(3):
    plan.run_pq(q, *case.values(), D ** -0.5)
torch.cuda.synchronize()
print("bytes", nbytes)
try:
    from kvstore.kernels._decode_kernels import _decode_kernel
    for cache in _decode_kernel.device_caches.values():
        for k in cache[0].values():
            print("regs", k.n_regs, "spills", k.n_spills, "smem", k.metadata.shared,
                  "warps", k.metadata.num_warps)
except Exception as e:  # resource report is best effort
    print("no compile info:", e)
