#!/bin/bash
# Session 25, third call: device_run.sh as it now stands (three rounds per bench process, each
# ending with the medians over its rounds): op and module tests, the default modes of the
# 13B-shape bench in F16 and Q4_0, then two lanes per dtype. Bundle: cudamod only
# (gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod; tar -cf - -C /tmp/svcb cudamod | xz -9e
# > .device/svc.tar.xz). Outputs packed so that they come back.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
mkdir -p $out/run
BENCH_TIMEOUT=170 BENCH_FLAGS="--steps=48 --warmup=16" timeout 540 gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out/run > $out/device_run.log 2>&1
echo "== device_run: rc $? at $((SECONDS - start)) s"
grep -E "^\[  (PASSED|FAILED) |bandwidth after|^Over the rounds" $out/device_run.log | cut -c1-170
sed -n '/^Over the rounds/,$p' $out/run/bench_*.log $out/run/lanes_*.log | grep -E "^\| (F16|Q4_0)"
tar -czf $out/run.tgz -C $out run && rm -rf $out/run
