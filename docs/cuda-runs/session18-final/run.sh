#!/bin/bash
# Session 18, final table: the submitted code (7b40f8d: greedy requests picked on the GPU), run
# 27's flags; the variants are the GPU's cold share (auto) and the pick on the host (PICK=host,
# the path before 7b40f8d). Then the whole service on relu-llama-tiny's 12 reference prompts
# (tests ran in session18-pick on the same code; here they are skipped, timeout 1 s).
# Bundle made on the Debian machine:
#   bench/make_service_bundle.sh build /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod
#   tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=280 BENCH_FLAGS="--steps=48 --warmup=16 --variants=base;COLD_GPU_SHARE=auto;PICK=host --variant-modes=pinfer,gpu" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/run.log 2>&1
for f in $out/bench_*.log; do grep -E "^bandwidth|^cold rows|^\| |whole model|bandwidth after|skew 20%:|skew 40%:" $f | grep -v "^| dtype\|^|---\|active rows" | cut -c1-300; done
THREADS=none TOKENS=64 REPEATS=1 GPU_FLAGS="" OUT=/tmp/service bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/service.log 2>&1
echo "service rc $?"; grep -E "prompts match|reference check" $out/service.log
tar -czf $out/service.tar.gz -C /tmp service
