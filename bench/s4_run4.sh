#!/bin/bash
# Session 4, device run 4: codebook loads before the item read, tail-balanced items
set -o pipefail
O=${OUT:-/tmp}
echo "### tests"; python -m pytest -q -m gpu tests/test_cuda_pq.py -x 2>&1 | tail -3 | tee $O/test_s4_run4.log
echo "### stamps default"; KVSTORE_CUDA_PQ_DEFS="-DPQ_STAMPS" python bench/attrib_cuda_pq.py --cases 1x4096 1x32768 8x32768 2>&1 > $O/attrib_s4_stamps_run4.log
awk '/^==/{print; p=0} /^rep 0/{p=0} /^rep 1/{p=1} p{print}' $O/attrib_s4_stamps_run4.log
C="1x4096 1x32768 8x4096 8x32768"
for v in "" "-DPQ_STAGE_NB=1"; do
  echo "### time [$v]"; KVSTORE_CUDA_PQ_DEFS="$v" python bench/attrib_cuda_pq.py --cases $C 2>&1 | grep time | tee -a $O/attrib_s4_time_run4.log
done
for t in 0 6; do echo "### time TAIL_TILES=$t"; KVSTORE_CUDA_PQ_TAIL_TILES=$t python bench/attrib_cuda_pq.py --cases $C 2>&1 | grep time | tee -a $O/attrib_s4_time_run4.log; done
