#!/bin/bash
# One device call of the AppendAttend-overhead work (bench/NOTES-rpc.md): the GPU
# tests the daemon's CUDA path runs through, an interleaved bench_rpc --compare
# against BASE, and profile_rpc's doorbell breakdowns. Logs go to $OUT.
#
#   bench/device_rpc.sh TAG BASE_DIR
#
# Each step has its own timeout so that one call stays under the device tool's
# limit (~300 s in all); a failed or cut step does not stop the next.
O=${OUT:-/tmp} TAG=${1:?tag} BASE=${2:?base checkout}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee $O/env_$TAG.log
echo "### tests" | tee $O/test_gpu_$TAG.log
timeout 100 python -m pytest -q -m gpu --durations=6 tests/test_decode_graphs.py \
  "tests/test_gpu_dataplane.py::test_two_workers_remote_and_mapped_agree_with_reference[pq]" \
  tests/test_doorbell_gpu.py 2>&1 \
  | tail -25 | tee -a $O/test_gpu_$TAG.log
echo "rc=${PIPESTATUS[0]}" | tee -a $O/test_gpu_$TAG.log
echo "### bench_rpc" | tee $O/bench_rpc_gpu_$TAG.log
timeout 105 python bench/bench_rpc.py --device cuda --rounds 2 --calls 200 \
  --only pq/cuda/bell,pq/cuda/bell+views,pq/cuda/bell+views+hostwait,fp16/cuda/bell --compare "$BASE" 2>&1 | tee -a $O/bench_rpc_gpu_$TAG.log | tail -12
echo "rc=${PIPESTATUS[0]}" | tee -a $O/bench_rpc_gpu_$TAG.log
for mode in "" "--host-wait"; do
  echo "### profile_rpc --bell --views --stages $mode" | tee -a $O/profile_rpc_gpu_$TAG.log
  timeout 25 python bench/profile_rpc.py --device cuda --transport cuda --codec pq --bell --views --stages \
    --calls 1000 $mode 2>&1 | tail -40 | tee -a $O/profile_rpc_gpu_$TAG.log | head -8
done
