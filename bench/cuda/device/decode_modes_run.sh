#!/bin/bash
# The decode bench's default modes on a GPU machine, as docs/benchmarks.md's issue-5 targets quote
# them: gpu-worker/cuda/device_run.sh (one sequence, dense layer offload and the whole model at
# skews 20% and 40%, then two lanes; three rounds per dtype, F16 and Q4_0) with its tests cut off
# (OPS_TIMEOUT=1 BACKEND_TIMEOUT=1: the CUDA suites run in a call of their own). Prints the
# bandwidths after the modes and the rows of the medians' table; the logs come back packed in
# OUT/run.tgz. Run from the repository root on the device, with the bundle made here by
#
#   gpu-worker/cuda/make_bundle.sh BUILD_DIR /tmp/svcb/cudamod
#   tar -cf - -C /tmp/svcb cudamod | xz -9e > .device/cudamod.tar.xz
#
#   bench/cuda/device/decode_modes_run.sh OUT
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
mkdir -p $out/run
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=200 BENCH_FLAGS="--steps=48 --warmup=16" \
  timeout 540 gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out/run > $out/bench.log 2>&1
echo "== bench: rc $? at $((SECONDS - start)) s (the tests were cut off on purpose)"
grep -hE "bandwidth after" $out/run/*.log
grep -hE "^\| (F16|Q4_0) \| (pinfer|offload|gpu|pinfer, 2 lanes|lanes) \| [-0-9%]+ \| base" $out/run/*.log
tar -czf $out/run.tgz -C $out run && rm -rf $out/run
