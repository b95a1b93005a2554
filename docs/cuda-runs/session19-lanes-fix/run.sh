#!/bin/bash
# Session 19, after the hang of session19-service-ab's sixth service (four lanes): the module now
# sets CUDA_DEVICE_MAX_CONNECTIONS=32 when it loads, and allows at most 8 lanes. The backend test
# (LanesRunTwoSequencesAtOnce now also makes the most lanes), then the whole service with 4 and 8
# decode lanes, twice each, every service guarded by a timeout; last, --vram-budget 24MiB with the
# default 2 lanes (the plan against the allocation). Bundle made on the Debian machine:
#   bench/make_service_bundle.sh build /tmp/svcb/svc; gpu-worker/cuda/make_bundle.sh build /tmp/svcb/cudamod
#   tar -cJf .device/svc.tar.xz -C /tmp/svcb svc cudamod
set -u
out=$1
pkill -9 -f pinfer- 2>/dev/null; nvidia-smi --query-compute-apps=pid,used_memory --format=csv
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
OPS_TIMEOUT=1 BACKEND_TIMEOUT=120 BENCH_DTYPES=none BENCH_TIMEOUT=1 gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/run.log 2>&1
grep -E "PASSED|FAILED|tests ran" $out/cuda_backend_test.log | head -4
grep -E "Failure|Expected|Which is" $out/cuda_backend_test.log | head -8
for lanes in 4 8 4 8; do
  d=/tmp/svc-lanes$lanes-$RANDOM
  THREADS=none TOKENS=128 REPEATS=2 STREAMS=8 GPU_FLAGS="--decode-lanes $lanes" OUT=$d timeout 100 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $d.log 2>&1
  echo "== --decode-lanes $lanes: rc $?"
  grep -E "prompts match|check|lane steps|decode lanes:|concurrent streams|1 stream|did not stop" $d.log
  cp $d.log $out/service-lanes$lanes-$(basename $d).log
done
pkill -9 -f pinfer- 2>/dev/null
d=/tmp/svc-budget
THREADS=none TOKENS=64 REPEATS=1 GPU_FLAGS="--vram-budget 24MiB" OUT=$d timeout 100 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $d.log 2>&1
echo "== --vram-budget 24MiB: rc $?"
grep -E "prompts match|check|VRAM|decode lanes:" $d.log
cp $d.log $out/service-budget.log
