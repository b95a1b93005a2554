#!/bin/bash
# Session 19: the VRAM plan with decode lanes: the whole service under --vram-budget 36MiB
# --gpu-slots 2 --max-context 512 (2 lanes, the default), whose plan includes the lane's scratch;
# device_service_run.sh fails unless the allocation is within 5% of the plan. (session19-lanes-fix
# asked for 24MiB, below this worker's fixed 128 MiB at 8 slots of 2048 positions: refused at
# start, as it should be.) Lanes now allocate scratch for decode batches (8 tokens) only: with
# 128-token scratch the lane alone took the worker past 36 MiB in the first try of this run. First
# the backend test (the lane's sequence now prompted on the first backend). Bundle as in
# session19-lanes-fix.
set -u
out=$1
pkill -9 -f pinfer- 2>/dev/null
mkdir -p /tmp/s && tar -xJf .device/svc.tar.xz -C /tmp/s
OPS_TIMEOUT=1 BACKEND_TIMEOUT=120 BENCH_DTYPES=none BENCH_TIMEOUT=1 gpu-worker/cuda/device_run.sh /tmp/s/cudamod $out > $out/run.log 2>&1
grep -E "PASSED|FAILED|tests ran" $out/cuda_backend_test.log | head -4
grep -E "Failure|Expected|Which is" $out/cuda_backend_test.log | head -8
d=/tmp/svc-budget
THREADS=none TOKENS=64 REPEATS=1 GPU_FLAGS="--vram-budget 36MiB --gpu-slots 2 --max-context 512" OUT=$d timeout 100 bench/device_service_run.sh /tmp/s/svc /tmp/s/cudamod > $d.log 2>&1
echo "== --vram-budget 36MiB: rc $?"
grep -E "prompts match|check|VRAM|decode lanes" $d.log
cp $d.log $out/service-budget.log
