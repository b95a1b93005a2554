#!/bin/bash
set -u
out=$1
BACKEND_TIMEOUT=1 BENCH_TIMEOUT=400 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=pinfer,gpu --variant-modes=pinfer,gpu --steps=48 --warmup=8 --variants=base;QX_PREFETCH=0;QX_PREFETCH=2;QX_PREFETCH=1;QX_PREFETCH=0" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
grep -E "PASSED|FAILED|Failure" $out/cuda_ops_test.log | head
for f in $out/bench_*.log; do grep -E "^bandwidth|by shape|^\| |whole model|GPU busy" $f | grep -v "^| dtype\|^|---" | cut -c1-250; done
