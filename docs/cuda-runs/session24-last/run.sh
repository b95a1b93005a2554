#!/bin/bash
# Session 24, last call: main as submitted (0eba39e; the binaries as session24-final's, comments
# aside) through device_run.sh as it now stands: op and module tests, the default modes of the
# 13B-shape bench in F16 and Q4_0, then two lanes per dtype in a process of their own; then the
# whole service. Outputs packed so that they come back (a call returns at most eight files).
# Bundles: bench/make_service_bundle.sh build /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build
# /tmp/svcb/cudamod; tar -cf - -C /tmp/svcb svc cudamod | xz -9e > .device/svc.tar.xz
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
mkdir -p $out/run
BENCH_FLAGS="--steps=48 --warmup=16" gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out/run > $out/device_run.log 2>&1
echo "== device_run: rc $? at $((SECONDS - start)) s"
grep -E "^\[  (PASSED|FAILED) |^\| (F16|Q4_0) \||bandwidth after" $out/device_run.log | cut -c1-170
d=$out/run/service; mkdir -p $d
THREADS=none TOKENS=128 REPEATS=2 STREAMS=4 OUT=$d timeout 110 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/run/service.log 2>&1
echo "== service: rc $? at $((SECONDS - start)) s"
grep -E "reference|tokens/s|^\| service" $out/run/service.log | tail -6
tar -czf $out/run.tgz -C $out run && rm -rf $out/run
