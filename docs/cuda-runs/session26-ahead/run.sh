#!/bin/bash
# Session 26: the cold rows loaded into the CPU's caches while the GPU computes the layer's
# attention (cuda::ColdFfn::Ahead; the bench's COLD_AHEAD guess). One sequence, skew 20%,
# variants in one process per dtype, three rounds: base; COLD_AHEAD=1 (the active cold neurons
# themselves, prefetcht1); COLD_AHEAD=0.9:1.4 (90% of them plus inactive ones, 1.4x as many:
# the lookahead study's cost); COLD_AHEAD=1+COLD_AHEAD_HINT=0 (loads instead of prefetches).
# Bundle: cudamod only, built from the session's work tree.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
for dt in Q4_0 F16; do
  left=$(( 560 - (SECONDS - start) ))
  (( left < 60 )) && { echo "skipped $dt"; continue; }
  timeout $(( left < 280 ? left : 280 )) $bin/cuda_decode_bench --dtype=$dt --modes=pinfer \
    --variant-modes=pinfer \
    --variants="base;COLD_AHEAD=1;COLD_AHEAD=0.9:1.4;COLD_AHEAD=1+COLD_AHEAD_HINT=0" \
    --rounds=3 --skews=0.2 --steps=48 --warmup=16 > $out/bench_$dt.log 2>&1
  echo "== $dt: rc $? at $((SECONDS - start)) s"
  grep -E "^cold rows|bandwidth after" $out/bench_$dt.log
  grep -E "cold rows loaded ahead" $out/bench_$dt.log | head -8
  sed -n '/^Over the rounds/,$p' $out/bench_$dt.log
done
