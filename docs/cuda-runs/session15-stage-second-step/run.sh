#!/bin/bash
# Session 15: a norm product's second step copied into shared memory (cp.async) while the norm
# runs (QX_STAGE, default on in the patch) against loaded into registers after the first step
# (QX_STAGE=0); the op tests first.
set -u
out=$1
V="base;QX_STAGE=0;base;QX_STAGE=0"
OPS_TIMEOUT=90 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=200 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=32 --warmup=8 --bandwidths=0 --variants=$V" \
  timeout 400 gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
grep -E "PASSED|FAILED" $out/cuda_ops_test.log | head
grep -E "Failure|Which is|error" -A3 $out/cuda_ops_test.log | head -20
for f in $out/bench_*.log; do grep -E "^\| " $f | grep -v "^| dtype\|^|---" | cut -c1-110; done
