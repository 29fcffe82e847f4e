#!/bin/bash
# One device run of the CUDA PQ kernel work: GPU tests, attribution timings / stamps of
# build variants, the bench. Logs go to $OUT (the device tool's folder; /tmp elsewhere).
#
# [ENV=...] bench/device_run.sh [-t TAG] [-T PYTEST_ARGS]... [-c CASES] [-C CASES] [-a VARIANT]...
#                     [-s DEFS]... [-b BENCH_ARGS] [-M BENCH_ARGS] [-n]
#   -t TAG      log tag: test_TAG.log, attrib_time_TAG.log, attrib_stamps_TAG.log,
#               bench_cuda_pq_TAG.log, bench_cuda_pq_TAG_main.log (default: run)
#   -T ARGS     one GPU pytest run: python -m pytest -q -m gpu -x ARGS (repeatable)
#   -c CASES    attribution cases of the timings (default "1x4096 1x32768 8x4096 8x32768")
#   -C CASES    attribution cases of the stamps (default: as -c)
#   -a VARIANT  attrib_cuda_pq.py timings under VARIANT, shell assignments put before the
#               command ("" = as built; "KVSTORE_CUDA_PQ_DEFS='-DPQ_NO_ROT'",
#               "KVSTORE_CUDA_PQ_TAIL_TILES=6", "KVSTORE_CUDA_PQ_WARPS=8"); repeatable
#   -s DEFS     stamps (attrib_cuda_pq.py with -DPQ_STAMPS DEFS), rep 1 printed; repeatable
#   -b ARGS     bench_cuda_pq.py ARGS (e.g. "--no-encode")
#   -M ARGS     bench_cuda_pq.py ARGS in the main tree (../.., the state before the branch)
#   -n          print the GPU's clocks first
# Steps run in the order: clocks, tests, timings, stamps, bench, main-tree bench; a
# failed test run stops the script (nothing else is worth the device time then).
# Variables set before the script (KVSTORE_CUDA_PQ_DEFS=... bench/device_run.sh ...) hold
# for every step; a timing VARIANT overrides them for its step.
set -o pipefail
O=${OUT:-/tmp}
TAG=run CASES="1x4096 1x32768 8x4096 8x32768" SCASES= BENCH= MAIN= CLOCKS=
TESTS=() VARS=() STAMPS=()
while getopts "t:T:c:C:a:s:b:M:n" opt; do
  case $opt in
    t) TAG=$OPTARG ;; T) TESTS+=("$OPTARG") ;; c) CASES=$OPTARG ;; C) SCASES=$OPTARG ;;
    a) VARS+=("$OPTARG") ;; s) STAMPS+=("$OPTARG") ;; b) BENCH=$OPTARG ;; M) MAIN=$OPTARG ;;
    n) CLOCKS=1 ;; *) sed -n '2,23p' "$0"; exit 2 ;;
  esac
done
SCASES=${SCASES:-$CASES}
[ -n "$CLOCKS" ] && nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader
for t in "${TESTS[@]}"; do
  echo "### tests [$t]"
  eval "timeout 400 python -m pytest -q -m gpu -x $t" 2>&1 | tail -15 | tee -a $O/test_$TAG.log || exit 1
done
for v in "${VARS[@]}"; do
  echo "### time [$v]"
  eval "$v timeout 150 python bench/attrib_cuda_pq.py --cases $CASES" 2>&1 | grep -i "time\|error" \
    | sed "s|^|[$v] |" | tee -a $O/attrib_time_$TAG.log
done
for d in "${STAMPS[@]}"; do
  echo "### stamps [$d]"
  KVSTORE_CUDA_PQ_DEFS="-DPQ_STAMPS $d" timeout 150 python bench/attrib_cuda_pq.py --cases $SCASES \
    > $O/stamps.tmp 2>&1
  (echo "### stamps [$d]"; cat $O/stamps.tmp) >> $O/attrib_stamps_$TAG.log
  awk '/^==/{print; p=0} /^rep 0/{p=0} /^rep 1/{p=1} p{print}' $O/stamps.tmp; rm -f $O/stamps.tmp
done
if [ -n "$BENCH" ]; then
  echo "### bench $BENCH"
  timeout 400 python bench/bench_cuda_pq.py $BENCH 2>&1 | grep --line-buffered -v Warn > $O/bench_cuda_pq_$TAG.log
  tail -14 $O/bench_cuda_pq_$TAG.log
fi
if [ -n "$MAIN" ]; then
  echo "### bench (main tree) $MAIN"
  (cd ../.. && PYTHONPATH=/tmp/site:$PWD timeout 300 python bench/bench_cuda_pq.py $MAIN 2>&1 \
    | grep -v Warn > $O/bench_cuda_pq_${TAG}_main.log)
  tail -14 $O/bench_cuda_pq_${TAG}_main.log
fi
