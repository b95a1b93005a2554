#!/bin/bash
# Session 19: two lanes (Backend::NewLane: a second backend over the same weights and KV cache)
# decoding two sequences at once, against one sequence on the same backend, both skews, F16 and
# Q4_0, base and with the GPU's cold share (auto); first the op and backend tests (the backend
# test's LanesRunTwoSequencesAtOnce is new). Bundle made on the Debian machine:
#   gpu-worker/cuda/make_bundle.sh build /tmp/cb/cudamod; tar -cJf .device/cudamod.tar.xz -C /tmp/cb cudamod
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
BENCH_TIMEOUT=280 BENCH_FLAGS="--modes=pinfer,lanes --steps=48 --warmup=16 --variants=base;COLD_GPU_SHARE=auto" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/run.log 2>&1
grep -E "PASSED|FAILED|tests ran" $out/run.log | head
grep -E "Failure|Expected|Which is" $out/cuda_ops_test.log $out/cuda_backend_test.log | head -8
for f in $out/bench_*.log; do grep -E "^bandwidth|^\| |skew 20%:|skew 40%:" $f | grep -v "^| dtype\|^|---\|active rows" | cut -c1-300; done
