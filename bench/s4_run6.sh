#!/bin/bash
# Session 4, device run 6: split-K merge fused into the attention kernel
set -o pipefail
O=${OUT:-/tmp}
echo "### tests"; python -m pytest -q -m gpu tests/test_cuda_pq.py -x 2>&1 | tail -3 | tee $O/test_s4_final.log
echo "### decode tests (gpu)"; timeout 200 python -m pytest -q -m gpu tests/test_triton_kernels.py -x -k "pq or plan or update" 2>&1 | tail -2
C="1x4096 1x32768 8x4096 8x32768"
for f in 1 0; do
  echo "### time FUSE_MERGE=$f"; KVSTORE_CUDA_PQ_FUSE_MERGE=$f python bench/attrib_cuda_pq.py --cases $C 2>&1 | grep time | tee -a $O/attrib_s4_time_run6.log
done
echo "### stamps"; KVSTORE_CUDA_PQ_DEFS="-DPQ_STAMPS" python bench/attrib_cuda_pq.py --cases 1x4096 1x32768 8x32768 2>&1 > $O/attrib_s4_stamps_final.log
echo "### bench (kern)"; timeout 330 python bench/bench_cuda_pq.py --no-encode 2>&1 | grep -v Warn > $O/bench_cuda_pq_s4.log; tail -14 $O/bench_cuda_pq_s4.log
