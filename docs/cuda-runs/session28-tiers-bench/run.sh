#!/bin/bash
# Session 28, sixth call: session28-tiers' bench again, on a quieter host if one comes: one F16
# sequence at skew 20%, the bench's drawn guess (0.95 at 1.2x, pinned prefetcht0) with and without
# the module's guess (now two compactions: the guess and its first tier) running beside it.
# Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod, packed as .device/cudamod.tar.xz.
set -u
out=$1
mkdir -p /tmp/s && tar -xJf .device/cudamod.tar.xz -C /tmp/s
bin=/tmp/s/cudamod/bin
d="COLD_AHEAD=0.95:1.2+COLD_AHEAD_PIN=1+COLD_AHEAD_HINT=3"
LD_LIBRARY_PATH=/tmp/s/cudamod/lib timeout 200 $bin/cuda_decode_bench --dtype=F16 --modes=pinfer \
  --variant-modes=pinfer --rounds=4 --skews=0.2 --steps=48 --warmup=16 \
  --variants="base;$d;COLD_GUESS=1+COLD_GUESS_SHIFT=-4+$d" > $out/bench_F16.log 2>&1
echo "== bench F16: rc $?"
grep -E "^cold rows|bandwidth after|guess waited" $out/bench_F16.log | cut -c1-330
sed -n '/^Over the rounds/,$p' $out/bench_F16.log
