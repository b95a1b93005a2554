#!/bin/bash
# Session 26, last call: main as submitted (f484db7) on the H200. The whole service (gateway,
# CUDA gpu-worker, cpu-worker; relu-llama-tiny's 12 reference prompts one by one and all at once,
# 4 streams), then device_run.sh's default modes and two lanes, three rounds per dtype (tests
# skipped: session26-tests ran them on the same module code). Bundles:
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
left=$(( 570 - (SECONDS - start) ))
OPS_TIMEOUT=1 BACKEND_TIMEOUT=1 BENCH_TIMEOUT=200 BENCH_FLAGS="--steps=48 --warmup=16" \
  timeout $left gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out/run/bench > $out/run/bench.log 2>&1
echo "== bench: rc $? at $((SECONDS - start)) s (the tests were cut off on purpose)"
grep -hE "bandwidth after" $out/run/bench/*.log
grep -hE "^\| (F16|Q4_0) \| (pinfer|offload|gpu|pinfer, 2 lanes) \| [-0-9%]+ \| base" $out/run/bench/*.log
tar -czf $out/run.tgz -C $out run && rm -rf $out/run
