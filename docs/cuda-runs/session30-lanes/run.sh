#!/bin/bash
# Session 30, first call: do the guess's loads ahead help two lanes? The bench's lanes gained
# COLD_AHEAD (the loads take the cold side's turn and stop as soon as the other lane's request
# waits, as the cpu-worker's loads stop at the next request's doorbell). Two lanes at skew 20%,
# per dtype: no guess, pinned chunks alone, the drawn guess at 1.6x with relu-llama-tiny's tier,
# and a perfect guess. Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
p="+COLD_AHEAD_PIN=1+COLD_AHEAD_HINT=3"
t="+COLD_AHEAD_TIER=0.82:0.31"
for d in Q4_0 F16; do
  LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 280 $bin/cuda_decode_bench --dtype=$d --modes=lanes \
    --variant-modes=lanes --rounds=3 --skews=0.2 --steps=48 --warmup=16 \
    --variants="base;COLD_AHEAD_PIN=1;COLD_AHEAD=0.95:1.6$p$t;COLD_AHEAD=1$p" \
    > $out/bench_$d.log 2>&1
  echo "== bench $d: rc $? at $((SECONDS - start)) s"
  grep -E "^cold rows|bandwidth after" $out/bench_$d.log | cut -c1-330
  sed -n '/^Over the rounds/,$p' $out/bench_$d.log
done
