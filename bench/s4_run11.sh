#!/bin/bash
# Session 4, device run 11: codebook tables shared by block pairs through DSMEM (PQ_CLUSTER)
set -o pipefail
O=${OUT:-/tmp}
C="1x4096 1x32768 8x4096 8x32768"
echo "### time cluster"; KVSTORE_CUDA_PQ_DEFS="-DPQ_CLUSTER" timeout 90 python bench/attrib_cuda_pq.py --cases $C 2>&1 | grep -i "time\|error" | tee -a $O/attrib_s4_time_run11.log
echo "### time default"; timeout 90 python bench/attrib_cuda_pq.py --cases $C 2>&1 | grep time | tee -a $O/attrib_s4_time_run11.log
echo "### tests cluster"; KVSTORE_CUDA_PQ_DEFS="-DPQ_CLUSTER" timeout 120 python -m pytest -q -m gpu tests/test_cuda_pq.py -x 2>&1 | tail -2 | tee $O/test_s4_run11_cluster.log
echo "### bench cluster"; KVSTORE_CUDA_PQ_DEFS="-DPQ_CLUSTER" timeout 200 python bench/bench_cuda_pq.py --no-encode --warps 12 2>&1 | grep -v Warn > $O/bench_cuda_pq_s4_run11_cluster.log; tail -11 $O/bench_cuda_pq_s4_run11_cluster.log
