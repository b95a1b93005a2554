#!/bin/bash
# Session 29, fourth call: where the loads' extra 0.3-0.6 ms a token between x published and the
# cold signal comes from. session29-stop found it whatever the stop's granularity. Here the loads'
# parts run without loading anything (COLD_AHEAD_HINT=-1: part 0 polls x_ready with
# cudaEventQuery until x is published, the pool joins, then the callback), against no loads and
# the real loads. One F16 sequence at skew 20%. Bundle: gpu-worker/cuda/make_bundle.sh build
# /tmp/svcb/cudamod.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
f="COLD_AHEAD=1+COLD_AHEAD_PIN=1"
LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 450 $bin/cuda_decode_bench --dtype=F16 --modes=pinfer \
  --variant-modes=pinfer --rounds=5 --skews=0.2 --steps=48 --warmup=16 \
  --variants="base;$f+COLD_AHEAD_HINT=-1;$f+COLD_AHEAD_HINT=3;COLD_AHEAD_PIN=1" \
  > $out/bench_F16.log 2>&1
echo "== bench F16: rc $? at $((SECONDS - start)) s"
grep -E "^cold rows|bandwidth after" $out/bench_F16.log | cut -c1-330
grep -E "^pinfer \[.*per token host" $out/bench_F16.log | sed -E 's/; the module.*//' | cut -c1-300
sed -n '/^Over the rounds/,$p' $out/bench_F16.log
