#!/bin/bash
# Session 13's final run: with the bundle built on the Debian machine (make_bundle.sh; the same
# steps as device_build_run.sh after its build), the op and backend tests and the standard decode
# bench, then the whole service with the CUDA gpu-worker on relu-llama-tiny's 12 reference
# prompts. .device/svc.tar.xz was made on the Debian machine with
#   bench/make_service_bundle.sh build /tmp/svcb/svc
#   gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod
#   tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
BENCH_TIMEOUT=280 BENCH_FLAGS="--steps=48 --warmup=16 --variants=base;COLD_GPU_SHARE=auto;FUSED_NORM=0+ROPE_IN_PRODUCT=0+ACT_IN_PRODUCT=0 --variant-modes=pinfer,gpu" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/run.log 2>&1
grep -E "PASSED|FAILED|tests ran" $out/run.log | head
for f in $out/bench_*.log; do grep -E "^bandwidth|^cold rows|^\| |whole model|skew 20%:|skew 40%:|by shape" $f | grep -v "^| dtype\|^|---\|active rows" | cut -c1-300; done
THREADS=none TOKENS=64 REPEATS=1 GPU_FLAGS="" OUT=$out/service bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/service.log 2>&1
echo "service rc $?"; tail -4 $out/service.log
