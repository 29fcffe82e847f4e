#!/bin/bash
# ncu counters of the CUDA PQ attention (issue 3's "what limits it"): one launch of
# pq_attn per case (the third: codebook image cached, kernels warm), logs to $OUT.
#
#   bench/device_ncu.sh TAG "B L [ENV=...]" ...     e.g. bench/device_ncu.sh s7 "1 32768" "64 32768"
#
# Sections: speed of light, memory tables, occupancy, scheduler, warp state, instruction
# and launch statistics; plus the stall reasons per issued instruction and the shared-load
# bank conflicts as raw metrics (the CLI prints no stall breakdown for the section).
O=${OUT:-/tmp} TAG=${1:?tag}; shift
M=smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
for s in math_pipe_throttle wait short_scoreboard not_selected barrier mio_throttle lg_throttle \
         dispatch_stall selected no_instruction branch_resolving sleeping membar; do
  M=$M,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio
done
M=$M,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum
M=$M,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed.sum
for c in "$@"; do
  set -- $c
  b=$1 l=$2; shift 2
  f=$O/ncu_${TAG}_b${b}_l${l}${1:+_${1//[^A-Za-z0-9]/}}.txt
  echo "### ncu B=$b L=$l $*" | tee "$f"
  env "$@" timeout 150 ncu --clock-control none -k regex:pq_attn --launch-skip 2 -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section Occupancy \
    --section SchedulerStats --section WarpStateStats --section InstructionStats \
    --section LaunchStats --metrics "$M" python bench/profile_cuda_pq.py "$b" "$l" 12 >> "$f" 2>&1
  echo "rc=$?" >> "$f"
  grep -E "Duration|DRAM Throughput|Issue Slots Busy|No Eligible|Achieved Occupancy|Grid Size|stalled_(long|math|wait|short|not_sel|mio|barrier)|bank_conflicts|wavefronts_mem_shared|hmma|inst_executed.sum" "$f"
done
