#!/bin/bash
# Session 26, third call: the loads ahead with pinned parts and prefetcht0 (session26-pin's best),
# with a perfect guess and two imperfect ones (recall 0.9 at 1.4x the active count, the lookahead
# study's cost; recall 0.95 at 1.2x), both skews. One sequence, one process per dtype, three
# rounds. Bundle: cudamod of 8bc2d27.
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
p="+COLD_AHEAD_PIN=1+COLD_AHEAD_HINT=3"
for dt in Q4_0 F16; do
  left=$(( 560 - (SECONDS - start) ))
  (( left < 60 )) && { echo "skipped $dt"; continue; }
  timeout $(( left < 330 ? left : 330 )) $bin/cuda_decode_bench --dtype=$dt --modes=pinfer \
    --variant-modes=pinfer \
    --variants="base;COLD_AHEAD=1$p;COLD_AHEAD=0.9:1.4$p;COLD_AHEAD=0.95:1.2$p" \
    --rounds=3 --skews=0.2,0.4 --steps=48 --warmup=16 > $out/bench_$dt.log 2>&1
  echo "== $dt: rc $? at $((SECONDS - start)) s"
  grep -E "^cold rows|bandwidth after" $out/bench_$dt.log
  grep -E "cold rows loaded ahead" $out/bench_$dt.log | head -8
  sed -n '/^Over the rounds/,$p' $out/bench_$dt.log
done
