#!/bin/bash
# Session 23, last call: the submitted code (7918870: the test additions after
# aed6b33; the module unchanged since 3568a8a): the op and module tests, the default modes of the
# 13B-shape bench (pinfer one sequence, dense layer offload, the whole model on the GPU) in F16
# and Q4_0, and the whole service. Bundle as session23-parts (tar | xz -9e).
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
BENCH_FLAGS="--steps=48 --warmup=16" gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/device_run.log 2>&1
echo "== device_run: rc $? at $((SECONDS - start)) s"
grep -E "^\[  (PASSED|FAILED) |^\| (F16|Q4_0) \||bandwidth after" $out/device_run.log | cut -c1-170
d=$out/service; mkdir -p $d
THREADS=none TOKENS=128 REPEATS=2 STREAMS=4 OUT=$d timeout 110 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/service.log 2>&1
echo "== service: rc $? at $((SECONDS - start)) s"
grep -E "reference|tokens/s|^\| service" $out/service.log | tail -6
tar -czf $out/service_dir.tgz -C $out service && rm -rf $out/service
