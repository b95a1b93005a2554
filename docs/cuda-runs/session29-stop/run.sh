#!/bin/bash
# Session 29, third call: how soon the loads ahead stop. In session29-tiers-again the GPU's time
# from x published to the cold signal, beyond the callback, was 0.22 ms a token without loads and
# 0.6-1.2 ms with them: part 0 polls x_ready only between neurons (30 KB of bundled F16 rows),
# and the other parts see the stop only between theirs. COLD_AHEAD_STEP=B checks every B bytes
# as well. One F16 sequence at skew 20%, the drawn guess at 1.6x with relu-llama-tiny's tier, and
# a perfect guess. Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
g="COLD_AHEAD=0.95:1.6+COLD_AHEAD_PIN=1+COLD_AHEAD_HINT=3+COLD_AHEAD_TIER=0.82:0.31"
f="COLD_AHEAD=1+COLD_AHEAD_PIN=1+COLD_AHEAD_HINT=3"
LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 450 $bin/cuda_decode_bench --dtype=F16 --modes=pinfer \
  --variant-modes=pinfer --rounds=5 --skews=0.2 --steps=48 --warmup=16 \
  --variants="base;$g;$g+COLD_AHEAD_STEP=8192;$g+COLD_AHEAD_STEP=4096;$g+COLD_AHEAD_STEP=2048;$f;$f+COLD_AHEAD_STEP=4096" \
  > $out/bench_F16.log 2>&1
echo "== bench F16: rc $? at $((SECONDS - start)) s"
grep -E "^cold rows|bandwidth after" $out/bench_F16.log | cut -c1-330
grep -E "^pinfer \[.*per token host" $out/bench_F16.log | sed -E 's/host queueing layers [0-9.]+ ms; //; s/; the module.*//' | cut -c1-300
sed -n '/^Over the rounds/,$p' $out/bench_F16.log
