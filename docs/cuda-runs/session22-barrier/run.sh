#!/bin/bash
# Session 22, first call: SparseFfnToken's parts and reduction in one pool loop that meets at a
# barrier (5a78e90, "new") against the two loops of 9576425 ("old": that commit's
# cuda_decode_bench, carried as cuda_decode_bench_old), processes taking turns: the cold side
# alone (--modes=coldrows, whose fixed-cost line times both ways in turns in the new binary), then
# the 13B shape's one sequence and two lanes. Bundles: bench/make_service_bundle.sh build
# /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod; the old bench copied
# into /tmp/svcb/cudamod/bin; tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
for dt in Q4_0 F16; do
  for v in new old new old; do
    b=$bin/cuda_decode_bench; [[ $v == old ]] && b=$bin/cuda_decode_bench_old
    timeout 90 $b --dtype=$dt --modes=coldrows >> $out/coldrows_$dt.log 2>&1
    echo "== coldrows $dt $v: rc $? at $((SECONDS - start)) s"
    grep -E "^\|.*\| 16 \| (150|295|500|838) \||fixed costs" $out/coldrows_$dt.log | tail -5
  done
done
for dt in Q4_0 F16; do
  for v in new old; do
    if (( SECONDS - start > 470 )); then echo "skipped $dt $v: time"; continue; fi
    b=$bin/cuda_decode_bench; [[ $v == old ]] && b=$bin/cuda_decode_bench_old
    echo "== bench $dt $v" >> $out/bench_$dt.log
    timeout 110 $b --dtype=$dt --modes=pinfer,lanes --steps=48 --warmup=16 >> $out/bench_$dt.log 2>&1
    echo "== bench $dt $v: rc $? at $((SECONDS - start)) s"
    grep -E "^\| .*pinfer|bandwidth after" $out/bench_$dt.log | tail -5 | cut -c1-150
  done
done
