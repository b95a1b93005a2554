#!/bin/bash
# Session 17, final table: the submitted code (7508bac: GreedyToken, the attention's trigger at its start), bundle as below; the third variant turns the late trigger on.
# Flags as run 27's final.sh. The tests ran in the call before (session17-verify3); here they
# are skipped (timeout 1 s).
# Bundle made on the Debian machine:
#   bench/make_service_bundle.sh build /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod
#   tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=280 BENCH_FLAGS="--steps=48 --warmup=16 --variants=base;COLD_GPU_SHARE=auto;ATTN_LATE_TRIGGER=1 --variant-modes=pinfer,gpu" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/run.log 2>&1
for f in $out/bench_*.log; do grep -E "^bandwidth|^cold rows|^\| |whole model|bandwidth after|skew 20%:|skew 40%:" $f | grep -v "^| dtype\|^|---\|active rows" | cut -c1-300; done
