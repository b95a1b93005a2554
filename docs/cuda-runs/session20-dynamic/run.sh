#!/bin/bash
# Session 20, third call: the cold side now runs the cpu-worker's own op (SparseFfnToken: chunks
# of a few neurons taken by spinning threads as they come free, per-chunk partials) instead of
# the bench's equal shares. The 13B shape, one sequence and two lanes (and dense offload and the
# whole model on the GPU once), base (the op) against COLD_DEAL=static (equal shares, runs 1-33), one
# process per dtype. Bundle (the cudamod of session20-service/run.sh's svc.tar.xz):
#   gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=280 \
  BENCH_FLAGS="--modes=pinfer,lanes,offload,gpu --variant-modes=pinfer,lanes --steps=48 --warmup=16 --variants=base;COLD_DEAL=static" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod /tmp/dr > /tmp/dr-run.log 2>&1
echo "device_run rc $?"
cp /tmp/dr/bench_F16.log /tmp/dr/bench_Q4_0.log $out/
for f in $out/bench_*.log; do grep -E "^\| |per token cold|^bandwidth|^cold rows" $f | cut -c1-300; done
