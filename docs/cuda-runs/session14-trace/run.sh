#!/bin/bash
# Session 14 (measurement patch): block timestamps of the dense Q4_0 decode layer's kernels.
set -u
out=$1
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=200 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=32 --warmup=8 --bandwidths=0 --variants=base;TRACE=1" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/bench_*.log; do grep -E "^\| |TRACE" $f | grep -v "^| dtype\|^|---" | cut -c1-160; done
grep -h TRACE $out/*.log | head -20
