#!/bin/bash
# Session 24, first call. (1) The thread pool's contended atomics on cache lines of their own
# (new, this session's working tree) against 4510e50's pool (old: that commit's cuda_decode_bench,
# carried as cuda_decode_bench_old), processes taking turns: the cold side alone
# (--modes=coldrows: the op by size, and its fixed costs, the empty pool loop among them).
# (2) Lanes: two against three and four sequences in flight (variant LANES=N), taking turns in one
# process per dtype, skew 20%. Bundle: gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod,
# the old bench copied into its bin/, tar -cf - -C /tmp/svcb cudamod | xz -9e > .device/svc.tar.xz
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for dt in Q4_0 F16; do
  for v in new old new old; do
    if [[ $dt == F16 ]] && (( SECONDS - start > 150 )); then echo "skipped coldrows $dt $v"; continue; fi
    b=$bin/cuda_decode_bench; [[ $v == old ]] && b=$bin/cuda_decode_bench_old
    echo "== coldrows $dt $v" >> $out/coldrows_$dt.log
    timeout 60 $b --dtype=$dt --modes=coldrows >> $out/coldrows_$dt.log 2>&1
    echo "== coldrows $dt $v: rc $? at $((SECONDS - start)) s"
    grep -E "^\|.*\| 16 \| (150|295|500|838) \||fixed costs" $out/coldrows_$dt.log | tail -5
  done
done
v="base;LANES=3;LANES=4;base;LANES=3;LANES=4;base;LANES=3"
for dt in Q4_0 F16; do
  left=$(( 590 - (SECONDS - start) ))
  (( left < 60 )) && { echo "skipped lanes $dt"; continue; }
  timeout $(( left < 220 ? left : 220 )) $bin/cuda_decode_bench --dtype=$dt --modes=lanes \
    --variants="$v" --skews=0.2 --steps=48 --warmup=16 > $out/bench_$dt.log 2>&1
  echo "== lanes $dt: rc $? at $((SECONDS - start)) s"
  grep -E "^\| .*lanes|bandwidth after" $out/bench_$dt.log | cut -c1-130
done
