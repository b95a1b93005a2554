#!/bin/bash
# Session 26, second call: the cold rows loaded ahead (session26-ahead) by the thread that will
# compute them. ThreadPool::set_pinned_chunks (variant COLD_AHEAD_PIN=1) gives part i of both the
# loads and the op to the same thread, so the rows wait in that core's L2; in session26-ahead any
# thread could take either part. One sequence, skew 20%, one process per dtype, three rounds:
# base; COLD_AHEAD_PIN=1 alone (pinned parts, no loads ahead); COLD_AHEAD=1+COLD_AHEAD_PIN=1;
# the same with prefetcht0 (HINT=3); COLD_AHEAD=0.9:1.4+COLD_AHEAD_PIN=1.
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
    --variants="base;COLD_AHEAD_PIN=1;COLD_AHEAD=1+COLD_AHEAD_PIN=1;COLD_AHEAD=1+COLD_AHEAD_PIN=1+COLD_AHEAD_HINT=3;COLD_AHEAD=0.9:1.4+COLD_AHEAD_PIN=1" \
    --rounds=3 --skews=0.2 --steps=48 --warmup=16 > $out/bench_$dt.log 2>&1
  echo "== $dt: rc $? at $((SECONDS - start)) s"
  grep -E "^cold rows|bandwidth after" $out/bench_$dt.log
  grep -E "cold rows loaded ahead" $out/bench_$dt.log | head -5
  sed -n '/^Over the rounds/,$p' $out/bench_$dt.log
done
