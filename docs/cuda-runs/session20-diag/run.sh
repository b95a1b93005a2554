#!/bin/bash
# Session 20, first call: (1) the code of session 19 that had not run on a GPU (c47e5d2: a lane
# refuses to make lanes; ffc3863: the gpu-worker's lane threads in lane_threads.h): the backend
# test and the whole service with the default two lanes; (2) the cold side alone
# (--modes=coldrows, CPU only) in F16 and Q4_0: where a layer's cold rows spend their time.
# Bundle made on the Debian machine:
#   bench/make_service_bundle.sh build /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod
#   tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
pkill -9 -f pinfer- 2>/dev/null
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA|L1d|L2|L3" > $out/lscpu.txt
OPS_TIMEOUT=1 BACKEND_TIMEOUT=150 BENCH_DTYPES=none BENCH_TIMEOUT=1 gpu-worker/cuda/device_run.sh /tmp/s/cudamod /tmp/dr > /tmp/dr-run.log 2>&1
cp /tmp/dr/cuda_backend_test.log $out/
grep -E "PASSED|FAILED|tests ran" $out/cuda_backend_test.log | head -4
grep -E "Failure|Expected|Which is" $out/cuda_backend_test.log | head -8
d=/tmp/svc-lanes2
THREADS=none TOKENS=128 REPEATS=1 STREAMS=4 OUT=$d timeout 120 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $d.log 2>&1
echo "== service, default lanes: rc $?"
grep -E "prompts match|check|lane steps|decode lanes:|concurrent streams|1 stream|did not stop" $d.log
cp $d.log $out/service-lanes2.log
pkill -9 -f pinfer- 2>/dev/null
export LD_LIBRARY_PATH=/tmp/s/cudamod/lib:${LD_LIBRARY_PATH:-}
for dt in F16 Q4_0; do
  timeout 150 /tmp/s/cudamod/bin/cuda_decode_bench --dtype=$dt --modes=coldrows > $out/coldrows_$dt.log 2>&1
  echo "== coldrows $dt: rc $?"; cat $out/coldrows_$dt.log
done
