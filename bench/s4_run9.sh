#!/bin/bash
# Session 4, device run 9: stamps of the final state
O=${OUT:-/tmp}
KVSTORE_CUDA_PQ_DEFS="-DPQ_STAMPS" python bench/attrib_cuda_pq.py --cases 1x4096 1x32768 8x32768 2>&1 > $O/attrib_s4_stamps_after.log
awk '/^==/{print; p=0} /^rep 0/{p=0} /^rep 1/{p=1} p{print}' $O/attrib_s4_stamps_after.log
