#!/bin/bash
# Session 14: the submitted code (be06a9b, unchanged this session) on the H200: the bundle's op and
# backend tests, a short whole-Q4_0-model bench against session
# 12's code path, and the whole service on relu-llama-tiny's 12 reference prompts. Bundle made as
# in final.sh.
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
BENCH_TIMEOUT=200 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=48 --warmup=16 --variants=base;FUSED_NORM=0+ROPE_IN_PRODUCT=0+ACT_IN_PRODUCT=0;base" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/run.log 2>&1
grep -E "PASSED|FAILED|tests ran" $out/run.log | head
grep -E "Failure|Expected|Which is|: q|cache" $out/cuda_ops_test.log | head -8
for f in $out/bench_*.log; do grep -E "^\| |whole model" $f | grep -v "^| dtype\|^|---" | cut -c1-200; done
THREADS=none TOKENS=64 REPEATS=1 GPU_FLAGS="" OUT=$out/service bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/service.log 2>&1
echo "service rc $?"; grep -E "prompts match|reference check" $out/service.log
