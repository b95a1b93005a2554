#!/bin/bash
# Session 22, last call: the submitted code (12276ea: the module unchanged since session 19, the
# cold op as at 9576425 after the one-loop experiment's revert): cuda_ops_test and cuda_backend_test, the 13B shape's default
# modes once per dtype, then the whole service (its cpu-worker runs the op) on relu-llama-tiny.
# Bundles: bench/make_service_bundle.sh build /tmp/svcb/svc;
# gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod; tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
BENCH_TIMEOUT=150 BENCH_FLAGS="--steps=48 --warmup=16" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod /tmp/dr > /tmp/dr-run.log 2>&1
echo "device_run rc $? at $((SECONDS - start)) s"
cp /tmp/dr/cuda_ops_test.log /tmp/dr/cuda_backend_test.log /tmp/dr/bench_F16.log /tmp/dr/bench_Q4_0.log $out/
grep -hE "^\[  (PASSED|FAILED) |tests ran" $out/cuda_*_test.log
for f in $out/bench_*.log; do grep -E "^\| |^bandwidth|whole model" $f | cut -c1-200; done
pkill -9 -f pinfer- 2>/dev/null
if (( SECONDS - start < 450 )); then
  d=/tmp/svc-$RANDOM
  THREADS=none TOKENS=128 REPEATS=2 STREAMS=4 OUT=$d timeout 120 \
    bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $d.log 2>&1
  echo "== service: rc $? at $((SECONDS - start)) s"
  grep -E "prompts match|check|concurrent streams|1 stream|did not stop" $d.log
  cp $d.log $out/service.log
  pkill -9 -f pinfer- 2>/dev/null
else
  echo "service skipped: time"
fi
