#!/bin/bash
# Session 25, last call: main as submitted (00fa772) on the H200. The whole service (gateway,
# CUDA gpu-worker, cpu-worker; relu-llama-tiny's 12 reference prompts one by one and all at once,
# 4 streams), then a second sample of the two lanes through device_run.sh (tests skipped: run
# session25-rounds ran them on the same code), three rounds per dtype. Bundles:
# bench/make_service_bundle.sh build /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build
# /tmp/svcb/cudamod; tar -cf - -C /tmp/svcb svc cudamod | xz -9e > .device/svc.tar.xz
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
mkdir -p $out/run/service
THREADS=none TOKENS=128 REPEATS=2 STREAMS=4 OUT=$out/run/service timeout 150 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/run/service.log 2>&1
echo "== service: rc $? at $((SECONDS - start)) s"
grep -E "reference|tokens/s|^\| service" $out/run/service.log | tail -8
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_DTYPES=" " BENCH_TIMEOUT=150 BENCH_FLAGS="--steps=48 --warmup=16" \
  timeout 300 gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out/run/lanes > $out/run/lanes.log 2>&1
echo "== lanes: rc $? at $((SECONDS - start)) s (the tests were cut off on purpose)"
grep -hE "bandwidth after" $out/run/lanes/lanes_*.log
grep -hE "^\| (F16|Q4_0) \| pinfer, 2 lanes \| [0-9]+% \| base" $out/run/lanes/lanes_*.log
tar -czf $out/run.tgz -C $out run && rm -rf $out/run
