"""One CUDA PQ decode step for ncu: python bench/profile_cuda_pq.py B L [warps].

ncu --clock-control none -k regex:pq_attn -c 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis_Tables --section Occupancy --section WarpStateStats \
    python bench/profile_cuda_pq.py 8 32768
Same case as bench_cuda_pq.py (Hq 32, Hkv 8, d 128, M 64, bs 16, tail 128)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import D, HKV, HQ, TBS, pq_case  # noqa: E402

from kvstore.kernels import cuda_pq  # noqa: E402
from kvstore.kernels import decode_attention as da  # noqa: E402

b, L = int(sys.argv[1]), int(sys.argv[2])
if len(sys.argv) > 3:
    cuda_pq.NUM_WARPS = int(sys.argv[3])
case, sl, tl_, nbytes = pq_case(b, L, 16)
q = torch.randn(b, HQ, D, device="cuda", dtype=torch.float16)
plan = da.plan_pq_decode(sl, tl_, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=16,
                         tail_block_size=TBS, device="cuda", backend="cuda")
for _ in range(3):
    plan.run_pq(q, *case.values(), D ** -0.5)
torch.cuda.synchronize()
print(f"B={b} L={L}: {plan.items.shape[0]} items x {HKV} heads, bytes {nbytes}")
