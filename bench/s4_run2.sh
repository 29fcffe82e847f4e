#!/bin/bash
# Session 4, device run 2: GPU tests, stamps and timings of the staging / tail / merge changes
set -o pipefail
O=${OUT:-/tmp}
echo "### tests"; python -m pytest -q -m gpu tests/test_cuda_pq.py -x 2>&1 | tail -5 | tee $O/test_s4_run2.log
echo "### stamps default"; KVSTORE_CUDA_PQ_DEFS="-DPQ_STAMPS" python bench/attrib_cuda_pq.py --cases 1x4096 1x32768 8x32768 2>&1 > $O/attrib_s4_stamps_run2.log
awk '/^==/{print; p=0} /^rep 0/{p=0} /^rep 1/{p=1} p{print}' $O/attrib_s4_stamps_run2.log
C="1x4096 1x32768 8x4096 8x32768"
for v in "-DPQ_STAGE_ASYNC -DPQ_NO_TAIL_PREFETCH" "-DPQ_NO_TAIL_PREFETCH" "" "-DPQ_STAGE_NB=3" "-DPQ_STAGE_NB=1"; do
  echo "### time [$v]"; KVSTORE_CUDA_PQ_DEFS="$v" python bench/attrib_cuda_pq.py --cases $C 2>&1 | grep time | tee -a $O/attrib_s4_time_run2.log
done
