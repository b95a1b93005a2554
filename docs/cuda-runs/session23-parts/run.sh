#!/bin/bash
# Session 23, first call: the cold side's partial sums added on the GPU (3568a8a: the callback
# leaves its threads' partials in the pinned exchange buffer, SumParts adds them) against the
# callback adding them itself (PINFER_CUDA_COLD_PARTS=0), in one process taking turns as bench
# variants. First the op tests and the module's end-to-end tests, then the cold side alone
# (--modes=coldrows: the op and the op leaving its partials, call by call in turns), the 13B
# shape's one sequence and two lanes, and the whole service. Bundles: bench/make_service_bundle.sh
# build /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod; tar -cJf
# .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
start=$SECONDS
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
BENCH_DTYPES=" " gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/tests.log 2>&1
echo "== tests: rc $? at $((SECONDS - start)) s"
grep -E "^\[  (PASSED|FAILED) |tests ran" $out/tests.log
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
bin=/tmp/s/cudamod/bin
for dt in Q4_0 F16; do
  timeout 100 $bin/cuda_decode_bench --dtype=$dt --modes=coldrows > $out/coldrows_$dt.log 2>&1
  echo "== coldrows $dt: rc $? at $((SECONDS - start)) s"
  grep -E "^\|.*\| 16 \| (150|295|500|838) \|" $out/coldrows_$dt.log
done
for dt in Q4_0 F16; do
  if (( SECONDS - start > 420 )); then echo "skipped $dt: time"; continue; fi
  timeout 150 $bin/cuda_decode_bench --dtype=$dt --modes=pinfer,lanes --variant-modes=pinfer,lanes \
    --variants="base;COLD_PARTS=0;base;COLD_PARTS=0" --steps=48 --warmup=16 > $out/bench_$dt.log 2>&1
  echo "== bench $dt: rc $? at $((SECONDS - start)) s"
  grep -E "^\| .*(pinfer|lanes)|bandwidth after" $out/bench_$dt.log | cut -c1-160
done
if (( SECONDS - start < 480 )); then
  d=$out/service; mkdir -p $d
  THREADS=none TOKENS=128 REPEATS=2 STREAMS=4 OUT=$d timeout 110 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $out/service.log 2>&1
  echo "== service: rc $? at $((SECONDS - start)) s"
  grep -E "reference|tokens/s" $out/service.log | tail -8
fi
