#!/bin/bash
# Session 4, device run 3: tail tiles through the ring, prologue block ids at once
set -o pipefail
O=${OUT:-/tmp}
echo "### tests"; python -m pytest -q -m gpu tests/test_cuda_pq.py -x 2>&1 | tail -3 | tee $O/test_s4_run3.log
echo "### stamps default"; KVSTORE_CUDA_PQ_DEFS="-DPQ_STAMPS" python bench/attrib_cuda_pq.py --cases 1x4096 1x32768 8x32768 2>&1 > $O/attrib_s4_stamps_run3.log
awk '/^==/{print; p=0} /^rep 0/{p=0} /^rep 1/{p=1} p{print}' $O/attrib_s4_stamps_run3.log
C="1x4096 1x32768 8x4096 8x32768"
for v in "" "-DPQ_NO_TAIL_RING" "-DPQ_NO_TAIL_PREFETCH"; do
  echo "### time [$v]"; KVSTORE_CUDA_PQ_DEFS="$v" python bench/attrib_cuda_pq.py --cases $C 2>&1 | grep time | tee -a $O/attrib_s4_time_run3.log
done
for w in 8 16; do echo "### time warps $w"; python bench/attrib_cuda_pq.py --warps $w --cases 1x32768 8x32768 2>&1 | grep time | tee -a $O/attrib_s4_time_run3.log; done
