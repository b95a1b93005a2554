#!/bin/bash
# Session 15 (measurement): session 14's block timestamps (trace.patch) with the second step
# staged by cp.async (stage-second-step.patch) on and off: does the stage delay x?
set -u
out=$1
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=150 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=32 --warmup=8 --bandwidths=0 --variants=TRACE=1;TRACE=1+QX_STAGE=0;TRACE=1;TRACE=1+QX_STAGE=0" \
  timeout 300 gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/bench_*.log; do grep -E "^\| |TRACE" $f | grep -v "^| dtype\|^|---" | cut -c1-170; done
