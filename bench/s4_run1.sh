#!/bin/bash
# Session 4, device run 1: attribution (stamps) + timings, baseline vs PQ_STAGE_REG
set -o pipefail
O=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader
echo "### stamps baseline"; KVSTORE_CUDA_PQ_DEFS="-DPQ_STAMPS" python bench/attrib_cuda_pq.py 2>&1 | tee $O/attrib_s4_stamps_base.log
echo "### stamps stage_reg"; KVSTORE_CUDA_PQ_DEFS="-DPQ_STAMPS -DPQ_STAGE_REG" python bench/attrib_cuda_pq.py 2>&1 | tee $O/attrib_s4_stamps_reg.log
echo "### time baseline"; python bench/attrib_cuda_pq.py --cases 1x4096 1x32768 8x4096 8x32768 2>&1 | tee $O/attrib_s4_time_base.log
echo "### time stage_reg"; KVSTORE_CUDA_PQ_DEFS="-DPQ_STAGE_REG" python bench/attrib_cuda_pq.py --cases 1x4096 1x32768 8x4096 8x32768 2>&1 | tee $O/attrib_s4_time_reg.log
