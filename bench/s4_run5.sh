#!/bin/bash
# Session 4, device run 5: staging batch 1 early; final bench (new tree) and the main tree's
set -o pipefail
O=${OUT:-/tmp}
echo "### tests"; python -m pytest -q -m gpu tests/test_cuda_pq.py -x 2>&1 | tail -3 | tee $O/test_s4_final.log
C="1x4096 1x32768 8x4096 8x32768"
for v in "" "-DPQ_STAGE_LATE"; do
  echo "### time [$v]"; KVSTORE_CUDA_PQ_DEFS="$v" python bench/attrib_cuda_pq.py --cases $C 2>&1 | grep time | tee -a $O/attrib_s4_time_run5.log
done
echo "### bench (kern)"; timeout 330 python bench/bench_cuda_pq.py --no-encode 2>&1 | grep -v Warn > $O/bench_cuda_pq_s4.log; tail -14 $O/bench_cuda_pq_s4.log
echo "### bench (main, before)"; (cd ../.. && PYTHONPATH=/tmp/site:$PWD timeout 150 python bench/bench_cuda_pq.py --no-encode --warps 12 2>&1 | grep -v Warn > $O/bench_cuda_pq_s4_main_before.log); tail -14 $O/bench_cuda_pq_s4_main_before.log
