#!/bin/bash
# Session 4, device run 10: tail V loads with the K loads
set -o pipefail
O=${OUT:-/tmp}
echo "### tests"; python -m pytest -q -m gpu tests/test_cuda_pq.py -x 2>&1 | tail -2 | tee $O/test_s4_run10.log
C="1x4096 1x32768 8x4096 8x32768"
for v in "" "-DPQ_TAIL_V_LATE"; do
  echo "### time [$v]"; KVSTORE_CUDA_PQ_DEFS="$v" python bench/attrib_cuda_pq.py --cases $C 2>&1 | grep time | tee -a $O/attrib_s4_time_run10.log
done
echo "### bench (kern)"; timeout 330 python bench/bench_cuda_pq.py --no-encode 2>&1 | grep -v Warn > $O/bench_cuda_pq_s4_run10.log; tail -12 $O/bench_cuda_pq_s4_run10.log
KVSTORE_CUDA_PQ_DEFS="-DPQ_STAMPS" python bench/attrib_cuda_pq.py --cases 1x4096 1x32768 2>&1 > $O/attrib_s4_stamps_run10.log
awk '/^==/{print; p=0} /^rep 0/{p=0} /^rep 1/{p=1} p{print}' $O/attrib_s4_stamps_run10.log | grep "rep 1\|tail"
