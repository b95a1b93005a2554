#!/bin/bash
# Session 22, second call: the same bundle as session22-barrier (the op in one loop with a
# barrier, 5a78e90, "new", against 9576425's two loops, "old"), the 13B shape's one sequence and
# two lanes only, the two binaries taking turns three times per dtype (session22-barrier had one
# turn each, and the host drifted between processes).
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
for dt in Q4_0 F16; do
  for v in new old old new new old; do
    if (( SECONDS - start > 520 )); then echo "skipped $dt $v: time"; continue; fi
    b=$bin/cuda_decode_bench; [[ $v == old ]] && b=$bin/cuda_decode_bench_old
    echo "== bench $dt $v" >> $out/bench_$dt.log
    timeout 60 $b --dtype=$dt --modes=pinfer,lanes --steps=48 --warmup=16 >> $out/bench_$dt.log 2>&1
    echo "== bench $dt $v: rc $? at $((SECONDS - start)) s"
    grep -E "^\| .*pinfer|bandwidth after" $out/bench_$dt.log | tail -5 | cut -c1-150
  done
done
