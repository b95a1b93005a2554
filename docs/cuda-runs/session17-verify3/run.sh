#!/bin/bash
# Session 17, last call: the same on a bundle of the commit after 10d3017 (the attention's trigger back at its start by default; the A/B turns the late trigger on).
# Written in session 16, not run (the H200 time ran out): the code with the attention's late trigger as default (5df0e5d) on the H200 as the product ships it: the bundle's op and
# backend tests, a whole-Q4_0-model A/B of the late trigger, and the whole service
# on relu-llama-tiny's 12 reference prompts. Bundle made on the Debian machine:
#   bench/make_service_bundle.sh build /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod
#   tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
BENCH_TIMEOUT=200 BENCH_DTYPES="Q4_0" BENCH_FLAGS="--modes=gpu --variant-modes=gpu --steps=48 --warmup=16 --variants=base;ATTN_LATE_TRIGGER=1;base;ATTN_LATE_TRIGGER=1" \
  gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/run.log 2>&1
grep -E "PASSED|FAILED|tests ran" $out/run.log | head
grep -E "Failure|Expected|Which is" $out/cuda_ops_test.log | head -8
for f in $out/bench_*.log; do grep -E "^\| |whole model|bandwidth:" $f | grep -v "^| dtype\|^|---" | cut -c1-200; done
THREADS=none TOKENS=64 REPEATS=1 GPU_FLAGS="" OUT=$out/service bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/service.log 2>&1
echo "service rc $?"; grep -E "prompts match|reference check" $out/service.log
