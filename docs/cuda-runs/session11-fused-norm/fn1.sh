#!/bin/bash
set -u
out=$1
BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=48 --warmup=8 --variants=base;FUSED_NORM=0;FUSED_NORM=1;FUSED_NORM=0" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/cuda_ops_test.log $out/cuda_backend_test.log; do grep -E "PASSED|FAILED|Failure|error" $f | head -20; done
grep -E "nmse FusedNorm" $out/cuda_ops_test.log | sort -k3 -g | tail -2
grep -E "worst step" $out/cuda_backend_test.log
for f in $out/bench_*.log; do grep -E "^bandwidth|^\| |whole model|by shape" $f | grep -v "^| dtype\|^|---" | cut -c1-330; done
