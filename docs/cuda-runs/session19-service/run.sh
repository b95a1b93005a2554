#!/bin/bash
# Session 19: the gpu-worker with decode lanes (--decode-lanes 2, the default): the whole service
# on relu-llama-tiny's 12 reference prompts, one after another and all at once (the concurrent
# check puts decode steps on the second lane; the run fails unless some did), then the decode
# bench's table with lanes beside one sequence and dense layer offload, F16 and Q4_0 (tests ran
# in session19-lanes on the same module; skipped here, timeout 1 s). Bundle made on the Debian
# machine:
#   bench/make_service_bundle.sh build /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod
#   tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
THREADS=none TOKENS=64 REPEATS=1 GPU_FLAGS="" OUT=/tmp/service bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/service.log 2>&1
echo "service rc $?"; grep -E "prompts match|reference check|lanes|concurrent streams|1 stream" $out/service.log
tar -czf $out/service.tar.gz -C /tmp service
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=280 BENCH_FLAGS="--modes=pinfer,lanes,offload --variant-modes=pinfer,lanes --steps=48 --warmup=16 --variants=base;COLD_GPU_SHARE=auto" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/run.log 2>&1
for f in $out/bench_*.log; do grep -E "^bandwidth|^\| |skew 20%:|skew 40%:" $f | grep -v "^| dtype\|^|---\|active rows" | cut -c1-300; done
