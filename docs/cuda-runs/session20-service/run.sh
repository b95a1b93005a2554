#!/bin/bash
# Session 20, last call: the whole service (relu-llama-tiny, CUDA gpu-worker with the default two
# lanes, cpu-worker with 4 threads) with the cpu-worker's new chunks, its threads sleeping between
# layers (--spin-us 0) against polling (the default, 200 us), each guarded by a timeout; then the
# cold side alone (--modes=coldrows) in F16 and Q4_0: the cpu-worker's op against equal shares.
# Bundles made on the Debian machine:
#   bench/make_service_bundle.sh build /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod
#   tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
pkill -9 -f pinfer- 2>/dev/null
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
for spin in 0 200 0 200; do
  d=/tmp/svc-spin$spin-$RANDOM
  THREADS=none TOKENS=128 REPEATS=2 STREAMS=4 CPU_FLAGS="--spin-us $spin" OUT=$d timeout 120 \
    bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $d.log 2>&1
  echo "== cpu-worker --spin-us $spin: rc $?"
  grep -E "prompts match|check|lane steps|concurrent streams|1 stream|did not stop" $d.log
  cat $d.log >> $out/service.log
  pkill -9 -f pinfer- 2>/dev/null
done
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
for dt in F16 Q4_0; do
  timeout 100 /tmp/s/cudamod/bin/cuda_decode_bench --dtype=$dt --modes=coldrows > $out/coldrows_$dt.log 2>&1
  echo "== coldrows $dt: rc $?"; grep -E "^\|.*\| 16 \| (150|295|500|838|1382) \||difference|in cache" $out/coldrows_$dt.log
done
