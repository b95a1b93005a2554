#!/bin/bash
# (This folder: the first attempt, on a host whose CPU memory was disturbed throughout: the cold
# rows line measured 15-39 GB/s against 80-125 in the other calls. session29-final ran it again.)
# Session 29, last call: the submitted code's default modes on the H200,
# `gpu-worker/cuda/device_run.sh` (one sequence, dense layer offload and the whole model at both
# skews, then two lanes; three rounds per dtype), with its tests cut off on purpose:
# session29-tiers ran them, and the whole service, on the same module. Bundle:
# gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod (tar -cf - -C /tmp/svcb cudamod | xz -9e).
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
