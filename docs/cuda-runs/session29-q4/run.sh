#!/bin/bash
# Session 29, last bench call: session29-tiers-again's comparison for Q4_0, whose cold rows are
# under a third of F16's bytes (run 43: loads ahead gained Q4_0 only 2-9%). One Q4_0 sequence at
# skew 20%: the drawn guess at 1.6x loaded in ascending order, with relu-llama-tiny's tier
# (COLD_AHEAD_TIER=0.82:0.31) and ranked perfectly; a perfect guess. Bundle:
# gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
p="+COLD_AHEAD_PIN=1+COLD_AHEAD_HINT=3"
LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 400 $bin/cuda_decode_bench --dtype=Q4_0 --modes=pinfer \
  --variant-modes=pinfer --rounds=5 --skews=0.2 --steps=48 --warmup=16 \
  --variants="base;COLD_AHEAD=0.95:1.6$p;COLD_AHEAD=0.95:1.6$p+COLD_AHEAD_TIER=0.82:0.31;COLD_AHEAD=0.95:1.6$p+COLD_AHEAD_RANKED=1;COLD_AHEAD=1$p" \
  > $out/bench_Q4_0.log 2>&1
echo "== bench Q4_0: rc $? at $((SECONDS - start)) s"
grep -E "^cold rows|bandwidth after" $out/bench_Q4_0.log | cut -c1-330
sed -n '/^Over the rounds/,$p' $out/bench_Q4_0.log
