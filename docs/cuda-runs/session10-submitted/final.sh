#!/bin/bash
# Session 10's final run: tests and the standard decode bench with the submitted code.
set -u
out=$1
BENCH_TIMEOUT=280 BENCH_FLAGS="--steps=48 --warmup=16 --variants=base;COLD_GPU_SHARE=auto;QX_REGS=0 --variant-modes=pinfer,gpu" \
  gpu-worker/cuda/device_build_run.sh .device/sdk $out > $out/run.log 2>&1
grep -E "PASSED|FAILED|tests ran|built in" $out/run.log | head
for f in $out/bench_*.log; do grep -E "^bandwidth|^cold rows|^\| |whole model|skew 20%:|skew 40%:|by shape" $f | grep -v "^| dtype\|^|---\|active rows" | cut -c1-300; done
