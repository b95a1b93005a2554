#!/bin/bash
# Session 29, second call: session29-tiers' bench again with six rounds (its rounds spread by up
# to 20%, and a perfect ranking came out below the drawn tier there). One F16 sequence at skew
# 20%, the bench's drawn guesses at 1.6x and 2.2x loaded in ascending order, with a first tier
# drawn as relu-llama-tiny's (COLD_AHEAD_TIER=0.82:0.31) and ranked perfectly. Bundles as in
# session29-tiers.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
p="+COLD_AHEAD_PIN=1+COLD_AHEAD_HINT=3"
t="+COLD_AHEAD_TIER=0.82:0.31"
r="+COLD_AHEAD_RANKED=1"
LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 400 $bin/cuda_decode_bench --dtype=F16 --modes=pinfer \
  --variant-modes=pinfer --rounds=6 --skews=0.2 --steps=48 --warmup=16 \
  --variants="base;COLD_AHEAD=0.95:1.6$p;COLD_AHEAD=0.95:1.6$p$t;COLD_AHEAD=0.95:1.6$p$r;COLD_AHEAD=0.95:2.2$p;COLD_AHEAD=0.95:2.2$p$t;COLD_AHEAD=0.95:2.2$p$r" \
  > $out/bench_F16.log 2>&1
echo "== bench F16: rc $? at $((SECONDS - start)) s"
grep -E "^cold rows|bandwidth after" $out/bench_F16.log | cut -c1-330
sed -n '/^Over the rounds/,$p' $out/bench_F16.log
