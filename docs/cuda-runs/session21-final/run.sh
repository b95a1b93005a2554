#!/bin/bash
# Session 21, last call: the submitted code (4829ccb; the module unchanged since session 19):
# cuda_ops_test and cuda_backend_test, then the 13B shape's default modes once per dtype.
# Bundles: bench/make_service_bundle.sh build /tmp/svcb/svc;
# gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod; tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
BENCH_TIMEOUT=150 BENCH_FLAGS="--steps=48 --warmup=16" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod /tmp/dr > /tmp/dr-run.log 2>&1
echo "device_run rc $?"
cp /tmp/dr/cuda_ops_test.log /tmp/dr/cuda_backend_test.log /tmp/dr/bench_F16.log /tmp/dr/bench_Q4_0.log $out/
grep -hE "^\[  (PASSED|FAILED) |tests ran" $out/cuda_*_test.log
for f in $out/bench_*.log; do grep -E "^\| |^bandwidth|whole model" $f | cut -c1-200; done
