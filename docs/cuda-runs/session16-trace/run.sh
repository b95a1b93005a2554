#!/bin/bash
# Session 16 (measurement patch, session14-trace/trace.patch on 7af684c): block timestamps of the dense Q4_0 decode layer, the late blocks of the q/k/v product loading x first (the rule) against not (LATE_X_FIRST=0).
set -u
out=$1
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=200 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=32 --warmup=8 --bandwidths=0 --variants=TRACE=1;TRACE=1+LATE_X_FIRST=0;TRACE=1;TRACE=1+LATE_X_FIRST=0" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/bench_*.log; do grep -E "^\| |TRACE" $f | grep -v "^| dtype\|^|---" | cut -c1-160; done
grep -h TRACE $out/*.log | head -40
