#!/bin/bash
# Session 14: the attention's norm, RoPE and cache write inside the q/k/v product in layers whose
# FFN the GPU and the cold side share: op and
# backend tests built here and the Q4_0 pinfer rows alternating with ROPE_IN_PRODUCT=0.
set -u
out=$1
BENCH_TIMEOUT=300 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=pinfer --variant-modes=pinfer --steps=32 --warmup=8 --bandwidths=0 --variants=base;ROPE_IN_PRODUCT=0;base;ROPE_IN_PRODUCT=0" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
echo "rc $?"
grep -E "built in" $out/run.log
for f in $out/cuda_ops_test.log $out/cuda_backend_test.log; do grep -E "PASSED|FAILED|Failure" $f | head; done
cat $out/cuda_ops_test.log $out/cuda_backend_test.log | grep -E "(ResidualRmsNorm|QuantizedModelStep|HotColdSplit).*(OK|FAILED)|Failure|Expected|Which is|nmse" | head -20
for f in $out/bench_*.log; do grep -E "^\| |per token cold" $f | grep -v "^| dtype\|^|---" | cut -c1-200; done
